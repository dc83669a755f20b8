"""Does the calculator task learn as much, in the same time, when an agent program written elsewhere drives its
episodes as with the built-in environment? docs/agents.md, "Does it learn as the built-in environment does?", gives
the numbers.

    python benchmarks/agent_learning.py                      # 30 steps per arm, seed 0
    python benchmarks/agent_learning.py --steps 2 --eval-every 1 --num-eval 8   # a smoke run
    python benchmarks/agent_learning.py --record             # the table in docs/agents.md

Each arm is `lmrl train model.name_or_path=tiny-calculator` (its preset: GRPO, 32 prompts x 8 episodes, two turns
at most, one thread), one after the other in subprocesses. The built-in arm runs the task's own tool environment;
the agent arms `env.name=agent reward.functions=[env]` with this file as the program: `--agent` started once for
the run (`env.agent_mode=persistent`), every episode of a batch in a thread, over the official `openai` client or
(`--stdlib`) the standard library's http.client; and `--pull RUN/agent.json`, started beside a run of
`env.agent_mode=serve`, which asks the gateway for its episodes. Every program runs the same tool as the task's own
environment (`<calc>a+b+c</calc>` -> `=sum` and a new line; its error line word for word) and the same reward (the
last line is the sum), reported to the gateway. Held-out accuracy is the task's own check, greedy, on --num-eval
sums, in every arm (through the agent program in its arms).

Time is training time: the sum of the steps' seconds (collection, experience, update), evaluations left out (they
are the measurement; in the agent arms they run through the agent too). Printed per arm: held-out accuracy at step 0
and at the end, the gain in points, the training seconds in all and per step, the held-out accuracy of the last
evaluation each arm had done by the built-in arm's training time and by a quarter of it (learning "as much in the
same time"), and the CPU seconds of `lmrl train` and of the agent program. --record [NAME] (default agent-learning)
writes benchmarks/results/NAME.MACHINE.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CALC = re.compile(r"<calc>([^<>]*)</calc>")
CPU_FILE = "LMRL_BENCH_AGENT_CPU"  # where the agent program adds its CPU seconds
THREADS = 32  # episodes at once over the openai client (`agent`)


def episode_runner():
    """One episode of the calculator task, given its {base_url, api_key, row}, over one shared connection pool."""
    from openai import BadRequestError, OpenAI

    shared = OpenAI(base_url="http://127.0.0.1", api_key="none", max_retries=0, timeout=600)  # each episode's below

    def episode(spec: dict) -> None:
        client = shared.with_options(base_url=spec["base_url"], api_key=spec["api_key"])

        def complete(text: str) -> str | None:
            try:
                choice = client.completions.create(model="policy", prompt=text, stop=["</calc>"]).choices[0]
                return closed(choice.text, choice.finish_reason)
            except BadRequestError:  # the episode's tokens are spent (a long error line): it ends, as the built-in's
                return None

        play(spec["row"], complete, lambda reward: client.post("/lmrl/reward", body={"reward": reward}, cast_to=object))

    return episode


def closed(text: str, finish_reason: str) -> str:
    """The model's turn as an agent written to the OpenAI API sees it: the text leaves out the stop string that ended
    it, so a call the model closed gets its `</calc>` back."""
    return text + "</calc>" if finish_reason == "stop" and "<calc>" in text and "</calc>" not in text else text


def play(row: dict, complete, report) -> None:  # noqa: ANN001 - the client's calls
    """One episode of the calculator task: the model's turn is `complete(text so far)` (None: the episode's tokens
    are spent), the tool's result is appended after a call, and the reward goes to `report`."""
    text = row["prompt"]
    for turn in range(2):
        said = complete(text)
        if said is None:
            break
        text += said
        call = CALC.search(said)
        if call is None or turn == 1:
            break
        text += "=" + tool(call.group(1)) + "\n"
    report(answer_reward(text, row))


