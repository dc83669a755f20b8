"""HFGenerator: agreement with transformers' generate and with a full forward pass, masks, stops, seeds."""

from __future__ import annotations

import copy

import pytest
import torch

import lmrl.engine.engine as engine_module
import lmrl.engine.layers as spd
from lmrl.engine import supports as engine_supports
from lmrl.engine.layers import Linear as _Linear
from lmrl.engine.layers import onednn_weight as _onednn_weight
from lmrl.engine.model_step import cache_keyword
from lmrl.engine.sampling import row_keys, uniform
from lmrl.engine.sampling import sample_categorical as _sample_categorical
from lmrl.engine.sampling import truncate as _truncate
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
from lmrl.rollout import Generator, HFGenerator, Rollout, SamplingParams

TEXTS = ["hello there", "ab", "what is 2+2?", "x"]


def scrambled_model(tokenizer, arch: str = "llama", seed: int = 0):
    """A tiny model whose weights are perturbed so that greedy outputs vary (a fresh init repeats its input)."""
    model = tiny_causal_lm(tokenizer, arch=arch)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tok):
    return scrambled_model(tok, request.param)


@pytest.fixture(scope="module")
def llama(tok):
    return scrambled_model(tok, "llama", seed=1)


def other_model(tok, arch: str, seed: int):
    """A tiny GPT-2 (learned positions) or GPT-NeoX (partial rotary): models the engine steps through their own
    forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(gpt2=dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
                 gpt_neox=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))[arch]
    config = AutoConfig.for_model(arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **shape)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def encode(tok, texts=TEXTS) -> list[list[int]]:
    return [tok.encode(t) for t in texts]


def reference_logprobs(model, rollout: Rollout, temperature: float) -> torch.Tensor:
    """Sampled-token log-probs from one full forward pass over prompt + response (no cache)."""
    mask = rollout.attention_mask
    position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=rollout.sequences, attention_mask=mask.long(), position_ids=position_ids
        ).logits
    prompt_len = rollout.prompt_ids.shape[1]
    # logits at position t score the token at t + 1
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    return logp.masked_fill(~rollout.response_mask, 0.0)


def test_greedy_matches_transformers_generate(model, tok):
    prompts, n, max_new = encode(tok), 2, 12
    rollout = HFGenerator(model, tok).generate(
        prompts, n, SamplingParams(max_new_tokens=max_new, temperature=0)
    )
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            input_ids=enc.input_ids.repeat_interleave(n, 0),
            attention_mask=enc.attention_mask.repeat_interleave(n, 0),
            do_sample=False,
            max_new_tokens=max_new,
        )
    expected = out[:, enc.input_ids.shape[1] :]
    assert rollout.response_ids.shape == expected.shape
    assert torch.equal(rollout.response_ids, expected)
    assert torch.equal(rollout.prompt_ids, enc.input_ids.repeat_interleave(n, 0))
    # greedy outputs of the scrambled model are not trivial repeats
    assert len(set(rollout.texts)) == len(TEXTS)


def test_greedy_with_early_eos_matches_generate(tok):
    """Rows that end early leave the batch (the KV cache is compacted); the others must not notice."""
    model = scrambled_model(tok, "llama", seed=3)
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = 2.5
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    try:
        texts = ["hello there", "ab", "what is 2+2?", "x", "zz top", "1+1=", "lmrl", "q"]
        rollout = HFGenerator(model, tok).generate(
            encode(tok, texts), 1, SamplingParams(max_new_tokens=16, temperature=0)
        )
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=16)
    finally:
        handle.remove()
    lengths = rollout.lengths
    assert rollout.finished.sum() >= 2 and len(set(lengths.tolist())) >= 3  # rows end at different steps
    assert torch.equal(rollout.response_ids, out[:, enc.input_ids.shape[1] :])


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_equal_full_forward_pass(model, tok, temperature, device):
    model = model if device.type == "cpu" else copy.deepcopy(model).to(device)  # the fixture's stays on the CPU
    gen = HFGenerator(model, tok)
    rollout = gen.generate(encode(tok), 3, SamplingParams(max_new_tokens=10, temperature=temperature, seed=0))
    assert rollout.logprobs.dtype == torch.float32 and rollout.logprobs.device.type == device.type
    expected = reference_logprobs(model, rollout, temperature)
    torch.testing.assert_close(rollout.logprobs, expected, atol=1e-4, rtol=0)
    assert torch.all(rollout.logprobs[~rollout.response_mask] == 0)
    assert torch.all(rollout.logprobs[rollout.response_mask] < 0)


def test_logprobs_ignore_top_k_truncation(llama, tok):
    """Top-k restricts sampling, not the reported log-prob: it stays the full distribution's."""
    rollout = HFGenerator(llama, tok).generate(
        encode(tok), 2, SamplingParams(max_new_tokens=8, temperature=0.8, top_k=5, seed=1)
    )
    torch.testing.assert_close(rollout.logprobs, reference_logprobs(llama, rollout, 0.8), atol=1e-4, rtol=0)


