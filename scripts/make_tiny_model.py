"""Build the tiny models that ship with lmrl: character-level Llamas fine-tuned a little on a built-in task.

    .venv/bin/python scripts/make_tiny_model.py                    # writes lmrl/assets/tiny-addition/
    .venv/bin/python scripts/make_tiny_model.py --task calculator  # writes lmrl/assets/tiny-calculator/
    .venv/bin/python scripts/make_tiny_model.py --task reasoner    # writes lmrl/assets/tiny-reasoner/

Seeded and deterministic: same seed, same torch build -> same weights. The model is supervised on
the training split of the built-in addition task and stopped early on purpose: RL can only sharpen
answers the model already samples sometimes, so the shipped starting point answers a minority of
held-out prompts greedily while sampling the right answer for most of them within 8 tries at
temperature 1. That is where GRPO has the most room to show progress in a few CPU minutes.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lmrl.data.tasks import AdditionTask, evaluate
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

ASSETS = Path(__file__).resolve().parent.parent / "lmrl" / "assets"
DEFAULT_OUT = ASSETS / "tiny-addition"


@dataclass
class SFTConfig:
    """Supervised fine-tuning of the shipped model; the defaults are what ships.

    Attributes:
        hidden_size: model width.
        num_layers: transformer blocks.
        num_heads: attention heads.
        steps: optimizer steps; stopping early is what leaves room for RL.
        batch_size: sequences per step, drawn with replacement from the training split.
        lr: peak AdamW learning rate (linear warmup, then constant).
        warmup: warmup steps.
        weight_decay: AdamW weight decay.
        seed: seed for weights and batch order.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    steps: int = 300
    batch_size: int = 128
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0


def encode_items(tokenizer, items: list[dict[str, str]]) -> list[tuple[list[int], list[int]]]:
    """Token ids of each item as (`prompt`, `answer + EOS`), tokenized as the trainer does: no BOS."""
    eos = tokenizer.eos_token_id
    prompts = tokenizer([it["prompt"] for it in items], add_special_tokens=False)["input_ids"]
    answers = tokenizer([it["answer"] for it in items], add_special_tokens=False)["input_ids"]
    return [(p, a + [eos]) for p, a in zip(prompts, answers)]