def answer_reward(text: str, row: dict) -> float:
    """The task's own reward: the completion's last line (after the prompt: an answer given without the tool is on
    the prompt's line) is the sum."""
    return float(text[len(row["prompt"]):].rsplit("\n", 1)[-1].strip() == row["answer"])


def tool(expression: str) -> str:
    """The built-in environment's calculator, its error line word for word (episodes as long as the built-in's)."""
    terms = [t.strip() for t in expression.split("+")]
    if not all(t.isdigit() and len(t) <= 18 for t in terms) or len(terms) > 32:
        return f"error: calc raised ValueError: not a sum of whole numbers: {expression!r}"
    return str(sum(int(t) for t in terms))


def stdlib_episode_runner():
    """The same episode over the standard library's http.client, a kept-alive connection per thread: what an agent
    in a language with a lean HTTP client costs (the `openai` client's own CPU is about 1-2 ms a request)."""
    import http.client
    import threading
    from urllib.parse import urlsplit

    local = threading.local()

    def post(url: str, key: str, body: dict) -> tuple[int, dict]:
        where = urlsplit(url)
        if getattr(local, "connection", None) is None:
            local.connection = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
        local.connection.request("POST", where.path, json.dumps(body), {"Authorization": f"Bearer {key}",
                                                                        "Content-Type": "application/json"})
        answer = local.connection.getresponse()
        return answer.status, json.loads(answer.read())

    def episode(spec: dict) -> None:
        def complete(text: str) -> str | None:
            status, answer = post(spec["base_url"] + "/completions", spec["api_key"],
                                  {"model": "policy", "prompt": text, "stop": ["</calc>"]})
            if status != 200:  # the episode's tokens are spent
                return None
            return closed(answer["choices"][0]["text"], answer["choices"][0]["finish_reason"])

        play(spec["row"], complete, lambda reward: post(spec["base_url"] + "/lmrl/reward", spec["api_key"],
                                                        {"reward": reward}))

    return episode


def agent() -> None:
    """The agent program (env.agent_mode=batch or persistent): every episode of each batch's file, in threads."""
    from concurrent.futures import ThreadPoolExecutor

    stdlib = "--stdlib" in sys.argv
    episode = stdlib_episode_runner() if stdlib else episode_runner()
    # http.client: every episode of a step at once; the openai client: 32 threads, its fastest here (8 steps took
    # 1.5-1.7 s each with 16-32 threads, 2.2 s with 64: their Python contends for the interpreter lock)
    with ThreadPoolExecutor(256 if stdlib else THREADS) as pool:
        # env.agent_mode=batch: the batch LMRL_EPISODES names; persistent: a batch per line of stdin
        for path in [os.environ["LMRL_EPISODES"]] if os.environ.get("LMRL_EPISODES") else sys.stdin:
            with open(path.strip()) as f:
                list(pool.map(episode, [json.loads(line) for line in f]))
    if os.environ.get(CPU_FILE):  # this program's CPU seconds, for the table (one line per run of it)
        with open(os.environ[CPU_FILE], "a") as f:
            f.write(f"{time.process_time()}\n")