def test_pad_is_eos_mask_keeps_first_eos_only(tok):
    tok_pe = char_tokenizer(pad_is_eos=True)
    eos = tok_pe.eos_token_id
    assert tok_pe.pad_token_id == eos
    model = scrambled_model(tok_pe, "qwen2")
    bias = torch.zeros(model.config.vocab_size)
    bias[eos] = 3.0  # make EOS likely so that completions really end early
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    try:
        max_new = 16
        rollout = HFGenerator(model, tok_pe).generate(
            encode(tok_pe), 4, SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=0)
        )
        expected = reference_logprobs(model, rollout, 1.0)
    finally:
        handle.remove()
    ended = rollout.finished
    assert ended.any() and (rollout.lengths[ended] < rollout.response_ids.shape[1]).any()
    for i in range(rollout.response_ids.shape[0]):
        ids, mask = rollout.response_ids[i], rollout.response_mask[i]
        eos_positions = (ids == eos).nonzero().flatten()
        if rollout.finished[i]:
            first = int(eos_positions[0])
            assert int(rollout.lengths[i]) == first + 1  # the EOS itself is a response token
            assert mask[: first + 1].all() and not mask[first + 1 :].any()
        else:
            assert len(eos_positions) == 0 and int(rollout.lengths[i]) == max_new
        assert "</s>" not in rollout.texts[i]
    torch.testing.assert_close(rollout.logprobs, expected, atol=1e-4, rtol=0)


def test_stop_string_ends_completion_and_text_keeps_it(llama, tok):
    prompts, max_new = encode(tok), 20
    greedy = SamplingParams(max_new_tokens=max_new, temperature=0)
    gen = HFGenerator(llama, tok)
    plain = gen.generate(prompts, 1, greedy)
    text0 = plain.texts[0]
    stop = text0[5:7]
    cut = text0.find(stop) + len(stop)
    assert 2 <= cut <= 7
    stopped = gen.generate(prompts, 1, SamplingParams(max_new_tokens=max_new, temperature=0, stop=[stop]))
    for i, text in enumerate(plain.texts):
        if stop in text:  # char tokenizer: one token per character
            end = text.find(stop) + len(stop)
            assert stopped.texts[i] == text[:end]
            assert bool(stopped.finished[i]) and int(stopped.lengths[i]) == end
            assert torch.equal(stopped.response_ids[i, :end], plain.response_ids[i, :end])
        else:
            assert stopped.texts[i] == text
            assert bool(stopped.finished[i]) == bool(plain.finished[i])
    assert stopped.finished[0]


def test_max_new_tokens_and_truncated_rows_not_finished(llama, tok):
    rollout = HFGenerator(llama, tok, eos_token_id=[]).generate(
        encode(tok), 2, SamplingParams(max_new_tokens=5, seed=0)
    )
    assert rollout.response_ids.shape == (8, 5)
    assert not rollout.finished.any()
    assert torch.equal(rollout.lengths, torch.full((8,), 5))


def test_same_seed_same_rollout_other_seed_differs(llama, tok):
    gen = HFGenerator(llama, tok)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=123)
    a, b = gen.generate(encode(tok), 3, params), gen.generate(encode(tok), 3, params)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.logprobs, b.logprobs) and a.texts == b.texts
    c = gen.generate(encode(tok), 3, SamplingParams(max_new_tokens=10, temperature=1.0, seed=124))
    assert c.texts != a.texts
    # seed=None continues the generator's own state: successive calls differ, a fresh generator repeats
    unseeded = SamplingParams(max_new_tokens=10)
    g1, g2 = HFGenerator(llama, tok, seed=7), HFGenerator(llama, tok, seed=7)
    first, second = g1.generate(encode(tok), 2, unseeded), g1.generate(encode(tok), 2, unseeded)
    assert first.texts != second.texts
    assert g2.generate(encode(tok), 2, unseeded).texts == first.texts


