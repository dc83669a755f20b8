"""`lmrl train-rm` vs TRL's RewardTrainer on equal settings (CPU): preference pairs per second, and the same loss.

    python benchmarks/train_rm_vs_trl.py                       # the shipped model and a 256x4 one, 60 steps of 32 pairs
    python benchmarks/train_rm_vs_trl.py --quick               # the shipped model, 12 steps: about a minute
    python benchmarks/train_rm_vs_trl.py --seeds 3 --record    # the table in docs/performance.md (results/train-rm-vs-trl.MACHINE.json)

Needs TRL (`pip install 'lmrl[bench]'`). Nothing is downloaded (HF_HUB_OFFLINE=1 in every process).

What is equal in both trainers:
    model      the same weights: a sequence-classification model (one output) on the shipped model (`shipped`) or
               on a seeded character-level Llama (`256x4`: hidden 256, 4 layers), its new score head drawn once
               here and saved, so that both trainers load the very same head.
    pairs      the addition task's training prompts; chosen = the right sum, rejected = a wrong one (the sum moved by
               1 to 10, seeded). Both get the same token ids: lmrl encodes each pair as its scorer does
               (`lmrl.data.pairs.encode_pairs`: prompt + completion, no EOS appended) and TRL gets those ids as its
               preprocessed `chosen_ids` / `rejected_ids` columns, so it tokenizes nothing and appends no EOS.
    batches    B pairs per optimizer step, chosen and rejected in one right-padded forward of 2B rows in both (TRL's
               DataCollatorForPreference; lmrl's `RewardTrainer.rewards`), no gradient accumulation.
    loss       Bradley-Terry, -log sigmoid(r_chosen - r_rejected), mean over the step's pairs; no margin, no centring.
    optimizer  AdamW, the same constant learning rate, no warm-up, weight decay 0, grad-norm clip 1.0, float32,
               dropout off (TRL: disable_dropout=True, its default; bf16=False, use_cpu=True).
    threads    torch.set_num_threads(--threads) in both processes.

Same loss: before the timed runs, both trainers are built from the same directory and each computes its loss on the
same first batch of pairs (TRL: `RewardTrainer.compute_loss` on its collator's batch; lmrl: `bradley_terry_loss` of
`RewardTrainer.rewards`), and the gradients of the two losses are compared; both differences are printed and
must be within --tolerance (1e-5: float32 rounding).

How it measures: each trainer runs in a fresh subprocess, one after the other (never at the same time), the first
trainer alternating from seed to seed.
    s/step     wall time from the end of step 1 to the end of step N, over N - 1 (step 1 is warm-up): everything each
               trainer's loop does per step: batching, the forward, the loss, the backward, the optimizer step, its
               metrics and logging at its defaults (lmrl: metrics.jsonl every step; TRL: logging_steps=10). lmrl:
               the `time` of its metrics rows; TRL: a callback's clock at on_step_end.
    pairs/s    B / s/step.
    train s    the whole train() call: TRL's includes its dataloader set-up and logging; lmrl's its final pass over
               the training pairs for reward_stats.json and the save of final/, which TRL's does not do.
The machine may be shared with other processes: compare the ratios of one run, and rerun when in doubt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

MODELS = {"shipped": None, "256x4": (256, 4, 4)}  # hidden, layers, heads of a seeded tiny Llama


@dataclass
class Settings:
    """One comparison: everything both trainers share."""

    init_dir: str
    pairs: int
    steps: int
    batch_size: int
    lr: float
    threads: int
    seed: int
    share_prompt: bool = True  # lmrl's train.share_prompt (--plain: false, the batch TRL runs)


@dataclass
class RunResult:
    """What one trainer's subprocess reports."""

    trainer: str
    step_ends: list[float]  # wall-clock time at the end of each step (its metrics logged)
    losses: list[float]
    train_seconds: float

    @property
    def steady_seconds(self) -> float:
        """Seconds per step from the end of step 1 to the end of the last: everything the loop does per step."""
        return (self.step_ends[-1] - self.step_ends[0]) / (len(self.step_ends) - 1)


