"""lmrl vs TRL's GRPOTrainer on a GPU, equal settings, on a real-architecture model built here.

    python benchmarks/gpu_vs_trl.py                    # Qwen2 at ~0.5B, 64 prompts x 8, 256 new tokens, bf16
    python benchmarks/gpu_vs_trl.py --tiny --trainers lmrl   # a tiny Qwen2 on the CPU: checks the script runs

Nothing comes from a hub: the model is a Qwen2 config with Qwen2-0.5B's shape and random weights, and the
tokenizer a byte-level BPE trained here on generated text. What is equal in both trainers:
    model      the same weights, loaded in bfloat16 (--dtype) with sdpa attention; TRL with bf16=True.
    prompts    the same `prompts_per_step` prompts at every step, in the same order.
    sampling   G completions per prompt, temperature 1, exactly `max_new_tokens` tokens each: the tokenizer's
               EOS lies outside the model's output vocabulary, so neither sampler can end early.
    reward     informative: a score in [0, 1) hashed from the completion's text, so groups are never all
               equal and no row is skipped for a zero advantage (equal work in the update).
    loss       GRPO, clip 0.2, no KL / reference model, one optimizer step per batch, per-sequence token mean.
    optimizer  AdamW, constant lr, no warm-up, weight decay 0, grad-norm clip 1.0.

What it prints, per trainer (steps 2..N; step 1 is warm-up):
    samples/s        completions per step / mean step time, and lmrl's ratio to TRL's;
    s per phase      generation (+ reward), the rest of the step;
    gen tokens/s     decode tokens per second of generation, against the bandwidth limit: each decode step
                     must read every weight once and every row's KV cache so far, at the device's copy
                     bandwidth (measured here with a large tensor copy);
    peak memory      torch.cuda.max_memory_allocated (GPU) or the process's peak RSS (CPU); also per phase, the
                     largest over the steps: lmrl's generate, experience and update (its memory/peak_*_mb
                     metrics), TRL's generate and rest, measured the same way (`lmrl.logging.metrics.Phases`).
Each trainer runs in its own subprocess, one after the other. Needs TRL (`pip install 'lmrl[bench]'`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.vs_trl import END_TOKEN, _peak_rss_mb, _timed  # noqa: E402

# Qwen2-0.5B's shape (hidden, layers, heads, kv heads, intermediate); the vocabulary is the local tokenizer's
SHAPES = {"0.5b": (896, 24, 14, 2, 4864), "tiny": (64, 2, 4, 2, 128)}
_TEXT = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no what up out who them some "
         "sum add number answer two three seven eleven twenty plus minus equals because first then next")
WORDS = _TEXT.split()  # the generated corpus's words (the tokenizer learns their merges)


@dataclass
class Settings:
    model_dir: str
    steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    lr: float
    dtype: str
    device: str
    seed: int
    lmrl_set: list[str]  # KEY=VALUE overrides of lmrl's config (--lmrl-set)


def hashed_reward(prompts, completions, **kwargs) -> list[float]:
    """A score in [0, 1) from the completion's text: informative (groups differ), the same in both trainers."""
    return [int(hashlib.sha256(c.encode()).hexdigest()[:8], 16) / 2**32 for c in completions]


def corpus(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randint(0, 999)) for _ in range(24))
            for _ in range(n)]


def bpe_tokenizer(vocab: int, seed: int):
    """A byte-level BPE tokenizer trained here on generated text (`corpus`), `<pad>` its id 0, no EOS yet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus(5000, seed), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>")


def build_model(shape: str, vocab: int, out_dir: str, seed: int) -> int:
    """A byte-level BPE tokenizer trained on generated text and a Qwen2 with random weights; returns parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = bpe_tokenizer(vocab, seed)
    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                         max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=0,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config)
    tokenizer.add_special_tokens({"eos_token": END_TOKEN})  # outside the model's vocabulary: never sampled
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def prompts(s: Settings) -> list[dict[str, str]]:
    return [{"prompt": text[:60]} for text in corpus(s.prompts_per_step * s.steps, s.seed + 1)]


def _load(s: Settings):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=getattr(torch, s.dtype), attn_implementation="sdpa")
    return model.to(s.device), AutoTokenizer.from_pretrained(s.model_dir)


def _whole_peak(device: str, phase_peaks: dict[str, float] | None = None) -> dict[str, float]:
    """{"peak_mb": the run's peak}: on a GPU the phases reset torch's peak (`lmrl.logging.metrics.Phases`), so the
    largest of the phases' peaks and torch's since the last reset; on a CPU the process's peak resident memory."""
    return {"peak_mb": max([_peak_mb(device), *(phase_peaks or {}).values()])}


