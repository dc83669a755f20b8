"""lmrl vs TRL's GRPOTrainer on equal settings (CPU): seconds per step, samples/s, peak memory, reward.

    python benchmarks/vs_trl.py                          # hidden 64 / 2 layers and 256 / 4 layers, 20 steps
    python benchmarks/vs_trl.py --quick                  # hidden 64 / 2 layers, 4 steps: about a minute
    python benchmarks/vs_trl.py --sizes 256x4 --steps 40 --sft-steps 400
    python benchmarks/vs_trl.py --seeds 3 --record       # the table in docs/performance.md (benchmarks/results/vs-trl.MACHINE.json)
    python benchmarks/vs_trl.py --seeds 3 --sizes 256x4 --precision bf16 --attn eager --record   # adds its bfloat16 row

Needs TRL (`pip install 'lmrl[bench]'`). Nothing is downloaded (HF_HUB_OFFLINE=1 in every process).

What is equal in both trainers:
    model      the same weights: a character-level Llama built from a seed (`tiny_causal_lm`), optionally
               warm-started by a short supervised fine-tuning on addition (--sft-steps, done once here), saved
               to a temporary directory that both trainers load from.
    prompts    the addition task's training split (`lmrl.data.tasks.get_task("addition")`), and the same
               prompts at every step: TRL gets them unshuffled, in the order lmrl's sampler draws them.
    reward     exact match of the answer: the completion's leading digits must equal the sum.
    sampling   8 prompts x G = 8 completions per step, temperature 1, no top-k / top-p, exactly 64 new
               tokens per completion in both: the benchmark tokenizer's EOS is a token id outside the
               model's output vocabulary, so neither trainer can sample it and every completion runs to
               max_new_tokens (equal work, no min_new_tokens logits processor in either sampler).
    loss       GRPO: group-normalised advantages (std of the group), PPO clip 0.2, beta = kl_coef = 0 (no
               reference model), one optimizer step per batch (1 iteration, 1 minibatch, no gradient
               accumulation), per-sequence token mean (TRL loss_type="grpo" = lmrl "seq-mean-token-mean").
    optimizer  AdamW, the same constant learning rate, no warm-up, weight decay 0, grad-norm clip 1.0,
               float32 (TRL: bf16=False, gradient_checkpointing=False, use_cpu=True).
    threads    torch.set_num_threads(--threads) in both processes.

Same update: before the timed runs (float32), one batch sampled by lmrl goes through lmrl's update and through
TRL's loss (`GRPOTrainer._compute_loss`) from the same weights; the printed relative difference of the two
gradients (about 1e-6 to 1.5e-5, float32 rounding) shows that the updates are the same, so reward differences
between the trainers come from the sampled completions.

How it measures: each trainer runs in a fresh subprocess, one after the other (never at the same time),
the first trainer alternating from seed to seed.
    s/step     mean wall time of steps 2..N (step 1 is warm-up and shown apart): generation, reward,
               forward/backward and the optimizer step. lmrl: its `time/step` metric; TRL: a callback from
               on_step_begin to on_step_end.
    samples/s  completions per step / s/step.
    peak RSS   the subprocess's resident-set high-water mark (getrusage). "+train" is how much it grew
               while the trainer was built and trained, over the process with the model loaded: it leaves
               out the import footprint, which for TRL includes trl, accelerate, pandas, pyarrow.
    reward     mean training reward of the first step and of the last min(5, N) steps; "held-out" is the
               greedy exact-match accuracy on 200 held-out prompts after training (before: the start model).
The machine may be shared with other processes: compare the ratios of one run, and rerun when in doubt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

SIZES = {"64x2": (64, 2, 4), "256x4": (256, 4, 4), "512x8": (512, 8, 8)}  # hidden, layers, heads
END_TOKEN = "<end>"  # the benchmark's EOS: an id outside the model's output vocabulary
HELD_OUT = 200


@dataclass
class Settings:
    """One comparison: everything both trainers share."""

    init_dir: str
    steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    lr: float
    threads: int
    seed: int
    precision: str = "fp32"  # fp32: both in float32; bf16: bfloat16 autocast in both, and lmrl samples in bf16
    attn: str = "sdpa"  # the attention kernel of the model both trainers load


@dataclass
class RunResult:
    """What one trainer's subprocess reports."""

    trainer: str
    step_seconds: list[float]
    rewards: list[float]  # mean training reward of each step
    lengths: list[float]  # mean completion length (tokens) of each step
    wall_seconds: float  # the whole train() call
    setup_seconds: float  # building the trainer
    peak_rss_mb: float
    rss_growth_mb: float
    held_out: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def steady_seconds(self) -> float:
        times = self.step_seconds[1:] or self.step_seconds
        return statistics.fmean(times)

    @property
    def final_reward(self) -> float:
        return statistics.fmean(self.rewards[-min(5, len(self.rewards)) :])


