"""One optimizer step per algorithm over the same global batch, on however many ranks torchrun started
(or one process without torchrun): each rank makes experience from its share of the batch's groups and
the update sums gradients over ranks. Rank 0 saves the trained parameters to OUT/<algorithm>.pt.

    python tests/dist_driver.py OUT grpo rloo ppo
    torchrun --standalone --nproc_per_node 2 tests/dist_driver.py OUT grpo rloo ppo
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lmrl.config import load_config
from lmrl.distributed import ONE_PROCESS
from lmrl.experience import select_rollout
from lmrl.trainer import Collected, Trainer

# 8 prompts x 4 completions of the shipped task; a learning rate that moves weights visibly in one step
COMMON = ["rollout.prompts_per_step=8", "rollout.group_size=4", "data.num_eval_prompts=0", "log.console=false",
          "optim.lr=1e-3", "optim.micro_batch_size=8", "train.threads=1"]


def share(c: Collected, world, group_size: int) -> Collected:
    """This rank's whole groups of a collected batch."""
    groups = world.shard(len(c.rows))
    index = torch.arange(groups.start * group_size, groups.stop * group_size)
    rollout = select_rollout(c.rollout, index)
    rollout.prompt_index = torch.arange(groups.stop - groups.start).repeat_interleave(group_size)
    keep = None if c.keep is None else c.keep[index]
    return Collected(rollout, c.scores[index], keep, c.rows[groups], c.metrics,
                     {k: v[index] for k, v in c.per_function.items()})


# variants of GRPO that must keep working on several ranks
VARIANTS = {"grpo-lora": ["algorithm=grpo", "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"],
            "grpo-checkpointing": ["algorithm=grpo", "model.gradient_checkpointing=true"]}


def main(out: Path, algorithms: list[str]) -> None:
    for name in algorithms:
        chosen = VARIANTS.get(name, [f"algorithm={name}"])
        cfg = load_config(None, [*COMMON, *chosen, f"train.output_dir={out}/{name}"])
        trainer = Trainer(cfg)
        world, trainer.world = trainer.world, ONE_PROCESS
        c = trainer.collect(1)  # the global batch as one process collects it: seeded, the same on every rank
        trainer.world = world
        trainer.update(trainer.experience(share(c, world, cfg.rollout.group_size)))
        if trainer.world.main:
            params = {f"policy.{k}": v for k, v in trainer.policy.state_dict().items()}
            if trainer.models.critic is not None:
                params |= {f"critic.{k}": v for k, v in trainer.models.critic.state_dict().items()}
            torch.save(params, out / f"{name}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
