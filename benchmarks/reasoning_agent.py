"""Does an agent on a reasoning model learn as much when its chat template cuts the reasoning from earlier turns (so
that each call is a training sample of its own) as when the template keeps it (one sample per episode)? docs/agents.md,
"An episode of several samples", gives the numbers.

    python benchmarks/reasoning_agent.py                       # 20 steps per arm, seed 0
    python benchmarks/reasoning_agent.py --steps 2 --eval-every 1 --num-eval 8   # a smoke run
    python benchmarks/reasoning_agent.py --record              # the table in docs/agents.md

Both arms are `lmrl train` on the shipped tiny-reasoner (a character-level Llama fine-tuned on the calculator task in
a reasoning chat format, `scripts/make_tiny_model.py --task reasoner`) through `examples/reasoning_agent.py`, an
`openai`-client chat agent (`env.agent_mode=persistent`, `reward.functions=[env]`), one after the other in
subprocesses, with the tiny-reasoner preset's settings. They differ only in the chat template: the shipped one
writes an earlier turn without its reasoning and opens `<think>` in the generation prompt, as DeepSeek-R1's does,
so the answer's request never extends the call's tokens; the other (`lmrl.models.tiny.REASONER_KEEP_TEMPLATE`, in a
copy of the model) writes the turn as it was sampled. Held-out accuracy is the agent's reward, greedy, on --num-eval
sums. Time is training time: the steps' seconds, evaluations left out. --record [NAME] (default reasoning-agent)
writes benchmarks/results/NAME.MACHINE.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the tiny-reasoner preset, spelled out: a model given by its path gets no preset
SETTINGS = ["data.task=calculator", "model.chat_template=true", "rollout.prompts_per_step=32", "rollout.group_size=8",
            "rollout.max_new_tokens=48", "rollout.stop=[</calc>]", "env.max_turns=2", "optim.lr=1e-4",
            "train.threads=1", "train.max_minutes=null", "env.name=agent", "env.agent_mode=persistent",
            "env.timeout=600", "reward.functions=[env]",
            f"env.command={sys.executable} {ROOT / 'examples' / 'reasoning_agent.py'}"]


def train(out: Path, model: Path, steps: int, eval_every: int, num_eval: int, seed: int) -> dict:
    from recording import lmrl_train_rows

    rows = lmrl_train_rows(out, f"model.name_or_path={model}", f"train.steps={steps}", f"train.eval_every={eval_every}",
                           f"data.num_eval_prompts={num_eval}", f"train.seed={seed}", *SETTINGS)
    steps_ = [r for r in rows if "time/step" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    mean = lambda key: sum(r[key] for r in steps_) / len(steps_)  # noqa: E731
    return {"start": 100 * evals[0], "end": 100 * evals[-1], "gain": 100 * (evals[-1] - evals[0]),
            "best": 100 * max(evals), "seconds": sum(r["time/step"] for r in steps_), "per_step": mean("time/step"),
            "samples": mean("agent/samples_per_episode"), "closed": mean("agent/closed_sample_tokens"),
            "retokenized": sum(r["agent/retokenized_tokens"] for r in steps_),
            "failures": sum(r["agent/failures"] for r in steps_)}


def main() -> None:
    from lmrl.models.shipped import SHIPPED_MODELS
    from lmrl.models.tiny import REASONER_KEEP_TEMPLATE

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--num-eval", type=int, default=200, help="held-out sums per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", nargs="?", const="reasoning-agent", metavar="NAME",
                   help="write the table to benchmarks/results/NAME.MACHINE.json (docs/agents.md)")
    args = p.parse_args()
    rows = []
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.steps} steps per arm", flush=True)
    with tempfile.TemporaryDirectory(prefix="lmrl-reasoning-agent-") as tmp:
        kept = Path(tmp) / "tiny-reasoner-kept"
        shutil.copytree(SHIPPED_MODELS["tiny-reasoner"], kept)
        (kept / "chat_template.jinja").write_text(REASONER_KEEP_TEMPLATE)
        arms = {"cuts the reasoning of earlier turns (shipped)": SHIPPED_MODELS["tiny-reasoner"],
                "keeps it": kept}
        for i, (arm, model) in enumerate(arms.items()):
            run = train(Path(tmp) / str(i), model, args.steps, args.eval_every, args.num_eval, args.seed)
            rows.append({"arm": arm, **run})
            print(f"template {arm:46s} {run['start']:5.1f}% -> {run['end']:5.1f}% ({run['gain']:+.1f} points, best "
                  f"{run['best']:.1f}%) in {run['seconds']:.1f} s of training ({run['per_step']:.2f} s per step); "
                  f"{run['samples']:.2f} samples per episode, {run['closed']:.1f} tokens in closed samples per "
                  f"episode; re-tokenized {run['retokenized']:.0f}, failures {run['failures']:.0f}", flush=True)
    if args.record:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from recording import Column, record

        columns = [Column("arm", "the chat template"), Column("start", "held-out accuracy, step 0", "{:.1f}%"),
                   Column("end", "at the end", "{:.1f}%"), Column("gain", "gain (points)", "{:+.1f}"),
                   Column("samples", "samples per episode", "{:.2f}"),
                   Column("closed", "tokens in closed samples per episode", "{:.1f}"),
                   Column("retokenized", "re-tokenized", "{:.0f}"),
                   Column("seconds", "training", "{:.1f} s"), Column("per_step", "per step", "{:.2f} s")]
        values = {"gain_difference": f"{abs(rows[0]['gain'] - rows[1]['gain']):.1f} points",
                  "time_ratio": f"{rows[0]['per_step'] / rows[1]['per_step']:.2f}x"}
        record(args.record, columns, rows, values=values,
               note=f"The shipped tiny-reasoner through examples/reasoning_agent.py (GRPO, 32 prompts x 8 episodes, "
                    f"one thread), seed {args.seed}, {args.steps} steps per arm, greedy held-out accuracy on "
                    f"{args.num_eval} sums every {args.eval_every} steps; times are training time (evaluations left "
                    f"out); load average {os.getloadavg()[0]:.1f} at the end.")


if __name__ == "__main__":
    main()
