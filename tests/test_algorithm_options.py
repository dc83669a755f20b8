"""Every algorithm option issue 19 added, chosen by config, trains a tiny model end to end."""

from __future__ import annotations

import math

import pytest
import torch

from lmrl.config import load_config
from lmrl.errors import ConfigError
from tests.test_trainer import make_trainer

OPTIONS = [
    ["algorithm.advantage=grpo_batch_std"],
    ["algorithm=rloo", "algorithm.kl_clamp=verl", "algorithm.kl_estimator=k3"],
    ["algorithm.kl_coef=0.05", "algorithm.kl_clamp=openrlhf", "algorithm.kl_estimator=k3+"],
    ["algorithm=reinforce_pp", "algorithm.whiten_std=population"],
    ["algorithm=rloo", "algorithm.ratio_level=sequence-sum", "algorithm.aggregation=seq-mean-token-sum",
     "algorithm.num_iterations=2"],
    ["algorithm.advantage=pass_at_k", "algorithm.pass_k=2"],
    ["algorithm.tis_cap=2.0", "algorithm.tis_mode=icepop"],
    ["algorithm.tis_cap=2.0", "algorithm.tis_mode=sequence-mask", "algorithm.num_iterations=2"],
    ["algorithm=clip_cov", "algorithm.clip_cov_fraction=0.05", "algorithm.clip_cov_bounds=[0.0, 100.0]",
     "algorithm.num_minibatches=2"],
    ["algorithm=kl_cov", "algorithm.kl_cov_fraction=0.1", "algorithm.num_iterations=2"],
    ["algorithm=sapo", "algorithm.num_iterations=2"],
    ["algorithm=gmpo", "algorithm.num_iterations=2"],
]


@pytest.mark.parametrize("overrides", OPTIONS, ids=lambda o: " ".join(o))
def test_option_trains_end_to_end(tmp_path, overrides):
    trainer = make_trainer(tmp_path, *overrides, "train.steps=1")
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    history = trainer.train().history
    assert all(math.isfinite(v) for k, v in history[-1].items() if k.startswith(("loss/", "policy/")))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters())), "no weight changed"


@pytest.mark.parametrize("override, key", [
    ("algorithm.kl_clamp=trl", "algorithm.kl_clamp"),
    ("algorithm.whiten_std=sample", "algorithm.whiten_std"),
    ("algorithm.ratio_level=seq", "algorithm.ratio_level"),
    ("algorithm.pass_k=9", "algorithm.pass_k"),
    ("algorithm.clip_cov_bounds=[5, 1]", "algorithm.clip_cov_bounds"),
    ("algorithm.tis_low=1.5", "algorithm.tis_low"),
    ("algorithm.tau_neg=0", "algorithm.tau_neg"),
])
def test_bad_option_values_name_the_field(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override, "algorithm.advantage=pass_at_k", "rollout.group_size=8"])


def test_remax_baseline_is_the_greedy_completions_reward(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm=remax")
    c = trainer.collect(1)
    assert c.baseline.shape == (4,)  # one greedy completion per prompt
    exp = trainer.experience(c)
    want = c.scores - c.baseline.repeat_interleave(4)
    torch.testing.assert_close(exp.advantages[:, 0], torch.where(exp.response_mask[:, 0], want.float(), 0.0))
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_config(None, ["algorithm=remax", "algorithm.dynamic_sampling=true"])


KNOBS = [
    (["algorithm.relu_log_p_weights=true"], "val/relu_zeroed_frac"),
    (["algorithm.use_advantages=false", "algorithm.relu_log_p_weights=true"], "policy/logprob_positive_weights"),
    (["algorithm.reward_minus_kl_coef=0.1"], "objective/reward_minus_kl"),
    (["algorithm.clip_filter_like_weight=3.0"], "val/clip_filter_weight_mean"),
    (["algorithm.loss=cpgd", "algorithm.num_iterations=2"], "policy/clipfrac_avg"),
]


@pytest.mark.parametrize("overrides, metric", KNOBS, ids=lambda o: " ".join(o) if isinstance(o, list) else o)
def test_seed_knob_trains_and_logs_its_metric(tmp_path, overrides, metric):
    trainer = make_trainer(tmp_path, *overrides, "train.steps=1")
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    history = trainer.train().history
    assert all(metric in h and math.isfinite(h[metric]) for h in history)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters())), "no weight changed"
    if overrides[0].startswith("algorithm.relu"):
        assert 0 < max(h[metric] for h in history) < 1  # some negative weights were zeroed, not all tokens
    if "reward_minus_kl" in metric:
        assert trainer.models.reference is not None  # the KL needs the reference


def _bytes_held(*modules) -> int:
    """Bytes of the distinct parameter and buffer storages the modules hold together."""
    seen = {}
    for m in modules:
        if m is None:
            continue
        for t in [*m.parameters(), *m.buffers()]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_lora_reference_is_the_base_with_adapters_disabled(tmp_path):
    import copy

    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0)
    base_bytes = _bytes_held(model)
    separate = copy.deepcopy(model).eval()  # what the reference used to be: a second copy of the weights
    lora = '{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}'
    trainer = make_trainer(tmp_path, f"model.lora={lora}", "algorithm.kl_coef=0.1", "optim.lr=5e-2", model=model)
    assert trainer.models.reference is None and trainer.models.has_reference
    held = _bytes_held(trainer.models.policy, trainer.models.reference)
    assert held < 1.1 * base_bytes  # the base once, plus the small adapters
    full = make_trainer(tmp_path / "full", "algorithm.kl_coef=0.1", model=tiny_causal_lm(tok, hidden_size=32, num_layers=1))
    assert _bytes_held(full.models.policy, full.models.reference) > 1.9 * base_bytes  # a copy without LoRA
    # train_step, not train(): the final save merges the adapters into the base (a plain transformers model)
    kls = [trainer.train_step(step)["objective/kl"] for step in (1, 2, 3)]
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] != 0.0  # the adapters moved the policy from its base

    exp_rows = [{"prompt": "3+4="}, {"prompt": "12+9="}]
    rollout, _ = trainer.generate_and_score([{**r, "kind": "digits"} for r in exp_rows], 4, seed=1)
    seqs, attn, T = rollout.sequences, rollout.attention_mask, rollout.response_ids.shape[1]
    ref = trainer.forwards.reference(seqs, attn, T)
    with torch.no_grad():
        want = model_forward_logprobs(separate.to(seqs.device), seqs, attn, T, 1.0, share_prompt=False)
        policy = model_forward_logprobs(trainer.policy, seqs, attn, T, 1.0, share_prompt=False)
    mask = rollout.response_mask
    torch.testing.assert_close(ref[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert (policy[mask] - want[mask]).abs().max() > 1e-3  # with the adapters on, the policy differs
    assert trainer.policy.training  # the reference forward leaves the policy in train mode
