"""The decode engine: rows that join and leave sample what they sample alone, attention reads only live columns,
key / value heads are stored once, and a step on "cuda" makes no host synchronisation between the host's reads."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import lmrl.engine.engine as engine_module
import lmrl.engine.llama as llama
from lmrl.engine import DecodeEngine, Request
from lmrl.engine.cache import BLOCK
from lmrl.engine.sampling import row_keys
from lmrl.models.tiny import char_tokenizer
from lmrl.rollout import SamplingParams
from tests.fakecuda import fake_cuda
from tests.rollout.test_hf_generator import gqa_model

PARAMS = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request, tok):
    return gqa_model(tok, request.param).eval()


@pytest.fixture(params=["kernels", "pytorch"])
def path(request, monkeypatch):
    """Both attention paths of `LlamaStep`: the C kernel (where it builds) and PyTorch's."""
    if request.param == "pytorch":
        monkeypatch.setattr(llama, "USE_KERNELS", False)
    return request.param


@pytest.fixture(params=["kernels", "pytorch", "forward"])
def step(request, monkeypatch):
    """Every step: `LlamaStep` with either attention path, and the model's own forward (`ModelStep`, the step of
    every other model)."""
    if request.param == "pytorch":
        monkeypatch.setattr(llama, "USE_KERNELS", False)
    if request.param == "forward":
        monkeypatch.setattr(engine_module, "llama_supports", lambda model: False)
    return request.param


def run(engine: DecodeEngine, joins: dict[int, list[Request]], steps: int = 200) -> dict:
    """Step `engine`, adding `joins[s]` before step s; every row's (tokens, log-probs) by owner."""
    out = {}
    with torch.inference_mode():
        for s in range(steps):
            engine.add(joins.get(s, []))
            if not len(engine) and s > max(joins):
                break
            for ended in engine.step():
                out[ended.owner] = (ended.tokens, ended.logprobs, ended.finished)
    return out


def test_rows_that_join_and_leave_sample_what_they_sample_alone(model, tok, step):
    """Sampled, not greedy: rows join at different steps with prompts shorter and longer than any so far (the
    stores grow), a group of three shares its prompt, rows leave at different steps (EOS or max_new) and give
    their slots to later rows; each row's tokens equal its decode alone, log-probs within 1e-5."""
    keys = row_keys(7, torch.arange(8)).tolist()
    prompts = ["what is 2+2?", "hello there, how are you today my friend", "x", "ab", "what is 2+2?", "what is 2+2?",
               "a longer prompt than all the others before it", "ok"]
    max_new = [14, 9, 5, 30, 14, 14, 25, 60]
    at = [0, 3, 3, 6, 0, 0, 12, 13]
    requests = [Request(tok.encode(p), m, i, keys[i]) for i, (p, m) in enumerate(zip(prompts, max_new))]
    eos = tok.encode("aeiou")  # ids that end a row, likely enough that some rows end early
    joined = DecodeEngine(model, PARAMS, eos)
    together = run(joined, {s: [r for r, a in zip(requests, at) if a == s] for s in set(at)})
    prefills = len(set(at))
    kernel_steps = getattr(joined.step_fn, "kernel_steps", 0)
    assert joined.rebuilds >= 2 and kernel_steps == (joined.forwards - prefills if step == "kernels" else 0)
    assert {finished for _, _, finished in together.values()} == {True, False}  # EOS and max_new both ended rows
    for r in requests:
        alone = run(DecodeEngine(model, PARAMS, eos), {0: [r]})[r.owner]
        assert together[r.owner][0] == alone[0]
        assert together[r.owner][1] == pytest.approx(alone[1], abs=1e-5)


