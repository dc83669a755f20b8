"""An agent for the calculator task on a reasoning model, written to the OpenAI chat API (docs/agents.md, "An episode
of several samples"): it asks for a turn, runs the `<calc>a+b+c</calc>` the model wrote, sends the result back as a
user message, asks for the answer and reports the reward: 1 when what the model wrote after its reasoning (after
`</think>`) is the sum.

    lmrl train model.name_or_path=tiny-reasoner env.name=agent env.agent_mode=persistent reward.functions=[env] \\
        env.command="python examples/reasoning_agent.py"

The shipped tiny-reasoner's chat template writes an earlier turn without its reasoning, as DeepSeek-R1's does, so the
second request does not extend the first call's tokens: lmrl trains each call as a sample of its own, in the context
it was sampled in. Run once per run (`env.agent_mode=persistent`): each line of its stdin names a file of episodes,
one JSON object per line ({"index", "base_url", "api_key", "row"}); every episode of a file runs in a thread.
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

from openai import BadRequestError, OpenAI

CALC = re.compile(r"<calc>([^<>]*)</calc>")


def calculator(expression: str) -> str:
    """The calculator task's tool: a sum of whole numbers, or the error line the built-in environment writes."""
    terms = [t.strip() for t in expression.split("+")]
    if not all(t.isdigit() and len(t) <= 18 for t in terms) or len(terms) > 32:
        return f"error: calc raised ValueError: not a sum of whole numbers: {expression!r}"
    return str(sum(int(t) for t in terms))


def episode(shared: OpenAI, spec: dict) -> None:
    client = shared.with_options(base_url=spec["base_url"], api_key=spec["api_key"])
    row = spec["row"]
    messages, answer = [{"role": "user", "content": row["prompt"]}], ""
    for turn in range(2):
        try:
            choice = client.chat.completions.create(model="policy", messages=messages, stop=["</calc>"]).choices[0]
        except BadRequestError:  # the episode's tokens are spent
            break
        content = choice.message.content or ""
        if (choice.model_extra or {}).get("stop_reason") == "</calc>":  # vLLM's field, lmrl's too: the stop string
            content += "</calc>"  # the API leaves it out of the content: the call is put back as the model wrote it
        messages.append({"role": "assistant", "content": content})
        call = CALC.search(content.split("</think>")[-1])
        answer = content.split("</think>")[-1].strip()
        if call is None or turn == 1:
            break
        messages.append({"role": "user", "content": "=" + calculator(call.group(1))})
    client.post("/lmrl/reward", body={"reward": float(answer == row["answer"])}, cast_to=object)


def main() -> None:
    shared = OpenAI(base_url="http://127.0.0.1", api_key="none", max_retries=0, timeout=600)
    with ThreadPoolExecutor(32) as pool:
        # env.agent_mode=batch: the file LMRL_EPISODES names; persistent: a file per line of stdin
        for path in [os.environ["LMRL_EPISODES"]] if os.environ.get("LMRL_EPISODES") else sys.stdin:
            with open(path.strip()) as f:
                list(pool.map(lambda spec: episode(shared, spec), [json.loads(line) for line in f]))


if __name__ == "__main__":
    main()