def _peak_mb(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else _peak_rss_mb()


def run_lmrl(s: Settings, out_dir: str) -> dict:
    from lmrl import Config, Trainer

    model, tokenizer = _load(s)
    cfg = Config(
        algorithm={"name": "grpo", "kl_coef": 0.0, "clip_low": 0.2, "clip_high": 0.2,
                   "aggregation": "seq-mean-token-mean"},
        rollout={"prompts_per_step": s.prompts_per_step, "group_size": s.group_size,
                 "max_new_tokens": s.max_new_tokens, "temperature": 1.0},
        optim={"lr": s.lr, "weight_decay": 0.0, "max_grad_norm": 1.0},
        model={"name_or_path": s.model_dir, "dtype": s.dtype, "device": s.device},
        data={"num_eval_prompts": 0},
        train={"steps": s.steps, "seed": s.seed, "output_dir": out_dir, "eval_every": 0},
        log={"console": False, "samples_every": 0})
    cfg = overridden(cfg, s.lmrl_set)
    trainer = Trainer(cfg, model=model, tokenizer=tokenizer, reward_funcs=[hashed_reward], train_dataset=prompts(s))
    path = trainer.generator.decode_path()
    history = trainer.train().history[1:]
    peaks = {phase: max(m.get(f"memory/peak_{phase}_mb", 0.0) for m in history) for phase in ("generate", "experience", "update")}
    return {"step": [m["time/step"] for m in history], "generate": [m["time/generate"] for m in history],
            "experience": [m["time/experience"] for m in history], "update": [m["time/update"] for m in history],
            "decode_path": f"{path[0]} ({path[1]})", "phase_peaks": peaks} | _whole_peak(s.device, peaks)


def overridden(cfg, pairs: list[str]):
    """`cfg` with KEY=VALUE overrides (dotted keys, YAML values: `train.logprob_chunk_size=null`)."""
    import yaml

    from lmrl import Config

    data = cfg.model_dump()
    for pair in pairs:
        key, _, value = pair.partition("=")
        *parents, last = key.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            raise SystemExit(f"--lmrl-set {pair}: lmrl's config has no field {key}")
        node[last] = yaml.safe_load(value)
    return Config(**data)


def run_trl(s: Settings, out_dir: str) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lmrl.logging.metrics import Phases

    model, tokenizer = _load(s)
    times: list[float] = []
    phases: list[Phases] = []  # the step's, as lmrl's trainer measures its own: generation, then the rest
    peaks = {"generate": 0.0, "rest": 0.0}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            phases[:] = [Phases(s.device)]

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)
            phases[0].end("rest")
            for name in peaks:
                peaks[name] = max(peaks[name], phases[0].peaks.get(f"memory/peak_{name}_mb", 0.0))

    args = GRPOConfig(
        output_dir=out_dir, max_steps=s.steps, per_device_train_batch_size=s.prompts_per_step * s.group_size,
        gradient_accumulation_steps=1, num_generations=s.group_size, max_completion_length=s.max_new_tokens,
        num_iterations=1, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group", temperature=1.0,
        top_p=1.0, top_k=0, learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, shuffle_dataset=False, seed=s.seed, use_cpu=s.device == "cpu",
        bf16=s.dtype == "bfloat16", report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[hashed_reward], args=args,
                          train_dataset=Dataset.from_list(prompts(s)), processing_class=tokenizer,
                          callbacks=[StepTimer()])
    generate: list[float] = []
    _timed(trainer, "_generate_and_score_completions", generate)
    sample = trainer._generate_and_score_completions

    def sample_then_mark(*args, **kwargs):  # the end of the step's generation phase (its memory peak)
        out = sample(*args, **kwargs)
        if phases:
            phases[0].end("generate")
        return out

    trainer._generate_and_score_completions = sample_then_mark
    trainer.train()
    return {"step": times[1:], "generate": generate[1:], "decode_path": "model.generate", "phase_peaks": peaks} | _whole_peak(
        s.device, peaks)


RUNNERS = {"lmrl": run_lmrl, "trl": run_trl}