# --------------------------------------------------------------------------------------- shared pieces
def answer_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's leading digits equal the answer, else 0.0 (TRL and lmrl signature).

    Completions never end with EOS here (it cannot be sampled), so the answer is read up to the first
    character that is not a digit.
    """
    return [float(re.match(r"\s*(\d*)", c).group(1) == str(a)) for c, a in zip(completions, answer)]


class RewardRecorder:
    """A reward function that also records each call's mean reward and mean completion length."""

    __name__ = "answer_reward"  # TRL names reward functions by __name__

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.lengths: list[float] = []

    def __call__(self, prompts, completions, answer, completion_ids=None, **kwargs) -> list[float]:
        scores = answer_reward(prompts, completions, answer)
        self.rewards.append(statistics.fmean(scores))
        if completion_ids is not None:
            self.lengths.append(statistics.fmean(len(c) for c in completion_ids))
        return scores


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _load(init_dir: str, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype="float32", attn_implementation=attn)
    return model, tokenizer


def held_out_accuracy(model, tokenizer, n: int = HELD_OUT) -> float:
    """Greedy exact-match accuracy on the first `n` held-out addition prompts (same code for both)."""
    from lmrl.data.tasks import generate_completions, get_task

    task = get_task("addition")
    items = task.eval_prompts()[:n]
    texts = generate_completions(model, tokenizer, [it["prompt"] for it in items], task.max_new_tokens)
    return statistics.fmean(answer_reward(None, texts, [it["answer"] for it in items]))


def prompt_rows(s: Settings) -> list[dict[str, str]]:
    from lmrl.data.tasks import get_task

    return get_task("addition").train_prompts()


# ------------------------------------------------------------------------------------------- trainers
def run_lmrl(s: Settings, out_dir: str) -> RunResult:
    import torch

    from lmrl.config import load_config
    from lmrl.trainer import Trainer

    model, tokenizer = _load(s.init_dir, s.attn)
    base_peak = _peak_rss_mb()
    recorder = RewardRecorder()
    cfg = load_config(None, [
        "algorithm=grpo", f"train.steps={s.steps}", f"rollout.prompts_per_step={s.prompts_per_step}",
        f"rollout.group_size={s.group_size}", f"rollout.max_new_tokens={s.max_new_tokens}", f"optim.lr={s.lr}",
        "optim.max_grad_norm=1.0", "optim.weight_decay=0.0", f"optim.micro_batch_size={s.prompts_per_step * s.group_size}",
        "rollout.temperature=1.0", "algorithm.kl_coef=0.0", "algorithm.aggregation=seq-mean-token-mean",
        "algorithm.clip_low=0.2", "algorithm.clip_high=0.2", f"train.seed={s.seed}", f"train.threads={s.threads}", f"train.autocast_bf16={s.precision == 'bf16'}",
        *(["rollout.dtype=bfloat16"] if s.precision == "bf16" else []),
        f"train.output_dir={out_dir}", "train.eval_every=0", "log.console=false", "log.samples_every=0",
        "model.name_or_path=benchmark",
    ])
    t0 = time.perf_counter()
    trainer = Trainer(cfg, model=model, tokenizer=tokenizer, reward_funcs=[recorder],
                      train_dataset=prompt_rows(s), console=False)
    t1 = time.perf_counter()
    result = trainer.train()
    t2 = time.perf_counter()
    torch.set_num_threads(s.threads)
    h = result.history
    extra = {k: statistics.fmean(m[k] for m in h[1:] or h) for k in ("time/generate", "time/experience", "time/update", "update/rows_skipped")}
    return RunResult("lmrl", [m["time/step"] for m in h], recorder.rewards, recorder.lengths, t2 - t1, t1 - t0,
                     _peak_rss_mb(), _peak_rss_mb() - base_peak, held_out_accuracy(trainer.policy, tokenizer), extra)


