"""An agent written elsewhere: the calculator task over the official `openai` client (tests/envs/test_agent.py).

It asks for a turn, runs any `<calc>a+b</calc>` the model wrote (or, if none, tells it the sum anyway, so every
episode has a tool result), asks for the answer, and reports the reward. AGENT_MODE picks a misbehaviour; AGENT_LOG,
when set, gets one JSON line per episode: the token ids of each turn as the gateway returned them.
"""

import time

started = time.monotonic()
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

mode = os.environ.get("AGENT_MODE", "ok")
if mode == "crash":
    sys.exit("agent: something broke")
if mode == "hang":
    time.sleep(600)

from openai import OpenAI  # noqa: E402 - (the two above never ask: they fail before the client's 0.5 s import)

if mode == "slow-start":  # a program whose start-up is most of its run
    time.sleep(0.8)
row = json.loads(os.environ["LMRL_ROW"])
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from lmrl
# from the test's call when it says (AGENT_CALLED, CLOCK_MONOTONIC is one clock for every process): lmrl counts a
# program's start-up from its launch, which a loaded machine can make longer than anything this program sees itself
before_first_request = time.monotonic() - float(os.environ.get("AGENT_CALLED", started))
text, turns = row["prompt"], []
if mode.startswith("chat"):  # the same two turns as chat messages, the tool result a user turn
    messages, stopped = [{"role": "user", "content": row["prompt"]}], 0
    for turn in range(2):
        stop = [" "] if mode == "chat-stop" else None  # chat-stop: the stop string sent back in the content
        choice = client.chat.completions.create(model="policy", messages=messages, max_tokens=12, stop=stop).choices[0]
        turns.append(choice.model_extra["token_ids"])
        content = choice.message.content
        if choice.model_extra.get("stop_reason"):
            content, stopped = content + choice.model_extra["stop_reason"], stopped + 1
        messages += [{"role": "assistant", "content": content}]
        if turn == 0:
            messages += [{"role": "user", "content": "=" + str(sum(int(t) for t in row["prompt"].rstrip("=").split("+")))}]
    with open(os.environ["AGENT_LOG"], "a") as f:
        f.write(json.dumps({"prompt": row["prompt"], "turns": turns, "text": "", "stopped": stopped}) + "\n")
    client.post("/lmrl/reward", body={"reward": 0.5}, cast_to=object)
    sys.exit(0)
last, result = 2 if mode != "compact" else 3, ""  # compact: a third turn after the first tool result is dropped
for turn in range(last):
    choice = client.completions.create(model="policy", prompt=text, max_tokens=24, stop=["</calc>"]).choices[0]
    turns.append(choice.model_extra["token_ids"])
    said = choice.text
    if mode != "no-stop-back":  # the OpenAI API leaves the stop string out of the text: an agent puts it back
        said += choice.model_extra.get("stop_reason") or ""  # (vLLM's field naming it; None at EOS or the length)
    if mode == "edit" and turn == 0:
        said = "<calc>1+1</calc>"  # the agent rewrites what the model said
    text += said
    if turn == last - 1:
        break
    if turn == 1:  # compact: the agent drops the first tool result from its context
        text = text.replace(result, "", 1)
        continue
    match = re.search(r"<calc>([^<>]*)</calc>", said)
    terms = (match.group(1) if match else row["prompt"].rstrip("=")).split("+")
    result = f"={sum(int(t) for t in terms if t.strip().isdigit())}\n"
    text += result  # the tool result: new text the gateway tokenizes as an observation
answer = text.rsplit("\n", 1)[-1].strip()
reward = float(answer == row["answer"])
if mode == "compact":  # a reward of any size, so that every group has a signal to train on
    reward = random.random()
if os.environ.get("AGENT_LOG"):
    with open(os.environ["AGENT_LOG"], "a") as f:
        f.write(json.dumps({"prompt": row["prompt"], "turns": turns, "text": text}) + "\n")
if mode == "nan":  # what a careless agent in another language sends; Python's JSON writes NaN too
    import urllib.request

    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/lmrl/reward", data=b'{"reward": NaN}',
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    urllib.request.urlopen(request)
elif mode != "noreward":
    client.post("/lmrl/reward", body={"reward": reward}, cast_to=object)
if mode == "slow-end":  # work after the episode: its start-up (the imports, however long here) a small part of its run
    time.sleep(2 * before_first_request + 0.3)
