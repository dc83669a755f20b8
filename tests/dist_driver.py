"""One optimizer step per algorithm over the same global batch, on however many ranks torchrun started
(or one process without torchrun): each rank makes experience from its share of the batch's groups and
the update sums gradients over ranks. Rank 0 saves the trained parameters to OUT/<algorithm>.pt.

    python tests/dist_driver.py OUT grpo rloo ppo
    BATCHES=OUT torchrun --standalone --nproc_per_node 2 tests/dist_driver.py OUT2 grpo rloo ppo

One process also saves each global batch it collected (OUT/<algorithm>.batch.pt); with BATCHES set, the
ranks take those instead of collecting their own. The same prompts and seeds give the same completions
either way, but under FSDP generation takes transformers' decode instead of lmrl's fast decoder, whose
sampling log-probs differ in float rounding, and RLOO's KL in the reward reads them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from lmrl.config import load_config
from lmrl.distributed import ONE_PROCESS
from lmrl.rollout import select_rollout
from lmrl.trainer import Collected, Trainer

# 8 prompts x 4 completions of the shipped task; a learning rate that moves weights visibly in one step
COMMON = ["rollout.prompts_per_step=8", "rollout.group_size=4", "data.num_eval_prompts=0", "log.console=false",
          "optim.lr=1e-3", "optim.micro_batch_size=8", "train.threads=1",
          # a row's log-probs round up to 2e-7 differently with the rows that share its forward, in every forward
          # (packed, padded and transformers', measured 2026-11-29); the ranks leave out the rows without signal
          # and batch the rest unlike one process, and AdamW's first step makes 1e-5 of it (see below). Packed
          # forwards, whose shapes follow each micro-batch's rows, show it here; padded ones, at these seeds, do not
          "train.packing=false"]


def share(c: Collected, world, group_size: int) -> Collected:
    """This rank's whole groups of a collected batch (rank r of W takes groups r*n//W .. (r+1)*n//W: DAPO's
    dynamic sampling may keep a number of groups that does not split evenly)."""
    n = len(c.rows)
    groups = slice(world.rank * n // world.size, (world.rank + 1) * n // world.size)
    index = torch.arange(groups.start * group_size, groups.stop * group_size)
    rollout = select_rollout(c.rollout, index)
    rollout.prompt_index = torch.arange(groups.stop - groups.start).repeat_interleave(group_size)
    keep = None if c.keep is None else c.keep[index]
    return Collected(rollout, c.scores[index], keep, c.rows[groups], c.metrics,
                     {k: v[index] for k, v in c.per_function.items()})


# variants of GRPO that must keep working on several ranks
VARIANTS = {"grpo-lora": ["algorithm=grpo", "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"],
            "grpo-checkpointing": ["algorithm=grpo", "model.gradient_checkpointing=true"],
            # batch statistics over every rank's share: the std of TRL's scale_rewards="batch", the informative
            # share of GPG's scale and of the clip-filter-like weights
            "grpo-batch-std": ["algorithm=grpo", "algorithm.advantage=grpo_batch_std",
                               "algorithm.clip_filter_like_weight=3.0"],
            "gpg": ["algorithm=gpg"],
            # the reference of a LoRA run is the policy with its adapters disabled
            "rloo-lora": ["algorithm=rloo", "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"],
            # PPO's value head on the policy's backbone: the value loss's gradient reaches the policy too
            "ppo-shared": ["algorithm=ppo", "model.shared_critic=true"],
            # DAPO with dynamic sampling: one round keeps 5 groups of 8 (seed 2), split 2 + 3 over 2 ranks, and
            # micro-batches of one group, so that the ranks make different numbers of forwards
            # on-policy distillation: the teacher (the shipped calculator model: the same tokenizer, other weights)
            # scores each rank's share; its per-token signal joins GRPO's advantage
            "grpo-distill": ["algorithm=grpo", "algorithm.teacher=tiny-calculator"],
            # micro-batches of at most 30 tokens; the ranks trade groups so that each trains on about as many tokens
            "grpo-balanced": ["algorithm=grpo", "optim.micro_batch_tokens=30"],
            "dapo": ["algorithm=dapo", "algorithm.max_sampling_rounds=1", "train.seed=2", "optim.micro_batch_size=4",
                     "train.share_prompt=false"]}
# train.share_prompt=false where ranks batch rows differently than one process does (uneven shares; FSDP, under
# which the shared-prompt forward steps aside): its float rounding depends on which rows share a forward, and
# AdamW's first step, lr * g / (|g| + eps), turns 1e-7 of rounding in a near-zero gradient into 1e-5 of weight
# "<name>-fsdp": the same with the models sharded by FSDP2 (train.parallel=fsdp)
VARIANTS |= {f"{name}-fsdp": [*VARIANTS.get(name, [f"algorithm={name}"]), "train.parallel=fsdp", "train.share_prompt=false"]
             for name in ("grpo", "rloo", "ppo", "dapo", "grpo-checkpointing", "ppo-shared", "grpo-distill")}


def full_state(module) -> dict[str, torch.Tensor]:
    """The whole parameters of a module, sharded or not (a collective when sharded: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def main(out: Path, algorithms: list[str]) -> None:
    import lmrl.update

    moved = []  # whether `balanced` gave rank 0 other rows than it had (optim.micro_batch_tokens)
    real_balanced = lmrl.update.balanced

    def balanced(exp, world, live=None):
        out = real_balanced(exp, world, live)
        moved.append(len(out) != len(exp) or int(out.sequences.sum()) != int(exp.sequences.sum()))
        return out

    lmrl.update.balanced = balanced
    for name in algorithms:
        moved.clear()
        chosen = VARIANTS.get(name, [f"algorithm={name}"])
        cfg = load_config(None, [*COMMON, *chosen, f"train.output_dir={out}/{name}"])
        trainer = Trainer(cfg)
        world, trainer.collector.world = trainer.collector.world, ONE_PROCESS  # collect as one process does
        if os.environ.get("BATCHES"):
            c = torch.load(Path(os.environ["BATCHES"]) / f"{name}.batch.pt", weights_only=False)
        else:
            c = trainer.collect(1)  # the global batch as one process collects it: seeded, the same on every rank
            if not world.distributed:
                torch.save(c, out / f"{name}.batch.pt")
        trainer.collector.world = world
        trainer.update(trainer.experience(share(c, world, cfg.rollout.group_size)))
        params = {f"policy.{k}": v for k, v in full_state(trainer.policy).items()}
        if trainer.models.critic is not None:
            params |= {f"critic.{k}": v for k, v in full_state(trainer.models.critic).items()}
        if trainer.world.main:
            torch.save({"params": params, "groups": len(c.rows), "sharded": trainer.world.sharded,
                        "units": sorted(trainer.units), "moved": any(moved)}, out / f"{name}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    if torch.distributed.is_initialized():  # as lmrl.cli.main ends a rank
        torch.distributed.destroy_process_group()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
