"""The Experience batch and make_experience(): a scored rollout in, everything the update needs out.

Data flow (one step):

    Rollout (tokens, masks, sampling log-probs) + scores [B]
      -> old / reference log-probs and values: micro-batched no-grad forwards, each skipped when unused
      -> KL in the reward (k1, per token or per sequence) when the algorithm asks for it
      -> advantages by the estimator's name (ADVANTAGE_ESTIMATORS), optional batch whitening
      -> on-policy distillation: + distill_coef x (teacher - student log-prob) on each token, when a teacher scores
      -> Experience: every tensor aligned to response tokens [B, T]

Everything here is plain tensors, models and keyword arguments (named as the config fields they come from,
e.g. `advantage`, `kl_in`, `tis_cap`: `cfg.algorithm.options_for(make_experience)` gives them), so this module
knows nothing of the config layer; the math is in `lmrl.algorithms`. The scores arrive shaped
(`lmrl.rewards.shaping`), and the rollout joined and filtered (`lmrl.rollout.ops`), before this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmrl import algorithms as A
from lmrl.distributed import ONE_PROCESS, World, idle_batch, std_across_ranks, whiten_across_ranks
from lmrl.errors import RewardError
from lmrl.rollout import Rollout
from lmrl.rollout.samples import episode_sum, first_rows, split_samples


@dataclass
class Experience:
    """One batch of experience. B sequences, P prompt tokens (left-padded), T response tokens."""

    sequences: torch.Tensor  # [B, P+T] prompt + response token ids
    attention_mask: torch.Tensor  # [B, P+T] bool
    response_mask: torch.Tensor  # [B, T] bool: tokens the loss trains on
    # [B, T] log-probs under the policy before this update (detached). None: the batch is used for one
    # update, so the update's own forward gives them (detached: the ratio is exactly 1)
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor  # [B, T]
    scores: torch.Tensor  # [B] total reward of each completion (after shaping)
    group_index: torch.Tensor  # [B] prompt index; samples of a group are contiguous
    ref_logprobs: torch.Tensor | None = None  # [B, T] when a KL term needs them
    values: torch.Tensor | None = None  # [B, T] critic values (PPO)
    returns: torch.Tensor | None = None  # [B, T] value targets (PPO)
    rewards: torch.Tensor | None = None  # [B, T] per-token rewards when KL is in the reward
    weights: torch.Tensor | None = None  # [B, T] per-token loss weights (truncated IS, entropy filter)
    # [B, T] the sampler's log-probs, when old_logprobs is None and truncated importance sampling is on:
    # the update weighs each token by min(exp(old - sampler), cap) from its own forward
    rollout_logprobs: torch.Tensor | None = None
    info: dict[str, torch.Tensor] = field(default_factory=dict)  # [B] tensors: lengths, finished, ...
    # a vision-language policy's bundle of each prompt, indexed by group_index (a list: `select` keeps it whole)
    media: list | None = None
    # [B] the bundle of `media` each row shows where episodes showed images of their own (`Rollout.media_index`)
    media_index: torch.Tensor | None = None
    # [B] the episode each row is a sample of, where an agent's episode is several samples (`lmrl.rollout.samples`)
    episode_index: torch.Tensor | None = None

    def row_media(self) -> dict[str, torch.Tensor] | None:
        """The forward arguments of these rows' images (`lmrl.models.vision.row_media`); None for text."""
        if self.media is None:
            return None
        from lmrl.models.vision import row_media

        index = self.group_index if self.media_index is None else self.media_index
        return row_media(self.media, index, self.sequences.device)

    @property
    def num_response_tokens(self) -> int:
        return self.response_mask.shape[1]

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def to(self, device: torch.device | str) -> Experience:
        """These rows with every tensor on `device`."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, v in moved.items():
            if isinstance(v, torch.Tensor):
                moved[name] = v.to(device)
            elif isinstance(v, dict):
                moved[name] = {k: t.to(device) for k, t in v.items()}
        return Experience(**moved)

    def per_episode(self) -> Experience:
        """A row per episode (its first sample's) where an agent's episode is several samples; else these rows."""
        first = first_rows(self.episode_index)
        return self if first is None else self.select(first)

    def select(self, index: torch.Tensor) -> Experience:
        """The rows `index` of every tensor (minibatches, micro-batches)."""
        out, on = {}, {}  # on: the index on each device that holds a tensor, moved there once

        def rows(t: torch.Tensor) -> torch.Tensor:
            if t.device not in on:
                on[t.device] = index.to(t.device)
            return t[on[t.device]]

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = rows(v)
            elif isinstance(v, dict):
                out[f.name] = {k: rows(t) for k, t in v.items()}
            else:
                out[f.name] = v
        return Experience(**out)


# ------------------------------------------------------------------------------------------- advantages

# Sequence-level estimators: scores [B] -> baseline-corrected scores [B], by the name in
# `algorithm.advantage`. gae is per-token and needs a critic: compute_advantages handles it.
SEQUENCE_ESTIMATORS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "grpo": lambda r, g: A.grpo_advantages(r, g),
    "dr_grpo": lambda r, g: A.grpo_advantages(r, g, scale_by_std=False),
    "rloo": A.rloo_advantages,
    "reinforce_baseline": A.reinforce_baseline_advantages,
    "reinforce": lambda r, g: r,
    "grpo_batch_std": A.batch_std_advantages,
    "gpg": A.gpg_advantages,
}
# Estimators that need more than (scores, G) (pass_at_k's k, remax's greedy baselines, a batch statistic of
# every rank) are completed in `_sequence_advantages`.


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B, T]
    returns: torch.Tensor | None = None  # [B, T]
    rewards: torch.Tensor | None = None  # [B, T]
    relu_zeroed: torch.Tensor | None = None  # [B] tokens whose negative weight relu_log_p_weights zeroed


def compute_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    *,
    advantage: str = "grpo",
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = False,
    whiten_std: str = "unbiased",
    use_advantages: bool = True,
    relu_log_p_weights: bool = False,
    pass_k: int = 4,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_in: str = "loss",
    kl_level: str = "token",
    values: torch.Tensor | None = None,
    world: World = ONE_PROCESS,
    baseline: torch.Tensor | None = None,
    episode_index: torch.Tensor | None = None,
) -> Advantages:
    """Advantages for the estimator named `advantage`.

    Args:
        scores: [B] rewards of the completions.
        mask: [B, T] response tokens.
        group_size: G, completions per prompt (groups are contiguous).
        advantage: the estimator: a name in SEQUENCE_ESTIMATORS, or "gae" (needs `values`).
        gamma, lam: discount and GAE lambda.
        whiten_advantages: whiten the advantages over the whole batch, with the unbiased or the
            population std (`whiten_std`, "unbiased" or "population").
        use_advantages: False weighs the log-probs by the rewards themselves (TapeAgents).
        relu_log_p_weights: clamp negative weights to 0 (TapeAgents): learn only from what beat the baseline.
        pass_k: k of the pass@k advantage (advantage="pass_at_k").
        kl: [B, T] per-token KL estimate of the sampling policy against the reference, used only when
            `kl_in == "reward"`, weighted by `kl_coef`, per token or summed per sequence (`kl_level`).
        values: [B, T] critic values (gae only).
        world: the ranks sharing the batch (`lmrl.distributed`): batch whitening uses all of their rows.
        baseline: [B / G] the reward of each prompt's greedy completion (remax only).
        episode_index: [B] the episode each row is a sample of, where an episode is several samples
            (`lmrl.rollout.samples`); None: each row its own. `scores` are then each row's episode's, and `group_size`
            counts episodes: a sequence-level estimator's baseline is taken over episodes (an episode of more samples
            does not weigh more) and each sample gets its episode's advantage; a sequence-level KL is the episode's.

    Group estimators (grpo, dr_grpo, rloo, reinforce_baseline) and plain REINFORCE turn the scores into a
    sequence-level baseline-corrected reward. Without a per-token KL reward that is the advantage of every
    token; with one, the per-token rewards (KL penalty on each token, the corrected score on the last)
    are summed into returns-to-go, as REINFORCE++ does. gae runs GAE over the per-token rewards.

    Everything is computed in float64 and returned in float32: a group's std of rewards near 1e20 overflows
    float32, and normalising estimators (grpo, whitened advantages) learn from rewards of any finite size
    as from scaled small ones. Advantages that still do not fit float32 (an estimator that keeps the
    reward's scale, with rewards beyond 3e38) are a RewardError rather than a silently skipped step.
    """
    mask = mask.bool()
    scores = scores.double()
    kl = kl.double() if kl is not None else None
    values = values.double() if values is not None else None
    kl_in_reward = kl is not None and kl_in == "reward" and kl_coef > 0
    if kl_in_reward and kl_level == "sequence":  # penalise the sequence's (the episode's) total KL
        scores = scores - kl_coef * episode_sum(A.masked_sum(kl, mask, dim=1), episode_index)
    token_kl = kl_in_reward and kl_level == "token"

    if advantage == "gae":
        if values is None:
            raise ValueError("algorithm.advantage=gae needs critic values")
        zeros = torch.zeros_like(values)
        rewards = A.kl_shaped_rewards(scores, kl if token_kl else zeros, mask, kl_coef if token_kl else 0.0)
        adv, ret = A.gae(values, rewards, mask, gamma, lam)
        out = Advantages(adv, ret, rewards)
    else:
        # TapeAgents' use_advantages=false: the log-probs' weights are the rewards themselves
        seq = scores
        if use_advantages:  # over episodes: each row's is its episode's
            first = first_rows(episode_index)
            seq = _sequence_advantages(advantage, scores if first is None else scores[first], group_size, world,
                                       baseline, pass_k)
            seq = seq if episode_index is None else seq[episode_index]
        if token_kl or gamma < 1:
            rewards = A.kl_shaped_rewards(seq, kl if token_kl else torch.zeros_like(mask, dtype=seq.dtype),
                                          mask, kl_coef if token_kl else 0.0)
            ret = A.discounted_returns(rewards, mask, gamma)
            out = Advantages(ret, None, rewards)
        else:
            out = Advantages(seq[:, None].expand(mask.shape).clone())
    if whiten_advantages:  # over the whole batch: every rank's share of it
        out.advantages = whiten_across_ranks(out.advantages, mask, world, unbiased=whiten_std == "unbiased")
    out.advantages = torch.where(mask, out.advantages, torch.zeros_like(out.advantages))
    relu_zeroed = None
    if relu_log_p_weights:  # TapeAgents: learn only from what beat its baseline
        relu_zeroed = (out.advantages < 0).sum(1).float()
        out.advantages = out.advantages.clamp(min=0)
    wide = out.advantages
    out = Advantages(*(None if x is None else x.float() for x in (out.advantages, out.returns, out.rewards)),
                     relu_zeroed=relu_zeroed)
    if bool(torch.isfinite(wide).all()) and not bool(torch.isfinite(out.advantages).all()):
        raise RewardError(f"advantages overflow float32: rewards up to {scores.abs().max().item():.3g} with "
                          f"algorithm.advantage={advantage}, which keeps the rewards' scale; scale the rewards "
                          "down, or set reward.normalize=true")
    return out


# ------------------------------------------------------------------------------------------- forwards

LogprobFn = Callable[..., torch.Tensor]


def micro_batches(attention_mask: torch.Tensor, num_response_tokens: int, size: int, tokens: int | None = None,
                  group_index: torch.Tensor | None = None) -> list[slice]:
    """Consecutive row ranges of a batch: at most `size` rows each and, with `tokens`, at most that many tokens, as a
    packed forward counts them (`lmrl.models.shared_prompt.packed_states`): a row's real prompt tokens once for the
    rows of its prompt in the range (`group_index`, [B]; None: every row its own), its response up to its last real
    token. A row alone over `tokens` is a range of its own."""
    rows = attention_mask.shape[0]
    if tokens is None:
        return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]
    prompt, response = row_tokens(attention_mask, num_response_tokens)
    groups = group_index.tolist() if group_index is not None else list(range(rows))
    out, start, used, seen = [], 0, 0, set()
    for i in range(rows):
        cost = response[i] + (0 if groups[i] in seen else prompt[i])
        if i > start and (used + cost > tokens or i - start == size):
            out.append(slice(start, i))
            start, used, seen = i, 0, set()
            cost = response[i] + prompt[i]
        used += cost
        seen.add(groups[i])
    if rows:
        out.append(slice(start, rows))
    return out


def row_tokens(attention_mask: torch.Tensor, num_response_tokens: int) -> tuple[list[int], list[int]]:
    """Each row's real prompt tokens and its response up to its last real token: what a packed forward runs."""
    real = attention_mask.bool()
    p = attention_mask.shape[1] - num_response_tokens
    columns = torch.arange(num_response_tokens, device=real.device)
    response = torch.where(real[:, p:], columns + 1, 0).amax(1) if num_response_tokens else real.new_zeros(len(real))
    return real[:, :p].sum(1).tolist(), response.tolist()


def batched_forward(
    fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    num_response_tokens: int,
    micro_batch_size: int,
    world: World = ONE_PROCESS,
    media: tuple[list, torch.Tensor] | None = None,
    micro_batch_tokens: int | None = None,
    group_index: torch.Tensor | None = None,
) -> list:
    """`fn(sequences, attention_mask, T)` over micro-batches (`micro_batches`), no grad; the list of per-micro-batch
    results. With sharded models a rank makes as many forwards as the busiest rank (`World.calls`). `media`: a
    vision-language policy's (bundles, [B] each row's bundle): each micro-batch gets `media=` its rows'."""
    from lmrl.models.vision import row_media

    parts = micro_batches(attention_mask, num_response_tokens, micro_batch_size, micro_batch_tokens, group_index)

    def images(part: slice) -> dict[str, Any]:
        if media is None:
            return {}
        return {"media": row_media(media[0], media[1][part], sequences.device)}

    with torch.no_grad():
        outs = [fn(sequences[part], attention_mask[part], num_response_tokens, **images(part)) for part in parts]
        for _ in range(world.calls(len(parts)) - len(parts)):
            fn(*idle_batch(sequences.device))
    return outs


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """[B, T] bool: the top `fraction` of real tokens by entropy over the whole batch (Wang et al. 2025,
    "Beyond the 80/20 rule": only the high-entropy forking tokens carry the learning signal)."""
    real = entropy[mask.bool()]
    if real.numel() == 0:
        return mask.bool()
    k = max(1, int(round(fraction * real.numel())))
    threshold = torch.topk(real.float(), k).values.min()
    return mask.bool() & (entropy >= threshold)


def make_experience(
    rollout: Rollout,
    scores: torch.Tensor,
    *,
    advantage: str = "grpo",
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = False,
    kl_in: str = "loss",
    kl_level: str = "token",
    kl_estimator: str = "k3",
    kl_clamp: str = "none",
    tis_cap: float | None = None,
    tis_mode: str = "truncate",
    tis_low: float = 0.5,
    entropy_top_fraction: float | None = None,
    whiten_std: str = "unbiased",
    use_advantages: bool = True,
    relu_log_p_weights: bool = False,
    reward_minus_kl_coef: float = 0.0,
    clip_filter_like_weight: float | None = None,
    pass_k: int = 4,
    policy_logprobs: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None,
    ref_logprobs: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    critic_values: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    teacher_logprobs: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    distill_coef: float = 1.0,
    kl_coef: float = 0.0,
    micro_batch_size: int = 64,
    micro_batch_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
    info: dict[str, torch.Tensor] | None = None,
    world: World = ONE_PROCESS,
    baseline: torch.Tensor | None = None,
) -> Experience:
    """Turn a scored rollout into an Experience.

    Args:
        rollout: B sequences with their sampling log-probs.
        scores: [B] shaped rewards.
        advantage, gamma, lam, whiten_advantages, whiten_std, use_advantages, relu_log_p_weights, kl_in,
            kl_level, pass_k: as `compute_advantages` takes them.
        kl_estimator: the KL estimator of a KL in the reward (`kl_in="reward"`); a KL in the loss is
            reported here as k1. `kl_clamp` ("none", "verl", "openrlhf") clamps it as that framework does.
        tis_cap: cap of the importance weights against the sampling log-probs (None: none); `tis_mode`
            "truncate" caps them, "icepop" / "sequence-mask" mask tokens / sequences outside [tis_low, tis_cap].
        reward_minus_kl_coef: subtract this times the sequence's k3 KL from its reward before the
            advantages (TapeAgents).
        clip_filter_like_weight: weigh each group's rows by LightRFT's clip-filter-like weight, capped here.
        entropy_top_fraction: train only on this top fraction of tokens by entropy (None: all).
        policy_logprobs: `fn(sequences, attention_mask, T) -> (logprobs [b, T], entropy [b, T])` of the
            current policy; None means one update per batch: the update's own forward gives the old
            log-probs (`old_logprobs=None`), and with `tis_cap` its truncated IS weights against
            the sampling log-probs (`rollout_logprobs`). A second forward here could not change anything.
        ref_logprobs / critic_values: same shape contract; None skips that forward.
        teacher_logprobs: the teacher's log-probs of the response tokens (on-policy distillation), same shape
            contract; each token's advantage gains `distill_coef` x (teacher - student log-prob), after the
            estimator's advantages (and their whitening). The student's are the old log-probs, else the sampler's.
        micro_batch_size, micro_batch_tokens: the forwards' micro-batches (`micro_batches`).
        loss_mask: [B] bool, False drops a whole completion from the loss (e.g. truncated ones).
        world: the ranks sharing the batch, this rollout being one rank's share (`lmrl.distributed`).
        baseline: [B / G] rewards of each prompt's greedy completion (advantage=remax).
    """
    group_size = rollout.group_size  # episodes per prompt
    rollout, episode, scores, mask, info = _per_sample(rollout, scores, loss_mask, dict(info or {}))

    micro = (micro_batch_size, micro_batch_tokens)
    # 1. the policy's forward: old log-probs and entropy, and the per-token weights they give (TIS, entropy mask)
    old, entropy = _policy_forward(policy_logprobs, rollout, micro, world)
    weights = _token_weights(rollout, old, entropy, mask, info, tis_cap=tis_cap, tis_mode=tis_mode, tis_low=tis_low,
                             entropy_top_fraction=entropy_top_fraction)
    # 2. the reference's log-probs and the critic's values
    ref = _forward(ref_logprobs, rollout, micro, world)
    values = _forward(critic_values, rollout, micro, world)
    # 3. the KL to the reference, and the rewards the advantages see
    kl, rewards = _kl_and_rewards(rollout, scores, mask, old, ref, info, kl_in=kl_in, kl_estimator=kl_estimator,
                                  kl_clamp=kl_clamp, reward_minus_kl_coef=reward_minus_kl_coef, episode=episode)
    # 4. advantages
    adv = compute_advantages(rewards, mask, group_size, advantage=advantage, gamma=gamma, lam=lam,
                             whiten_advantages=whiten_advantages, whiten_std=whiten_std, use_advantages=use_advantages,
                             relu_log_p_weights=relu_log_p_weights, pass_k=pass_k, kl=kl, kl_coef=kl_coef, kl_in=kl_in,
                             kl_level=kl_level, values=values, world=world, baseline=baseline, episode_index=episode)
    if adv.relu_zeroed is not None:
        info["relu_zeroed"] = adv.relu_zeroed
    teacher = _forward(teacher_logprobs, rollout, micro, world)
    if teacher is not None:  # on-policy distillation: the teacher's verdict on each sampled token
        adv.advantages = adv.advantages + _distill_signal(rollout, old, teacher, mask, info, distill_coef)
    # 5. each group's clip-filter-like weight on its rows
    if clip_filter_like_weight is not None:
        weights = _times_clip_filter(weights, rewards, mask, info, group_size, clip_filter_like_weight, world, episode)

    # 6. the Experience
    info["length"] = rollout.response_mask.sum(1)
    info["finished"] = rollout.finished
    if entropy is not None:
        info["entropy"] = A.masked_mean(entropy, mask, dim=1)
    return Experience(
        sequences=rollout.sequences,
        attention_mask=rollout.attention_mask,
        response_mask=mask,
        old_logprobs=old,
        advantages=adv.advantages,
        scores=scores.double(),  # rewards beyond float32's range stay finite in metrics
        group_index=rollout.prompt_index,
        ref_logprobs=ref,
        values=values,
        returns=adv.returns,
        rewards=adv.rewards,
        weights=weights,
        # one update per batch: the update's own forward reweighs against the sampling log-probs
        rollout_logprobs=rollout.logprobs.float() if old is None and tis_cap is not None else None,
        info=info,
        media=rollout.media,
        media_index=rollout.media_index,
        episode_index=episode,
    )


def _per_sample(rollout: Rollout, scores: torch.Tensor, loss_mask: torch.Tensor | None, info: dict[str, torch.Tensor]
                ) -> tuple[Rollout, torch.Tensor | None, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A row per sample where an agent's episode is several (`lmrl.rollout.samples`), with [R] the episode of each
    and its episode's score and `info`; and the [R, T] tokens trained on (`loss_mask` [B] drops whole episodes)."""
    rollout, episode = split_samples(rollout, pad_id=0)
    if episode is not None:
        scores, info = scores[episode], {k: v[episode] for k, v in info.items()}
        loss_mask = None if loss_mask is None else loss_mask[episode]
    mask = rollout.response_mask.bool()
    if loss_mask is not None:
        mask = mask & loss_mask[:, None].bool()
    return rollout, episode, scores, mask, info


def _media(rollout: Rollout) -> tuple[list, torch.Tensor] | None:
    return None if rollout.media is None else (rollout.media, rollout.media_rows)


def _policy_forward(
    fn: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None,
    rollout: Rollout,
    micro: tuple[int, int | None],
    world: World,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The policy's [B, T] old log-probs and entropy; (None, None) without its forward."""
    if fn is None:
        return None, None
    seqs, T = rollout.sequences, rollout.response_ids.shape[1]
    outs = batched_forward(fn, seqs, rollout.attention_mask, T, micro[0], world, media=_media(rollout),
                           micro_batch_tokens=micro[1], group_index=rollout.prompt_index)
    return _cat([o[0] for o in outs], seqs, T), _cat([o[1] for o in outs], seqs, T)


def _token_weights(rollout: Rollout, old: torch.Tensor | None, entropy: torch.Tensor | None, mask: torch.Tensor,
                   info: dict[str, torch.Tensor], *, tis_cap: float | None, tis_mode: str, tis_low: float,
                   entropy_top_fraction: float | None) -> torch.Tensor | None:
    """[B, T] TIS weights times the top-entropy mask (None: neither); adds the TIS metrics to `info`."""
    weights = None
    if old is not None and tis_cap is not None:
        # the sampler's probabilities differ from the trainer's: reweight instead of pretending on-policy
        weights = rollout_is_weights(old, rollout.logprobs.float(), mask, tis_mode=tis_mode, tis_cap=tis_cap,
                                     tis_low=tis_low)
        info["tis_weight"] = A.masked_mean(weights, mask, dim=1)
        info["tis_masked"] = ((weights == 0) & mask).sum(1).float()
        info["sampler_kl"] = A.masked_mean(rollout.logprobs.float() - old, mask, dim=1)  # k1: KL(sampler || trainer)
        info["sampler_diff"] = A.masked_mean((rollout.logprobs.float() - old).abs(), mask, dim=1)  # the sync check's
    if entropy_top_fraction is not None:
        if entropy is None:
            raise ValueError("algorithm.entropy_top_fraction needs the policy forward (entropy) in make_experience")
        keep = top_entropy_mask(entropy, mask, entropy_top_fraction).float()
        weights = keep if weights is None else weights * keep
    return weights


def _forward(fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None, rollout: Rollout,
             micro: tuple[int, int | None], world: World) -> torch.Tensor | None:
    """[B, T] float32 of `fn(sequences, attention_mask, T)` over the rollout's micro-batches; None without `fn`."""
    if fn is None:
        return None
    seqs, T = rollout.sequences, rollout.response_ids.shape[1]
    return _cat(batched_forward(fn, seqs, rollout.attention_mask, T, micro[0], world, media=_media(rollout),
                                micro_batch_tokens=micro[1], group_index=rollout.prompt_index), seqs, T)


def _kl_and_rewards(rollout: Rollout, scores: torch.Tensor, mask: torch.Tensor, old: torch.Tensor | None,
                    ref: torch.Tensor | None, info: dict[str, torch.Tensor], *, kl_in: str, kl_estimator: str,
                    kl_clamp: str, reward_minus_kl_coef: float, episode: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """[B, T] KL to the reference (None without one) and the [B] rewards the advantages see; KL metrics to `info`."""
    if ref is None:
        return None, scores
    # the KL that enters the reward uses the configured estimator; in the loss it is only reported (k1)
    behaviour = old if old is not None else rollout.logprobs.float()
    in_reward = kl_in == "reward"
    kl = A.kl_penalty(behaviour, ref, estimator=kl_estimator if in_reward else "k1",
                      clamp=kl_clamp_option(kl_clamp) if in_reward else None)
    info["kl"] = A.masked_sum(kl, mask, dim=1)
    # k3, never negative, summed per sequence: the `kl` TRL's GRPOTrainer logs (a token mean of it)
    info["kl_k3"] = A.masked_sum(A.kl_penalty(behaviour, ref, "k3"), mask, dim=1)
    rewards = scores
    if reward_minus_kl_coef:  # TapeAgents: the reward minus the sequence's k3 KL, before advantages
        kl_k3 = episode_sum(info["kl_k3"].to(scores.dtype), episode)  # an episode's, over its samples
        rewards = info["reward_minus_kl"] = scores - reward_minus_kl_coef * kl_k3
    return kl, rewards


def _distill_signal(rollout: Rollout, old: torch.Tensor | None, teacher: torch.Tensor, mask: torch.Tensor,
                    info: dict[str, torch.Tensor], coef: float) -> torch.Tensor:
    """[B, T] on-policy distillation's per-token advantage (`lmrl.algorithms.distill_advantages`); adds each row's
    summed reverse KL and teacher log-prob to `info` (metrics: distill/*)."""
    student = old if old is not None else rollout.logprobs.float()
    rkl = A.distill_reverse_kl(student, teacher, mask)
    info["distill_rkl"] = rkl.sum(1)
    info["distill_teacher_logp"] = A.masked_sum(teacher, mask, dim=1)
    return A.distill_advantages(student, teacher, mask, coef).to(torch.float32)


def _times_clip_filter(weights: torch.Tensor | None, rewards: torch.Tensor, mask: torch.Tensor,
                       info: dict[str, torch.Tensor], group_size: int, cap: float, world: World,
                       episode: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] `weights` (None: ones) times each row's clip-filter-like weight (its episode's, over episodes); adds
    that [B] weight to `info`."""
    first = first_rows(episode)
    w = clip_filter_weights(rewards if first is None else rewards[first], group_size, cap, world)
    w = w if episode is None else w[episode]  # [B]
    info["clip_filter_weight"] = w
    w = w[:, None].float().expand(mask.shape)
    return w if weights is None else weights * w


def _cat(parts: list[torch.Tensor], sequences: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] float32 from per-micro-batch results ([0, T] for a rank left without rows)."""
    return torch.cat(parts).float() if parts else torch.zeros(0, T, device=sequences.device)


def _sequence_advantages(advantage: str, scores: torch.Tensor, group_size: int, world: World,
                         baseline: torch.Tensor | None, pass_k: int) -> torch.Tensor:
    """[B] advantages of a sequence-level estimator; batch statistics span every rank's share."""
    if advantage == "remax":
        if baseline is None:
            raise ValueError("algorithm.advantage=remax needs the greedy completions' rewards (baseline)")
        return A.remax_advantages(scores, baseline.to(scores.dtype), group_size)
    if advantage == "pass_at_k":
        return A.pass_at_k_advantages(scores, group_size, pass_k)
    if world.distributed and advantage == "grpo_batch_std":
        return A.batch_std_advantages(scores, group_size, std=std_across_ranks(scores, world))
    if world.distributed and advantage == "gpg":
        return A.gpg_advantages(scores, group_size, informative_fraction=_informative_fraction(scores, group_size, world))
    return SEQUENCE_ESTIMATORS[advantage](scores, group_size)


def _informative_fraction(scores: torch.Tensor, group_size: int, world: World) -> torch.Tensor:
    """The share of groups whose rewards are not all equal, over every rank's groups."""
    ok = A.informative_groups(scores, group_size, tol=0.0).double()
    counts = world.sum(torch.stack([ok.sum(), torch.tensor(float(len(ok)), dtype=torch.float64, device=ok.device)]))
    return counts[0] / counts[1].clamp(min=1)


def rollout_is_weights(old: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, tis_mode: str = "truncate",
                       tis_cap: float | None = None, tis_low: float = 0.5) -> torch.Tensor:
    """[B, T] weights correcting for a sampler whose probabilities differ from the trainer's (`algorithm.tis_mode`)."""
    if tis_mode == "truncate":
        return A.truncated_is_weights(old, rollout_logp, mask, cap=tis_cap)
    level = "token" if tis_mode == "icepop" else "sequence"
    return A.masked_is_weights(old, rollout_logp, mask, low=tis_low, high=tis_cap, level=level)


def clip_filter_weights(scores: torch.Tensor, group_size: int, cap: float, world: World = ONE_PROCESS) -> torch.Tensor:
    """`lmrl.algorithms.clip_filter_like_weights` with the informative share of the whole batch (every rank's)."""
    fraction = _informative_fraction(scores, group_size, world) if world.distributed else None
    return A.clip_filter_like_weights(scores, group_size, max_weight=cap, informative_fraction=fraction)


def kl_clamp_option(kl_clamp: str) -> str | None:
    """`algorithm.kl_clamp` as `lmrl.algorithms.kl_penalty` takes it."""
    return None if kl_clamp == "none" else kl_clamp