def pull(work_file: Path) -> None:
    """The agent program of env.agent_mode=serve: asks the run's gateway for episodes until the run is over."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from openai import APIConnectionError, OpenAI

    while not work_file.exists():  # the run writes it when its gateway starts
        time.sleep(0.05)
    time.sleep(0.05)
    work = json.loads(work_file.read_text())
    boss = OpenAI(base_url=work["work_url"].removesuffix("/lmrl/work"), api_key=work["key"], max_retries=0, timeout=90)
    episode = episode_runner()
    with ThreadPoolExecutor(THREADS) as pool:
        while True:
            try:
                answer = boss.post("/lmrl/work", body={"max": 256, "wait": 30}, cast_to=object)
            except APIConnectionError:  # the run is over
                break
            for spec in answer["episodes"]:
                pool.submit(episode, spec)
            if answer["done"]:
                break
    with open(os.environ[CPU_FILE], "a") as f:  # this program's CPU seconds, for the table
        f.write(f"{time.process_time()}\n")


def train(out: Path, steps: int, eval_every: int, num_eval: int, seed: int, *overrides: str) -> dict:
    from recording import lmrl_train_rows

    out.mkdir(parents=True, exist_ok=True)
    os.environ[CPU_FILE] = str(out.parent / f"{out.name}.agent-cpu")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = lmrl_train_rows(out, "model.name_or_path=tiny-calculator", f"train.steps={steps}",
                           f"train.eval_every={eval_every}", f"data.num_eval_prompts={num_eval}", f"train.seed={seed}",
                           "train.threads=1", "train.max_minutes=null", *overrides)
    steps_ = [r for r in rows if "time/step" in r]
    trained, seconds = {0: 0.0}, 0.0  # training seconds by the end of each step
    for r in steps_:
        seconds += r["time/step"]
        trained[r["step"]] = seconds
    evals = [(r["step"], r["eval/accuracy"], trained[r["step"]]) for r in rows if "eval/accuracy" in r]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # lmrl train and the agent programs it waited for
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    agent_cpu = sum(float(x) for x in Path(os.environ[CPU_FILE]).read_text().split()) if Path(os.environ[CPU_FILE]).exists() else 0.0
    return {"evals": evals, "seconds": seconds, "per_step": seconds / len(steps_),
            "turns": steps_[-1].get("env/turns", float("nan")), "trainer_cpu": cpu - agent_cpu, "agent_cpu": agent_cpu}


def at(run: dict, seconds: float) -> tuple[int, float]:
    """(step, held-out accuracy) of the last evaluation `run` had done by `seconds` of training."""
    step, accuracy, _ = [e for e in run["evals"] if e[2] <= seconds + 1e-9][-1]
    return step, accuracy


def row(arm: str, run: dict, seconds: float | None = None) -> dict:
    """The arm's table row; `seconds`: the built-in arm's training time, at which (and at a quarter of which) its
    held-out accuracy is also given, so that "as much in the same time" is read off two columns."""
    (_, start, _), (last, end, _) = run["evals"][0], run["evals"][-1]
    seconds = run["seconds"] if seconds is None else seconds
    step, then = at(run, seconds)
    early_step, early = at(run, seconds / 4)
    return {"arm": arm, "start": 100 * start, "end": 100 * end, "gain": 100 * (end - start), "last_step": last,
            "seconds": run["seconds"], "per_step": run["per_step"], "turns": run["turns"],
            "at_builtin_time": 100 * then, "step_at_builtin_time": step,
            "at_quarter_time": 100 * early, "step_at_quarter_time": early_step,
            "trainer_cpu": run.get("trainer_cpu", 0.0), "agent_cpu": run.get("agent_cpu", 0.0)}


def main() -> None:
    if "--agent" in sys.argv:
        return agent()
    if "--pull" in sys.argv:
        return pull(Path(sys.argv[sys.argv.index("--pull") + 1]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--num-eval", type=int, default=200, help="held-out sums per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", nargs="?", const="agent-learning", metavar="NAME",
                   help="write the table to benchmarks/results/NAME.MACHINE.json (docs/agents.md)")
    args = p.parse_args()
    me = Path(__file__).resolve()
    gateway = ["env.name=agent", "env.timeout=600", "reward.functions=[env]"]
    arms = {"built-in tool environment": [],
            "a program on the standard library's http.client": [
                *gateway, f"env.command={sys.executable} {me} --agent --stdlib", "env.agent_mode=persistent"],
            "a program on the `openai` client": [
                *gateway, f"env.command={sys.executable} {me} --agent", "env.agent_mode=persistent"],
            "the `openai` program asking for work (`env.agent_mode=serve`)": [*gateway, "env.agent_mode=serve"]}
    rows = []
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.steps} steps per arm", flush=True)
    with tempfile.TemporaryDirectory(prefix="lmrl-agent-learning-") as tmp:
        for i, (arm, overrides) in enumerate(arms.items()):
            serve = "env.agent_mode=serve" in overrides  # its program runs beside the run, started here
            os.environ[CPU_FILE] = str(Path(tmp) / f"{i}.agent-cpu")  # (as train sets it) for the program started here
            puller = subprocess.Popen([sys.executable, str(me), "--pull", str(Path(tmp) / str(i) / "agent.json")]
                                      ) if serve else None
            run = train(Path(tmp) / str(i), args.steps, args.eval_every, args.num_eval, args.seed, *overrides)
            if puller is not None:  # not lmrl train's child: its CPU, written as it ends, was not in train's
                puller.wait(60)
                run["trainer_cpu"] += run["agent_cpu"]  # what train took off, had the program ended before it
                run["agent_cpu"] = float(Path(os.environ[CPU_FILE]).read_text())
            rows.append(row(arm, run, rows[0]["seconds"] if rows else None))
            r = rows[-1]
            print(f"{arm:40s} {r['start']:5.1f}% -> {r['end']:5.1f}% at step {r['last_step']} ({r['gain']:+.1f} points)"
                  f" in {r['seconds']:.1f} s of training ({r['per_step']:.2f} s per step, turns {r['turns']:.2f}); "
                  f"{r['at_builtin_time']:.1f}% at step {r['step_at_builtin_time']} by the built-in arm's training time, "
                  f"{r['at_quarter_time']:.1f}% at step {r['step_at_quarter_time']} by a quarter of it; "
                  f"CPU: lmrl train {r['trainer_cpu']:.0f} s, the agent program {r['agent_cpu']:.0f} s", flush=True)
    if args.record:
        sys.path.insert(0, str(me.parent))
        from recording import Column, record

        columns = [Column("arm", "episodes driven by"), Column("start", "held-out accuracy, step 0", "{:.1f}%"),
                   Column("end", "at the end", "{:.1f}%"), Column("gain", "gain (points)", "{:+.1f}"),
                   Column("at_builtin_time", "by the built-in's training time", "{:.1f}%"),
                   Column("step_at_builtin_time", "(its step)"),
                   Column("at_quarter_time", "by a quarter of it", "{:.1f}%"),
                   Column("step_at_quarter_time", "(its step)"),
                   Column("seconds", "training", "{:.1f} s"), Column("per_step", "per step", "{:.2f} s"),
                   Column("turns", "turns per episode at the end", "{:.2f}"),
                   Column("trainer_cpu", "CPU: lmrl train", "{:.0f} s"), Column("agent_cpu", "agent program", "{:.0f} s")]
        base = rows[0]
        values = {"gain_difference": f"{max(abs(base['gain'] - r['gain']) for r in rows[1:]):.1f} points",
                  "time_ratio_stdlib": f"{rows[1]['per_step'] / base['per_step']:.2f}x",
                  "time_ratio_openai": f"{rows[2]['per_step'] / base['per_step']:.2f}x",
                  "time_ratio_serve": f"{rows[3]['per_step'] / base['per_step']:.2f}x",
                  "same_time_difference": f"{max(abs(base['at_builtin_time'] - r['at_builtin_time']) for r in rows[1:]):.1f} points",
                  "quarter_time_difference_stdlib": f"{base['at_quarter_time'] - rows[1]['at_quarter_time']:.1f} points",
                  "quarter_time_difference_openai":
                      f"{max(base['at_quarter_time'] - r['at_quarter_time'] for r in rows[2:]):.1f} points"}
        record(args.record, columns, rows, values=values,
               note=f"The shipped tiny-calculator model and its preset (GRPO, 32 prompts x 8 episodes, one thread), "
                    f"seed {args.seed}, {args.steps} steps per arm, greedy held-out accuracy on {args.num_eval} sums "
                    f"every {args.eval_every} steps; times are training time (evaluations left out); load average "
                    f"{os.getloadavg()[0]:.1f} at the end.")


if __name__ == "__main__":
    main()