def collate(encoded: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded `prompt + answer + EOS` sequences and their labels.

    Returns input_ids `[B, L]`, attention_mask `[B, L]` and labels `[B, L]`: the input ids on
    answer and EOS tokens, -100 elsewhere (no loss on the prompt or on padding).
    """
    width = max(len(p) + len(a) for p, a in encoded)
    ids, attention, labels = [], [], []
    for p, a in encoded:
        fill = width - len(p) - len(a)
        ids.append(p + a + [pad_id] * fill)
        attention.append([1] * (len(p) + len(a)) + [0] * fill)
        labels.append([-100] * len(p) + a + [-100] * fill)
    return torch.tensor(ids), torch.tensor(attention), torch.tensor(labels)


def sft(task: AdditionTask, config: SFTConfig, log_every: int = 0):
    """Build the tokenizer and model from `config.seed` and fine-tune on `task.train_prompts()`.

    Returns (model, tokenizer); the model is in eval mode.
    """
    tokenizer = char_tokenizer()
    model = tiny_causal_lm(
        tokenizer,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        max_position_embeddings=64,
        seed=config.seed,
    )
    train = encode_items(tokenizer, task.train_prompts())

    def progress(model) -> str:
        m = evaluate(model, tokenizer, task, n_prompts=200, k=8)
        return f"greedy {m['accuracy']:.3f}  pass@8 {m['pass_at_k']:.3f}"

    supervise(model, tokenizer, len(train), lambda index: collate([train[i] for i in index], tokenizer.pad_token_id),
              config, log_every, progress)
    return model, tokenizer


def supervise(model, tokenizer, num_examples: int, batch, config: SFTConfig, log_every: int, progress) -> None:
    """`config.steps` AdamW steps (linear warm-up, gradient norm clipped at 1) on batches of `config.batch_size`
    examples drawn with replacement by a generator seeded with `config.seed`; `batch(indices)` gives their
    (input_ids, attention_mask, labels), and optionally a dict of the forward's other inputs. Every `log_every` steps prints the loss and `progress(model)`, which
    evaluates (the model is put back in train mode after). Leaves the model in eval mode, its generation
    config naming the tokenizer's EOS, pad and BOS."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / config.warmup))
    gen = torch.Generator().manual_seed(config.seed)
    model.train()
    start = time.perf_counter()
    for step in range(config.steps):
        # a vision model's batch brings its forward's other inputs (pixel values) as a fourth element
        ids, attention, labels, *extra = batch(torch.randint(num_examples, (config.batch_size,), generator=gen).tolist())
        logits = model(input_ids=ids, attention_mask=attention, **(extra[0] if extra else {})).logits  # [B, L, V]
        # logits at position t predict the token at t + 1
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if log_every and (step + 1) % log_every == 0:
            model.eval()
            line = progress(model)
            model.train()
            print(f"step {step + 1:5d}  loss {loss.item():.4f}  {line}  {time.perf_counter() - start:.0f}s", flush=True)
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id


def calculator_traces(tokenizer, task, tool_fraction: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """Supervised traces of the calculator task as (token ids, labels): in a `tool_fraction` of them the model
    calls the tool and copies its answer (`<calc>47+85+36</calc>` `=168\n` `168`), in the others it answers at
    once. The tool's output is in the sequence but not in the loss (label -100), as in the RL rollouts."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    out = []
    for item in task.train_prompts():
        prompt, answer = ids(item["prompt"]), item["answer"]
        if rng.random() < tool_fraction:
            call, result = ids(f"<calc>{item['prompt'][:-1]}</calc>"), ids(f"={answer}\n")
            final = ids(answer) + [eos]
            out.append((prompt + call + result + final, [-100] * len(prompt) + call + [-100] * len(result) + final))
        else:
            final = ids(answer) + [eos]
            out.append((prompt + final, [-100] * len(prompt) + final))
    return out


def sft_calculator(task, config: SFTConfig, tool_fraction: float, log_every: int = 0):
    """The calculator task's model: traces that call the tool in a `tool_fraction` of cases, trained briefly."""
    tokenizer = char_tokenizer()
    model = tiny_causal_lm(tokenizer, hidden_size=config.hidden_size, num_layers=config.num_layers,
                           num_heads=config.num_heads, max_position_embeddings=128, seed=config.seed)
    train = calculator_traces(tokenizer, task, tool_fraction, config.seed)
    supervise_traces(model, tokenizer, train, config, log_every,
                     lambda model: evaluate_calculator(model, tokenizer, task, n_prompts=200))
    return model, tokenizer


def supervise_traces(model, tokenizer, train: list[tuple[list[int], list[int]]], config: SFTConfig, log_every: int,
                     evaluate) -> None:
    """`supervise` on (token ids, labels) traces, right-padded; `evaluate(model)` gives the progress line's greedy
    accuracy and tool calls ({"accuracy", "tool_rate"})."""

    def batch(index: list[int]) -> tuple[torch.Tensor, ...]:
        traces = [train[i] for i in index]
        width = max(len(x) for x, _ in traces)
        ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _ in traces])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in traces])
        attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in traces])
        return ids, attention, labels

    def progress(model) -> str:
        m = evaluate(model)
        return f"greedy {m['accuracy']:.3f}  tool calls {m['tool_rate']:.2f}"

    supervise(model, tokenizer, len(train), batch, config, log_every, progress)


@torch.no_grad()
def evaluate_calculator(model, tokenizer, task, n_prompts: int | None = None, tool: bool = True) -> dict[str, float]:
    """Greedy held-out accuracy of multi-turn episodes (with the tool, or without it), and tool calls per episode."""
    from lmrl.data.tasks import final_answer_reward
    from lmrl.rollout import HFGenerator, SamplingParams
    from lmrl.rollout.multiturn import generate_episodes

    model.eval()
    items = task.eval_prompts()[:n_prompts]
    prompts = [tokenizer(it["prompt"], add_special_tokens=False)["input_ids"] for it in items]
    params = SamplingParams(max_new_tokens=task.max_new_tokens, temperature=0.0, stop=["</calc>"])
    generator = HFGenerator(model, tokenizer)
    env = task.environment() if tool else (lambda row: _OneTurn())
    episodes = generate_episodes(generator, tokenizer, prompts, items, 1, params, env, max_turns=2)
    rewards = final_answer_reward(None, episodes.rollout.texts, [it["answer"] for it in items])
    return {"accuracy": sum(rewards) / len(items), "tool_rate": episodes.metrics["env/tool_calls"]}


