"""The architecture matrix: tiny random models of transformers architectures, trained a few steps through each
backend, and the supported-models table of docs/supported-models.md.

    python benchmarks/architectures.py                                  # every architecture, every column
    python benchmarks/architectures.py --archs llama gpt2 --columns lmrl lora
    python benchmarks/architectures.py --record supported-models        # the docs' table (then make figures)

Each model is built from its transformers config class (hidden 64, 2 heads of 32: vLLM's CPU attention needs a
head of 32 or more), saved with a tokenizer made here (a byte-level BPE with a ChatML template, or a character
tokenizer with or without a pad token) and trained `STEPS` steps from its directory, as a user's model is. A cell
trains when the run ends without an error, every loss and policy statistic is finite, and the sampler computes the
trainer's distribution: `val/sampler_logprob_diff`, the mean |log-prob| difference per token between the sampler's
tokens and the trainer's forward on them, is below `MAX_DIFF` at every step (truncated importance sampling is on in
every column, so each logs it; GPT-2's and OPT's configs set dropout 0.1). A cell is refused when lmrl stops the run
in one line (an `LmrlError`), and the line is the table's reason. Anything else is a failure.

The columns: `lmrl` (rollout.backend=lmrl, full fine-tuning), `lora` (the same with model.lora), `vllm`
(rollout.backend=vllm, vLLM's CPU build; one engine per process, so each vLLM cell runs in a process of its own).
Every cell runs on the CPU, in float32, whatever the machine has.
`tests/test_supported_models.py` runs the lmrl and LoRA columns of every architecture and a few vLLM cells, and checks
that they agree with the recorded table.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

STEPS = 2
MAX_DIFF = 1e-4  # nats per token; a synced float32 sampler is ~1e-6 from the trainer on the CPU
TEXTS = ["What is 2 + 3? The answer is 5.", "Name a colour: red, green or blue.", "12+7=19 3+4=7 0123456789"] * 20
COLUMNS = ("lmrl", "lora", "vllm")

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=512)
_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_DROPOUT = "dropout 0.1"

# name: (model_type, config keywords, tokenizer, what the row shows). Tokenizers: "chat" (byte-level BPE, ChatML
# template, pad <|endoftext|>), "char" (characters, pad <pad>), "char-nopad" (characters, no pad token).
ARCHITECTURES: dict[str, tuple[str, dict, str, str]] = {
    "llama": ("llama", dict(_BASE, tie_word_embeddings=False), "char", "dense, untied"),
    "qwen2": ("qwen2", dict(_BASE, tie_word_embeddings=True), "chat", "dense, tied, chat template"),
    "qwen3": ("qwen3", dict(_BASE, tie_word_embeddings=True), "chat", "dense, tied, chat template"),
    "qwen3-untied": ("qwen3", dict(_BASE, tie_word_embeddings=False), "chat", "dense, untied, chat template"),
    "mistral": ("mistral", dict(_BASE, sliding_window=8), "char", "sliding window 8"),
    "gemma2": ("gemma2", dict(_BASE, sliding_window=8, query_pre_attn_scalar=32), "chat",
               "sliding window 8, soft-capping, tied"),
    "gemma3": ("gemma3_text", dict(_BASE, sliding_window=8, query_pre_attn_scalar=32), "chat",
               "text-only, sliding window 8, tied"),
    "phi3": ("phi3", dict(_BASE, pad_token_id=None), "chat", "fused qkv and gate-up"),
    "olmo2": ("olmo2", _BASE, "chat", "q/k norms"),
    "granite": ("granite", _BASE, "char", "scaled residuals and logits"),
    "falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, new_decoder_architecture=False,
                              multi_query=True, parallel_attn=True, alibi=False), "char", "multi-query, parallel block"),
    "smollm3": ("smollm3", _BASE, "chat", "no rope on some layers"),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=2, n_positions=512, resid_pdrop=0.1, embd_pdrop=0.1,
                          attn_pdrop=0.1), "char", f"learned positions, {_DROPOUT}"),
    "opt": ("opt", dict(hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2, num_attention_heads=2,
                        max_position_embeddings=512, dropout=0.1, attention_dropout=0.1), "char", _DROPOUT),
    "gpt_neox": ("gpt_neox", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  max_position_embeddings=512), "chat", "Pythia's, pad token"),
    "gpt_neox-nopad": ("gpt_neox", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=512), "char-nopad",
                       "Pythia's, no pad token"),
    "qwen3_moe": ("qwen3_moe", dict(_BASE, **_MOE), "chat", "mixture of experts"),
    "mixtral": ("mixtral", dict(_BASE, **_MOE), "chat", "mixture of experts"),
}


def tokenizer_of(kind: str):
    from lmrl.models.tiny import bpe_chat_tokenizer, char_tokenizer

    if kind == "chat":
        return bpe_chat_tokenizer(TEXTS, vocab_size=320)
    tok = char_tokenizer()
    if kind == "char-nopad":
        tok.pad_token = None
    return tok


def build(name: str, out: Path) -> Path:
    """Save a random tiny model of architecture `name` and its tokenizer in `out`; return `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kw, tok_kind, _ = ARCHITECTURES[name]
    tok = tokenizer_of(tok_kind)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(model_type, **{**ids, **kw})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)  # sets config.architectures, which vLLM needs
    tok.save_pretrained(out)
    return out


def digit_share(prompts, completions, **kw):
    """A reward that varies between a random model's samples: the share of characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def overrides(name: str, column: str, out: Path) -> list[str]:
    tok_kind = ARCHITECTURES[name][2]
    return [f"model.name_or_path={out / 'model'}", "model.device=cpu", f"train.steps={STEPS}", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.temperature=1.5", "data.num_eval_prompts=4",
            "train.eval_every=0", f"train.output_dir={out / 'run'}", "log.console=false", "optim.lr=1e-2",
            "algorithm.tis_cap=2.0", *(["model.chat_template=true"] if tok_kind == "chat" else []),
            *(["model.lora.r=8"] if column == "lora" else []),
            *(["rollout.backend=vllm"] if column == "vllm" else [])]


def verdict(rows: list[dict], error: str | None) -> dict:
    """A cell from its metrics rows and its error line: status trains / refused / fails, the reason, the largest
    sampler difference."""
    steps = [r for r in rows if r.get("step", 0) > 0]
    diffs = [r["val/sampler_logprob_diff"] for r in steps if "val/sampler_logprob_diff" in r]
    worst = max(diffs) if diffs else None
    if error is not None:
        return {"status": "refused", "reason": error, "diff": worst}
    stats = [v for r in steps for k, v in r.items() if k.startswith(("loss/", "policy/")) and isinstance(v, float)]
    if len(steps) != STEPS or not stats or not all(math.isfinite(v) for v in stats):
        return {"status": "fails", "reason": f"{len(steps)} steps logged, finite losses: "
                                              f"{all(math.isfinite(v) for v in stats) if stats else 'none'}", "diff": worst}
    if len(diffs) != STEPS or worst > MAX_DIFF:
        return {"status": "fails", "reason": f"sampler {worst} nats per token from the trainer", "diff": worst}
    return {"status": "trains", "reason": "", "diff": worst}


def run_cell(name: str, column: str, workdir: Path) -> dict:
    """Train architecture `name` through `column` in this process; the cell's verdict (and its wall time)."""
    from lmrl import Trainer
    from lmrl.config import load_config
    from lmrl.errors import LmrlError

    out = workdir / f"{name}-{column}"
    build(name, out / "model")
    start, error = time.perf_counter(), None
    try:
        Trainer(load_config(None, overrides(name, column, out)), reward_funcs=[digit_share]).train()
    except LmrlError as e:
        error = str(e).splitlines()[0]
    metrics = out / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return {"arch": name, "column": column, **verdict(rows, error), "seconds": time.perf_counter() - start}


def run_cell_apart(name: str, column: str, workdir: Path, timeout: float = 600, threads: int = 1,
                   run=None) -> dict:
    """run_cell in a process of its own (vLLM runs one engine per process); a crash is a failing cell. `run(path,
    *args, timeout=)`: how `python path args...` is run, a CompletedProcess of text (default: a new interpreter)."""
    args = ["--cell", name, column, "--workdir", str(workdir), "--threads", str(threads)]
    if run is None:
        done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout)
    else:
        done = run(__file__, *args, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"arch": name, "column": column, "status": "fails", "reason": f"rc {done.returncode}: {tail}",
                "diff": None, "seconds": None}
    return json.loads(lines[-1])


def reason_of(text: str) -> str:
    """An error line for the table: its cause, without the run's paths (lmrl: error: step 1: ... written: ...)."""
    text = text.removeprefix("lmrl: error: ")
    return text.split(": checkpoint")[0].split(", so ")[0].replace("|", "/")


def table_rows(cells: list[dict]) -> list[dict]:
    rows: dict[str, dict] = {}
    for c in cells:
        row = rows.setdefault(c["arch"], {"arch": c["arch"], "model_type": ARCHITECTURES[c["arch"]][0],
                                          "shape": ARCHITECTURES[c["arch"]][3], "why": ""})
        row[c["column"]] = c["status"] if c["diff"] is None else f"{c['status']} ({c['diff']:.0e})"
        if c["status"] != "trains":
            row["why"] = "; ".join(filter(None, [row["why"], f"{c['column']}: {reason_of(c['reason'])}"]))
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", choices=list(ARCHITECTURES), default=list(ARCHITECTURES))
    parser.add_argument("--columns", nargs="+", choices=COLUMNS, default=list(COLUMNS))
    parser.add_argument("--record", nargs="?", const="supported-models", default=None,
                        help="write benchmarks/results/NAME.MACHINE.json (default name: supported-models)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's threads (1: the cells' times do not depend on what else runs)")
    parser.add_argument("--cell", nargs=2, metavar=("ARCH", "COLUMN"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.cell:
        print(json.dumps(run_cell(*args.cell, args.workdir)))
        return 0
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for column in args.columns:
            for name in args.archs:
                cell = (run_cell_apart(name, column, Path(tmp), threads=args.threads) if column == "vllm"
                        else run_cell(name, column, Path(tmp)))
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    if args.record:
        from recording import Column, record

        columns = [Column("arch", "architecture"), Column("model_type", "model_type", "`{}`"),
                   Column("shape", "what it tests"), *[Column(c, {"lmrl": "rollout.backend=lmrl", "lora": "LoRA",
                                                                  "vllm": "rollout.backend=vllm (CPU)"}[c])
                                                       for c in args.columns], Column("why", "refused: why")]
        note = (f"Tiny random models (hidden 64, 2 layers), {STEPS} steps each; a cell trains when the run ends, its "
                f"losses are finite and the sampler's log-probs are within {MAX_DIFF:g} nats per token of the "
                "trainer's at every step (the largest difference in brackets).")
        record(args.record, columns, table_rows(cells), note=note)
    return 1 if any(c["status"] == "fails" for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
