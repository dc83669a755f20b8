"""Preference pairs from a policy's own samples, judged by the task's verifier: the first stage of the RLHF loop.

    python examples/rlhf/make_pairs.py --model tiny-addition --out runs/rlhf/pairs-0.jsonl
    python examples/rlhf/make_pairs.py --model runs/rlhf/grpo-1/final --out runs/rlhf/pairs-1.jsonl   # a later round

For each training prompt of the built-in task the model samples --samples completions (temperature 1, lmrl's own
generator, as `lmrl train` samples); the task's reward decides which are right. A prompt with a wrong sample
gives one pair: chosen = a right sample (the reference answer when none was right), rejected = the most frequent
wrong sample: the mistake this model makes most, which is what a reward model must learn to score low
(--every-wrong: a pair for each distinct wrong sample). Prompts the model always answers right give no pair. The held-out split is never sampled.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path


def make_pairs(model: str, samples: int, prompts: int, seed: int, threads: int,
               every_wrong: bool = False) -> tuple[list[dict], dict[str, float]]:
    from lmrl import Trainer, load_config

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"model.name_or_path={model}", f"train.output_dir={out}", f"train.seed={seed}",
                                 f"train.threads={threads}", "log.console=false", "data.num_eval_prompts=0",
                                 "model.device=cpu", "rollout.max_new_tokens=4"])  # the task's: a sum and EOS
        trainer = Trainer(cfg, console=False)
        rows = trainer.data.train_rows[:prompts]
        pairs, right_samples, chunk = [], 0, 256
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            rollout, out_scores = trainer.generate_and_score(part, samples, seed=seed + start)
            scores = out_scores.scores.view(len(part), samples).tolist()
            texts = [rollout.texts[i * samples : (i + 1) * samples] for i in range(len(part))]
            for row, s, t in zip(part, scores, texts):
                right = [c.strip() for c, v in zip(t, s) if v > 0]
                wrong = [c.strip() for c, v in zip(t, s) if v <= 0 and c.strip()]
                right_samples += len(right)
                counts = collections.Counter(wrong).most_common(None if every_wrong else 1)
                for rejected, _ in counts:  # the most frequent wrong sample (every distinct one with every_wrong)
                    pairs.append({"prompt": row["prompt"], "chosen": right[0] if right else row["answer"],
                                  "rejected": rejected})
    stats = {"prompts": len(rows), "pairs": len(pairs), "sample_accuracy": right_samples / (len(rows) * samples)}
    return pairs, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-addition", help="the policy that samples: shipped name or directory")
    parser.add_argument("--out", required=True, help="the pairs' JSONL file")
    parser.add_argument("--samples", type=int, default=8, help="completions sampled per prompt")
    parser.add_argument("--prompts", type=int, default=4000, help="training prompts used (the task has 4000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--every-wrong", action="store_true",
                        help="a pair for every distinct wrong sample of a prompt, not only the most frequent")
    parser.add_argument("--append", nargs="*", default=[], help="earlier rounds' pair files to add to this one")
    args = parser.parse_args()
    tic = time.perf_counter()
    pairs, stats = make_pairs(args.model, args.samples, args.prompts, args.seed, args.threads, args.every_wrong)
    earlier = [json.loads(line) for path in args.append for line in Path(path).read_text().splitlines() if line.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p) + "\n" for p in earlier + pairs))
    print(f"{args.model}: {stats['pairs']} pairs from {stats['prompts']} prompts x {args.samples} samples (sample "
          f"accuracy {stats['sample_accuracy']:.1%}), {len(earlier)} earlier pairs added; {out} in "
          f"{time.perf_counter() - tic:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