def run_trl(s: Settings, out_dir: str) -> RunResult:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lmrl.data.prompts import PromptSampler

    model, tokenizer = _load(s.init_dir, s.attn)
    base_peak = _peak_rss_mb()
    rows = prompt_rows(s)
    # the prompts lmrl's trainer draws at steps 1..N (its sampler's batch `step`), in order: TRL reads the
    # dataset unshuffled, P distinct prompts per step, each repeated G times
    sampler = PromptSampler(len(rows), seed=s.seed)
    order = [i for step in range(1, s.steps + 1) for i in sampler.indices(step, s.prompts_per_step)]
    dataset = Dataset.from_list([rows[i] for i in order])
    recorder = RewardRecorder()

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0
            self.threads = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)
            self.threads = torch.get_num_threads()  # accelerate must not have changed it

    timer = StepTimer()
    args = GRPOConfig(
        output_dir=out_dir,
        max_steps=s.steps,
        per_device_train_batch_size=s.prompts_per_step * s.group_size,  # completions per optimizer step
        gradient_accumulation_steps=1,
        num_generations=s.group_size,
        max_completion_length=s.max_new_tokens,
        num_iterations=1,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        shuffle_dataset=False,
        seed=s.seed,
        use_cpu=True,
        bf16=s.precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=[recorder], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    torch.set_num_threads(s.threads)
    # where TRL's step time goes: generation + reward + advantages, and the loss forward (its backward and the
    # optimizer step are the rest)
    spent: dict[str, list[float]] = {"time/generate": [], "time/loss_forward": []}
    _timed(trainer, "_generate_and_score_completions", spent["time/generate"])
    _timed(trainer, "compute_loss", spent["time/loss_forward"])
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    extra = {k: statistics.fmean(v[1:] or v) for k, v in spent.items() if v}
    extra["threads"] = timer.threads
    return RunResult("trl", timer.times, recorder.rewards, recorder.lengths, t2 - t1, t1 - t0,
                     _peak_rss_mb(), _peak_rss_mb() - base_peak, held_out_accuracy(trainer.model, tokenizer), extra)


def _timed(obj, name: str, sink: list[float]) -> None:
    """Replace the bound method `obj.name` by one that appends its duration to `sink`."""
    method = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)


RUNNERS = {"lmrl": run_lmrl, "trl": run_trl}


