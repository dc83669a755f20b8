"""Build the chat example's model and data locally: a Qwen2-architecture model with random weights, a byte-level
BPE tokenizer trained here with a ChatML chat template, and a conversational dataset of arithmetic questions.

    .venv/bin/python scripts/make_chat_model.py runs/chat-demo     # then: lmrl train examples/chat_qwen2.yaml

Writes OUT/model/ (config.json, model.safetensors, tokenizer files with the chat template) and
OUT/train.jsonl, OUT/test.jsonl, rows like

    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "What is 12 + 7?"}], "answer": "19"}

Nothing is downloaded. The weights are random, so the run shows the plumbing of a chat model end to end
(chat template, message-list prompts and completions, the math and format rewards), not learning.
Seeded: the same command writes the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from lmrl.models.tiny import bpe_chat_tokenizer, tiny_causal_lm

SYSTEM = "Think in <think></think>, then give the final number in <answer></answer>."


def make_rows(n: int, rng: random.Random) -> list[dict]:
    """n conversational rows: a system message, a question, and the answer column the math reward reads."""
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        op = rng.choice("+-")
        answer = a + b if op == "+" else a - b
        rows.append({"prompt": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": f"What is {a} {op} {b}?"}],
                     "answer": str(answer)})
    return rows


def build(out: Path, seed: int = 0, train_rows: int = 400, test_rows: int = 50, vocab_size: int = 400) -> None:
    rng = random.Random(seed)
    train, test = make_rows(train_rows, rng), make_rows(test_rows, rng)
    # the tokenizer learns from whole conversations, answers written in the format the rewards ask for
    texts = []
    for row in train:
        question = row["prompt"][1]["content"].removeprefix("What is ").removesuffix("?")
        texts.append(f"{SYSTEM}\n{row['prompt'][1]['content']}\n<think>{question} = {row['answer']}</think>"
                     f"<answer>{row['answer']}</answer>")
    tokenizer = bpe_chat_tokenizer(texts, vocab_size=vocab_size)
    model = tiny_causal_lm(tokenizer, arch="qwen2", hidden_size=64, num_layers=2, num_heads=4,
                           max_position_embeddings=512, seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="runs/chat-demo", help="directory to write (default runs/chat-demo)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(Path(args.out), seed=args.seed)
    print(f"wrote {args.out}/model, {args.out}/train.jsonl, {args.out}/test.jsonl")


if __name__ == "__main__":
    main()