def test_top_k_1_and_tiny_top_p_equal_greedy(llama, tok):
    gen = HFGenerator(llama, tok)
    greedy = gen.generate(encode(tok), 2, SamplingParams(max_new_tokens=10, temperature=0))
    for params in (
        SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1, seed=3),
        SamplingParams(max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=4),
    ):
        sampled = gen.generate(encode(tok), 2, params)
        assert torch.equal(sampled.response_ids, greedy.response_ids)
        # both report temperature-1 log-probs of the full distribution
        torch.testing.assert_close(sampled.logprobs, greedy.logprobs, atol=1e-5, rtol=0)


def test_shapes_groups_prompt_index_and_texts(llama, tok):
    prompts, n = encode(tok), 3
    rollout = HFGenerator(llama, tok).generate(prompts, n, SamplingParams(max_new_tokens=7, seed=0))
    assert isinstance(HFGenerator(llama, tok), Generator)
    B, P = len(prompts) * n, max(len(p) for p in prompts)
    T = rollout.response_ids.shape[1]
    assert rollout.prompt_ids.shape == rollout.prompt_mask.shape == (B, P)
    assert rollout.response_ids.shape == rollout.response_mask.shape == rollout.logprobs.shape == (B, T)
    assert T == int(rollout.lengths.max()) <= 7
    assert rollout.sequences.shape == rollout.attention_mask.shape == (B, P + T)
    assert rollout.num_prompts == len(prompts) and rollout.group_size == n
    assert torch.equal(rollout.prompt_index, torch.arange(len(prompts)).repeat_interleave(n))
    for i in range(B):
        prompt = prompts[i // n]
        assert rollout.prompt_ids[i, P - len(prompt) :].tolist() == prompt
        assert (
            int(rollout.prompt_mask[i].sum()) == len(prompt)
            and rollout.prompt_mask[i, P - len(prompt) :].all()
        )
        real = rollout.response_ids[i][rollout.response_mask[i]].tolist()
        assert rollout.texts[i] == tok.decode(real, skip_special_tokens=True)
        assert (rollout.response_ids[i][~rollout.response_mask[i]] == tok.pad_token_id).all()
    assert rollout.texts[0] != rollout.texts[1]  # completions of one prompt are sampled independently


def test_batch_size_split_gives_same_greedy_output(llama, tok):
    params = SamplingParams(max_new_tokens=9, temperature=0)
    whole = HFGenerator(llama, tok).generate(encode(tok), 2, params)
    split = HFGenerator(llama, tok, batch_size=3).generate(encode(tok), 2, params)
    assert torch.equal(split.response_ids, whole.response_ids)
    assert torch.equal(split.prompt_ids, whole.prompt_ids)
    torch.testing.assert_close(split.logprobs, whole.logprobs, atol=1e-5, rtol=0)


def test_uses_live_weights_and_restores_train_mode(tok):
    model = scrambled_model(tok, "llama", seed=2)
    gen = HFGenerator(model, tok)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    model.train()
    before = gen.generate(encode(tok), 1, params)
    assert model.training
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)  # an in-place update, as an optimizer does
    model.eval()
    after = gen.generate(encode(tok), 1, params)
    assert not model.training
    assert after.texts != before.texts


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda g, p: g.generate([], 1, SamplingParams()), "prompts"),
        (lambda g, p: g.generate([p[0], []], 1, SamplingParams()), "prompts"),
        (lambda g, p: g.generate(p, 0, SamplingParams()), "n"),
        (lambda g, p: SamplingParams(temperature=-0.5), "temperature"),
        (lambda g, p: SamplingParams(top_p=0.0), "top_p"),
        (lambda g, p: SamplingParams(top_p=1.5), "top_p"),
        (lambda g, p: SamplingParams(top_k=-1), "top_k"),
        (lambda g, p: SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (lambda g, p: SamplingParams(stop="</a>"), "stop"),
        (lambda g, p: HFGenerator(g.model, g.tokenizer, batch_size=0), "batch_size"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(llama, tok, call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call(HFGenerator(llama, tok), encode(tok))


def test_params_mutated_after_construction_are_validated(llama, tok):
    params = SamplingParams()
    params.temperature = -1.0
    with pytest.raises(ValueError, match="^temperature:"):
        HFGenerator(llama, tok).generate(encode(tok), 1, params)


def test_truncate_top_k_and_top_p_by_hand():
    logp = torch.tensor([[0.5, 0.3, 0.2]]).log()
    keep = lambda k, p: torch.isfinite(_truncate(logp, k, p))[0].tolist()  # noqa: E731
    assert keep(0, 0.6) == [True, True, False]  # 0.5 < 0.6, so the second token is needed
    assert keep(0, 0.5) == [True, False, False]  # the first token already holds 0.5
    assert keep(0, 0.81) == [True, True, True]
    assert keep(2, 1.0) == [True, True, False]
    # top-p after top-k uses the renormalised top-2 mass: 0.5/0.8 = 0.625 >= 0.6
    assert keep(2, 0.6) == [True, False, False]


def test_sample_categorical_frequencies_and_zero_weights():
    """Drawn with the rows' own streams (`uniform`): 20,000 rows at step 0, then one row over 20,000 steps."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(20000, 4)
    across_rows = uniform(row_keys(0, torch.arange(20000)), torch.zeros(20000, dtype=torch.long))
    along_a_row = uniform(row_keys(1, torch.zeros(20000, dtype=torch.long)), torch.arange(20000))
    for u in (across_rows, along_a_row):
        draws = _sample_categorical(probs, u)
        freq = torch.bincount(draws, minlength=4).double() / draws.numel()
        assert freq[1] == 0
        torch.testing.assert_close(
            freq, torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64), atol=0.015, rtol=0
        )


def test_row_streams_are_uniform_and_independent_by_hand():
    """The counter-based stream: values in [0, 1) with the uniform's mean and variance, no correlation between
    neighbouring rows or steps, and a bijective mix (distinct keys never collide)."""
    keys = row_keys(3, torch.arange(500))
    u = uniform(keys[:, None].expand(500, 200), torch.arange(200)[None].expand(500, 200))  # [rows, steps]
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    for a, b in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:])):
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.01
    assert len(set(keys.tolist())) == 500 and not torch.equal(row_keys(3, torch.arange(5)), row_keys(4, torch.arange(5)))
    assert torch.equal(u[7, 9:10], uniform(keys[7:8], torch.tensor([9])))  # a row's number depends on it alone


def gqa_model(tok, arch: str):
    """A scrambled tiny model with grouped-query attention (4 query heads share each of 2 key/value heads)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(5)
    model = model_cls(config).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape) * 0.2)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_matches_generic_path(tok, arch, monkeypatch):
    """The engine's module-by-module step with shared-prompt attention equals its step through transformers' forward
    (`ModelStep`, every other model's): 40
    response tokens, grouped-query attention, at most 5 rows in a step with n 3 (groups split, rows joining as
    others leave) and rows leaving the batch (EOS made likely); each row samples the same tokens on both paths."""
    model = gqa_model(tok, arch)
    assert engine_supports(model)
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = 1.0
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    try:
        params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=11)
        lean = HFGenerator(model, tok, batch_size=5).generate(encode(tok), 3, params)
        expected = reference_logprobs(model, lean, 0.9)
        monkeypatch.setattr(engine_module, "llama_supports", lambda model: False)
        generic = HFGenerator(model, tok, batch_size=5).generate(encode(tok), 3, params)
    finally:
        handle.remove()
    lengths = lean.lengths
    assert lean.finished.any() and (~lean.finished).any() and int(lengths.max()) == 40
    assert torch.equal(lean.response_ids, generic.response_ids)
    torch.testing.assert_close(lean.logprobs, generic.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(lean.logprobs, expected, atol=1e-4, rtol=0)


def test_generic_path_greedy_matches_generate(llama, tok, monkeypatch):
    """Models the module-by-module step does not know step through transformers' forward (`ModelStep`)."""
    monkeypatch.setattr(engine_module, "llama_supports", lambda model: False)
    rollout = HFGenerator(llama, tok).generate(
        encode(tok), 2, SamplingParams(max_new_tokens=12, temperature=0)
    )
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = llama.generate(
            input_ids=enc.input_ids.repeat_interleave(2, 0),
            attention_mask=enc.attention_mask.repeat_interleave(2, 0),
            do_sample=False,
            max_new_tokens=12,
        )
    assert torch.equal(rollout.response_ids, out[:, enc.input_ids.shape[1] :])


def sliding_model(tok, kernel: str = "sdpa"):
    """A scrambled tiny Mistral with a sliding window of 4 tokens and grouped-query attention."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, sliding_window=4, pad_token_id=tok.pad_token_id,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, attn_implementation=kernel)
    torch.manual_seed(3)
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape) * 0.2)
        model.lm_head.weight[tok.eos_token_id] += 0.05 * model.lm_head.weight.mean(0)
    return model


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_a_sliding_window_model_samples_what_its_forward_scores(tok, kernel):
    """Mistral with a window of 4 tokens, 24 sampled through its own forward (`ModelStep`): rows of different ages
    share each step (batch_size 3, n 2: rows join as others end, EOS made likely), each row's window counted in its
    own tokens; the sampled log-probs equal a full forward's over the finished rows, which differ from those of the
    same weights without the window."""
    model = sliding_model(tok, kernel)
    generator = HFGenerator(model, tok, batch_size=3)
    assert generator.decode_path()[1].startswith("its own forward: the model has sliding-window layers")
    rollout = generator.generate(encode(tok), 2, SamplingParams(max_new_tokens=24, temperature=1.0, seed=4))
    assert int(rollout.lengths.max()) > 8 and len(set(rollout.lengths.tolist())) > 1
    torch.testing.assert_close(rollout.logprobs, reference_logprobs(model, rollout, 1.0), atol=1e-4, rtol=0)
    model.config.sliding_window = None  # the window mattered
    assert not torch.allclose(rollout.logprobs, reference_logprobs(model, rollout, 1.0), atol=1e-3)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_other_architectures_sample_what_their_forward_scores(tok, arch):
    """GPT-2 (learned positions) and GPT-NeoX (partial rotary) step through their own forward, rows joining and
    leaving: the sampled log-probs equal a full forward's."""
    model = other_model(tok, arch, seed=2)
    generator = HFGenerator(model, tok, batch_size=3)
    assert generator.decode_path()[1].startswith("its own forward:")
    rollout = generator.generate(encode(tok), 2, SamplingParams(max_new_tokens=20, temperature=1.0, seed=1))
    assert len(set(rollout.lengths.tolist())) > 1 or not rollout.finished.any()
    torch.testing.assert_close(rollout.logprobs, reference_logprobs(model, rollout, 1.0), atol=1e-4, rtol=0)


def test_greedy_gqa_long_response_matches_generate(tok):
    """70 tokens span three response blocks; EOS is suppressed so that every row runs to the end."""
    model = gqa_model(tok, "qwen2")
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = -1e4
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    try:
        rollout = HFGenerator(model, tok).generate(
            encode(tok), 2, SamplingParams(max_new_tokens=70, temperature=0)
        )
        enc = tok(TEXTS, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                input_ids=enc.input_ids.repeat_interleave(2, 0),
                attention_mask=enc.attention_mask.repeat_interleave(2, 0),
                do_sample=False,
                max_new_tokens=70,
            )
    finally:
        handle.remove()
    assert rollout.response_ids.shape == (8, 70) and not rollout.finished.any()
    assert torch.equal(rollout.response_ids, out[:, enc.input_ids.shape[1] :])


def test_engine_only_for_known_unhooked_models(tok):
    """Hooks on the decoder layers would be bypassed by the module-by-module decode: such models take the
    generic path (and so does any other architecture)."""
    llama = tiny_causal_lm(tok, "llama")
    assert engine_supports(llama) and engine_supports(
        tiny_causal_lm(tok, "qwen2")
    )
    handle = llama.model.layers[1].register_forward_hook(lambda module, inputs, output: output * 0.5)
    assert not engine_supports(llama)
    # the hooked model still generates what transformers generates
    rollout = HFGenerator(llama, tok).generate(
        encode(tok), 1, SamplingParams(max_new_tokens=6, temperature=0)
    )
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = llama.generate(**enc, do_sample=False, max_new_tokens=6)
    handle.remove()
    assert torch.equal(rollout.response_ids, out[:, enc.input_ids.shape[1] :])
    assert engine_supports(llama)
    assert not engine_supports(torch.nn.Linear(2, 2))


def test_hooked_projections_and_norms_are_called_not_fused(tok, monkeypatch):
    """The decoder concatenates q/k/v and gate/up weights and runs RMSNorm with torch's kernel, except
    where a module carries a hook (or is not a plain nn.Linear): there the module itself runs."""
    model = gqa_model(tok, "llama")
    layer = model.model.layers[0]
    handles = [layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: o * 1.5),
               layer.mlp.up_proj.register_forward_hook(lambda m, i, o: o * 0.5),
               layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: o * 2.0)]
    try:
        assert engine_supports(model)
        params = SamplingParams(max_new_tokens=12, temperature=0)
        lean = HFGenerator(model, tok).generate(encode(tok), 2, params)
        monkeypatch.setattr(engine_module, "llama_supports", lambda model: False)
        generic = HFGenerator(model, tok).generate(encode(tok), 2, params)
    finally:
        for h in handles:
            h.remove()
    unhooked = HFGenerator(model, tok).generate(encode(tok), 2, params)
    assert torch.equal(lean.response_ids, generic.response_ids)
    torch.testing.assert_close(lean.logprobs, generic.logprobs, atol=1e-5, rtol=0)
    assert not torch.allclose(lean.logprobs, unhooked.logprobs)  # the hooks changed something