def update_difference(s: Settings, out_dir: str) -> tuple[float, float]:
    """Both trainers' loss gradients on one identical batch: (relative L2 difference, cosine).

    lmrl samples one step's batch, scores it with a random 0 / 1 reward (so that advantages are not all 0)
    and computes its update's gradient (no clipping, lr ~0);
    TRL's GRPOTrainer computes its loss (`_compute_loss`, the function its training step calls) on the
    same prompt / completion tokens, masks and advantages, from a copy of the same start weights. Equal
    gradients mean equal updates (both use AdamW with the same settings), so any reward difference after
    N steps comes from the sampled completions, not from the update.
    """
    import copy

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from lmrl.config import load_config
    from lmrl.experience import make_experience
    from lmrl.trainer import Trainer

    model, tokenizer = _load(s.init_dir, s.attn)
    twin = copy.deepcopy(model)
    cfg = load_config(None, [
        "algorithm=grpo", "train.steps=1", f"rollout.prompts_per_step={s.prompts_per_step}",
        f"rollout.group_size={s.group_size}", f"rollout.max_new_tokens={s.max_new_tokens}", "optim.lr=1e-30",
        "optim.max_grad_norm=null", "optim.weight_decay=0.0", "algorithm.kl_coef=0.0",
        "algorithm.aggregation=seq-mean-token-mean", f"train.seed={s.seed}", "log.console=false",
        "model.name_or_path=benchmark", f"train.output_dir={out_dir}/lmrl",
    ])
    coin = random.Random(s.seed)  # a random 0 / 1 reward: every group has signal, whatever the model

    def coin_reward(prompts, completions, **kwargs) -> list[float]:
        return [float(coin.random() < 0.5) for _ in completions]

    trainer = Trainer(cfg, model=model, tokenizer=tokenizer, reward_funcs=[coin_reward],
                      train_dataset=prompt_rows(s), console=False)
    c = trainer.collect(1)
    exp = make_experience(c.rollout, c.scores, **cfg.algorithm.options_for(make_experience), policy_logprobs=None, kl_coef=0.0,
                          micro_batch_size=len(c.scores), loss_mask=c.keep, info=c.per_function)
    trainer.update(exp)  # leaves the (unclipped) gradient in .grad; lr ~0 leaves the weights
    ours = {n: p.grad for n, p in trainer.policy.named_parameters()}

    args = GRPOConfig(output_dir=f"{out_dir}/trl", max_steps=1, per_device_train_batch_size=len(c.scores),
                      num_generations=s.group_size, max_completion_length=s.max_new_tokens, beta=0.0,
                      loss_type="grpo", use_cpu=True, bf16=False, report_to="none")
    trl_trainer = GRPOTrainer(model=twin, reward_funcs=[RewardRecorder()], args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(prompt_rows(s)[: len(c.scores)]))
    trl_trainer.current_gradient_accumulation_steps = 1  # set by its training loop
    P = c.rollout.prompt_ids.shape[1]
    inputs = {"prompt_ids": c.rollout.prompt_ids, "prompt_mask": exp.attention_mask[:, :P].long(),
              "completion_ids": c.rollout.response_ids, "completion_mask": exp.response_mask.long(),
              "advantages": exp.advantages[:, 0]}  # GRPO: one advantage per sequence
    twin.train()
    trl_trainer._compute_loss(twin, inputs).backward()
    theirs = {n: p.grad for n, p in twin.named_parameters()}
    dot = sum((ours[n] * theirs[n]).sum() for n in ours)
    norm_ours, norm_theirs = (sum((g[n] ** 2).sum() for n in g) ** 0.5 for g in (ours, theirs))
    diff = sum(((ours[n] - theirs[n]) ** 2).sum() for n in ours) ** 0.5
    return float(diff / norm_theirs), float(dot / (norm_ours * norm_theirs))