# --------------------------------------------------------------------------------------- shared pieces
def make_pairs(n: int, seed: int) -> list[dict]:
    """n preference pairs on the addition task's training prompts: the right sum against a wrong one."""
    from lmrl.data.tasks import get_task

    rng = random.Random(seed)
    rows = get_task("addition").train_prompts()[:n]
    pairs = []
    for row in rows:
        right = int(row["answer"])
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        pairs.append({"prompt": row["prompt"], "chosen": str(right), "rejected": str(wrong if wrong >= 0 else right + 11)})
    return pairs


def build_start_model(model: str, seed: int, out_dir: str) -> None:
    """The reward model both trainers start from: a new score head (drawn with `seed`) on the base model, saved."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from lmrl.models.shipped import SHIPPED_MODEL, load_shipped
    from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

    torch.manual_seed(seed)
    if MODELS[model] is None:
        _, tokenizer = load_shipped()
        rm = AutoModelForSequenceClassification.from_pretrained(SHIPPED_MODEL, num_labels=1)
    else:
        hidden, layers, heads = MODELS[model]
        tokenizer = char_tokenizer()
        with tempfile.TemporaryDirectory() as base:
            tiny_causal_lm(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=seed).save_pretrained(base)
            rm = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def lmrl_trainer(s: Settings, out: str, steps: int):
    from lmrl import RewardTrainer

    cfg = {"model": {"name_or_path": s.init_dir, "device": "cpu"},
           "train": {"output_dir": out, "batch_size": s.batch_size, "steps": steps, "seed": s.seed, "threads": s.threads,
                     "overwrite": True, "share_prompt": s.share_prompt},
           "optim": {"lr": s.lr, "weight_decay": 0.0, "warmup_steps": 0, "max_grad_norm": 1.0},
           "log": {"console": False}}  # metrics.jsonl every step, as by default
    return RewardTrainer(cfg, train_pairs=make_pairs(s.pairs, s.seed))


def trl_trainer(s: Settings, out: str, steps: int, encoded, callbacks=()):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(s.init_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(s.init_dir)
    data = Dataset.from_list([{"chosen_ids": c, "rejected_ids": r} for c, r in zip(encoded.chosen, encoded.rejected)])
    args = RewardConfig(output_dir=out, per_device_train_batch_size=s.batch_size, gradient_accumulation_steps=1,
                        max_steps=steps, learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0,
                        weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, report_to="none",
                        save_strategy="no", eval_strategy="no", seed=s.seed, data_seed=s.seed,
                        dataloader_num_workers=0, max_length=None, disable_dropout=True,
                        gradient_checkpointing=False)
    return RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         callbacks=list(callbacks))


# ------------------------------------------------------------------------------------------ runners
def run_lmrl(s: Settings, out: str) -> RunResult:
    trainer = lmrl_trainer(s, out, s.steps)
    tic = time.perf_counter()
    result = trainer.train()
    train_seconds = time.perf_counter() - tic
    return RunResult("lmrl", [r["time"] for r in result.history], [r["rm/loss"] for r in result.history], train_seconds)


def run_trl(s: Settings, out: str) -> RunResult:
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.ends, self.losses = [], []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    encoded = lmrl_trainer(s, out, 1).train_set  # the very ids lmrl trains on
    timer = Timer()
    trainer = trl_trainer(s, out, s.steps, encoded, [timer])
    tic = time.perf_counter()
    trainer.train()
    return RunResult("trl", timer.ends, timer.losses, time.perf_counter() - tic)


def same_loss(s: Settings, out: str) -> dict[str, float]:
    """Both trainers' loss and gradient on the same first batch of pairs, from the same weights."""
    import torch
    from trl.trainer.reward_trainer import DataCollatorForPreference

    from lmrl.algorithms import bradley_terry_loss

    ours = lmrl_trainer(s, out, 1)
    batch = ours.train_set.subset(list(range(s.batch_size)))
    ours.model.train()
    loss_ours = bradley_terry_loss(*ours.rewards(batch.chosen, batch.rejected))
    loss_ours.backward()
    theirs = trl_trainer(s, out, 1, ours.train_set)
    theirs.model.train()
    collate = DataCollatorForPreference(pad_token_id=theirs.processing_class.pad_token_id)
    inputs = collate([{"chosen_ids": c, "rejected_ids": r} for c, r in zip(batch.chosen, batch.rejected)])
    loss_theirs = theirs.compute_loss(theirs.model, inputs)
    loss_theirs.backward()
    g_ours = {n: p.grad for n, p in ours.model.named_parameters() if p.grad is not None}
    g_theirs = {n: p.grad for n, p in theirs.model.named_parameters() if p.grad is not None}
    assert g_ours.keys() == g_theirs.keys(), sorted(set(g_ours) ^ set(g_theirs))
    diff = sum(((g_ours[n] - g_theirs[n]) ** 2).sum() for n in g_ours) ** 0.5
    norm = sum((g ** 2).sum() for g in g_theirs.values()) ** 0.5
    return {"loss_lmrl": loss_ours.item(), "loss_trl": loss_theirs.item(),
            "loss_diff": abs(loss_ours.item() - loss_theirs.item()), "grad_rel_diff": float(diff / norm),
            "padded_width": int(inputs["input_ids"].shape[1]), "rows": int(inputs["input_ids"].shape[0]),
            "same_ids": float(torch.equal(inputs["input_ids"], torch.cat([_pad(batch.chosen + batch.rejected)])))}