def copy_bandwidth(device: str) -> float:
    """Bytes per second a large on-device copy moves (read + write), the decode's memory-bound ceiling."""
    import torch

    x = torch.empty(2**28 if device.startswith("cuda") else 2**25, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        y.copy_(x)
    sync()
    return 2 * x.numel() * reps / (time.perf_counter() - start)


def decode_bytes(params: int, bytes_per_value: int, rows: int, prompt_len: int, new: int, layers: int,
                 kv_heads: int, head_dim: int) -> float:
    """Bytes a whole generation must read at least: every weight once per decode step, plus each step's
    KV cache of every row (keys and values of all layers, over the prompt and the tokens so far)."""
    kv_per_token = 2 * layers * kv_heads * head_dim * bytes_per_value
    weights = params * bytes_per_value * new
    cache = rows * kv_per_token * sum(prompt_len + t for t in range(new))
    return weights + cache


def child(trainer: str, settings: str, result: str) -> None:
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    s = Settings(**json.loads(settings))
    torch.manual_seed(s.seed)
    with tempfile.TemporaryDirectory() as out:
        Path(result).write_text(json.dumps(RUNNERS[trainer](s, out)))


def run_child(trainer: str, s: Settings) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "result.json")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", trainer, "--settings",
                               json.dumps(asdict(s)), "--result", str(path)])  # its progress shows as it runs
        if proc.returncode:
            raise SystemExit(f"{trainer} failed (exit {proc.returncode}): its output is above")
        return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen2, 4 prompts x 4, 16 tokens, 3 steps, CPU")
    parser.add_argument("--trainers", nargs="+", choices=list(RUNNERS), default=["lmrl", "trl"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts-per-step", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lmrl-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of lmrl's config, e.g. optim.micro_batch_size=512 train.logprob_chunk_size=null")
    parser.add_argument("--child", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.settings, args.result)
    if args.lmrl_set:  # a wrong key is one line now, not after the model is built and a child started
        from lmrl import Config

        overridden(Config(), args.lmrl_set)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = "tiny" if args.tiny else "0.5b"
    if args.tiny:
        args.steps, args.prompts_per_step, args.group_size, args.max_new_tokens, args.vocab = 3, 4, 4, 16, 400
        args.dtype = "float32"
    with tempfile.TemporaryDirectory() as model_dir:
        params = build_model(shape, args.vocab, model_dir, args.seed)
        s = Settings(model_dir, args.steps, args.prompts_per_step, args.group_size, args.max_new_tokens, 1e-6,
                     args.dtype, device, args.seed, args.lmrl_set)
        hidden, layers, heads, kv_heads, _ = SHAPES[shape]
        name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
        print(f"Qwen2 {params / 1e6:.1f}M parameters ({hidden} hidden, {layers} layers), {args.dtype}, on {name}; "
              f"{s.prompts_per_step} prompts x {s.group_size}, {s.max_new_tokens} new tokens, {s.steps} steps")
        runs = {t: run_child(t, s) for t in args.trainers}
    rows = s.prompts_per_step * s.group_size
    bandwidth = copy_bandwidth(device)
    floor = decode_bytes(params, 2 if args.dtype == "bfloat16" else 4, rows, 16, s.max_new_tokens, layers, kv_heads,
                         hidden // heads) / bandwidth
    print(f"bandwidth limit: {bandwidth / 1e9:.0f} GB/s copy bandwidth -> a generation needs >= {floor:.3g} s "
          f"({rows * s.max_new_tokens / floor:,.0f} tokens/s)")
    base = None
    for trainer, r in runs.items():
        step, gen = statistics.fmean(r["step"]), statistics.fmean(r["generate"])
        rate = rows / step
        base = base or rate
        print(f"{trainer:5s} samples/s {rate:8.2f} ({rate / base:.2f}x {args.trainers[0]})  s/step {step:.3f}  "
              f"generate {gen:.3f} s ({rows * s.max_new_tokens / gen:,.0f} tokens/s, {gen / floor:.1f}x the limit)  "
              f"rest {step - gen:.3f} s{_split(r)}  peak memory {r['peak_mb']:,.0f} MB  decode: {r['decode_path']}")
    if args.lmrl_set:
        print("lmrl's config overrides: " + " ".join(args.lmrl_set))


def _split(r: dict) -> str:
    """lmrl's rest of the step: the experience (old / reference forwards, advantages) and the update; each phase's
    memory peak (TRL's: its generation and its rest)."""
    peaks = ", ".join(f"{phase} {mb:,.0f} MB" for phase, mb in r.get("phase_peaks", {}).items())
    if "update" not in r:
        return f" (peak per phase: {peaks})" if peaks else ""
    return (f" (experience {statistics.fmean(r['experience']):.3f} + update {statistics.fmean(r['update']):.3f}; "
            f"peak per phase: {peaks})")


if __name__ == "__main__":
    main()
