"""torch.distributed for lmrl: one process per rank, started by `torchrun`, gloo on CPU and NCCL on GPUs.

Data parallelism as lmrl does it: every rank holds the whole policy, makes experience from its own
share of the prompts (a group never spans ranks, so group statistics stay local), and the update
sums the ranks' gradients. Whatever the single-process run computes over the whole batch is summed
over ranks first: the loss normaliser (token or sequence counts), whitening statistics and metrics.
So one optimizer step on N ranks equals one step of a single process over the same global batch.

Gradients are summed with one all-reduce per step, after the last micro-batch's backward, over a
flat buffer (not torch's DistributedDataParallel, which averages gradients and overlaps the
reduction with the backward): the sum keeps "normalise by the global batch" exact and readable.

Without torchrun's environment (`WORLD_SIZE` unset) everything here is the identity: `World()` is
one rank and no collective is called.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmrl import algorithms as A
from lmrl.errors import ConfigError, RunError


@contextlib.contextmanager
def _collective(rank: int):
    """A collective that fails because another rank died (gloo: "Connection closed by peer") is one line on
    this rank; the rank that failed first has printed its own."""
    try:
        yield
    except RuntimeError as e:
        error = RunError(f"rank {rank}: another rank stopped (its error is above), so this one stops too")
        error.exit_code = 1
        raise error from e


@dataclass(frozen=True)
class World:
    """The ranks of a run. `World()` (the default) is a single process."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # where collectives' tensors must live: "cuda:<local rank>" with NCCL

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs, prints and writes files other than sharded state."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over ranks (a new tensor; x itself on one rank)."""
        if not self.distributed:
            return x
        out = x.detach().to(self.device, copy=True)
        with _collective(self.rank):
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(x.device)

    def first(self, value):
        """Rank 0's `value` on every rank (a picklable object)."""
        if not self.distributed:
            return value
        box = [value]
        with _collective(self.rank):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            with _collective(self.rank):
                dist.barrier()

    def all(self, flag: bool) -> bool:
        """True when `flag` is True on every rank."""
        if not self.distributed:
            return flag
        t = torch.tensor([0.0 if flag else 1.0], device=self.device)
        with _collective(self.rank):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.item() == 0.0

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of the whole batch from each rank's: `loss/*` (each rank's share of the global loss) summed,
        the others averaged over the ranks that logged them."""
        if not self.distributed:
            return metrics
        every: list[dict[str, float]] = [{} for _ in range(self.size)]
        with _collective(self.rank):
            dist.all_gather_object(every, metrics)
        out = {}
        for key in sorted({k for m in every for k in m}):
            values = [m[key] for m in every if key in m]
            out[key] = sum(values) if key.startswith("loss/") else sum(values) / len(values)
        return out

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over ranks (one all-reduce of a flat buffer). A missing
        gradient counts as zeros, so that every rank reduces the same buffer."""
        if not self.distributed or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).to(self.device, torch.float32) for g in grads])
        with _collective(self.rank):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g).to(g.device, g.dtype)
            offset += n

    def shard(self, count: int, what: str = "rollout.prompts_per_step") -> slice:
        """This rank's contiguous share of `count` items (prompts: whole groups stay on one rank)."""
        if count % self.size:
            raise ConfigError(f"{what}: {count} does not split evenly over {self.size} ranks; make it a multiple of "
                              f"{self.size}")
        per = count // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


ONE_PROCESS = World()
"""The world of a run not started by torchrun."""


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, world: World, eps: float = 1e-8) -> torch.Tensor:
    """`lmrl.algorithms.masked_whiten` over the batch of every rank: (x - mean) / (std + eps) with the mean and
    unbiased std of the masked entries of all ranks together; masked-out entries become 0."""
    if not world.distributed:
        return A.masked_whiten(x, mask, eps=eps)
    mask = mask.bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    stats = world.sum(torch.stack([torch.where(mask, x, zero).sum(), mask.sum().to(x.dtype)]))
    mean = stats[0] / stats[1].clamp(min=1)
    square = world.sum(torch.where(mask, (x - mean) ** 2, zero).sum())
    std = (square / (stats[1] - 1).clamp(min=1)).sqrt()
    return torch.where(mask, (x - mean) / (std + eps), zero)


def init_world() -> World:
    """Join the process group torchrun set up (gloo on CPU, NCCL when CUDA is available), or `World()` when
    this process was not started by torchrun."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    nccl = torch.cuda.is_available()
    if not dist.is_initialized():
        if nccl:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if nccl else "gloo")
    return World(rank, size, local_rank, f"cuda:{local_rank}" if nccl else "cpu")