def test_attention_reads_only_live_columns(model, tok, step):
    """Every column of the stores a step must not read is NaN: the unused slots, and with the C kernel the columns
    before each prompt and past each row's length; with PyTorch and the model's forward, those outside the spans it
    reads (the longest prompt and response rounded up to the block). The step's logits stay finite and equal to
    those of clean stores."""
    requests = [Request(tok.encode(p), 40, i, i) for i, p in enumerate(["hello there", "ab", "ab", "what is 2+2?"])]

    def logits_after(poison: bool) -> torch.Tensor:
        engine = DecodeEngine(model, PARAMS, [])
        with torch.inference_mode():
            engine.add(requests[:2])
            for _ in range(5):
                engine.step()
            engine.add(requests[2:])  # rows of different lengths from here on
            for _ in range(3):
                engine.step()
            cache = engine.cache
            p, n = cache.spans()
            _, pc, _, nc = cache.capacity
            assert p == min(-(-max(cache.prompt_length) // BLOCK) * BLOCK, pc)
            assert n == min(-(-(max(cache.row_length) + 1) // BLOCK) * BLOCK, nc) and n < nc  # reads less than it holds
            if poison:  # what the path never reads (PyTorch reads the spans, masked columns within them as zeros)
                _, pc, _, _ = cache.capacity
                for store in (*cache.prompt_keys, *cache.prompt_values):
                    store[len(cache.prompt_length):] = float("nan")
                    for u, m in enumerate(cache.prompt_length):
                        store[u, :, : pc - (m if step == "kernels" else p)] = float("nan")
                for store in (*cache.row_keys, *cache.row_values):
                    store[cache.rows:] = float("nan")
                    for r, length in enumerate(cache.row_length):
                        store[r, :, length if step == "kernels" else n:] = float("nan")
            engine.step()
            return engine.logits

    clean, poisoned = logits_after(False), logits_after(True)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, atol=1e-5, rtol=0)


def test_key_value_heads_are_stored_once_and_never_repeated(model, tok, path):
    """Grouped-query attention (4 query heads per 2 key / value heads): the stores hold 2 heads, a prompt shared by
    three rows is stored once, and no decode step repeats or expands a key / value tensor to the query heads."""
    engine = DecodeEngine(model, PARAMS, [])
    calls = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("repeat_interleave", "repeat", "expand") and args and getattr(args[0], "dim", lambda: 0)() >= 3:
                calls.append(name)
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        engine.add([Request(tok.encode("hello there"), 10, i, i) for i in range(3)])
        with Watch():
            for _ in range(4):
                engine.step()
    kv = model.config.num_key_value_heads
    assert kv == 2 and engine.cache.prompt_keys[0].shape[1] == kv and engine.cache.row_keys[0].shape[1] == kv
    assert engine.cache.prompt_length == [len(tok.encode("hello there"))] and engine.cache.prompt_rows == [3]
    assert calls == []


class SyncCounter(TorchFunctionMode):
    """Counts the calls that make the host wait for a GPU: reading a value back (`item`, `tolist`, `bool`, `int`,
    `float`) or an op whose output shape depends on values (`nonzero`, `unique`, boolean-mask indexing)."""

    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique", "masked_select",
             "argwhere"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls.append(name)
        if name in ("__getitem__", "__setitem__") and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.calls.append("boolean index")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("step", ["module by module", "the model's forward", "module by module, fixed shapes",
                                  "the model's forward, fixed shapes"])
def test_a_step_on_cuda_synchronises_only_when_the_host_reads_the_tokens(tok, monkeypatch, step):
    """On "cuda" (`tests.fakecuda`) rows run without the host reading anything back, except every `check_every`
    steps and the step a row reaches its max_new (then the ended rows' log-probs): the sampling, the cache writes,
    the masks and attention, stop checks included, make no host synchronisation; through `LlamaStep` and through
    the model's own forward (`ModelStep`) alike."""
    monkeypatch.setattr(llama, "USE_KERNELS", False)
    lean = step.startswith("module by module")
    monkeypatch.setattr(engine_module, "llama_supports", lambda model: lean)
    with fake_cuda():
        model = gqa_model(tok, "qwen2").to("cuda").eval()
        engine = DecodeEngine(model, SamplingParams(temperature=1.0, top_k=5, top_p=0.9), [tok.eos_token_id],
                              check_every=4, fixed=step.endswith("fixed shapes"), graphs=False)
        assert type(engine.step_fn).__name__ == ("LlamaStep" if lean else "ModelStep")
        synced_steps, steps = [], 0
        with torch.inference_mode():
            engine.add([Request(tok.encode(p), m, i, i) for i, (p, m) in enumerate([("hello", 30), ("ab", 30), ("x", 18)])])
            assert engine.device.type == "cuda" and engine.cache.device.type == "cuda"
            while len(engine):
                reads_before = engine.reads
                counter = SyncCounter()
                with counter:
                    engine.step()
                steps += 1
                if counter.calls:
                    synced_steps.append(steps)
                    assert engine.reads == reads_before + 1, counter.calls  # only a read synchronises
    assert steps > 12 and synced_steps and len(synced_steps) <= steps // 4 + 3, synced_steps  # 3 rows: 3 max_new reads


@pytest.mark.parametrize("stop", [None, ["e ", "o"]])
def test_reading_every_few_steps_cuts_rows_back_to_where_reading_every_step_ends_them(model, tok, stop):
    """A GPU's engine reads the sampled tokens every `check_every` steps, so rows run past their EOS or stop string
    and are cut back: the rows handed back (tokens, log-probs, finished) equal those of reading every step, with rows
    of different ages (a second group joins at step 3) and EOS and stop strings both ending rows."""
    from lmrl.rollout.hf import StopChecker

    eos = tok.encode("aiu")
    prompts = ["what is 2+2?", "hello there", "x"]

    def decode(check_every: int) -> dict:
        stops = StopChecker(tok, stop) if stop else None
        engine = DecodeEngine(model, PARAMS, eos, stops=stops, check_every=check_every)
        joins = {0: [Request(tok.encode(p), 30, (p, j), 100 * i + j) for i, p in enumerate(prompts[:2]) for j in range(3)],
                 3: [Request(tok.encode(prompts[2]), 25, (prompts[2], j), 300 + j) for j in range(3)]}
        return run(engine, joins), engine.reads

    (every, reads_every), (batched, reads_batched) = decode(1), decode(5)
    assert reads_batched < reads_every / 2  # the rows did run past their ends between reads
    assert every.keys() == batched.keys() and len(every) == 9
    assert {finished for _, _, finished in every.values()} == {True, False} or stop is None
    for owner, (tokens, logprobs, finished) in every.items():
        assert batched[owner][0] == tokens and batched[owner][2] == finished, owner
        assert batched[owner][1] == pytest.approx(logprobs, abs=1e-5)  # other rows beside it: float rounding
