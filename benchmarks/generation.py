"""Rollout throughput: lmrl's HFGenerator vs transformers' `model.generate` vs a vLLM engine (tokens/s).

    python benchmarks/generation.py                     # the tiny and 100m presets, hf and lmrl
    python benchmarks/generation.py --preset tiny       # ~20 s
    python benchmarks/generation.py --preset 100m       # a couple of minutes
    python benchmarks/generation.py --preset shipped 30m --backends hf lmrl vllm   # the vLLM table (docs/generation.md)
    python benchmarks/generation.py --preset tiny --prompts 50 --n 4 --max-new-tokens 32 --repeats 5
    python benchmarks/generation.py --threads 1 2 --record   # the table in docs/performance.md
    python benchmarks/generation.py --preset qwen0.5b --backends hf lmrl engine vllm --modes no-eos --repeats 2
                                                         # the GPU set-up (scripts/gpu_run.sh, part decode)

Presets (random weights built from a config, or the model lmrl ships; nothing is downloaded):
    tiny     Llama, hidden 64, 2 layers, char tokenizer (vocab ~97); 100 prompts x n=8, 64 new tokens
    shipped  the shipped tiny-addition model (~0.5M parameters); 32 prompts x n=8, 16 new tokens
    30m      Llama, hidden 512, 8 layers, 8 heads, vocab 32000 (~41M parameters); 16 prompts x n=8,
             64 new tokens: where an engine's batching starts to matter
    100m     Llama, hidden 768, 12 layers, 12 heads, vocab 32000 (~110M parameters); 8 prompts x n=4,
             32 new tokens
    qwen0.5b Qwen2 of Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads over 2 key / value heads, vocab 151936,
             ~494M parameters), bfloat16 on the GPU; 64 prompts x n=8, 256 new tokens: the GPU set-up. Also prints
             ms per decode step, the device's bound for the same work (`decode_bound`) and each backend's
             fraction of it.
    qwen3    the 30m shape as Qwen3 (an RMSNorm of each query and key head), 2 key / value heads (~60M parameters,
             untied); 16 prompts x n=8, 64 new tokens

Backends (--backends): hf (`model.generate`), lmrl (`HFGenerator`), engine (`HFGenerator(cuda_graph=False)`:
the engine's unfixed steps also on CUDA, where `lmrl` replays its fixed-shape steps as CUDA graphs), vllm (`VLLMGenerator`, rollout.backend=vllm:
vLLM's CPU build here, its CUDA build on a GPU; the weights pushed to it once before timing). Ratios are against
the first backend listed.

Both generators sample with the same settings (temperature 1, no top-k / top-p, all rows in one
batch, `n` completions per prompt via `num_return_sequences`) on the same prompts (random token ids,
8 to 32 tokens, left-padded). Two modes:
    eos     EOS ends a completion as usual. Random weights sample EOS now and then, so the two runs
            generate different numbers of tokens: tokens/s counts real response tokens (up to and
            including the first EOS) of each run.
    no-eos  Every completion runs to max_new_tokens (transformers: `min_new_tokens = max_new_tokens`;
            lmrl: `eos_token_id=[]`), so both do exactly the same amount of decoding.
Time: best of --repeats runs, the two generators taking turns, after one warm-up call of each, with the same torch.set_num_threads.
The CPU is shared with other processes on some machines: compare the ratio, and rerun when in doubt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm  # noqa: E402
from lmrl.rollout import HFGenerator, SamplingParams  # noqa: E402

PRESETS = {
    "tiny": dict(prompts=100, n=8, max_new_tokens=64),
    "shipped": dict(prompts=32, n=8, max_new_tokens=16),
    "30m": dict(prompts=16, n=8, max_new_tokens=64),
    "100m": dict(prompts=8, n=4, max_new_tokens=32),
    "qwen0.5b": dict(prompts=64, n=8, max_new_tokens=256),
    "qwen3": dict(prompts=16, n=8, max_new_tokens=64),  # the 30m shape as Qwen3 (q / k head norms), 2 KV heads
}
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
# memory bandwidth (bytes/s) by device name, for the decode bound
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
SHAPES = {"30m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8),
          "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12)}


@dataclass
class Setup:
    model: torch.nn.Module
    tokenizer: object
    eos_id: int
    pad_id: int
    vocab: int


def build(preset: str) -> Setup:
    tokenizer = char_tokenizer()
    if preset == "qwen0.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, **QWEN_05B)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = Qwen2ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
        model.generation_config.pad_token_id = 0
        return Setup(model, tokenizer, 2, 0, config.vocab_size)
    if preset == "tiny":
        model = tiny_causal_lm(tokenizer, arch="llama", hidden_size=64, num_layers=2)
        return Setup(model, tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer))
    if preset == "shipped":
        from lmrl.models.shipped import SHIPPED_MODELS

        path = SHIPPED_MODELS["tiny-addition"]
        model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
        return Setup(model, tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer))
    if preset == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(vocab_size=32000, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0, **SHAPES["30m"])
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).eval()
        model.generation_config.pad_token_id = 0
        return Setup(model, tokenizer, 2, 0, config.vocab_size)
    # a Llama shape of random weights (the 100m one close to TinyLlama's layer). The char tokenizer is only
    # used to decode texts; ids above its vocabulary decode to nothing, which is fine here.
    shape = SHAPES[preset]
    config = LlamaConfig(vocab_size=32000, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return Setup(model, tokenizer, 2, 0, config.vocab_size)


def make_prompts(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 33, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def real_tokens(responses: torch.Tensor, eos_ids: list[int]) -> int:
    """Response tokens up to and including the first EOS of each `[B, T]` row (all T if none)."""
    if not eos_ids:
        return responses.numel()
    is_eos = torch.isin(responses, torch.tensor(eos_ids))
    seen_before = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    return int((~seen_before).sum())


def run_hf(s: Setup, prompts: list[list[int]], n: int, max_new: int, eos: bool) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), s.pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    extra = {} if eos else {"min_new_tokens": max_new}
    device = next(s.model.parameters()).device
    out = s.model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=None,
        max_new_tokens=max_new,
        num_return_sequences=n,
        eos_token_id=s.eos_id,
        pad_token_id=s.pad_id,
        **extra,
    )
    return real_tokens(out[:, width:].cpu(), [s.eos_id])


def run_lmrl(gen: HFGenerator, prompts: list[list[int]], n: int, max_new: int) -> int:
    rollout = gen.generate(prompts, n, SamplingParams(max_new_tokens=max_new, temperature=1.0))
    return int(rollout.lengths.sum())


def best_of_alternating(fns: list, repeats: int) -> list[tuple[float, int]]:
    """Best time (and its token count) of each function, runs interleaved so both see the same load."""
    best = [(float("inf"), 0)] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            tokens = fn()
            elapsed = time.perf_counter() - start
            if elapsed < best[i][0]:
                best[i] = (elapsed, tokens)
    return best


def vllm_engine(s: Setup, eos: bool, max_len: int):
    from lmrl.models.weights import export_weights
    from lmrl.rollout.vllm_engine import VLLMGenerator

    dtype = str(next(s.model.parameters()).dtype).removeprefix("torch.")
    engine = VLLMGenerator(s.model.config, s.tokenizer, dtype=dtype, max_model_len=max_len, seed=0,
                           eos_token_ids=[s.eos_id] if eos else [])
    engine.load_weights(export_weights(s.model), version=0)
    return engine


LABELS = {"tiny": "tiny Llama (hidden 64, 2 layers)", "shipped": "the shipped model (~0.5M parameters)",
          "30m": "~41M Llama (hidden 512, 8 layers, V 32k)", "100m": "~110M Llama (hidden 768, 12 layers, V 32k)",
          "qwen0.5b": "Qwen2 of Qwen2-0.5B's shape, bfloat16", "qwen3": "~60M Qwen3 (hidden 512, 8 layers, 2 KV heads, V 32k)"}
NAMES = {"hf": "`model.generate`", "lmrl": "lmrl", "engine": "lmrl's engine", "vllm": "vLLM"}
HEADERS = {b: f"{name} tok/s" for b, name in NAMES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", nargs="+", choices=[*PRESETS, "both"], default=["both"],
                        help="presets to run (both: tiny and 100m)")
    parser.add_argument("--backends", nargs="+", choices=["hf", "lmrl", "engine", "vllm"], default=["hf", "lmrl"])
    parser.add_argument("--prompts", type=int, help="number of prompts (default: preset's)")
    parser.add_argument("--n", type=int, help="completions per prompt (default: preset's)")
    parser.add_argument("--max-new-tokens", type=int, help="default: preset's")
    parser.add_argument("--modes", nargs="+", choices=["eos", "no-eos"], default=["eos", "no-eos"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch threads; several: one run each")
    parser.add_argument("--record", nargs="?", const="generation", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json (default NAME: generation)")
    args = parser.parse_args()
    presets = ["tiny", "100m"] if args.preset == ["both"] else [p for p in args.preset if p != "both"]

    device = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, threads {args.threads}, {device}")
    first = args.backends[0]
    header = f"{'model':<8} {'thr':>3} {'mode':<7} {'rows':>5} {'new':>4} " + " ".join(
        f"{b + ' tok/s':>11} {'x ' + first:>8}" if b != first else f"{b + ' tok/s':>11}" for b in args.backends)
    print(header)
    print("-" * len(header))
    rows = []
    for preset in presets:
        cfg = dict(PRESETS[preset])
        for key in ("prompts", "n", "max_new_tokens"):
            if getattr(args, key) is not None:
                cfg[key] = getattr(args, key)
        s = build(preset)
        prompts = make_prompts(cfg["prompts"], s.vocab)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for mode in args.modes:
                rates = time_backends(s, prompts, cfg["n"], cfg["max_new_tokens"], mode, args.backends, args.repeats)
                cells = [f"{rate:>11.0f}" + (f" {rate / rates[first]:>7.2f}x" if b != first else "")
                         for b, rate in rates.items()]
                print(f"{preset:<8} {threads:>3} {mode:<7} {len(prompts) * cfg['n']:>5} {cfg['max_new_tokens']:>4} "
                      + " ".join(cells), flush=True)
                if preset == "qwen0.5b":
                    print(bound_line(s, prompts, cfg["n"], cfg["max_new_tokens"], rates), flush=True)
                rows.append({"model": f"{LABELS[preset]}, {len(prompts)} prompts x {cfg['n']}, "
                                      f"{cfg['max_new_tokens']} new tokens", "threads": threads, "mode": mode,
                             **{b: round(rate) for b, rate in rates.items()},
                             **{f"x_{b}": round(rate / rates[first], 2) for b, rate in rates.items() if b != first}})
    if args.record:
        from recording import Column, record

        columns = [Column("model", merge=True), Column("threads", merge=True), Column("mode")]
        for b in args.backends:
            columns.append(Column(b, HEADERS[b], "{:.0f}"))
            if b != first:
                columns.append(Column(f"x_{b}", f"{NAMES[b]} / {NAMES[first]}", "{:.2f}x"))
        record(args.record, columns, rows, note=f"Tokens/s of real generated tokens, best of {args.repeats} "
               "interleaved runs; `eos`: completions may end early, `no-eos`: all run to the limit.")


def decode_bound(config, prompt_lengths: list[int], n: int, max_new: int, weight_bytes: int, kv_bytes: int = 2) -> float:
    """Bytes a decode of `n` completions of each prompt must read from memory at least: every weight once per step,
    and at step t each prompt's keys and values once (shared by its rows) and each row's t response keys and
    values. Divided by the device's bandwidth, the fastest the decode can run."""
    text = config.get_text_config(decoder=True)
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * kv_bytes
    prompt_kv = sum(prompt_lengths) * per_token  # read once per step
    total = 0
    for t in range(max_new):
        total += weight_bytes + prompt_kv + len(prompt_lengths) * n * t * per_token
    return float(total)