def _pad(seqs):
    from lmrl.rewards.reward_model import pad_right

    return pad_right(seqs, 0)[0]


RUNNERS = {"lmrl": run_lmrl, "trl": run_trl}


def child(kind: str, settings_json: str, result_path: str) -> None:
    """Subprocess entry: one trainer's run (or the same-loss check), its result written as JSON."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    s = Settings(**json.loads(settings_json))
    torch.set_num_threads(s.threads)
    with tempfile.TemporaryDirectory() as out:
        result = same_loss(s, out) if kind == "check" else asdict(RUNNERS[kind](s, out))
    Path(result_path).write_text(json.dumps(result))


def run_child(kind: str, s: Settings):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--settings", json.dumps(asdict(s)),
               "--result", path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} subprocess failed:\n{proc.stderr[-4000:]}")
        out = json.loads(Path(path).read_text())
        return out if kind == "check" else RunResult(**out)
    finally:
        os.unlink(path)


# ------------------------------------------------------------------------------------------- parent
def ratio_row(model: str, s: Settings, runs: list[dict[str, RunResult]], check: dict[str, float]) -> dict:
    """One table row: the means over seeds of each trainer's s/step, and the ratio of pairs/s."""
    ours = statistics.fmean(r["lmrl"].steady_seconds for r in runs)
    theirs = statistics.fmean(r["trl"].steady_seconds for r in runs)
    per_seed = ", ".join(f"{r['trl'].steady_seconds / r['lmrl'].steady_seconds:.2f}" for r in runs)
    return {"model": model, "batch": s.batch_size, "lmrl_pairs_s": s.batch_size / ours, "trl_pairs_s": s.batch_size / theirs,
            "ratio": theirs / ours, "per_seed": per_seed,
            "train_s_lmrl": statistics.fmean(r["lmrl"].train_seconds for r in runs),
            "train_s_trl": statistics.fmean(r["trl"].train_seconds for r in runs),
            "loss_diff": check["loss_diff"], "grad_rel_diff": check["grad_rel_diff"]}