def child(trainer: str, settings_json: str, result_path: str) -> None:
    """Subprocess entry: run one trainer (or the same-update check) and write its result as JSON."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    s = Settings(**json.loads(settings_json))
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    with tempfile.TemporaryDirectory() as out:
        result = update_difference(s, out) if trainer == "check" else asdict(RUNNERS[trainer](s, out))
    Path(result_path).write_text(json.dumps(result))


# -------------------------------------------------------------------------------------- start model
def build_start_model(hidden: int, layers: int, heads: int, sft_steps: int, seed: int, out_dir: str,
                      eos: bool = False) -> float:
    """Seeded tiny model (+ optional supervised warm start), saved with the benchmark tokenizer.

    Without `eos`, the tokenizer gets an extra special token `<end>` as its EOS; the model's vocabulary
    stops just before it, so no sampler can produce it, and the supervised targets are `answer;`: the
    model learns to write the sum and then a non-digit. With `eos`, the char tokenizer's own EOS is kept
    and the targets are `answer</s>`. Returns the start model's held-out accuracy.
    """
    import torch
    import torch.nn.functional as F

    from lmrl.data.tasks import get_task
    from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

    tokenizer = char_tokenizer()
    model = tiny_causal_lm(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=seed)
    if not eos:
        tokenizer.add_special_tokens({"eos_token": END_TOKEN})
        end = tokenizer.convert_tokens_to_ids(END_TOKEN)
        assert end >= model.config.vocab_size, "the benchmark EOS must lie outside the model's vocabulary"
        model.config.eos_token_id = end
        model.generation_config.eos_token_id = end
    suffix = [tokenizer.eos_token_id] if eos else tokenizer(";", add_special_tokens=False)["input_ids"]
    if sft_steps:
        rows = get_task("addition").train_prompts()
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        for _ in range(sft_steps):
            batch = [rows[i] for i in torch.randint(len(rows), (128,), generator=gen).tolist()]
            prompts = tokenizer([r["prompt"] for r in batch], add_special_tokens=False)["input_ids"]
            answers = [a + suffix for a in tokenizer([r["answer"] for r in batch], add_special_tokens=False)["input_ids"]]
            width = max(len(p) + len(a) for p, a in zip(prompts, answers))
            ids = torch.zeros(len(batch), width, dtype=torch.long)  # right padding with <pad> = 0
            labels = torch.full((len(batch), width), -100)
            for i, (p, a) in enumerate(zip(prompts, answers)):
                ids[i, : len(p) + len(a)] = torch.tensor(p + a)
                labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
            logits = model(input_ids=ids, attention_mask=(ids != 0).long()).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())  # t predicts t + 1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return held_out_accuracy(model, tokenizer)


# ------------------------------------------------------------------------------------------- parent
def run_child(trainer: str, s: Settings):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", trainer, "--settings", json.dumps(asdict(s)),
               "--result", path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{trainer} subprocess failed:\n{proc.stderr[-4000:]}")
        out = json.loads(Path(path).read_text())
        return out if trainer == "check" else RunResult(**out)
    finally:
        os.unlink(path)


def report(size: str, s: Settings, start_acc: float, runs: dict[str, RunResult]) -> None:
    batch = s.prompts_per_step * s.group_size
    print(f"\n== {size}: hidden {SIZES[size][0]}, {SIZES[size][1]} layers; {s.prompts_per_step} prompts x "
          f"G={s.group_size}, {s.max_new_tokens} new tokens, {s.steps} steps, lr {s.lr:g}, seed {s.seed}, "
          f"{s.precision}, {s.attn} attention; start held-out accuracy {start_acc:.3f}")
    header = (f"{'trainer':<8}{'s/step':>8}{'step 1':>8}{'samples/s':>11}{'tokens/s':>10}{'wall s':>8}"
              f"{'peak MB':>9}{'+train MB':>10}{'len':>6}{'reward 1st':>11}{'reward end':>11}{'held-out':>9}")
    print(header)
    print("-" * len(header))
    for r in runs.values():
        length = statistics.fmean(r.lengths) if r.lengths else float("nan")
        print(f"{r.trainer:<8}{r.steady_seconds:>8.2f}{r.step_seconds[0]:>8.2f}{batch / r.steady_seconds:>11.1f}"
              f"{batch * length / r.steady_seconds:>10.0f}{r.wall_seconds:>8.1f}{r.peak_rss_mb:>9.0f}"
              f"{r.rss_growth_mb:>10.0f}{length:>6.1f}{r.rewards[0]:>11.3f}{r.final_reward:>11.3f}{r.held_out:>9.3f}")
    if "lmrl" in runs and "trl" in runs:
        a, b = runs["lmrl"], runs["trl"]
        print(f"lmrl/TRL: samples/s {b.steady_seconds / a.steady_seconds:.2f}x  (incl. step 1: "
              f"{sum(b.step_seconds) / sum(a.step_seconds):.2f}x)  peak RSS {a.peak_rss_mb / b.peak_rss_mb:.2f}x  "
              f"+train RSS {a.rss_growth_mb / max(b.rss_growth_mb, 1e-9):.2f}x  "
              f"reward end {a.final_reward:.3f} vs {b.final_reward:.3f}  held-out {a.held_out:.3f} vs {b.held_out:.3f}")
    for r in runs.values():
        if r.extra:
            print(f"{r.trainer} step breakdown (steps 2..N): "
                  + "  ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in r.extra.items()))


def summary(size: str, seeds: list[int], all_runs: list[dict[str, RunResult]]) -> None:
    """Across seeds: the mean of the per-seed speed ratios, and each trainer's reward and held-out accuracy."""
    def spread(xs: list[float]) -> str:
        return f"{statistics.fmean(xs):.3f} +- {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"

    print(f"\n== {size}, seeds {seeds[0]}..{seeds[-1]}:")
    if all("lmrl" in r and "trl" in r for r in all_runs):
        ratios = [r["trl"].steady_seconds / r["lmrl"].steady_seconds for r in all_runs]
        print(f"lmrl/TRL samples/s: {statistics.fmean(ratios):.2f}x (per seed: {', '.join(f'{x:.2f}' for x in ratios)})")
    for name in all_runs[0]:
        runs = [r[name] for r in all_runs]
        print(f"{name:<5} s/step {statistics.fmean(r.steady_seconds for r in runs):.2f}  reward end "
              f"{spread([r.final_reward for r in runs])}  held-out {spread([r.held_out for r in runs])}")