@pytest.fixture
def packing(monkeypatch):
    """oneDNN-packed weights for every size (not only large ones) with the 2 threads packing needs."""
    monkeypatch.setattr(spd, "PACK_MIN_ELEMENTS", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("cpu, smallest", [("AVX2", 2**17), ("AVX512", 2**19), ("DEFAULT", 2**17)])
def test_packing_only_for_large_weights_on_several_threads(monkeypatch, cpu, smallest):
    """Where oneDNN measured slower than F.linear (small weights for the CPU, one thread), weights stay
    unpacked; `PACK_MIN_ELEMENTS` overrides the CPU's threshold."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: nothing is ever packed")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu)
    assert spd.pack_min_elements() == smallest
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _Linear.of(torch.nn.Linear(256, smallest // 256), rows=64).packed is not None
        assert _Linear.of(torch.nn.Linear(256, smallest // 256 - 1), rows=64).packed is None
        assert _Linear.of(torch.nn.Linear(256, smallest // 256).to(torch.float64), rows=64).packed is None
        monkeypatch.setattr(spd, "PACK_MIN_ELEMENTS", 2**10)
        assert _Linear.of(torch.nn.Linear(32, 32), rows=64).packed is not None
        torch.set_num_threads(1)
        assert _Linear.of(torch.nn.Linear(256, smallest // 256), rows=64).packed is None
    finally:
        torch.set_num_threads(threads)


def test_gate_and_up_too_small_to_pack_stay_unpacked_when_concatenated(monkeypatch):
    """gate / up below the threshold run as one concatenated matmul, never packed even when the
    concatenation reaches the threshold (no epilogue to fuse there: it measured slower); above it each
    is packed with its epilogue."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: nothing is ever packed")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=128))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(spd, "PACK_MIN_ELEMENTS", 64 * 256)  # the concatenation's size, twice gate's
        gated = spd.GatedMLP(mlp, rows=8)
        assert gated.gate.packed is None and gated.gate_up is not None and gated.gate_up.packed is None
        monkeypatch.setattr(spd, "PACK_MIN_ELEMENTS", 64 * 128)
        gated = spd.GatedMLP(mlp, rows=8)
        assert gated.gate.packed is not None and gated.gate_up is None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_fused_epilogues_equals_plain_ops(bias, monkeypatch, packing):
    """`_Linear`: x W^T + b, SiLU of it, plus or times another tensor, for every batch size (the weight
    layout is chosen for 8 rows), packed for oneDNN where torch has it and plain otherwise."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 48, bias=bias)
    w, b = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    for pack in (True, False):
        monkeypatch.setattr(spd, "PACK_WEIGHTS", pack)
        linear = _Linear.of(layer, rows=8)
        assert (linear.packed is not None) == (pack and torch.backends.mkldnn.is_available())
        for rows in (1, 5, 8, 13):
            x, other = torch.randn(rows, 32), torch.randn(rows, 48)
            with torch.inference_mode():
                y = torch.nn.functional.linear(x, w, b)
                close = dict(atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(linear(x), y, **close)
                torch.testing.assert_close(linear(x, act=torch.nn.SiLU()), torch.nn.functional.silu(y), **close)
                torch.testing.assert_close(linear(x, add=other), y + other, **close)
                torch.testing.assert_close(linear(x, mul=other), y * other, **close)
                torch.testing.assert_close(linear(x, act=torch.nn.GELU(), mul=other), torch.nn.functional.gelu(y) * other, **close)


def test_linear_concat_and_modules_called_as_is():
    """q / k / v concatenated into one `_Linear`; a hooked module is not concatenated and runs itself."""
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(16, n) for n in (16, 8, 8))
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(_Linear.concat([q, k, v], rows=3)(x), torch.cat([q(x), k(x), v(x)], -1), atol=1e-5, rtol=1e-5)
    assert _Linear.concat([q, torch.nn.Linear(16, 8, bias=False), v], rows=3) is None  # only some have a bias
    handle = k.register_forward_hook(lambda m, i, o: o * 2)
    try:
        assert _Linear.concat([q, k, v], rows=3) is None
        with torch.inference_mode():
            expected = 2 * torch.nn.functional.linear(x, k.weight, k.bias) + x[:, :8]
            torch.testing.assert_close(_Linear.of(k, rows=3)(x, add=x[:, :8]), expected)
    finally:
        handle.remove()


def test_packed_weights_sample_what_plain_matmuls_sample(tok, monkeypatch, packing):
    """The oneDNN-packed decode samples the same tokens as plain matmuls (the log-probs differ by rounding)."""
    model = gqa_model(tok, "qwen2")  # q / k / v with biases
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3)
    packed = HFGenerator(model, tok).generate(encode(tok), 4, params)
    assert not torch.backends.mkldnn.is_available() or _onednn_weight(model.lm_head.weight.detach(), 8) is not None
    monkeypatch.setattr(spd, "PACK_WEIGHTS", False)
    plain = HFGenerator(model, tok).generate(encode(tok), 4, params)
    assert torch.equal(packed.response_ids, plain.response_ids)
    torch.testing.assert_close(packed.logprobs, plain.logprobs, atol=1e-5, rtol=0)


def test_cache_keyword_follows_the_models_forward():
    """The KV cache goes in as `cache` where transformers renamed the argument, as `past_key_values` before,
    and a peft-style wrapper is looked through to its base model."""

    class Renamed(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class Wrapper(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs): ...

    assert cache_keyword(Renamed()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(Wrapper(Renamed())) == "cache"
    assert cache_keyword(Wrapper(Old())) == "past_key_values"


def test_the_decode_cache_is_freed_when_a_rollout_returns(llama, tok, monkeypatch):
    """The engine and its KV cache live only while `generate` samples: the update that follows has their memory."""
    import weakref

    import lmrl.rollout.hf as hf

    made = []

    class Recorded(hf.DecodeEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(hf, "DecodeEngine", Recorded)
    rollout = HFGenerator(llama, tok).generate(encode(tok), 2, SamplingParams(max_new_tokens=4, seed=0))
    assert len(made) == 1 and rollout.response_ids.shape[0] == 2 * len(TEXTS)
    assert made[0]() is None


def test_stream_samples_each_group_as_generate_does_and_hands_it_back_the_step_it_ends(llama, tok):
    """`HFGenerator.stream` (bounded staleness): prompts join a running decode as rows end, each group comes back the
    step its last row ends, and a group samples what `generate` samples for its prompt with its seed, whatever ran
    beside it."""
    prompts, n, seeds = encode(tok, TEXTS * 3), 2, list(range(100, 112))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop=["e", "a", "o", "t", " "])
    gen = HFGenerator(llama, tok)
    queue, given = list(range(len(prompts))), []

    def take():
        return (i := queue.pop(0), prompts[i], seeds[i]) if queue else None

    gen.stream(take, n, params, rows=4, give=lambda owner, r: given.append((owner, r)))
    assert sorted(owner for owner, _ in given) == list(range(len(prompts)))  # every prompt once
    assert [owner for owner, _ in given] != sorted(owner for owner, _ in given)  # short groups overtook long ones
    for owner, r in given:
        alone = gen.generate([prompts[owner]], n, SamplingParams(**{**vars(params), "seed": seeds[owner]}))
        assert r.texts == alone.texts and torch.equal(r.response_ids, alone.response_ids), owner
        torch.testing.assert_close(r.logprobs, alone.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(r.finished, alone.finished) and r.prompt_index.tolist() == [0] * n


def swap_at(call: int, model, new, version: int):
    """`stream`'s swap for a test: at its `call`-th asking, load `new`'s weights into `model` in place (as a generator
    process loads published ones) as `version`."""
    calls = [0]

    def swap():
        calls[0] += 1
        if calls[0] != call:
            return None

        def load():
            model.load_state_dict(new.state_dict())
            return version
        return load
    return swap


def test_a_partial_rollout_takes_new_weights_at_the_next_token_each_token_keeping_its_version_and_log_prob(llama, tok):
    """`stream` with `swap` (rollout.partial): after a few steps the rows in flight take other weights; each token's
    log-prob is the one the weights that sampled it give (checked by full forwards of both models), its version says
    which, and stop strings still end a row where they complete, the swap in the middle of one or not."""
    old, new = copy.deepcopy(llama), scrambled_model(tok, "llama", seed=5)
    model = copy.deepcopy(old)
    gen = HFGenerator(model, tok)
    stops = ["e", "o", "t"]  # none in the special tokens' texts (<pad> <s> </s>), which the stop checker decodes
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop=stops)
    prompts, given = encode(tok, TEXTS * 2), []
    queue = list(range(len(prompts)))
    gen.stream(lambda: (i := queue.pop(0), prompts[i], 50 + i) if queue else None, 3, params, rows=24,
               give=lambda owner, r: given.append((owner, r)), version=6, swap=swap_at(4, model, new, 7))
    assert sorted(o for o, _ in given) == list(range(len(prompts)))
    mixed = 0
    for _, r in given:
        lengths = r.lengths.tolist()
        for i, n in enumerate(lengths):
            v = r.versions[i, :n].tolist()
            assert v == sorted(v) and set(v) <= {6, 7} and (r.versions[i, n:] == -1).all()
            mixed += len(set(v)) == 2
            if r.finished[i]:
                assert any(r.texts[i].endswith(s) for s in stops) or r.response_ids[i, n - 1] == tok.eos_token_id, r.texts[i]
            assert not any(s in r.texts[i][:-1] for s in stops)  # no stop string before the row's end
        for weights, version in ((old, 6), (new, 7)):
            mine = r.versions == version
            torch.testing.assert_close(r.logprobs[mine], reference_logprobs(weights, r, 1.0)[mine], atol=1e-4, rtol=0)
    assert mixed > 0  # some rows ran under both


def test_a_row_kept_across_several_swaps_gives_each_token_the_version_that_sampled_it():
    """`_Partial.extended` with the (tokens, version) of each swap that kept the cache: the spans in order, then the
    version at the row's end; a row that ended before a later swap's mark takes that swap's version after the earlier."""
    from lmrl.engine import Ended
    from lmrl.rollout.hf import _Partial

    ended = Ended("row", list(range(7)), [0.0] * 7, True, 7)
    assert _Partial().extended(ended, 8, [(3, 6), (5, 7)]).versions == [6, 6, 6, 7, 7, 8, 8]
    short = Ended("row", list(range(4)), [0.0] * 4, True, 4)
    assert _Partial().extended(short, 8, [(3, 6), (5, 7)]).versions == [6, 6, 6, 7]
    assert _Partial().extended(short, 8).versions == [8] * 4


