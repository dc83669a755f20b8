"""Tests of lmrl.algorithms.losses and .aggregation: hand-computed cases, gradients, invariants, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.algorithms.aggregation import AGGREGATION_MODES, aggregate_loss, loss_normalizer
from lmrl.algorithms.importance import truncated_is_weights
from lmrl.algorithms.losses import cispo_loss, explained_variance, policy_loss, value_loss

F64 = torch.float64


def _t(rows, dtype=F64, requires_grad=False):
    return torch.tensor(rows, dtype=dtype, requires_grad=requires_grad)


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def _logp_with_ratios(ratios, dtype=F64):
    """(logp leaf, old_logp) such that exp(logp - old_logp) == ratios."""
    old = torch.full_like(_t(ratios, dtype), -1.0)
    logp = (old + torch.log(_t(ratios, dtype))).detach().requires_grad_(True)
    return logp, old


# ---------------------------------------------------------------------------------------------------
# aggregate_loss

# 2x3 with a ragged mask; padding holds inf / nan to show it never matters.
LOSS_2x3 = [[1.0, 2.0, math.inf], [4.0, math.nan, -math.inf]]
MASK_2x3 = [[1, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("token-sum", 7.0),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-sum-norm", 7 / (2 * 4)),
    ],
)
def test_aggregate_loss_hand_computed(mode, expected):
    loss = aggregate_loss(_t(LOSS_2x3), torch.tensor(MASK_2x3), mode, norm_length=4)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_aggregate_loss_gradient_of_token_mean_is_mask_over_count():
    x = _t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    g = _grad(aggregate_loss(x, torch.tensor(MASK_2x3)), x)
    assert torch.equal(g, _t(MASK_2x3) / 3)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 3.0),
        ("token-sum", 1.0),
        ("seq-mean-token-mean", 2.0),
        ("seq-mean-token-sum", 2.0),
        ("seq-mean-token-sum-norm", 8.0),
    ],
)
def test_loss_normalizer(mode, expected):
    assert loss_normalizer(torch.tensor(MASK_2x3), mode, norm_length=4).item() == expected


def test_loss_normalizer_empty_mask_is_one_for_token_mean():
    assert loss_normalizer(torch.zeros(2, 3, dtype=torch.bool)).item() == 1.0
    assert aggregate_loss(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_aggregate_loss_normalizer_overrides_batch_normaliser():
    loss = aggregate_loss(_t(LOSS_2x3), torch.tensor(MASK_2x3), "token-mean", normalizer=14.0)
    assert loss.item() == pytest.approx(7 / 14, abs=1e-12)


# ---------------------------------------------------------------------------------------------------
# policy_loss: hand-computed cases


def test_policy_loss_on_policy_ratio_is_one():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 4, generator=gen).requires_grad_(True)
    adv = torch.randn(3, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss, m = policy_loss(logp, logp.detach(), adv, mask, ref_logp=logp.detach() + 0.0, kl_coef=0.1)
    assert m.clipfrac == 0.0 and m.clipfrac_low == 0.0 and m.clipfrac_high == 0.0
    assert m.approx_kl == 0.0
    assert m.ratio_mean == 1.0 and m.ratio_max == 1.0
    assert m.kl == 0.0
    expected = -(adv[:, None].expand(3, 4)[mask.bool()]).mean()  # ρ = 1: loss = -mean A over tokens
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert isinstance(m.clipfrac, float) and isinstance(m.approx_kl, float)


def test_policy_loss_clipping_on_each_side_by_hand():
    # ρ = 1.5, A = 1: clipped high (-1.2);  ρ = 0.5, A = -1: clipped low (0.8);
    # ρ = 1.1, A = -1: inside (1.1);        ρ = 0.7, A = 2: below range but A > 0, unclipped (-1.4).
    logp, old = _logp_with_ratios([[1.5, 0.5, 1.1, 0.7]])
    adv = _t([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.1 - 1.4) / 4, abs=1e-12)
    assert m.clipfrac == pytest.approx(0.5)
    assert m.clipfrac_low == pytest.approx(0.25) and m.clipfrac_high == pytest.approx(0.25)
    assert m.ratio_mean == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    assert m.ratio_max == pytest.approx(1.5)
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.7)]
    assert m.approx_kl == pytest.approx(sum(k3) / 4, rel=1e-9)
    assert m.kl is None and m.dual_clipfrac == 0.0
    # d loss / d logp = -A ρ / N where unclipped, 0 where the clipped branch is taken.
    g = _grad(loss, logp)
    assert torch.allclose(g, _t([[0.0, 0.0, 1.1 / 4, -2 * 0.7 / 4]]), atol=1e-12)


def test_policy_loss_clip_higher_asymmetry():
    logp, old = _logp_with_ratios([[1.25, 0.75]])
    adv = _t([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    sym, m_sym = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    dapo, m_dapo = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert sym.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-12)
    assert dapo.item() == pytest.approx((-1.25 + 0.8) / 2, abs=1e-12)  # 1.25 < 1.28: not clipped
    assert (m_sym.clipfrac_high, m_sym.clipfrac_low) == (0.5, 0.5)
    assert (m_dapo.clipfrac_high, m_dapo.clipfrac_low) == (0.0, 0.5)
    assert torch.allclose(_grad(dapo, logp), _t([[-1.25 / 2, 0.0]]), atol=1e-12)


def test_policy_loss_one_sided_clip():
    logp, old = _logp_with_ratios([[3.0, 0.1]])
    adv = _t([[1.0, -1.0]])
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 2), clip_low=None, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.1) / 2, abs=1e-12)  # no lower bound: 0.1 stays
    assert (m.clipfrac_high, m.clipfrac_low) == (0.5, 0.0)


def test_policy_loss_dual_clip_by_hand():
    # A < 0, ρ = 5: PPO gives 5, dual clip c = 3 caps it at 3 |A| = 3 (no gradient);
    # A < 0, ρ = 2: 2 < 3, unchanged, gradient -A ρ / N; A > 0, ρ = 5: PPO clip gives -1.2.
    logp, old = _logp_with_ratios([[5.0, 2.0, 5.0]])
    adv = _t([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-12)
    assert m.dual_clipfrac == pytest.approx(1 / 3)
    assert m.clipfrac_high == pytest.approx(1 / 3) and m.clipfrac_low == 0.0
    assert torch.allclose(_grad(loss, logp), _t([[0.0, 2.0 / 3, 0.0]]), atol=1e-12)
    plain, _ = policy_loss(logp, old, adv, mask)
    assert plain.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3, abs=1e-12)


def test_policy_loss_kl_term_by_hand():
    # ρ = 1 and A = 0, so the loss is kl_coef * mean KL; d/dlogp of k3 = 1 - exp(ref - logp).
    logp = _t([[-1.0, -2.0]], requires_grad=True)
    ref = _t([[-1.5, -1.0]])
    d = ref - logp.detach()
    k3 = torch.exp(d) - d - 1
    for estimator, per_token in [("k1", -d), ("k2", 0.5 * d**2), ("k3", k3)]:
        loss, m = policy_loss(
            logp,
            logp.detach(),
            _t([0.0]),
            torch.ones(1, 2),
            ref_logp=ref,
            kl_coef=0.5,
            kl_estimator=estimator,
        )
        assert loss.item() == pytest.approx(0.5 * per_token.mean().item(), abs=1e-12)
        assert m.kl == pytest.approx(per_token.mean().item(), abs=1e-12)
    loss, _ = policy_loss(logp, logp.detach(), _t([0.0]), torch.ones(1, 2), ref_logp=ref, kl_coef=0.5)
    assert torch.allclose(_grad(loss, logp), 0.5 * (1 - torch.exp(d)) / 2, atol=1e-12)


def test_policy_loss_identical_reference_changes_nothing():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(2, 5, generator=gen, dtype=F64, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(2, 5, generator=gen, dtype=F64)
    adv = torch.randn(2, generator=gen, dtype=F64)
    mask = torch.ones(2, 5)
    base, _ = policy_loss(logp, old, adv, mask)
    with_ref, m = policy_loss(logp, old, adv, mask, ref_logp=logp.detach(), kl_coef=0.3)
    assert m.kl == 0.0
    assert with_ref.item() == pytest.approx(base.item(), abs=1e-12)
    assert torch.allclose(_grad(with_ref, logp), _grad(base, logp), atol=1e-12)


def test_metrics_are_a_record_and_a_mapping():
    logp = torch.zeros(1, 2)
    _, m = policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2))
    keys = {
        "clipfrac",
        "clipfrac_low",
        "clipfrac_high",
        "dual_clipfrac",
        "approx_kl",
        "ratio_mean",
        "ratio_max",
    }
    assert set(m) == keys and "kl" not in m  # no reference, no kl entry
    assert m["ratio_mean"] == m.ratio_mean == 1.0 and dict(m) == m.to_dict()
    _, m_ref = policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), ref_logp=logp)
    assert m_ref["kl"] == 0.0 and set(m_ref) == keys | {"kl"}
    _, vm = value_loss(logp, logp, logp + 1, torch.ones(1, 2))
    assert dict(vm) == {"vf_clipfrac": 0.0, "value_mean": 0.0}


# ---------------------------------------------------------------------------------------------------
# policy_loss against DI-engine's GRPO formula (seed 002), re-derived here element by element


def _grpo_reference(new_lp, old_lp, ref_lp, adv, mask, eps, beta):
    """GRPO loss written from the formula: per sequence, the mean over its real tokens of
    -min(ρA, clip(ρ, 1-ε, 1+ε)A) + β(exp(ref - new) - (ref - new) - 1); then the mean over sequences."""
    seq_losses = []
    for i in range(new_lp.shape[0]):
        terms = []
        for t in range(new_lp.shape[1]):
            if not mask[i, t]:
                continue
            rho = torch.exp(new_lp[i, t] - old_lp[i, t])
            rho_clipped = torch.clamp(rho, 1 - eps, 1 + eps)
            surrogate = torch.minimum(rho * adv[i], rho_clipped * adv[i])
            diff = ref_lp[i, t] - new_lp[i, t]
            terms.append(-surrogate + beta * (torch.exp(diff) - diff - 1))
        seq_losses.append(torch.stack(terms).sum() / len(terms))
    return torch.stack(seq_losses).mean()


def test_policy_loss_matches_grpo_formula_from_logits():
    gen = torch.Generator().manual_seed(2)
    B, S, V = 2, 5, 7
    logits_new = torch.randn(B, S, V, generator=gen, dtype=F64, requires_grad=True)
    logits_old = logits_new.detach() + 0.4 * torch.randn(B, S, V, generator=gen, dtype=F64)
    logits_ref = logits_new.detach() + 0.4 * torch.randn(B, S, V, generator=gen, dtype=F64)
    actions = torch.randint(0, V, (B, S), generator=gen)
    adv = torch.tensor([0.8, -1.3], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    beta, eps = 0.1, 0.2

    def gather(logits):
        return torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    new_lp, old_lp, ref_lp = gather(logits_new), gather(logits_old), gather(logits_ref)
    ours, m = policy_loss(
        new_lp,
        old_lp,
        adv,
        mask,
        clip_low=eps,
        clip_high=eps,
        ref_logp=ref_lp,
        kl_coef=beta,
        kl_estimator="k3",
        aggregation="seq-mean-token-mean",
    )
    ref = _grpo_reference(new_lp, old_lp, ref_lp, adv, mask, eps, beta)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-12)
    (g_ours,) = torch.autograd.grad(ours, logits_new, retain_graph=True)  # the log-softmax graph is shared
    assert torch.allclose(g_ours, _grad(ref, logits_new), atol=1e-12)
    ratios = torch.exp(new_lp - old_lp).detach()[mask.bool()]
    assert m.ratio_mean == pytest.approx(ratios.mean().item(), abs=1e-6)
    assert 0 < m.clipfrac < 1  # the case exercises both branches


# ---------------------------------------------------------------------------------------------------
# gradients: REINFORCE, GSPO, CISPO


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_no_clip_is_reinforce(mode):
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(3, 4, generator=gen, dtype=F64, requires_grad=True)
    adv = torch.randn(3, 4, generator=gen, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    loss, m = policy_loss(
        logp, logp.detach(), adv, mask, clip_low=None, clip_high=None, aggregation=mode, norm_length=4
    )
    reinforce = aggregate_loss(-adv * logp, mask, mode, norm_length=4)
    assert torch.allclose(_grad(loss, logp), _grad(reinforce, logp), atol=1e-12)
    assert m.clipfrac == 0.0


def test_gspo_matches_sequence_level_objective():
    # Sequence 0 stays inside the tiny clip range, 1 is clipped (A > 0, s > 1 + ε), 2 is outside
    # the range with A < 0 (unclipped); all three with ragged lengths and per-token noise.
    gen = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    seq_shift = torch.tensor([1e-4, 0.01, 0.01], dtype=F64)
    noise = 0.05 * torch.randn(3, 4, generator=gen, dtype=F64)
    noise = noise - (noise * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)  # zero masked mean
    logp = torch.randn(3, 4, generator=gen, dtype=F64, requires_grad=True)
    old = logp.detach() - seq_shift[:, None] - noise
    adv = torch.tensor([0.7, 1.2, -0.9], dtype=F64)
    lo, hi = 3e-4, 4e-4

    loss, m = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=lo,
        clip_high=hi,
        ratio_level="sequence",
        aggregation="seq-mean-token-mean",
    )
    # GSPO (Zheng et al. 2025, eq. 5-7) written directly on sequences.
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    objective = torch.minimum(s * adv, torch.clamp(s, 1 - lo, 1 + hi) * adv).mean()
    assert loss.item() == pytest.approx(-objective.item(), abs=1e-12)
    g, g_ref = _grad(loss, logp), _grad(-objective, logp)
    assert torch.allclose(g, g_ref, atol=1e-12)
    assert g[1].abs().sum() == 0 and g[0].abs().sum() > 0 and g[2].abs().sum() > 0
    assert m.clipfrac_high == pytest.approx(4 / 9) and m.clipfrac_low == 0.0
    assert m.ratio_max == pytest.approx(s.max().item(), rel=1e-12)


def test_cispo_gradient_is_clipped_weight_times_advantage():
    logp, old = _logp_with_ratios([[0.3, 1.0, 2.0, 6.0]])
    adv = _t([[1.0, -2.0, 0.5, 1.5]])
    mask = torch.ones(1, 4)
    loss, m = cispo_loss(logp, old, adv, mask, clip_high=3.0)
    w = torch.tensor([[0.3, 1.0, 2.0, 4.0]], dtype=F64)  # no lower bound, cap 1 + 3 = 4
    assert loss.item() == pytest.approx((-w * adv * logp.detach()).mean().item(), abs=1e-12)
    assert torch.allclose(_grad(loss, logp), -w * adv / 4, atol=1e-12)
    assert m.clipfrac == pytest.approx(0.25) and m.clipfrac_high == pytest.approx(0.25)

    loss_low, m_low = cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    w_low = torch.tensor([[0.8, 1.0, 1.2, 1.2]], dtype=F64)
    assert torch.allclose(_grad(loss_low, logp), -w_low * adv / 4, atol=1e-12)
    assert (m_low.clipfrac_low, m_low.clipfrac_high) == (0.25, 0.5)


def test_cispo_on_policy_metrics_and_kl():
    logp = _t([[-1.0, -2.0, -0.5]], requires_grad=True)
    loss, m = cispo_loss(
        logp, logp.detach(), _t([1.0]), torch.ones(1, 3), ref_logp=logp.detach(), kl_coef=0.2
    )
    assert (m.clipfrac, m.approx_kl, m.ratio_mean, m.kl) == (0.0, 0.0, 1.0, 0.0)
    assert torch.allclose(_grad(loss, logp), torch.full((1, 3), -1 / 3, dtype=F64), atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# properties: padding, weights, dtype


def _random_batch(seed, B=4, T=6, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[0] = T  # at least one real token
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(B, T, generator=gen, dtype=dtype) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=dtype)
    ref = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=dtype)
    adv = torch.randn(B, T, generator=gen, dtype=dtype)
    weights = torch.rand(B, T, generator=gen, dtype=dtype) * 2
    return logp, old, ref, adv, weights, mask


def _with_garbage(x, mask, seed):
    gen = torch.Generator().manual_seed(seed)
    junk = torch.tensor([math.inf, -math.inf, math.nan, 1e30], dtype=x.dtype)
    picks = junk[torch.randint(0, 4, x.shape, generator=gen)]
    return torch.where(mask, x, picks)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(AGGREGATION_MODES),
    loss_name=st.sampled_from(["ppo", "ppo-dual", "gspo", "cispo"]),
)
def test_padding_garbage_never_changes_loss_or_gradient(seed, mode, loss_name):
    logp, old, ref, adv, weights, mask = _random_batch(seed)
    kwargs = dict(ref_logp=ref, kl_coef=0.1, aggregation=mode, norm_length=6, weights=weights)
    if loss_name == "ppo-dual":
        kwargs["dual_clip"] = 3.0
    if loss_name == "gspo":
        kwargs["ratio_level"] = "sequence"
    fn = cispo_loss if loss_name == "cispo" else policy_loss

    clean = logp.clone().requires_grad_(True)
    loss_clean, m_clean = fn(clean, old, adv, mask, **kwargs)
    dirty = _with_garbage(logp, mask, seed + 1).requires_grad_(True)
    garbage_kwargs = dict(
        kwargs, ref_logp=_with_garbage(ref, mask, seed + 2), weights=_with_garbage(weights, mask, seed + 3)
    )
    dirty_old, dirty_adv = _with_garbage(old, mask, seed + 4), _with_garbage(adv, mask, seed + 5)
    snapshot = dirty.detach().clone()
    loss_dirty, m_dirty = fn(dirty, dirty_old, dirty_adv, mask, **garbage_kwargs)

    assert torch.isfinite(loss_clean) and loss_dirty.item() == loss_clean.item()
    g_clean, g_dirty = _grad(loss_clean, clean), _grad(loss_dirty, dirty)
    assert torch.equal(g_dirty, g_clean)
    assert torch.all(g_dirty[~mask] == 0)
    assert m_dirty == m_clean
    assert torch.equal(dirty.detach().isnan(), snapshot.isnan())  # inputs are not modified in place


def test_value_loss_and_aggregate_ignore_padding_garbage():
    logp, old, ref, _, _, mask = _random_batch(7)
    for mode in AGGREGATION_MODES:
        clean = aggregate_loss(logp, mask, mode, norm_length=6)
        assert aggregate_loss(_with_garbage(logp, mask, 1), mask, mode, norm_length=6).item() == clean.item()
    v = logp.clone().requires_grad_(True)
    loss, m = value_loss(v, old, ref, mask)
    dirty = _with_garbage(logp, mask, 2).requires_grad_(True)
    loss_d, m_d = value_loss(dirty, _with_garbage(old, mask, 3), _with_garbage(ref, mask, 4), mask)
    assert loss_d.item() == loss.item() and m_d == m
    assert torch.equal(_grad(loss_d, dirty), _grad(loss, v))


@pytest.mark.parametrize("fn", [policy_loss, cispo_loss])
def test_unit_weights_equal_no_weights(fn):
    logp, old, _, adv, _, mask = _random_batch(8)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    loss_a, m_a = fn(a, old, adv, mask)
    loss_b, m_b = fn(b, old, adv, mask, weights=torch.ones_like(logp))
    assert loss_a.item() == loss_b.item() and m_a == m_b
    assert torch.equal(_grad(loss_a, a), _grad(loss_b, b))


def test_weights_scale_per_token_loss():
    logp, old = _logp_with_ratios([[1.1, 0.9]])
    adv = _t([[1.0, 1.0]])
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 2), weights=_t([[2.0, 0.0]]))
    assert loss.item() == pytest.approx((2.0 * -1.1 + 0.0) / 2, abs=1e-12)  # normalizer still 2 tokens


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_bfloat16_inputs_match_float32(ratio_level):
    logp, old, ref, adv, _, mask = _random_batch(9, dtype=torch.float32)
    kwargs = dict(ref_logp=ref, kl_coef=0.05, ratio_level=ratio_level, clip_low=0.2, clip_high=0.28)
    bf = logp.to(torch.bfloat16).requires_grad_(True)
    bf_kwargs = dict(kwargs, ref_logp=ref.to(torch.bfloat16))
    loss_bf, m_bf = policy_loss(bf, old.to(torch.bfloat16), adv.to(torch.bfloat16), mask, **bf_kwargs)
    # The same bf16-rounded numbers in float32 give the same loss: the math runs in float32.
    f32 = bf.detach().float().requires_grad_(True)
    r32 = dict(kwargs, ref_logp=ref.to(torch.bfloat16).float())
    loss_32, _ = policy_loss(f32, old.to(torch.bfloat16).float(), adv.to(torch.bfloat16).float(), mask, **r32)
    assert loss_bf.dtype == torch.float32
    assert loss_bf.item() == pytest.approx(loss_32.item(), abs=1e-6)
    g_bf = _grad(loss_bf, bf)
    assert g_bf.dtype == torch.bfloat16
    # And the unrounded float32 inputs give a close loss.
    full = logp.clone().requires_grad_(True)
    loss_full, m_full = policy_loss(full, old, adv, mask, **kwargs)
    assert loss_bf.item() == pytest.approx(loss_full.item(), abs=3e-2)
    assert torch.allclose(g_bf.float(), _grad(loss_full, full), atol=3e-2)
    assert m_bf.ratio_mean == pytest.approx(m_full.ratio_mean, abs=3e-2)


# ---------------------------------------------------------------------------------------------------
# gradient accumulation: micro-batches with the global normalizer reproduce the full batch


def _accumulation_batch():
    gen = torch.Generator().manual_seed(10)
    B, T = 8, 5
    lengths = torch.tensor([5, 3, 1, 4, 0, 2, 5, 3])  # ragged, one empty sequence
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(B, T, generator=gen, dtype=F64) * 2
    old = logp + 0.2 * torch.randn(B, T, generator=gen, dtype=F64)
    ref = logp + 0.2 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, generator=gen, dtype=F64)
    return logp, old, ref, adv, mask


LOSSES = {
    "ppo": lambda lp, old, ref, adv, m, **kw: policy_loss(lp, old, adv, m, ref_logp=ref, kl_coef=0.1, **kw),
    "ppo-dual": lambda lp, old, ref, adv, m, **kw: policy_loss(lp, old, adv, m, dual_clip=2.0, **kw),
    "gspo": lambda lp, old, ref, adv, m, **kw: policy_loss(
        lp, old, adv, m, ratio_level="sequence", clip_low=0.05, clip_high=0.05, **kw
    ),
    "cispo": lambda lp, old, ref, adv, m, **kw: cispo_loss(lp, old, adv, m, clip_high=0.1, **kw),
    "value": lambda lp, old, ref, adv, m, **kw: value_loss(lp, old, ref, m, clip=0.1, **kw),
}


@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradient_accumulation_equals_full_batch(mode, name, micro):
    logp, old, ref, adv, mask = _accumulation_batch()
    fn = LOSSES[name]
    full_x = logp.clone().requires_grad_(True)
    full, _ = fn(full_x, old, ref, adv, mask, aggregation=mode, norm_length=5)
    full.backward()

    denom = loss_normalizer(mask, mode, norm_length=5)
    acc_x = logp.clone().requires_grad_(True)
    total = 0.0
    for start in range(0, 8, micro):
        sl = slice(start, start + micro)
        part, _ = fn(acc_x[sl], old[sl], ref[sl], adv[sl], mask[sl], aggregation=mode, normalizer=denom)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(acc_x.grad, full_x.grad, atol=1e-6)


def test_token_mean_of_micro_batch_means_is_not_the_full_loss():
    # Why `normalizer` exists: averaging micro-batch token-means weights short micro-batches more.
    logp, _, _, _, mask = _accumulation_batch()
    full = aggregate_loss(logp, mask).item()
    naive = sum(aggregate_loss(logp[i : i + 1], mask[i : i + 1]).item() for i in range(8)) / 8
    assert abs(naive - full) > 1e-3


# ---------------------------------------------------------------------------------------------------
# truncated_is_weights


def test_truncated_is_weights_token_level():
    old = _t([[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]], requires_grad=True)
    rollout = _t([[-1.5, -0.5, -3.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w = truncated_is_weights(old, rollout, mask, cap=2.0)
    expected = _t([[math.exp(0.5), math.exp(-0.5), 2.0], [1.0, 0.0, 0.0]])
    assert torch.allclose(w, expected, atol=1e-12)
    assert not w.requires_grad


def test_truncated_is_weights_sequence_level():
    old = _t([[-1.0, -1.0, -1.0], [-2.0, -1.0, 0.0]])
    rollout = _t([[-1.2, -1.1, -0.9], [-1.0, math.nan, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w = truncated_is_weights(old, rollout, mask, cap=2.0, level="sequence")
    s0 = math.exp(0.2 + 0.1 - 0.1)  # below the cap
    s1 = math.exp(-1.0)
    assert torch.allclose(w, _t([[s0, s0, s0], [s1, 0.0, 0.0]]), atol=1e-12)
    capped = truncated_is_weights(old, rollout - 10.0, mask, cap=2.0, level="sequence")
    assert torch.allclose(capped, _t([[2.0] * 3, [2.0, 0.0, 0.0]]), atol=1e-12)
    uncapped = truncated_is_weights(old, rollout, mask, cap=None, level="token")
    assert uncapped[0, 0].item() == pytest.approx(math.exp(0.2))


# ---------------------------------------------------------------------------------------------------
# value_loss and explained_variance


def test_value_loss_by_hand():
    # t0: (V-R)² = 1, clipped V = 0.5 + 0.2 = 0.7 → (0.7-2)² = 1.69 is larger: clipped, no gradient.
    # t1: V moved 0.1 < c, both branches equal 4. t2: exact prediction, 0.
    v = _t([[1.0, 2.0, 0.5]], requires_grad=True)
    old = _t([[0.5, 1.9, 0.5]])
    ret = _t([[2.0, 0.0, 0.5]])
    mask = torch.ones(1, 3)
    loss, m = value_loss(v, old, ret, mask, clip=0.2)
    assert loss.item() == pytest.approx((0.5 * 1.69 + 0.5 * 4.0) / 3, abs=1e-12)
    assert m.vf_clipfrac == pytest.approx(1 / 3)
    assert m.value_mean == pytest.approx(3.5 / 3)
    assert torch.allclose(_grad(loss, v), _t([[0.0, 0.5 * 2 * 2.0 / 3, 0.0]]), atol=1e-12)
    unclipped, m_u = value_loss(v, old, ret, mask, clip=None)
    assert unclipped.item() == pytest.approx((0.5 * 1 + 0.5 * 4) / 3, abs=1e-12)
    assert m_u.vf_clipfrac == 0.0


def test_explained_variance():
    ret = _t([[1.0, 2.0, 3.0, 99.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(ret + 5.0, ret, mask) == pytest.approx(1.0)  # a constant offset is free
    assert explained_variance(torch.zeros_like(ret), ret, mask) == pytest.approx(0.0)
    v = _t([[1.5, 2.0, 3.0, -7.0], [3.5, 0.0, 0.0, 0.0]])
    # Var[R] over {1,2,3,4} = 1.25; R - V = {-0.5, 0, 0, 0.5}: Var = 0.125.
    assert explained_variance(v, ret, mask) == pytest.approx(1 - 0.125 / 1.25)
    assert math.isnan(explained_variance(v, torch.ones_like(ret), mask))


# ---------------------------------------------------------------------------------------------------
# bad arguments: one ValueError naming the argument


def _args():
    logp = torch.zeros(2, 3)
    return logp, logp.clone(), torch.zeros(2), torch.ones(2, 3)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(aggregation="mean"), "aggregation"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(ratio_level="tokens"), "ratio_level"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(aggregation="seq-mean-token-sum-norm"), "norm_length"),
        (dict(aggregation="seq-mean-token-sum-norm", norm_length=0), "norm_length"),
        (dict(clip_low=1.5), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(kl_coef=0.1), "ref_logp"),
        (dict(kl_coef=-0.1), "kl_coef"),
        (dict(ref_logp=torch.zeros(2, 4)), "ref_logp"),
        (dict(weights=torch.zeros(3, 3)), "weights"),
    ],
)
def test_policy_loss_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        policy_loss(*_args(), **kwargs)


@pytest.mark.parametrize(
    ("position", "bad", "name"),
    [
        (0, torch.zeros(2, 3, 1), "logp"),
        (1, torch.zeros(2, 4), "old_logp"),
        (2, torch.zeros(3), "advantages"),
        (2, torch.zeros(2, 4), "advantages"),
        (3, torch.ones(2, 4), "mask"),
    ],
)
def test_shape_mismatch_names_the_argument(position, bad, name):
    args = list(_args())
    args[position] = bad
    with pytest.raises(ValueError, match=f"^{name}:"):
        policy_loss(*args)
    with pytest.raises(ValueError, match=f"^{name}:"):
        cispo_loss(*args)


def test_other_bad_arguments():
    logp, old, adv, mask = _args()
    with pytest.raises(ValueError, match="^mode: .*'token-mean'"):
        aggregate_loss(logp, mask, "tokens-mean")
    with pytest.raises(ValueError, match="^norm_length:"):
        aggregate_loss(logp, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="^normalizer:"):
        aggregate_loss(logp, mask, normalizer=0)
    with pytest.raises(ValueError, match="^mode:"):
        loss_normalizer(mask, "sum")
    with pytest.raises(ValueError, match="^level:"):
        truncated_is_weights(old, logp, mask, level="tokens")
    with pytest.raises(ValueError, match="^cap:"):
        truncated_is_weights(old, logp, mask, cap=0.0)
    with pytest.raises(ValueError, match="^rollout_logp:"):
        truncated_is_weights(old, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="^clip:"):
        value_loss(logp, old, old, mask, clip=0.0)
    with pytest.raises(ValueError, match="^returns:"):
        value_loss(logp, old, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="^aggregation:"):
        value_loss(logp, old, old, mask, aggregation="x")
    with pytest.raises(ValueError, match="^kl_estimator:"):
        cispo_loss(logp, old, adv, mask, kl_estimator="k9")


def test_value_loss_clipfrac_counts_only_values_outside_the_range():
    # Values within c of their rollout-time prediction are not clipped. Forming the clipped value as
    # V_old + clamp(V - V_old) rounds differently from V itself in float32 (here on 37% of the tokens),
    # which used to mark about 2% of these unclipped tokens as clipped.
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(64, 256, generator=gen) * 0.05
    old = torch.randn(64, 256, generator=gen) * 0.05
    ret = torch.randn(64, 256, generator=gen)
    mask = (v - old).abs() <= 0.2  # the tokens inside the range (99%)
    loss, m = value_loss(v, old, ret, mask, clip=0.2)
    assert m.vf_clipfrac == 0.0
    assert loss.item() == pytest.approx(0.5 * ((v - ret) ** 2)[mask].mean().item(), rel=1e-6)
    # outside the range a token counts exactly when the clipped error is the larger one
    all_tokens = torch.ones_like(mask)
    far = old + torch.where(torch.rand(64, 256, generator=gen) < 0.5, 0.5, -0.5)
    _, m_far = value_loss(far, old, ret, all_tokens, clip=0.2)
    v_clip = torch.minimum(torch.maximum(far, old - 0.2), old + 0.2)
    expected = ((v_clip - ret) ** 2 > (far - ret) ** 2).float().mean().item()
    assert m_far.vf_clipfrac == pytest.approx(expected, abs=1e-7)
    assert 0.3 < m_far.vf_clipfrac < 0.7