def size_label(size: str, precision: str = "fp32", attn: str = "sdpa", eos: bool = False) -> str:
    """A row's model on the page: "hidden 256, 4 layers", then what differs from the float32 default."""
    hidden, layers, _ = SIZES[size]
    return (f"hidden {hidden}, {layers} layers" + (", bfloat16" if precision == "bf16" else "")
            + (", eager attention" if attn == "eager" else "") + (", completions end at EOS" if eos else ""))


def table_row(label: str, all_runs: list[dict[str, RunResult]]) -> dict:
    """One size's row of the result file: means over seeds of both trainers' runs (`all_runs`: one
    {"lmrl": ..., "trl": ...} per seed); update / rest = s/step - generation."""
    def mean(xs) -> float:
        return round(statistics.fmean(xs), 4)

    def std(xs: list[float]) -> float | None:
        return round(statistics.stdev(xs), 4) if len(xs) > 1 else None

    row: dict = {"model": label}
    for name in ("lmrl", "trl"):
        runs = [r[name] for r in all_runs]
        row[f"{name}_s_step"] = mean(r.steady_seconds for r in runs)
        if all("time/generate" in r.extra for r in runs):
            row[f"{name}_generate"] = mean(r.extra["time/generate"] for r in runs)
            row[f"{name}_rest"] = round(row[f"{name}_s_step"] - row[f"{name}_generate"], 4)
        row[f"{name}_reward"], row[f"{name}_reward_std"] = mean(r.final_reward for r in runs), std([r.final_reward for r in runs])
        row[f"{name}_held_out"], row[f"{name}_held_out_std"] = mean(r.held_out for r in runs), std([r.held_out for r in runs])
    ratios = [r["trl"].steady_seconds / r["lmrl"].steady_seconds for r in all_runs]
    row["lmrl_s_step_generate_update"] = row.pop("lmrl_s_step")
    row["trl_s_step_generate_rest"] = row.pop("trl_s_step")
    row["samples_s_lmrl_trl_per_seed"] = mean(ratios)
    row["per_seed"] = ", ".join(f"{x:.2f}" for x in ratios)
    row["peak_rss_lmrl_trl"] = mean(r["lmrl"].peak_rss_mb / r["trl"].peak_rss_mb for r in all_runs)
    row["training_reward_last_5_steps_lmrl_trl"] = row.pop("lmrl_reward")
    row["held_out_after_lmrl_trl"] = row.pop("lmrl_held_out")
    return row