def kept_cache_logprobs(old, new, prompt: list[int], tokens: list[int], first: int) -> torch.Tensor:
    """Log-probs of `tokens` after `prompt` where the first `first` were sampled by `old` and the rest by `new` over
    the keys and values `old` computed for everything before the swap (transformers' own cache, filled by one model
    and continued by the other): the token that ends the old part is fed through `new`."""
    with torch.no_grad():
        if first == 0:
            logits = new(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        else:
            before = old(input_ids=torch.tensor([prompt + tokens[: first - 1]]), use_cache=True)
            logits = before.logits[0, len(prompt) - 1:]
            if first < len(tokens):
                after = new(input_ids=torch.tensor([tokens[first - 1: -1]]), past_key_values=before.past_key_values,
                            use_cache=True)
                logits = torch.cat([logits, after.logits[0]])
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # module by module (q / k / v concatenated again), own forward
def test_a_partial_rollout_that_keeps_the_cache_goes_on_from_the_keys_the_old_weights_computed(tok, arch):
    """`stream(keep_cache=True)` (rollout.partial=keep_cache): the rows stay in the engine when the weights change;
    each token's version says which weights sampled it, and its log-prob is the one those weights give over keys and
    values the old weights computed for the tokens before the swap, checked against transformers' own cache filled by
    the old model and continued by the new."""
    build = scrambled_model if arch == "llama" else other_model
    old, new = build(tok, arch, seed=1), build(tok, arch, seed=5)
    model = copy.deepcopy(old)
    gen = HFGenerator(model, tok)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop=["e", "o", "t"])
    prompts, given = encode(tok, TEXTS * 2), []
    queue = list(range(len(prompts)))
    gen.stream(lambda: (i := queue.pop(0), prompts[i], 50 + i) if queue else None, 3, params, rows=24,
               give=lambda owner, r: given.append((owner, r)), version=6, swap=swap_at(4, model, new, 7),
               keep_cache=True)
    assert sorted(o for o, _ in given) == list(range(len(prompts)))
    mixed = 0
    for _, r in given:
        for i, n in enumerate(r.lengths.tolist()):
            versions = r.versions[i, :n].tolist()
            first = versions.count(6)
            assert versions == [6] * first + [7] * (n - first) and (r.versions[i, n:] == -1).all()
            mixed += 0 < first < n
            prompt, tokens = r.prompt_ids[i][r.prompt_mask[i]].tolist(), r.response_ids[i, :n].tolist()
            torch.testing.assert_close(r.logprobs[i, :n], kept_cache_logprobs(old, new, prompt, tokens, first),
                                       atol=1e-4, rtol=0)
    assert mixed > 0  # some rows ran under both