def reasoner_traces(tokenizer, task, tool_fraction: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """The tiny-reasoner's supervised examples as (token ids, labels), each a model turn after its context in the
    reasoner's chat format (`lmrl.models.tiny.REASONER_TEMPLATE`). In a `tool_fraction` of the items the model reasons,
    calls the tool (`47+85+36</think><calc>47+85+36</calc>`) and, after the result as a user turn, answers
    (`</think>168`); the answer's context writes the first turn without its reasoning or with it, half each, so that
    one model starts from the same place under either template. In the others it answers at once."""
    from lmrl.models.tiny import REASONER_KEEP_TEMPLATE, REASONER_TEMPLATE

    rng = random.Random(seed)
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def render(messages: list[dict], template: str) -> list[int]:
        return ids(tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True))

    out = []
    for item in task.train_prompts():
        user, expr, answer = {"role": "user", "content": item["prompt"]}, item["prompt"][:-1], item["answer"]
        first = render([user], REASONER_TEMPLATE)
        if rng.random() < tool_fraction:
            call = f"{expr}</think><calc>{expr}</calc>"
            history = [user, {"role": "assistant", "content": call}, {"role": "user", "content": f"={answer}"}]
            second = render(history, rng.choice([REASONER_TEMPLATE, REASONER_KEEP_TEMPLATE]))
            turns = [(first, ids(call)), (second, ids(f"</think>{answer}") + [eos])]
        else:
            turns = [(first, ids(f"{expr}</think>{answer}") + [eos])]
        out += [(context + turn, [-100] * len(context) + turn) for context, turn in turns]
    return out


def sft_reasoner(task, config: SFTConfig, tool_fraction: float, log_every: int = 0):
    """The tiny-reasoner: a character-level Llama whose chat template cuts earlier turns' reasoning, trained briefly on
    `reasoner_traces`."""
    from lmrl.models.tiny import REASONER_TEMPLATE

    tokenizer = char_tokenizer()
    tokenizer.chat_template = REASONER_TEMPLATE
    model = tiny_causal_lm(tokenizer, hidden_size=config.hidden_size, num_layers=config.num_layers,
                           num_heads=config.num_heads, max_position_embeddings=128, seed=config.seed)
    train = reasoner_traces(tokenizer, task, tool_fraction, config.seed)
    supervise_traces(model, tokenizer, train, config, log_every,
                     lambda model: evaluate_reasoner(model, tokenizer, task, n_prompts=200))
    return model, tokenizer


