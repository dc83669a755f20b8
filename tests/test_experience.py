"""make_experience and its pieces: advantages by estimator, KL in the reward, importance and entropy weights."""

from __future__ import annotations

import math

import pytest
import torch

from lmrl import algorithms as A
from lmrl.config import load_config
from lmrl.experience import (
    compute_advantages,
    make_experience,
    top_entropy_mask,
)
from lmrl.rollout import Rollout


def algo(*overrides):
    return load_config(None, list(overrides)).algorithm


def adv_options(*overrides):
    """compute_advantages' keyword arguments as a config with these overrides gives them."""
    options = algo(*overrides).options_for(make_experience)
    make_experience_only = ("kl_estimator", "kl_clamp", "tis_cap", "tis_mode", "tis_low", "entropy_top_fraction",
                            "reward_minus_kl_coef", "clip_filter_like_weight", "distill_coef")
    return {k: v for k, v in options.items() if k not in make_experience_only}


# the AlgorithmConfig fields make_experience takes (kl_coef aside: the trainer passes its KL controller's value)
EXPERIENCE_OPTIONS = ("advantage", "gamma", "lam", "whiten_advantages", "whiten_std", "use_advantages",
                      "relu_log_p_weights", "pass_k", "kl_in", "kl_level", "kl_estimator", "kl_clamp", "tis_cap",
                      "tis_mode", "tis_low", "entropy_top_fraction", "reward_minus_kl_coef", "clip_filter_like_weight",
                      "distill_coef")


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo"])
def test_options_for_make_experience_are_its_19_algorithm_fields(name):
    cfg = algo(f"algorithm={name}", "rollout.dtype=bfloat16")
    options = cfg.options_for(make_experience)
    assert sorted(options) == sorted(EXPERIENCE_OPTIONS) and len(options) == 19
    assert options == {k: getattr(cfg, k) for k in EXPERIENCE_OPTIONS}