def table_columns() -> list:
    from recording import Column

    return [Column("model"), Column("batch", "pairs per step"),
            Column("lmrl_pairs_s", "lmrl pairs/s", "{:.0f}"), Column("trl_pairs_s", "TRL pairs/s", "{:.0f}"),
            Column("ratio", "lmrl / TRL (per seed)", "**{:.2f}x** ({per_seed})"),
            Column("train_s_lmrl", "train() s (lmrl; TRL)", "{:.1f}; {train_s_trl:.1f}"),
            Column("loss_diff", "first-batch loss / gradient difference", "{:.0e} / {grad_rel_diff:.0e}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["shipped", "256x4"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="pairs per optimizer step (2x rows per forward)")
    parser.add_argument("--pairs", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="the largest |loss difference| and relative gradient difference accepted on the first batch")
    parser.add_argument("--quick", action="store_true", help="the shipped model, 12 steps")
    parser.add_argument("--plain", action="store_true",
                        help="lmrl with train.share_prompt=false: the same right-padded batch as TRL's, nothing shared")
    parser.add_argument("--record", nargs="?", const="train-rm-vs-trl", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json")
    parser.add_argument("--child", choices=[*RUNNERS, "check"], help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.settings, args.result)
        return
    if args.quick:
        args.models, args.steps = ["shipped"], 12
    try:
        import trl
    except ImportError:
        sys.exit("TRL is not installed: pip install 'lmrl[bench]'")
    import torch
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"threads {args.threads}, {os.cpu_count()} CPUs; {args.steps} steps of {args.batch_size} pairs; lmrl "
          f"train.share_prompt={str(not args.plain).lower()}")
    rows, failed = [], []
    for model in args.models:
        with tempfile.TemporaryDirectory() as init_dir:
            build_start_model(model, args.seed, init_dir)
            base = Settings(init_dir, args.pairs, args.steps, args.batch_size, args.lr, args.threads, args.seed,
                            not args.plain)
            check = run_child("check", base)
            ok = check["loss_diff"] <= args.tolerance and check["grad_rel_diff"] <= args.tolerance and check["same_ids"]
            print(f"[{model}] same loss: first batch of {args.batch_size} pairs ({check['rows']} rows x "
                  f"{check['padded_width']} tokens, the same ids in both: {bool(check['same_ids'])}): lmrl "
                  f"{check['loss_lmrl']:.7f}, TRL {check['loss_trl']:.7f}, |diff| {check['loss_diff']:.1e}; gradients "
                  f"differ by {check['grad_rel_diff']:.1e} (relative L2); tolerance {args.tolerance:g}: "
                  f"{'ok' if ok else 'FAILED'}", flush=True)
            if not ok:
                failed.append(model)
            runs = []
            for i, seed in enumerate(range(args.seed, args.seed + args.seeds)):
                s, one = replace(base, seed=seed), {}
                for name in ["lmrl", "trl"] if i % 2 == 0 else ["trl", "lmrl"]:  # neither always goes first
                    one[name] = run_child(name, s)
                a, b = one["lmrl"], one["trl"]
                print(f"[{model}] seed {seed}: s/step lmrl {a.steady_seconds * 1e3:.1f} ms, TRL {b.steady_seconds * 1e3:.1f} "
                      f"ms; pairs/s lmrl {args.batch_size / a.steady_seconds:.0f}, TRL {args.batch_size / b.steady_seconds:.0f}: "
                      f"{b.steady_seconds / a.steady_seconds:.2f}x; train() {a.train_seconds:.1f} s vs {b.train_seconds:.1f} s; "
                      f"last loss {a.losses[-1]:.4f} vs {b.losses[-1]:.4f}", flush=True)
                runs.append(one)
            rows.append(ratio_row(model, base, runs, check))
    for row in rows:
        print(f"{row['model']}: pairs/s lmrl {row['lmrl_pairs_s']:.0f}, TRL {row['trl_pairs_s']:.0f}: "
              f"{row['ratio']:.2f}x (per seed {row['per_seed']})")
    if args.record:
        from recording import record

        seeds = f"seed {args.seed}" if args.seeds == 1 else f"means over seeds {args.seed}-{args.seed + args.seeds - 1}"
        record(args.record, table_columns(), rows, note=f"float32; lmrl train.share_prompt={str(not args.plain).lower()}; {args.steps} steps; {args.threads} thread(s); {seeds}; pairs/s from the wall time of "
                       "steps 2..N.")
    if failed:
        sys.exit(f"the two losses differ beyond --tolerance={args.tolerance:g} on: {', '.join(failed)}")


if __name__ == "__main__":
    main()
