"""tests/envs/calc_agent.py as one program for a whole batch (env.agent_mode=batch): every episode of the file
LMRL_EPISODES names, at once in threads, each over its own `openai` client (its base URL, its key). AGENT_LOG, when
set, gets one JSON line per episode: its index and the token ids of each turn as the gateway returned them. With
env.agent_mode=persistent it runs once and takes each batch's file from a line of its stdin.
AGENT_MODE=crash exits 1 after the first episode's reward; steal reports every reward with the first episode's key.
"""

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

MODE = os.environ.get("AGENT_MODE", "ok")


def episode(spec: dict) -> dict:
    row, client = spec["row"], OpenAI(base_url=spec["base_url"], api_key=spec["api_key"], max_retries=0)
    text, turns = row["prompt"], []
    for turn in range(2):
        choice = client.completions.create(model="policy", prompt=text, max_tokens=24, stop=["</calc>"]).choices[0]
        turns.append(choice.model_extra["token_ids"])
        said = choice.text + (choice.model_extra.get("stop_reason") or "")  # the stop string the model wrote, if any
        text += said  # (the OpenAI API leaves the stop string out of the text: an agent puts it back)
        if turn == 1:
            break
        match = re.search(r"<calc>([^<>]*)</calc>", said)
        terms = (match.group(1) if match else row["prompt"].rstrip("=")).split("+")
        text += f"={sum(int(t) for t in terms if t.strip().isdigit())}\n"  # the tool result
    return {"index": spec["index"], "turns": turns, "text": text,
            "reward": float(text.rsplit("\n", 1)[-1].strip() == row["answer"]), "client": client}


def batch(path: str) -> None:
    with open(path) as f:
        specs = [json.loads(line) for line in f]
    with ThreadPoolExecutor(len(specs)) as pool:
        done = list(pool.map(episode, specs))
    if os.environ.get("AGENT_LOG"):  # before the rewards: once they are in, the batch is over for lmrl
        with open(os.environ["AGENT_LOG"], "a") as f:
            for result in done:
                f.write(json.dumps({"pid": os.getpid(), **{k: result[k] for k in ("index", "turns", "text")}}) + "\n")
    for i, result in enumerate(done):
        if MODE == "steal":  # another episode's key: refused (403), so the episodes stay without a reward
            thief = OpenAI(base_url=specs[i]["base_url"], api_key=specs[0]["api_key"] + ("" if i else "x"), max_retries=0)
            try:
                thief.post("/lmrl/reward", body={"reward": 1.0}, cast_to=object)
            except Exception as e:  # noqa: BLE001
                print(f"agent: refused: {type(e).__name__}", file=sys.stderr)
            continue
        result["client"].post("/lmrl/reward", body={"reward": result["reward"]}, cast_to=object)
        if MODE == "crash":
            sys.exit("agent: something broke")


if os.environ.get("LMRL_EPISODES"):  # env.agent_mode=batch: this batch, then exit
    batch(os.environ["LMRL_EPISODES"])
else:  # env.agent_mode=persistent: a batch per line of stdin, until its end
    for line in sys.stdin:
        batch(line.strip())