def rollout(B=4, P=3, T=5, lengths=(5, 3, 2, 4), finished=(True, True, False, True), seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return Rollout(
        prompt_ids=torch.randint(3, 20, (B, P), generator=g),
        prompt_mask=torch.ones(B, P, dtype=torch.bool),
        response_ids=torch.randint(3, 20, (B, T), generator=g),
        response_mask=mask,
        logprobs=torch.where(mask, -torch.rand(B, T, generator=g), torch.zeros(())),
        texts=[f"t{i}" for i in range(B)],
        finished=torch.tensor(finished),
        prompt_index=torch.arange(B) // 2,
    )


SCORES = torch.tensor([1.0, 0.0, 0.5, 0.5])


@pytest.mark.parametrize("name, expected", [
    ("grpo", A.grpo_advantages(SCORES, 2)),
    ("dr_grpo", torch.tensor([0.5, -0.5, 0.0, 0.0])),
    ("rloo", torch.tensor([1.0, -1.0, 0.0, 0.0])),
    ("reinforce_baseline", torch.tensor([0.5, -0.5, 0.0, 0.0])),
])
def test_group_estimators_broadcast_over_real_tokens(name, expected):
    r = rollout()
    adv = compute_advantages(SCORES, r.response_mask, 2, **adv_options(f"algorithm.advantage={name}")).advantages
    want = torch.where(r.response_mask, expected[:, None].expand(4, 5), torch.zeros(()))
    torch.testing.assert_close(adv, want)


def test_sequence_kl_in_reward_is_subtracted_from_the_score():
    r = rollout()
    kl = torch.full((4, 5), 0.1)
    options = adv_options("algorithm=rloo")  # kl in reward, sequence level
    adv = compute_advantages(SCORES, r.response_mask, 2, kl=kl, kl_coef=0.5, **options).advantages
    penalised = SCORES - 0.5 * 0.1 * r.response_mask.sum(1)  # lengths 5, 3, 2, 4
    torch.testing.assert_close(adv[:, 0], A.rloo_advantages(penalised, 2))


def test_token_kl_in_reward_gives_returns_to_go():
    r = rollout()
    kl = torch.full((4, 5), 0.1)
    options = adv_options("algorithm=reinforce_pp", "algorithm.whiten_advantages=false")
    adv = compute_advantages(SCORES, r.response_mask, 2, kl=kl, kl_coef=1.0, **options).advantages
    # row 1 (length 3, score 0): rewards -0.1, -0.1, 0 - 0.1 -> returns -0.3, -0.2, -0.1
    torch.testing.assert_close(adv[1, :3], torch.tensor([-0.3, -0.2, -0.1]))
    assert (adv[1, 3:] == 0).all()


def test_gae_needs_values_and_uses_them():
    r = rollout()
    options = adv_options("algorithm=ppo", "algorithm.whiten_advantages=false", "algorithm.lam=1.0")
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages(SCORES, r.response_mask, 2, **options)
    values = torch.zeros(4, 5)
    out = compute_advantages(SCORES, r.response_mask, 2, values=values, **options)
    # lam = gamma = 1, V = 0, no KL: every real token's advantage is the final score
    torch.testing.assert_close(out.advantages, torch.where(r.response_mask, SCORES[:, None].expand(4, 5), torch.zeros(())))


def test_whitening_gives_zero_mean_unit_std_over_real_tokens():
    r = rollout()
    adv = compute_advantages(SCORES, r.response_mask, 2, kl=torch.rand(4, 5), kl_coef=0.1,
                             **adv_options("algorithm=reinforce_pp")).advantages
    assert A.masked_mean(adv, r.response_mask).abs() < 1e-5
    assert (A.masked_var(adv, r.response_mask).sqrt() - 1).abs() < 1e-4


def test_make_experience_leaves_old_logprobs_to_the_update_and_drops_truncated():
    r = rollout()
    exp = make_experience(r, SCORES, **algo().options_for(make_experience), policy_logprobs=None, loss_mask=r.finished)
    assert exp.old_logprobs is None and exp.rollout_logprobs is None  # one update: its own forward serves
    assert not exp.response_mask[2].any() and exp.response_mask[0].all()
    assert exp.ref_logprobs is None and exp.values is None
    assert exp.info["length"].tolist() == [5, 3, 2, 4]


def test_make_experience_hands_sampling_logprobs_to_the_update_for_tis():
    r = rollout()
    exp = make_experience(r, SCORES, **algo("algorithm.tis_cap=2.0").options_for(make_experience), policy_logprobs=None)
    assert exp.old_logprobs is None and torch.equal(exp.rollout_logprobs, r.logprobs.float())
    assert torch.equal(exp.select(torch.tensor([2, 0])).rollout_logprobs, r.logprobs[[2, 0]].float())


def test_make_experience_with_reference_and_entropy_filter():
    r = rollout()
    calls = []

    def policy(seqs, attn, T):
        calls.append(("policy", seqs.shape[0], T))
        entropy = torch.arange(seqs.shape[0] * T, dtype=torch.float).view(-1, T) + 100 * len(calls)  # distinct values
        return torch.full((seqs.shape[0], T), -1.0), entropy

    def ref(seqs, attn, T):
        calls.append(("ref", seqs.shape[0], T))
        return torch.full((seqs.shape[0], T), -1.5)

    cfg = algo("algorithm.kl_coef=0.1", "algorithm.entropy_top_fraction=0.5")
    exp = make_experience(r, SCORES, **cfg.options_for(make_experience), policy_logprobs=policy, ref_logprobs=ref,
                          micro_batch_size=3)
    assert calls == [("policy", 3, 5), ("policy", 1, 5), ("ref", 3, 5), ("ref", 1, 5)]
    torch.testing.assert_close(exp.info["kl"], 0.5 * r.response_mask.sum(1).float())  # k1: -1 - (-1.5) per token
    kept = (exp.weights > 0) & exp.response_mask
    assert kept.sum() == round(0.5 * int(r.response_mask.sum()))


def test_micro_batches_by_rows_and_by_tokens():
    from lmrl.experience import micro_batches

    # prompts of 2, 2, 3, 3 real tokens (rows 0-1 one prompt, rows 2-3 another); responses of 1, 3, 2, 0 tokens
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    groups = torch.tensor([0, 0, 1, 1])
    assert micro_batches(mask, 3, 3) == [slice(0, 3), slice(3, 4)]
    # rows 0-1: 2 + 1 + 3 = 6 tokens (the prompt once); row 2 would add 3 + 2
    assert micro_batches(mask, 3, 64, tokens=6, group_index=groups) == [slice(0, 2), slice(2, 4)]
    assert micro_batches(mask, 3, 64, tokens=10, group_index=groups) == [slice(0, 2), slice(2, 4)]
    assert micro_batches(mask, 3, 64, tokens=11, group_index=groups) == [slice(0, 4)]  # row 3 adds nothing
    assert micro_batches(mask, 3, 3, tokens=11, group_index=groups) == [slice(0, 3), slice(3, 4)]
    # without groups each row counts its prompt: 3 + 5 > 6
    assert micro_batches(mask, 3, 64, tokens=6) == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]
    # a row alone over the budget is a micro-batch of its own; rows still cap
    assert micro_batches(mask, 3, 64, tokens=1, group_index=groups) == [slice(i, i + 1) for i in range(4)]
    assert micro_batches(mask, 3, 1, tokens=100, group_index=groups) == [slice(i, i + 1) for i in range(4)]
    assert micro_batches(mask[:0], 3, 4, tokens=10) == []


