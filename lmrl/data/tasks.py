"""Built-in verifiable tasks: prompts with known answers, and a reward that checks them.

A task is what `lmrl train` runs on when no dataset is given. It needs nothing from the network:
prompts are generated from a seed, and the reward is a plain function of text.

Every prompt item is a dict `{"prompt": str, "answer": str}`. The trainer passes the extra columns
(here `answer`) to reward functions by name, as TRL does: `fn(prompts, completions, answer, **kw)`.

The shipped task is addition in natural written form, `"57+68="` -> `"125"`, sized for a
character-level model (`lmrl.models.tiny.char_tokenizer`): one token per digit, no chat template,
no BOS. The prompt is tokenized as is and the completion ends with EOS.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmrl.data.digits import digit_rows
from lmrl.errors import ConfigError
from lmrl.rewards.core import completion_text

RewardFn = Callable[..., list[float]]


def exact_match_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer; else 0.0.

    No partial credit and no format bonus: on this task a shaped reward did not speed RL up, and
    the held-out metric stays the same function as the training reward. Not the built-in
    `lmrl.rewards.exact_match_reward` (a factory whose functions also collapse inner whitespace and
    score a missing answer None): this one is the task's reward itself, metric name and all.
    """
    if len(completions) != len(answer):
        raise ValueError(f"answer: expected {len(completions)} answers (one per completion), got {len(answer)}")
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


@dataclass(frozen=True)
class AdditionTask:
    """Add two non-negative integers written in decimal: `"57+68="` -> `"125"`.

    Each operand independently gets a digit count drawn uniformly from `[min_digits, max_digits]`,
    then a value uniformly among numbers with that many digits (1 digit means 0-9). Pairs are drawn
    without replacement from one seeded stream: the first `num_eval` distinct (a, b) pairs are the
    held-out split, the next `num_train` the training split, so the splits never share a pair and
    the held-out set does not change when `num_train` does.

    Attributes:
        min_digits: fewest digits of an operand (>= 1).
        max_digits: most digits of an operand (>= min_digits).
        num_train: training prompts.
        num_eval: held-out prompts.
        seed: seed of the pair stream; the same seed gives the same splits on every machine.
    """

    min_digits: int = 1
    max_digits: int = 2
    num_train: int = 4000
    num_eval: int = 500
    seed: int = 0

    name = "addition"

    def __post_init__(self) -> None:
        if self.min_digits < 1:
            raise ValueError(f"min_digits: must be >= 1, got {self.min_digits}")
        if self.max_digits < self.min_digits:
            raise ValueError(f"max_digits: must be >= min_digits ({self.min_digits}), got {self.max_digits}")
        if self.num_train < 1 or self.num_eval < 1:
            raise ValueError(f"num_train, num_eval: must be >= 1, got {self.num_train}, {self.num_eval}")
        if self.num_train + self.num_eval > self._num_pairs():
            raise ValueError(
                f"num_train + num_eval: {self.num_train + self.num_eval} exceeds the "
                f"{self._num_pairs()} distinct pairs with {self.min_digits}-{self.max_digits} digits"
            )

    @property
    def max_new_tokens(self) -> int:
        """Enough tokens for the longest answer (max_digits + 1 digits) and the EOS."""
        return self.max_digits + 2

    @property
    def reward_funcs(self) -> list[RewardFn]:
        """Reward functions with the TRL signature; their sum is the score."""
        return [exact_match_reward]

    def train_prompts(self) -> list[dict[str, str]]:
        """The training split: `num_train` items `{"prompt": "a+b=", "answer": "a+b"}`."""
        return [_item(a, b) for a, b in self._pairs()[self.num_eval :]]

    def eval_prompts(self) -> list[dict[str, str]]:
        """The held-out split: `num_eval` items, no (a, b) pair shared with the training split."""
        return [_item(a, b) for a, b in self._pairs()[: self.num_eval]]

    def _num_pairs(self) -> int:
        count = 10**self.max_digits - (0 if self.min_digits == 1 else 10 ** (self.min_digits - 1))
        return count * count

    def _pairs(self) -> list[tuple[int, int]]:
        rng = random.Random(self.seed)
        wanted = self.num_eval + self.num_train
        seen: set[tuple[int, int]] = set()
        pairs: list[tuple[int, int]] = []
        while len(pairs) < wanted:
            pair = (self._operand(rng), self._operand(rng))
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
        return pairs

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)