@torch.no_grad()
def evaluate_reasoner(model, tokenizer, task, n_prompts: int | None = None, template: str | None = None
                      ) -> dict[str, float]:
    """Greedy held-out accuracy of the reasoner's chat episodes as an agent plays them (a call, its result as a user
    turn, the answer after </think>), the history written by `template` (None: the tokenizer's), and tool calls per
    episode."""
    from lmrl.rollout import HFGenerator, SamplingParams

    model.eval()
    items = task.eval_prompts()[:n_prompts]
    generator = HFGenerator(model, tokenizer)  # a turn reasons, then calls: twice the calculator's tokens
    params = SamplingParams(max_new_tokens=2 * task.max_new_tokens, temperature=0.0, stop=["</calc>"])

    def prompt(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    chats = [[{"role": "user", "content": it["prompt"]}] for it in items]
    first = generator.generate([prompt(c) for c in chats], 1, params).texts
    calls = [re.search(r"<calc>([^<>]*)</calc>", t) for t in first]
    answers = list(first)
    todo = [i for i, m in enumerate(calls) if m]
    for i in todo:
        terms = [t for t in calls[i].group(1).split("+") if t.strip().isdigit()]
        chats[i] += [{"role": "assistant", "content": first[i]}, {"role": "user", "content": f"={sum(map(int, terms))}"}]
    if todo:
        second = generator.generate([prompt(chats[i]) for i in todo], 1, params).texts
        for i, text in zip(todo, second):
            answers[i] = text
    right = [a.split("</think>")[-1].strip() == it["answer"] for a, it in zip(answers, items)]
    return {"accuracy": sum(right) / len(items), "tool_rate": len(todo) / len(items)}


class _OneTurn:
    def step(self, text, token_ids):
        from lmrl.envs import Step

        return Step(done=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--log-every", type=int, default=100)
    defaults = SFTConfig()
    for field, value in vars(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--min-digits", type=int, default=AdditionTask.min_digits)
    parser.add_argument("--max-digits", type=int, default=AdditionTask.max_digits)
    parser.add_argument("--task", choices=["addition", "calculator", "reasoner"], default="addition")
    parser.add_argument("--tool-fraction", type=float, default=0.5, help="calculator: share of traces calling the tool")
    args = parser.parse_args()
    # one thread: the same float reduction order on every machine (and faster for a model this small)
    torch.set_num_threads(1)
    config = SFTConfig(**{k: getattr(args, k) for k in vars(defaults)})
    if args.task == "calculator":
        main_calculator(args, config)
        return
    if args.task == "reasoner":
        main_reasoner(args, config)
        return
    task = AdditionTask(min_digits=args.min_digits, max_digits=args.max_digits)
    model, tokenizer = sft(task, config, log_every=args.log_every)
    torch.manual_seed(0)
    m = evaluate(model, tokenizer, task, k=8)
    print(f"held-out ({task.num_eval} prompts): greedy {m['accuracy']:.3f}  pass@8 (T=1) {m['pass_at_k']:.3f}")
    save(model, tokenizer, args.out)


def main_calculator(args, config: SFTConfig) -> None:
    from lmrl.data.tasks import CalculatorTask

    task = CalculatorTask()
    model, tokenizer = sft_calculator(task, config, args.tool_fraction, log_every=args.log_every)
    with_tool = evaluate_calculator(model, tokenizer, task)
    without = evaluate_calculator(model, tokenizer, task, tool=False)
    print(f"held-out ({task.num_eval} prompts), greedy: {with_tool['accuracy']:.3f} with the tool "
          f"({with_tool['tool_rate']:.2f} calls per episode), {without['accuracy']:.3f} without it")
    save(model, tokenizer, ASSETS / "tiny-calculator" if args.out == DEFAULT_OUT else args.out)


def main_reasoner(args, config: SFTConfig) -> None:
    from lmrl.data.tasks import CalculatorTask
    from lmrl.models.tiny import REASONER_KEEP_TEMPLATE

    task = CalculatorTask()
    model, tokenizer = sft_reasoner(task, config, args.tool_fraction, log_every=args.log_every)
    cut = evaluate_reasoner(model, tokenizer, task)
    kept = evaluate_reasoner(model, tokenizer, task, template=REASONER_KEEP_TEMPLATE)
    print(f"held-out ({task.num_eval} prompts), greedy: {cut['accuracy']:.3f} with the reasoning cut from the history "
          f"({cut['tool_rate']:.2f} calls per episode), {kept['accuracy']:.3f} with it kept")
    save(model, tokenizer, ASSETS / "tiny-reasoner" if args.out == DEFAULT_OUT else args.out)


def save(model, tokenizer, out: Path | None) -> None:
    args = argparse.Namespace(out=out)
    if args.out is not None and str(args.out) != "-":
        args.out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        # transformers 5 names the class TokenizersBackend, which 4.x cannot load; both load this name
        tok_config = args.out / "tokenizer_config.json"
        tok_config.write_text(tok_config.read_text().replace('"TokenizersBackend"', '"PreTrainedTokenizerFast"'))
        for f in args.out.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; installed package data must be readable by all
        size = sum(f.stat().st_size for f in args.out.iterdir()) / 1e6
        print(f"saved to {args.out} ({size:.2f} MB)")


if __name__ == "__main__":
    main()
