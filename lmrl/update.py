"""The update: one batch of experience -> optimizer steps on the policy (and the critic).

    for iteration in 1..num_iterations:
        for minibatch in a shuffled split of the batch into num_minibatches:      one optimizer step
            for micro-batch in the minibatch:                                      gradient accumulation
                policy forward with grad -> policy loss (+ value loss, - entropy bonus) -> backward
            sum the gradients over ranks, clip, step

How it departs from a textbook PPO update, and why:
  1. With one update per batch (num_iterations = num_minibatches = 1) the policy that sampled *is* the policy
     being trained, so the update's own forward, detached, gives the old log-probs: no second forward, and the
     ratio is exactly 1 (`needs_old_logprobs`). When a copy in another dtype samples (rollout.dtype), the same
     forward gives the truncated importance weights against the sampler's log-probs.
  2. Losses are normalised by the whole minibatch, not each micro-batch: gradient accumulation over 1 x 8 or
     8 x 1 sequences gives the same update.
  3. Rows whose advantages are all 0 (a GRPO group whose completions all scored the same) contribute exactly
     nothing to the loss or its gradient: when no entropy bonus, KL-in-loss term or critic acts on them, they
     are left out of the forward and backward (`Updater.rows_with_gradient`).
  4. A non-finite loss or gradient norm skips the step: no weight, optimizer state or learning rate moves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmrl import algorithms as A
from lmrl.distributed import World, idle_batch, set_gradient_sync
from lmrl.experience import Experience, kl_clamp_option, micro_batches, rollout_is_weights, row_tokens
from lmrl.models.forward import Forwards


def _clips(a) -> dict[str, Any]:
    return {"clip_low": a.clip_low, "clip_high": a.clip_high}


# The policy losses by `algorithm.loss`: the function, and its options beyond those every loss takes
# (aggregation, KL to the reference, weights, normalizer), from the algorithm config and a torch.Generator.
POLICY_LOSSES = {
    "ppo": (A.policy_loss, lambda a, rng: {**_clips(a), "dual_clip": a.dual_clip, "ratio_level": a.ratio_level}),
    "cispo": (A.cispo_loss, lambda a, rng: _clips(a)),
    "cpgd": (A.cpgd_loss, lambda a, rng: {**_clips(a), "drift_coef": a.drift_coef}),
    "sapo": (A.sapo_loss, lambda a, rng: {"tau_pos": a.tau_pos, "tau_neg": a.tau_neg}),
    "gmpo": (A.gmpo_loss, lambda a, rng: _clips(a)),
    "clip_cov": (A.clip_cov_loss, lambda a, rng: {**_clips(a), "clip_fraction": a.clip_cov_fraction,
                                                  "cov_low": a.clip_cov_bounds[0], "cov_high": a.clip_cov_bounds[1],
                                                  "generator": rng}),
    "kl_cov": (A.kl_cov_loss, lambda a, rng: {"kl_fraction": a.kl_cov_fraction, "cov_kl_coef": a.kl_cov_coef}),
}


def balanced(exp: Experience, world: World, live: torch.Tensor | None = None) -> Experience:
    """This rank's share of the whole batch, whole groups moved between ranks so that each trains on about as many
    packed tokens as any other (the largest group first, to the rank with the fewest tokens so far; `live`: the
    indices of the rows the update will run, the only ones counted; None: all). The update stays the same: losses
    are normalised over the whole minibatch and gradients summed over ranks. A batch with images stays where it is
    (its bundles are indexed per rank)."""
    if not world.distributed or exp.media is not None:
        return exp
    prompt, response = row_tokens(exp.attention_mask, exp.num_response_tokens)
    kept = set(range(len(exp))) if live is None else set(live.tolist())
    costs = [sum(response[r] for r in rows if r in kept) + prompt[rows[0]] * any(r in kept for r in rows)
             for rows in _group_rows(exp)]
    everyone = world.gather(costs)
    load, owner = [0] * world.size, {}
    for cost, rank, g in sorted(((c, r, i) for r, cs in enumerate(everyone) for i, c in enumerate(cs)),
                                key=lambda x: (-x[0], x[1], x[2])):
        owner[rank, g] = min(range(world.size), key=lambda k: (load[k], k))
        load[owner[rank, g]] += cost
    if all(owner[rank, g] == rank for rank, g in owner):
        return exp
    mine = []
    for rank, share in enumerate(world.gather(exp.to("cpu"))):
        for g, rows in enumerate(_group_rows(share)):
            if owner[rank, g] == world.rank:
                part = share.select(torch.tensor(rows))
                part.group_index = torch.full((len(rows),), len(mine))
                part.episode_index = None  # a logging aid of the batch before it was traded
                mine.append(part)
    return concat(mine, exp).to(exp.sequences.device)


def _group_rows(exp: Experience) -> list[list[int]]:
    """The rows of each group of `exp`, groups in their order of first appearance."""
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(exp.group_index.tolist()):
        groups.setdefault(g, []).append(row)
    return list(groups.values())


def concat(parts: list[Experience], like: Experience) -> Experience:
    """The rows of several batches as one: prompts left-padded and responses right-padded to the widest (`like`:
    a batch of the same run, for an empty result)."""
    if not parts:
        return like.select(torch.arange(0))
    P = max(x.sequences.shape[1] - x.num_response_tokens for x in parts)
    T = max(x.num_response_tokens for x in parts)

    def widen(x: Experience, name: str, t: torch.Tensor) -> torch.Tensor:
        p, t_x = x.sequences.shape[1] - x.num_response_tokens, x.num_response_tokens
        if name in ("sequences", "attention_mask"):  # the prompt left-padded, the response right-padded
            return torch.cat([t.new_zeros(len(t), P - p), t, t.new_zeros(len(t), T - t_x)], dim=1)
        if t.dim() == 2:  # [b, T] per response token
            return torch.cat([t, t.new_zeros(len(t), T - t_x)], dim=1)
        return t  # [b] per row

    out = {}
    for f in dataclasses.fields(Experience):
        values = [getattr(x, f.name) for x in parts]
        if isinstance(values[0], torch.Tensor):
            out[f.name] = torch.cat([widen(x, f.name, v) for x, v in zip(parts, values)])
        elif isinstance(values[0], dict):
            out[f.name] = {k: torch.cat([v[k] for v in values]) for k in values[0]}
        else:
            out[f.name] = values[0]
    return Experience(**out)


@dataclass
class _Norms:
    """What a minibatch's losses are divided by, the whole global minibatch's (so micro-batches add up to it)."""

    policy: Any  # the policy loss's normaliser (and the entropy bonus's)
    value: Any  # the value loss's: the global minibatch's real tokens
    length: int  # seq-mean-token-sum-norm's constant length
    metric: Any = None  # the live rows' own normaliser, for the entropy metric


def needs_old_logprobs(a) -> bool:
    """A separate no-grad policy forward for the old log-probs (`make_experience`): only when the batch serves
    more than one update (or the entropy filter needs the entropy before the update)."""
    return a.num_iterations > 1 or a.num_minibatches > 1 or a.entropy_top_fraction is not None


class Updater:
    """Optimizer steps on batches of experience (`update`), as `algorithm` and `optim` configure them.

    Args:
        cfg: the run's config (its `algorithm`, `optim` and `rollout.max_new_tokens`).
        forwards: the run's model forwards (`lmrl.models.forward.Forwards`).
        optimizer, scheduler: the policy's (and critic's) optimizer and learning-rate schedule.
        kl: the KL coefficient's controller (`lmrl.algorithms.KLController`): its current value weighs a KL term.
        world: the ranks (`lmrl.distributed.World`); gradients are summed over them.
        units: FSDP units of the trained models (empty unless sharded): gradient sync waits for the last backward.
        rng: the generator that shuffles minibatches (checkpointed with the run).
    """

    def __init__(self, cfg, forwards: Forwards, optimizer: torch.optim.Optimizer, scheduler, kl, world: World,
                 units: list[torch.nn.Module], rng: torch.Generator):
        self.cfg, self.forwards, self.optimizer, self.scheduler = cfg, forwards, optimizer, scheduler
        self.kl, self.world, self.units, self.rng = kl, world, units, rng

    @property
    def _has_critic(self) -> bool:
        return self.forwards.critic_model is not None

    def update(self, exp: Experience) -> dict[str, float]:
        """num_iterations passes; each splits the batch into num_minibatches shuffled optimizer steps. Returns the
        metrics averaged over the steps and the ranks."""
        if self.cfg.optim.micro_batch_tokens is not None:  # every rank's share of the tokens about the same
            exp = balanced(exp, self.world, live=self.rows_with_gradient(exp))
        a, B = self.cfg.algorithm, len(exp)
        size, totals, count = B // a.num_minibatches, {}, 0
        for _ in range(a.num_iterations):
            order = torch.randperm(B, generator=self.rng) if a.num_minibatches > 1 else torch.arange(B)
            for m in range(a.num_minibatches):
                rows = order[m * size:(m + 1) * size]
                # the same minibatch with a prompt's rows adjacent, so micro-batches share prompts (the
                # shared-prompt forward) as much as they can; the order inside a minibatch changes nothing else
                rows = rows[torch.argsort(exp.group_index[rows], stable=True).cpu()]
                for k, v in self.optimizer_step(exp.select(rows)).items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
        return self.world.reduce_metrics({k: v / count for k, v in totals.items()})

    def optimizer_step(self, mb: Experience) -> dict[str, float]:
        """One optimizer step on a minibatch, accumulating gradients over micro-batches. Every loss is
        normalised by the whole minibatch, so the micro-batch split never changes the update."""
        a = self.cfg.algorithm
        norms = self._normalizers(mb)
        loss_fn, options = POLICY_LOSSES[a.loss]
        loss_fn = functools.partial(loss_fn, **options(a, self.rng))  # the loss and its options, for every micro-batch
        live = self.rows_with_gradient(mb)
        stats: dict[str, float] = {"update/rows_skipped": 1.0 - len(live) / len(mb)}
        mb = mb.select(live)  # the losses keep the whole minibatch's normalizer; metrics average over `live`
        norms.metric = A.loss_normalizer(mb.response_mask, a.aggregation, norm_length=norms.length)
        self.optimizer.zero_grad(set_to_none=True)
        finite, o = True, self.cfg.optim
        parts = micro_batches(mb.attention_mask, mb.num_response_tokens, o.micro_batch_size, o.micro_batch_tokens,
                              mb.group_index)
        calls = self.world.calls(len(parts))  # sharded models: as many backwards as the busiest rank makes
        for i in range(calls):
            set_gradient_sync(self.units, i == calls - 1)  # FSDP: reduce-scatter after the last
            if i >= len(parts):
                self.idle_backward()
                continue
            micro = mb.select(torch.arange(parts[i].start, parts[i].stop))
            share = len(micro) / len(mb)  # metrics average over micro-batches by size
            loss, step_stats = self.micro_batch_loss(micro, loss_fn, norms, share)
            finite = finite and math.isfinite(step_stats["loss/policy_avg"]) and math.isfinite(
                step_stats.get("loss/value_avg", 0.0))
            loss.backward()
            for k, v in step_stats.items():
                stats[k] = stats.get(k, 0.0) + v * share
        return stats | self._step(len(mb), finite)

    def _normalizers(self, mb: Experience) -> _Norms:
        """The loss normalisers of a minibatch: the policy loss's and the value loss's, over every rank's share of
        the global minibatch (token-sum's normaliser is 1 on every rank), and the length of seq-mean-token-sum-norm."""
        a = self.cfg.algorithm
        length = a.norm_length or self.cfg.rollout.max_new_tokens
        policy = A.loss_normalizer(mb.response_mask, a.aggregation, norm_length=length)
        policy = policy if a.aggregation == "token-sum" else self.world.sum(policy)
        value = self.world.sum(A.loss_normalizer(mb.response_mask, "token-mean"))
        return _Norms(policy, value, length)

    def micro_batch_loss(self, micro: Experience, loss_fn: Callable[..., Any], norms: _Norms,
                         share: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch (`loss_fn`, the policy loss with its options, minus the entropy bonus, plus
        the value loss) with its gradient, and its metrics; `share`: its fraction of the minibatch's rows."""
        a = self.cfg.algorithm
        T, kl_in_loss = micro.num_response_tokens, micro.ref_logprobs is not None and a.kl_in == "loss"
        out = self.forwards.policy(micro.sequences, micro.attention_mask, T, grad=True, hidden=self.forwards.shared_critic,
                                   media=micro.row_media())
        logp, entropy = out.logprobs, out.entropy
        old = micro.old_logprobs if micro.old_logprobs is not None else logp.detach().float()
        weights, stats = self._weights(micro, old)
        loss, m = loss_fn(logp, old, micro.advantages, micro.response_mask,
                          aggregation=a.aggregation, norm_length=norms.length,
                          ref_logp=micro.ref_logprobs if kl_in_loss else None, kl_coef=self.kl.value if kl_in_loss else 0.0,
                          kl_estimator=a.kl_estimator, kl_clamp=kl_clamp_option(a.kl_clamp),
                          weights=weights, normalizer=norms.policy)
        ent = A.aggregate_loss(entropy, micro.response_mask, a.aggregation, norm_length=norms.length,
                               normalizer=norms.policy)
        ent_metric = A.aggregate_loss(entropy.detach(), micro.response_mask, a.aggregation, norm_length=norms.length,
                                      normalizer=norms.metric)
        with torch.no_grad():  # TapeAgents' mean new log-prob of tokens with positive / negative weights
            lp, adv_tok = logp.detach().float(), micro.advantages
            for name, side in (("positive", adv_tok > 0), ("negative", adv_tok < 0)):
                stats[f"policy/logprob_{name}_weights"] = A.masked_mean(lp, micro.response_mask & side).item()
        stats |= {"policy/approxkl_avg": m.approx_kl, "policy/clipfrac_avg": m.clipfrac,
                  "clip_ratio/low_mean": m.clipfrac_low, "clip_ratio/high_mean": m.clipfrac_high, "val/ratio": m.ratio_mean,
                  "val/ratio_max": m.ratio_max, "loss/policy_avg": loss.item() / share,
                  "policy/entropy_avg": ent_metric.item() / share}
        if m.kl is not None:
            stats["objective/kl_loss"] = m.kl
        if a.entropy_coef:
            loss = loss - a.entropy_coef * ent
        if self._has_critic:
            values = self.forwards.update_values(micro.sequences, micro.attention_mask, T, out)
            vloss, vm = A.value_loss(values, micro.values, micro.returns, micro.response_mask, clip=a.value_clip,
                                     normalizer=norms.value)
            loss = loss + a.vf_coef * vloss
            stats.update({"loss/value_avg": vloss.item() / share, "val/clipfrac_avg": vm.vf_clipfrac})
        return loss, stats

    def _weights(self, micro: Experience, old: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The micro-batch's per-token loss weights: the experience's, times the truncated importance weights of
        the sampler's tokens when the sampler differs from the trainer; with the latter's metrics."""
        a, weights, stats = self.cfg.algorithm, micro.weights, {}
        if micro.rollout_logprobs is not None:  # the sampler differs from the trainer: reweight its tokens
            tis = rollout_is_weights(old, micro.rollout_logprobs, micro.response_mask, tis_mode=a.tis_mode,
                                     tis_cap=a.tis_cap, tis_low=a.tis_low)
            weights = tis if weights is None else weights * tis
            stats["val/tis_weight_mean"] = A.masked_mean(tis, micro.response_mask).item()
            stats["val/tis_masked_frac"] = A.masked_mean((tis == 0).float(), micro.response_mask).item()
            # k1 estimate of KL(sampler || trainer) on the sampler's tokens: how far apart the two policies are
            stats["val/sampler_kl"] = A.masked_mean(micro.rollout_logprobs - old.detach(), micro.response_mask).item()
            stats["val/sampler_logprob_diff"] = A.masked_mean((micro.rollout_logprobs - old.detach()).abs(),
                                                              micro.response_mask).item()
        return weights, stats

    def _step(self, rows: int, finite: bool) -> dict[str, float]:
        """Sum the accumulated gradients over ranks, clip them and step, unless the loss or the gradient norm is
        not finite on some rank (then nothing moves: guards.py counts the skip)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if rows == 0:  # no row carries a gradient: a zero gradient still moves Adam (momentum, decay)
            for p in params:
                p.grad = torch.zeros_like(p)
        if not self.world.sharded:  # (FSDP's reduce-scatter has summed them into each rank's shard)
            self.world.sum_gradients(params)  # the global minibatch's gradient (lmrl.distributed)
        finite = self.world.all(finite)  # every rank skips, or none
        # the norm is needed either way: a non-finite gradient skips the step (max_norm=inf scales by exactly 1)
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        stats = {"policy/grad_norm": grad_norm, "guard/skipped_updates": 0.0}
        if not (finite and math.isfinite(grad_norm)):  # no weight, optimizer state or LR moves (guards.py)
            self.optimizer.zero_grad(set_to_none=True)
            stats["guard/skipped_updates"] = 1.0
            return stats
        self.optimizer.step()
        self.scheduler.step()
        return stats

    def idle_backward(self) -> None:
        """A forward and backward that add nothing to any gradient, by a rank with fewer micro-batches than
        another: each gathers the sharded weights with the other ranks, so every rank makes as many."""
        seqs, attn, T = idle_batch(self.world.device)
        out = self.forwards.policy(seqs, attn, T, grad=True, hidden=self.forwards.shared_critic)
        loss = out.logprobs.sum() * 0.0
        if self._has_critic:
            loss = loss + self.forwards.update_values(seqs, attn, T, out).sum() * 0.0
        loss.backward()

    def rows_with_gradient(self, mb: Experience) -> torch.Tensor:
        """Indices of the rows whose loss has a gradient. A row whose advantages are all 0 adds exactly 0 to
        the policy loss and its gradient (GRPO groups whose completions all score the same, REINFORCE rows
        scoring 0); unless an entropy bonus, a KL term in the loss or a critic acts on it, leaving it out
        of the forward and backward changes nothing in the update: the loss normalizer stays the whole
        minibatch's."""
        a = self.cfg.algorithm
        kl_in_loss = mb.ref_logprobs is not None and a.kl_in == "loss" and self.kl.value > 0
        if a.entropy_coef or kl_in_loss or self._has_critic:
            return torch.arange(len(mb))
        return ((mb.advantages != 0) & mb.response_mask).any(1).nonzero().flatten()