def _item(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


CALC_PATTERN = r"<(?P<name>calc)>(?P<expression>[^<>]*)</calc>"
"""How the calculator task's model calls its tool: `<calc>47+85+36</calc>` (short, for a character-level model)."""


def calc(expression: str) -> str:
    """Add whole numbers, such as 47+85+36.

    Args:
        expression: whole numbers joined by +
    """
    terms = [t.strip() for t in expression.split("+")]
    if not all(t.isdigit() and len(t) <= 18 for t in terms) or len(terms) > 32:
        raise ValueError(f"not a sum of whole numbers: {expression!r}")
    return str(sum(int(t) for t in terms))


def final_answer_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """1.0 when the episode's last line (the model's answer, after any tool output) equals the answer; else 0.0."""
    if len(completions) != len(answer):
        raise ValueError(f"answer: expected {len(completions)} answers (one per completion), got {len(answer)}")
    return [float(completion_text(c).rsplit("\n", 1)[-1].strip() == str(a).strip()) for c, a in zip(completions, answer)]


@dataclass(frozen=True)
class CalculatorTask:
    """Sums of several numbers, `"47+85+36="` -> `"168"`, with a calculator tool: a multi-turn task.

    The model may call `calc` by writing `<calc>47+85+36</calc>` (the turn ends there); the
    environment answers `=168` and a new line, and the model's next turn is its answer. It may also
    answer at once. The reward (`final_answer_reward`) checks the episode's last line, so a right
    answer counts however it was reached. `calculator-notool` is the same task without the tool: one
    turn, in which the model must add by itself.

    Attributes:
        num_terms: numbers per sum (>= 2).
        min_value, max_value: each number is drawn uniformly from this range.
        num_train, num_eval: training and held-out prompts; no sum appears in both.
        seed: seed of the stream of sums.
        tool: whether the calculator is there (`environment()` is None without it).
    """

    num_terms: int = 3
    min_value: int = 10
    max_value: int = 99
    num_train: int = 4000
    num_eval: int = 500
    seed: int = 0
    tool: bool = True

    name = "calculator"

    def __post_init__(self) -> None:
        if self.num_terms < 2 or not 0 <= self.min_value <= self.max_value:
            raise ValueError(f"num_terms, min_value, max_value: need num_terms >= 2 and 0 <= min_value <= max_value, "
                             f"got {self.num_terms}, {self.min_value}, {self.max_value}")
        if self.num_train + self.num_eval > (self.max_value - self.min_value + 1) ** self.num_terms:
            raise ValueError(f"num_train + num_eval: more than the {self.num_terms}-term sums in the range")

    @property
    def max_new_tokens(self) -> int:
        """Enough tokens for the longest tool call, `<calc>` + the terms + `</calc>`."""
        return len("<calc></calc>") + self.num_terms * (len(str(self.max_value)) + 1) + 2

    @property
    def reward_funcs(self) -> list[RewardFn]:
        return [final_answer_reward]

    def environment(self) -> Any:
        """The tool environment with `calc`, or None for the task without the tool."""
        if not self.tool:
            return None
        from lmrl.envs import ToolEnvironment, Tools

        return ToolEnvironment(Tools([calc]), CALC_PATTERN, response_format="={output}\n", stop=["</calc>"])

    def train_prompts(self) -> list[dict[str, str]]:
        return [_sum_item(t) for t in self._sums()[self.num_eval :]]

    def eval_prompts(self) -> list[dict[str, str]]:
        return [_sum_item(t) for t in self._sums()[: self.num_eval]]

    def _sums(self) -> list[tuple[int, ...]]:
        rng = random.Random(self.seed)
        seen: set[tuple[int, ...]] = set()
        out: list[tuple[int, ...]] = []
        while len(out) < self.num_eval + self.num_train:
            terms = tuple(rng.randint(self.min_value, self.max_value) for _ in range(self.num_terms))
            if terms not in seen:
                seen.add(terms)
                out.append(terms)
        return out


@dataclass(frozen=True)
class CalculatorNoToolTask(CalculatorTask):
    """The calculator task without its tool: one turn, the model adds by itself (the baseline)."""

    tool: bool = False

    name = "calculator-notool"


def _sum_item(terms: tuple[int, ...]) -> dict[str, str]:
    return {"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms))}


@functools.cache
def _cached_rows(n: int, seed: int, blank: bool) -> tuple[dict[str, Any], ...]:
    """`digit_rows`, drawn once per process: the train and held-out splits, and every evaluation, share them."""
    return tuple(digit_rows(n, seed, blank))


@dataclass(frozen=True)
class DigitsTask:
    """The digit shown plus k, a built-in task (`data.task=digits`): each prompt `<image>digit+K=` carries its PIL
    image in memory, the answer is digit + K, the reward exact match (as the addition task's).

    One seeded stream of `digit_rows`: the first `num_eval` rows are the held-out split, the next `num_train` the
    training split. There are only 90 (digit, k) pairs, so both splits hold every pair; what is held out is the
    drawing (place, size and colours), which the model has not seen. A model that ignores the image can at best
    guess the digit: about 10% exact. The shipped model was supervised on the first 2,000 training rows; RL meets
    18,000 drawings more, so that it learns to read digits, not to remember drawings.

    Attributes:
        num_train: training prompts.
        num_eval: held-out prompts.
        seed: seed of the row stream.
        blank: every image empty (`digits-blank`): the control, where the digit cannot be seen.
    """

    num_train: int = 20000
    num_eval: int = 500
    seed: int = 0
    blank: bool = False

    name = "digits"
    max_new_tokens = 3  # up to two digits (18) and the EOS

    @property
    def reward_funcs(self) -> list[RewardFn]:
        return [exact_match_reward]

    def train_prompts(self) -> list[dict[str, Any]]:
        """`num_train` rows `{"prompt", "image", "answer"}`, after the held-out ones in the stream."""
        return [dict(r) for r in self._rows()[self.num_eval:]]

    def eval_prompts(self) -> list[dict[str, Any]]:
        """The held-out split: the stream's first `num_eval` rows."""
        return [dict(r) for r in self._rows()[: self.num_eval]]

    def _rows(self) -> tuple[dict[str, Any], ...]:
        return _cached_rows(self.num_eval + self.num_train, self.seed, self.blank)


@dataclass(frozen=True)
class DigitsBlankTask(DigitsTask):
    """The digits task with every image blank (`data.task=digits-blank`): the control run."""

    blank: bool = True

    name = "digits-blank"


TASKS: dict[str, type] = {"addition": AdditionTask, "calculator": CalculatorTask,
                          "calculator-notool": CalculatorNoToolTask, "digits": DigitsTask, "digits-blank": DigitsBlankTask}


def get_task(name: str, **kwargs: Any) -> Any:
    """The built-in task called `name`, built with `kwargs` (e.g. `seed=1`)."""
    if name not in TASKS:
        raise ConfigError(f"data.task: unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


@torch.no_grad()
def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    greedy: bool = True,
    num_samples: int = 1,
    temperature: float = 1.0,
    batch_size: int = 256,
) -> list[str]:
    """Completions for `prompts` with plain `model.generate`, text decoded up to the first EOS.

    Returns `len(prompts) * num_samples` strings, the samples of one prompt adjacent.
    """
    if num_samples > 1 and greedy:
        raise ValueError("num_samples: greedy decoding gives one completion per prompt; use greedy=False")
    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    texts: list[str] = []
    expanded = [p for p in prompts for _ in range(num_samples)]
    for start in range(0, len(expanded), batch_size):
        chunk = expanded[start : start + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        # top_k=0 and top_p=1 switch off the generation_config defaults: RL needs the plain softmax
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            if eos in row:
                row = row[: row.index(eos)]
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    if was_training:
        model.train()
    return texts


def evaluate(
    model: Any,
    tokenizer: Any,
    task: AdditionTask,
    n_prompts: int | None = None,
    greedy: bool = True,
    k: int = 1,
    temperature: float = 1.0,
) -> dict[str, float]:
    """Held-out exact-match accuracy of `model` on the first `n_prompts` of `task.eval_prompts()`.

    Returns `accuracy`: the fraction answered exactly (greedy decoding, or one sample per prompt at
    `temperature` when `greedy=False`); and `pass_at_k`: the fraction of prompts where at least one
    of `k` samples at `temperature` is exact (equal to `accuracy` when `k == 1`).
    """
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    items = task.eval_prompts()[:n_prompts]
    prompts = [it["prompt"] for it in items]
    answers = [it["answer"] for it in items]
    first = generate_completions(model, tokenizer, prompts, task.max_new_tokens, greedy, 1, temperature)
    accuracy = sum(exact_match_reward(prompts, first, answers)) / len(items)
    pass_at_k = accuracy
    if k > 1:
        samples = generate_completions(model, tokenizer, prompts, task.max_new_tokens, False, k, temperature)
        rewards = exact_match_reward(prompts, samples, [a for a in answers for _ in range(k)])
        pass_at_k = sum(max(rewards[i * k : (i + 1) * k]) for i in range(len(items))) / len(items)
    return {"accuracy": accuracy, "pass_at_k": pass_at_k}