def bound_line(s: Setup, prompts: list[list[int]], n: int, max_new: int, rates: dict[str, float]) -> str:
    """ms per decode step of each backend, and the device's bound for the same work."""
    weights = sum(p.numel() * p.element_size() for p in s.model.parameters())
    total = decode_bound(s.model.config, [len(p) for p in prompts], n, max_new, weights)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    bandwidth = next((bw for key, bw in BANDWIDTH.items() if key in name), None)
    rows = len(prompts) * n
    steps = {b: 1e3 * rows / rate for b, rate in rates.items() if rate == rate}  # ms per step: rows tokens a step
    line = "ms per decode step: " + ", ".join(f"{b} {ms:.2f}" for b, ms in steps.items())
    if bandwidth is None:
        return line + f"; {total / 1e9:.1f} GB read at least (no bandwidth known for {name})"
    floor = 1e3 * total / bandwidth / max_new
    return (line + f"; the device's bound {floor:.2f} ms ({total / 1e9:.1f} GB at {bandwidth / 1e12:.2f} TB/s); "
            + ", ".join(f"{b} at {floor / ms:.0%} of it" for b, ms in steps.items()))


def time_backends(s: Setup, prompts, n: int, max_new: int, mode: str, backends: list[str],
                  repeats: int) -> dict[str, float]:
    """Tokens/s of each backend on the same prompts, best of `repeats` interleaved runs (nan: no engine)."""
    eos = mode == "eos"
    gen = HFGenerator(s.model, s.tokenizer, eos_token_id=[s.eos_id] if eos else [], seed=0)
    engine_gen = HFGenerator(s.model, s.tokenizer, eos_token_id=[s.eos_id] if eos else [], seed=0, cuda_graph=False)
    runs = {"hf": lambda: _hf(s, prompts, n, max_new, eos), "lmrl": lambda: run_lmrl(gen, prompts, n, max_new),
            "engine": lambda: run_lmrl(engine_gen, prompts, n, max_new)}
    warm = {"hf": lambda: run_hf(s, prompts[:2], 2, 4, eos), "lmrl": lambda: run_lmrl(gen, prompts[:2], 2, 4),
            "engine": lambda: run_lmrl(engine_gen, prompts[:2], 2, 4)}
    engine = None
    if "vllm" in backends:  # one at a time: vLLM runs one engine per process
        try:
            engine = vllm_engine(s, eos, max(len(p) for p in prompts) + max_new)
            runs["vllm"] = warm["vllm"] = lambda: run_lmrl(engine, prompts, n, max_new)
        except Exception as e:  # noqa: BLE001 - e.g. a head size the CPU build has no kernel for
            print(f"no vllm ({e})")
    timed = [b for b in backends if b in runs]
    torch.manual_seed(0)
    for b in timed:
        warm[b]()
    best = dict(zip(timed, best_of_alternating([runs[b] for b in timed], repeats)))
    if engine is not None:
        engine.close()
    return {b: best[b][1] / best[b][0] if b in best else float("nan") for b in backends}


def _hf(s: Setup, prompts, n, max_new, eos) -> int:
    with torch.inference_mode():
        return run_hf(s, prompts, n, max_new, eos)


if __name__ == "__main__":
    main()