def table_columns(rows: list[dict], steps: int):
    """The result file's columns (vs-trl): a column's format names the other keys of its rows."""
    from recording import Column

    split = all("lmrl_generate" in r and "trl_generate" in r for r in rows)
    several = all(r["lmrl_reward_std"] is not None for r in rows)
    spread = " +- {%s_std:.3f}" if several else ""

    def pair(key: str) -> str:
        return "{:.3f}" + spread.replace("%s", f"lmrl_{key}") + f"; {{trl_{key}:.3f}}" + spread.replace("%s", f"trl_{key}")

    return [Column("model", "model"),
            Column("lmrl_s_step_generate_update", "lmrl s/step (generate + update)",
                   "{:.2f} ({lmrl_generate:.2f} + {lmrl_rest:.2f})" if split else "{:.2f}"),
            Column("trl_s_step_generate_rest", "TRL s/step (generate + rest)",
                   "{:.2f} ({trl_generate:.2f} + {trl_rest:.2f})" if split else "{:.2f}"),
            Column("samples_s_lmrl_trl_per_seed", "samples/s lmrl / TRL" + (" (per seed)" if several else ""),
                   "**{:.2f}x** ({per_seed})" if several else "**{:.2f}x**"),
            Column("peak_rss_lmrl_trl", "peak RSS lmrl / TRL", "{:.2f}x"),
            Column("training_reward_last_5_steps_lmrl_trl", f"training reward, last {min(5, steps)} steps (lmrl; TRL)",
                   pair("reward")),
            Column("held_out_after_lmrl_trl", "held-out after (lmrl; TRL)", pair("held_out"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["64x2", "256x4"])
    parser.add_argument("--quick", action="store_true", help="hidden 64 / 2 layers, 4 steps, short warm start")
    parser.add_argument("--trainers", nargs="+", choices=list(RUNNERS), default=["lmrl", "trl"])
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sft-steps", type=int, default=300, help="supervised warm start (0 = random weights)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="run each trainer with seeds seed..seed+N-1 (one start model) and summarise: reward "
                             "after a few steps varies with the sampled completions more than between trainers")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: bfloat16 autocast in both trainers (TRL bf16=True, its default), and lmrl "
                             "samples with a bfloat16 copy of the policy (rollout.dtype=bfloat16, TIS-corrected)")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                        help="attention kernel of the model both trainers load")
    parser.add_argument("--eos", action="store_true",
                        help="let completions end at EOS (the warm start teaches it): unequal work by design, "
                             "lmrl drops finished rows from generation, TRL's model.generate keeps them")
    parser.add_argument("--record", nargs="?", const="vs-trl", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json (default NAME: vs-trl), a row "
                             "per size, merged into the file's other rows (the float32 and bf16 runs fill one table)")
    parser.add_argument("--child", choices=[*RUNNERS, "check"], help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.settings, args.result)
        return
    if args.quick:
        args.sizes, args.steps, args.sft_steps = ["64x2"], 4, 100
    if args.record and set(args.trainers) != set(RUNNERS):
        parser.error("--record compares the two trainers: run both (leave out --trainers)")

    import torch

    torch.set_num_threads(args.threads)
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        if "trl" in args.trainers:
            sys.exit("TRL is not installed: pip install 'lmrl[bench]' (or --trainers lmrl)")
        trl_version = "-"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl_version}, "
          f"threads {args.threads}, {os.cpu_count()} CPUs, "
          f"{'completions end at EOS' if args.eos else f'every completion {args.max_new_tokens} tokens (no EOS)'}")
    rows = []
    for size in args.sizes:
        hidden, layers, heads = SIZES[size]
        with tempfile.TemporaryDirectory() as init_dir:
            t = time.perf_counter()
            start_acc = build_start_model(hidden, layers, heads, args.sft_steps, args.seed, init_dir, args.eos)
            print(f"[{size}] start model: {args.sft_steps} warm-start steps in {time.perf_counter() - t:.0f}s", flush=True)
            seeds, all_runs = list(range(args.seed, args.seed + args.seeds)), []
            base = Settings(init_dir, args.steps, args.prompts_per_step, args.group_size, args.max_new_tokens,
                            args.lr, args.threads, args.seed, args.precision, args.attn)
            if set(args.trainers) == set(RUNNERS) and args.precision == "fp32":
                rel, cos = run_child("check", base)
                print(f"[{size}] same update: on one batch (same tokens, masks, advantages) lmrl's and TRL's loss "
                      f"gradients differ by {rel:.1e} (relative L2), cosine {cos:.6f}", flush=True)
            for i, seed in enumerate(seeds):
                s = replace(base, seed=seed)
                runs = {}
                # alternate which trainer goes first, so that a drift in the machine's speed favours neither
                for name in args.trainers if i % 2 == 0 else args.trainers[::-1]:
                    t = time.perf_counter()
                    runs[name] = run_child(name, s)
                    print(f"[{size}] {name}, seed {seed}: done in {time.perf_counter() - t:.0f}s", flush=True)
                runs = {name: runs[name] for name in args.trainers}
                report(size, s, start_acc, runs)
                all_runs.append(runs)
            if len(seeds) > 1:
                summary(size, seeds, all_runs)
            rows.append(table_row(size_label(size, args.precision, args.attn, args.eos), all_runs))
    if args.record:
        from recording import record

        setup = (f"{args.prompts_per_step} prompts x {args.group_size}, {args.max_new_tokens} new tokens, {args.steps} steps, "
                 f"{args.threads} threads")
        seeds = f"seed {args.seed}" if args.seeds == 1 else f"means over seeds {args.seed}-{args.seed + args.seeds - 1}"
        record(args.record, table_columns(rows, args.steps), rows, merge_on="model",
               note=f"float32 unless the row says otherwise; {setup}; {seeds}; update / rest: s/step - generate.")


if __name__ == "__main__":
    main()
