"""Data-parallel scaling on one machine: training throughput at 1 and 2 ranks against 1 rank with 2 threads, and
peak memory per rank with the policy sharded (FSDP2) against whole on every rank (ddp).

    python benchmarks/scaling.py               # 30 steps of 32 prompts x 8 completions, three ways: about 40 s on 2 cores
    python benchmarks/scaling.py --steps 10    # quicker, noisier
    python benchmarks/scaling.py --memory      # peak memory per rank, ddp against fsdp: about 3 min

Three runs of `lmrl train` on the shipped tiny model and the addition task, the same config and seed, no evaluation:
    1 rank  x 1 thread    python -m lmrl.cli train train.threads=1
    1 rank  x 2 threads   python -m lmrl.cli train train.threads=2
    2 ranks x 1 thread    torchrun --standalone --nproc_per_node 2 -m lmrl.cli train train.threads=1 (gloo)
Throughput is completions per second over the training steps (the last metrics row's `episode` over its
`time/elapsed`: process start-up, model loading and the first evaluation excluded), printed with its ratio to
1 rank x 1 thread, measured in the same run of this script (timings on a shared machine drift; ratios less so).

--memory: 2 ranks train a Llama built here with random weights (hidden 1024, 8 layers: 103M parameters, 0.41 GB in
float32; the shipped tokenizer), 3 steps of 8 prompts x 4, once with train.parallel=ddp and once with fsdp. Peak
memory is the largest resident set of any rank over the run (the kernel's maxrss of torchrun's children), model
loading included: each rank loads the whole model before sharding it, and gathers the whole policy to generate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_RANKS = {"CUDA_VISIBLE_DEVICES": ""}  # two ranks on the CPU with gloo, also on a machine with one GPU


def run(launcher: list[str], out: Path, steps: int, threads: int, seed: int) -> float:
    """Completions per second of one `lmrl train` run over its training steps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), **CPU_RANKS}  # CPU scaling, as documented
    args = [f"train.steps={steps}", "rollout.prompts_per_step=32", "rollout.group_size=8", "data.num_eval_prompts=0",
            f"train.threads={threads}", f"train.seed={seed}", f"train.output_dir={out}", "log.console=false",
            "train.max_minutes=null"]
    proc = subprocess.run([*launcher, "-m", "lmrl.cli", "train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"scaling: {' '.join(launcher)} failed:\n{proc.stderr[-2000:]}")
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    return last["episode"] / last["time/elapsed"]


def bigger_model(directory: Path, hidden: int = 1024, layers: int = 8) -> int:
    """A Llama with random weights and the shipped tokenizer, saved to `directory`; its parameter count."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lmrl.models.shipped import SHIPPED_MODEL

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


PEAK = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss_gb(command: list[str]) -> float:
    """The largest resident set (GB) of any process `command` starts, measured in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_RANKS}
    out = subprocess.run([sys.executable, "-c", PEAK, *command], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    code, kb = out.stdout.split() if out.returncode == 0 else ("?", "0")
    if code != "0":
        sys.exit(f"scaling: {' '.join(command[:6])} ... failed:\n{out.stderr[-3000:]}")
    return int(kb) / 2**20


def memory(steps: int, hidden: int, layers: int) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    with tempfile.TemporaryDirectory(prefix="lmrl-memory-") as tmp:
        count = bigger_model(Path(tmp) / "model", hidden, layers)
        print(f"scaling --memory: a {count / 1e6:.0f}M-parameter Llama ({count * 4 / 1e9:.2f} GB float32), 2 ranks, "
              f"{steps} steps x 32 completions")
        peaks = {}
        for parallel in ("ddp", "fsdp"):
            args = [f"model.name_or_path={tmp}/model", f"train.steps={steps}", "rollout.prompts_per_step=8",
                    "rollout.group_size=4", "data.num_eval_prompts=0", "train.threads=1", "log.console=false",
                    f"train.output_dir={tmp}/{parallel}", f"train.parallel={parallel}", "optim.lr=1e-5"]
            peaks[parallel] = peak_rss_gb([*torchrun, "-m", "lmrl.cli", "train", *args])
        for parallel, gb in peaks.items():
            print(f"  train.parallel={parallel:4}  peak memory per rank {gb:5.2f} GB  {gb / peaks['ddp']:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action="store_true", help="peak memory per rank, ddp against fsdp")
    parser.add_argument("--hidden", type=int, default=1024, help="--memory: the model's hidden size")
    parser.add_argument("--layers", type=int, default=8, help="--memory: the model's decoder layers")
    args = parser.parse_args()
    if args.memory:
        memory(min(args.steps, 3), args.hidden, args.layers)
        return
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    ways = [("1 rank  x 1 thread ", [sys.executable], 1), ("1 rank  x 2 threads", [sys.executable], 2),
            ("2 ranks x 1 thread ", torchrun, 1)]
    print(f"scaling: the shipped model, {args.steps} steps x 256 completions, seed {args.seed}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="lmrl-scaling-") as tmp:
        results = [(name, run(launcher, Path(tmp) / str(i), args.steps, threads, args.seed))
                   for i, (name, launcher, threads) in enumerate(ways)]
    base = results[0][1]
    for name, eps in results:
        print(f"  {name}  {eps:8.1f} completions/s  {eps / base:5.2f}x")


if __name__ == "__main__":
    main()
