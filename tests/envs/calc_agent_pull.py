"""An agent program that runs on its own and asks for work (env.agent_mode=serve): the calculator task over the
official `openai` client. Usage: python calc_agent_pull.py RUN_DIR/agent.json

It asks the gateway for episodes (POST work_url with the run key), runs each in a thread of its own (a turn, the
tool's result, the answer), reports each reward, and ends when the run is over. AGENT_LOG, when set, gets one JSON
line per episode: this program's pid, the episode's index and the token ids of each turn as the gateway returned them.
"""

import json
import os
import re
import sys
import threading
import time

from openai import APIConnectionError, OpenAI

with open(sys.argv[1]) as f:
    work = json.load(f)  # {"work_url", "key"}: written by lmrl train, readable by its user only
boss = OpenAI(base_url=work["work_url"].removesuffix("/lmrl/work"), api_key=work["key"], max_retries=0, timeout=90)
log_lock = threading.Lock()


def episode(spec: dict) -> None:
    row, client = spec["row"], OpenAI(base_url=spec["base_url"], api_key=spec["api_key"], max_retries=0)
    text, turns = row["prompt"], []
    for turn in range(2):
        choice = client.completions.create(model="policy", prompt=text, max_tokens=24, stop=["</calc>"]).choices[0]
        turns.append(choice.model_extra["token_ids"])
        said = choice.text + ("</calc>" if choice.finish_reason == "stop" and "<calc>" in choice.text else "")
        text += said  # (the OpenAI API leaves the stop string out of the text: an agent puts it back)
        if turn == 0:  # the tool: the sum the model asked for (or the question's, so every episode has a result)
            match = re.search(r"<calc>([^<>]*)</calc>", said)
            terms = (match.group(1) if match else row["prompt"].rstrip("=")).split("+")
            text += f"={sum(int(t) for t in terms if t.strip().isdigit())}\n"
    if os.environ.get("AGENT_LOG"):  # before the reward: once it is in, the episode is over for lmrl
        with log_lock, open(os.environ["AGENT_LOG"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "index": spec["index"], "turns": turns}) + "\n")
    reward = float(text.rsplit("\n", 1)[-1].strip() == row["answer"])
    client.post("/lmrl/reward", body={"reward": reward}, cast_to=object)


while True:
    try:
        answer = boss.post("/lmrl/work", body={"max": 4, "wait": 30}, cast_to=object)
    except APIConnectionError:  # the run is over (its gateway is gone)
        break
    for spec in answer["episodes"]:
        threading.Thread(target=episode, args=(spec,)).start()
    if answer["done"]:
        break
    time.sleep(0.01)