def test_top_entropy_mask_picks_the_highest():
    ent = torch.tensor([[0.1, 0.9, 0.5], [0.8, 0.2, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert top_entropy_mask(ent, mask, 0.4).tolist() == [[False, True, False], [True, False, False]]


def test_batch_std_advantage_divides_by_the_std_of_the_whole_batch():
    r = rollout()
    adv = compute_advantages(SCORES, r.response_mask, 2, **adv_options("algorithm.advantage=grpo_batch_std")).advantages
    want = torch.tensor([0.5, -0.5, 0.0, 0.0]) / (SCORES.std() + 1e-8)  # TRL's scale_rewards="batch"
    torch.testing.assert_close(adv[:, 0], want)


def test_population_std_whitening():
    r = rollout()
    options = adv_options("algorithm=reinforce_pp", "algorithm.whiten_std=population")
    adv = compute_advantages(SCORES, r.response_mask, 2, kl=torch.rand(4, 5), kl_coef=0.1, **options).advantages
    assert (A.masked_var(adv, r.response_mask, unbiased=False).sqrt() - 1).abs() < 1e-4


@pytest.mark.parametrize("clamp, expected", [("none", 30.0), ("openrlhf", 10.0), ("verl", 30.0)])
def test_kl_clamp_applies_to_the_kl_in_the_reward(clamp, expected):
    r = rollout(B=2, lengths=(5, 5), finished=(True, True))
    cfg = algo("algorithm=rloo", f"algorithm.kl_clamp={clamp}")
    exp = make_experience(r, torch.tensor([1.0, 0.0]), **cfg.options_for(make_experience), policy_logprobs=None,
                          ref_logprobs=lambda s, a, T: r.logprobs[: s.shape[0]] - 30.0, kl_coef=0.1)
    torch.testing.assert_close(exp.info["kl"], torch.full((2,), 5 * expected))  # k1 per token, 5 tokens


def test_use_advantages_false_weighs_by_the_rewards_and_relu_clamps():
    r = rollout()
    adv = compute_advantages(SCORES, r.response_mask, 2, **adv_options("algorithm.use_advantages=false"))
    torch.testing.assert_close(adv.advantages[:, 0], SCORES)
    relu = compute_advantages(SCORES, r.response_mask, 2,
                              **adv_options("algorithm.relu_log_p_weights=true", "algorithm.advantage=dr_grpo"))
    torch.testing.assert_close(relu.advantages[:, 0], torch.tensor([0.5, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(relu.relu_zeroed, torch.tensor([0.0, 3.0, 0.0, 0.0]))  # row 1: 3 real tokens
    with pytest.raises(Exception, match="use_advantages"):
        algo("algorithm=ppo", "algorithm.use_advantages=false")


def test_reward_minus_kl_and_clip_filter_weights_in_make_experience():
    r = rollout()
    cfg = algo("algorithm.reward_minus_kl_coef=0.5", "algorithm.clip_filter_like_weight=3.0",
               "algorithm.advantage=dr_grpo")
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0])  # group 0 all equal, group 1 mixed
    # reference log-probs 0.1 below the sampler's on every token: k3 = e^-0.1 - 1 + 0.1 per token
    exp = make_experience(r, scores, **cfg.options_for(make_experience), policy_logprobs=None, ref_logprobs=lambda s, a, T: r.logprobs[: s.shape[0]] - 0.1)
    k3 = math.expm1(-0.1) + 0.1
    lengths = r.response_mask.sum(1).float()
    torch.testing.assert_close(exp.info["reward_minus_kl"], scores - 0.5 * k3 * lengths)
    reduced = scores - 0.5 * k3 * lengths
    want = reduced - reduced.view(2, 2).mean(1).repeat_interleave(2)  # advantages of the reduced rewards
    torch.testing.assert_close(exp.advantages[:, 0], want)
    # the KL made group 0's rewards differ (lengths 5 and 3): both groups informative, weight 1
    torch.testing.assert_close(exp.info["clip_filter_weight"], torch.ones(4))
    plain = make_experience(r, scores, **algo("algorithm.clip_filter_like_weight=3.0").options_for(make_experience),
                            policy_logprobs=None)
    torch.testing.assert_close(plain.weights[:, 0], torch.tensor([1.0, 1.0, 2.0, 2.0]))


class ThreadWorld:
    """Ranks as threads of one process: `gather` hands every rank's value to all of them."""

    def __init__(self, rank: int, size: int, board: dict, barrier):
        self.rank, self.size, self.board, self.barrier, self.calls = rank, size, board, barrier, 0

    @property
    def distributed(self) -> bool:
        return True

    def gather(self, value) -> list:
        self.calls += 1
        self.board[self.calls, self.rank] = value
        self.barrier.wait()
        out = [self.board[self.calls, r] for r in range(self.size)]
        self.barrier.wait()
        return out


def test_ranks_trade_whole_groups_until_their_tokens_are_about_even():
    """Rank 0 holds two groups of long completions and a prompt of 9 tokens, rank 1 two groups of short ones: after
    `balanced` each rank trains on about half of the tokens, every row once, each with its own advantages, and
    prompts and responses of other widths padded to fit."""
    import threading

    from lmrl.experience import row_tokens
    from lmrl.update import balanced

    shares = [make_experience(rollout(P=P, T=T, lengths=lengths, finished=(True,) * 4, seed=rank), SCORES + rank,
                              **algo().options_for(make_experience), policy_logprobs=None)
              for rank, (P, T, lengths) in enumerate([(9, 8, (8, 7, 8, 6)), (3, 3, (1, 2, 1, 1))])]
    board, barrier, out = {}, threading.Barrier(2), [None, None]

    def rank(r):
        out[r] = balanced(shares[r], ThreadWorld(r, 2, board, barrier))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def tokens(exp):
        prompt, response = row_tokens(exp.attention_mask, exp.num_response_tokens)
        firsts = {int(g): row for row, g in reversed(list(enumerate(exp.group_index.tolist())))}
        return sum(response) + sum(prompt[row] for row in firsts.values())

    before, after = [tokens(s) for s in shares], [tokens(x) for x in out]
    assert sum(after) == sum(before) and max(after) - min(after) < max(before) - min(before)
    assert max(after) - min(after) <= 18 + 8  # at most one group's worth apart
    rows = lambda exp: sorted(  # noqa: E731  every real token of each row, with its advantages
        (tuple(exp.sequences[i][exp.attention_mask[i].bool()].tolist()), tuple(exp.advantages[i].tolist()[:3]))
        for i in range(len(exp)))
    assert rows(out[0]) + rows(out[1]) != [] and sorted(rows(out[0]) + rows(out[1])) == sorted(rows(shares[0]) + rows(shares[1]))
    for exp in out:  # groups contiguous and numbered from 0
        g = exp.group_index.tolist()
        assert g == sorted(g) and g[0] == 0
