"""torch.distributed for lmrl: one process per rank, started by `torchrun`, gloo on CPU and NCCL on GPUs.

Data parallelism as lmrl does it: every rank holds the whole policy, makes experience from its own
share of the prompts (a group never spans ranks, so group statistics stay local), and the update
sums the ranks' gradients. Whatever the single-process run computes over the whole batch is summed
over ranks first: the loss normaliser (token or sequence counts), whitening statistics and metrics.
So one optimizer step on N ranks equals one step of a single process over the same global batch.

Gradients are summed with one all-reduce per step, after the last micro-batch's backward, over a
flat buffer (not torch's DistributedDataParallel, which averages gradients and overlaps the
reduction with the backward): the sum keeps "normalise by the global batch" exact and readable.

With `train.parallel=fsdp` the policy, reference and critic are sharded instead (FSDP2's
`fully_shard`, one unit per decoder layer): a unit gathers its weights from every rank when it runs and
frees them after, and FSDP's reduce-scatter sums (not averages) the gradients into each rank's shard.
Every forward of a sharded model is then a collective, so ranks must make the same number of them: a
rank with fewer micro-batches than another makes idle ones (`World.calls`, `idle_batch`), and
generation runs on the whole weights gathered once (`full_weights`), where ranks may decode for
different numbers of steps.

Without torchrun's environment (`WORLD_SIZE` unset) everything here is the identity: `World()` is
one rank and no collective is called.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmrl import algorithms as A
from lmrl.errors import ConfigError, RunError

FSDP_AUTO_PARAMS = 10**9
"""train.parallel=auto shards policies of this many parameters or more (their float32 weights, gradients
and AdamW moments take 16 GB per rank unsharded)."""


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
    sharded: bool = False  # the models are FSDP-sharded: every forward is a collective (`calls`)

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

    def gather(self, value) -> list:
        """Every rank's `value` (a picklable object), in rank order, on every rank."""
        if not self.distributed:
            return [value]
        every = [None] * self.size
        with _collective(self.rank):
            dist.all_gather_object(every, value)
        return every

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

    def most(self, n: int) -> int:
        """The largest `n` of any rank."""
        if not self.distributed:
            return n
        t = torch.tensor([float(n)], device=self.device)
        with _collective(self.rank):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def calls(self, n: int) -> int:
        """How many forwards to make when this rank needs `n`: with sharded models every rank makes as many
        as the rank that needs the most (the extra ones on `idle_batch`, their outputs unused)."""
        return self.most(n) if self.sharded else n

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of the whole batch from each rank's: `loss/*` (each rank's share of the global loss) summed,
        minima (`.../min_length`) and maxima (`val/ratio_max`) taken over ranks, the others averaged over the
        ranks that logged them."""
        if not self.distributed:
            return metrics
        every: list[dict[str, float]] = self.gather(metrics)
        out = {}
        for key in sorted({k for m in every for k in m}):
            values = [m[key] for m in every if key in m]
            last = key.rsplit("/", 1)[-1]
            if key.startswith("loss/"):
                out[key] = sum(values)
            elif last.startswith("min") or last.endswith("_min"):
                out[key] = min(values)
            elif last.startswith("max") or last.endswith("_max"):
                out[key] = max(values)
            else:
                out[key] = sum(values) / len(values)
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


def whiten_across_ranks(x: torch.Tensor, mask: torch.Tensor, world: World, eps: float = 1e-8,
                        unbiased: bool = True) -> torch.Tensor:
    """`lmrl.algorithms.masked_whiten` over the batch of every rank: (x - mean) / (std + eps) with the mean and
    std (unbiased, or population with `unbiased=False`) of the masked entries of all ranks together; masked-out
    entries become 0."""
    if not world.distributed:
        return A.masked_whiten(x, mask, eps=eps, unbiased=unbiased)
    mask = mask.bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    mean, std = _world_mean_std(x, mask, world, unbiased)
    return torch.where(mask, (x - mean) / (std + eps), zero)


def std_across_ranks(x: torch.Tensor, world: World, unbiased: bool = True) -> torch.Tensor:
    """The std of the 1-D `x` of every rank together (a 0-dim tensor)."""
    return _world_mean_std(x, torch.ones_like(x, dtype=torch.bool), world, unbiased)[1]


def _world_mean_std(x: torch.Tensor, mask: torch.Tensor, world: World, unbiased: bool):
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    stats = world.sum(torch.stack([torch.where(mask, x, zero).sum(), mask.sum().to(x.dtype)]))
    mean = stats[0] / stats[1].clamp(min=1)
    square = world.sum(torch.where(mask, (x - mean) ** 2, zero).sum())
    std = (square / (stats[1] - (1 if unbiased else 0)).clamp(min=1)).sqrt()
    return mean, std


def init_world() -> World:
    """Join the process group torchrun set up (gloo on CPU, NCCL when CUDA is available), or `World()` when
    this process was not started by torchrun."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    nccl = torch.cuda.is_available()
    if nccl and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"torchrun started {os.environ.get('LOCAL_WORLD_SIZE', local_rank + 1)} processes on this node, "
                          f"which has {torch.cuda.device_count()} GPU(s): start one process per GPU (--nproc-per-node), "
                          "or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run CPU processes")
    if not dist.is_initialized():
        if nccl:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if nccl else "gloo")
    return World(rank, size, local_rank, f"cuda:{local_rank}" if nccl else "cpu")


# ------------------------------------------------------------------------------------------- FSDP2
def idle_batch(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sequences [1, 2], attention_mask [1, 2], T = 1): the smallest input a causal LM scores, for the
    forwards a rank makes only to keep in step with the others (`World.calls`)."""
    return (torch.zeros(1, 2, dtype=torch.long, device=device), torch.ones(1, 2, dtype=torch.bool, device=device), 1)


def choose_parallel(setting: str, world: World, policy: torch.nn.Module, lora: bool, sampler_copy: bool) -> tuple[str, str]:
    """("ddp" or "fsdp", why) for `train.parallel` under torchrun (("none", "") in one process). auto: fsdp from
    FSDP_AUTO_PARAMS parameters, except for what fsdp does not shard (a LoRA run, a sampler copy)."""
    if not world.distributed:
        return "none", ""
    if setting != "auto":
        return setting, "as set"
    count = sum(p.numel() for p in policy.parameters())
    if count < FSDP_AUTO_PARAMS:
        return "ddp", f"auto: {_amount(count)} parameters, fewer than {_amount(FSDP_AUTO_PARAMS)}"
    if lora or sampler_copy:
        return "ddp", f"auto: fsdp does not shard {'LoRA runs' if lora else 'a sampler copy in rollout.dtype'} yet"
    return "fsdp", f"auto: {_amount(count)} parameters"


def _amount(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (the classes its `_no_split_modules` names, e.g.
    LlamaDecoderLayer): FSDP's units, each gathered on its own."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(model: torch.nn.Module, world: World, bf16: bool = False) -> list[torch.nn.Module]:
    """FSDP2 over `model`, in place: each decoder layer one unit, the rest (embeddings, final norm, head,
    value head) the root unit. Gradients are summed over ranks (divide factor 1), as the ddp path sums
    them, so that losses normalised by the global batch stay exact. `bf16`: compute in bfloat16 with
    float32 gradient reduction (FSDP's mixed precision, where `train.autocast_bf16` asks for bfloat16).
    Returns the units, root last."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.split(":")[0], (world.size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:  # a plain SUM (gloo has no pre-multiplied sum; a divide factor of 1 is one)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return units


@contextlib.contextmanager
def full_weights(units: list[torch.nn.Module]) -> Iterator[None]:
    """Every unit's whole weights on this rank for the block, gathered once (a collective: every rank
    enters it), and sharded again after. Inside, forwards gather nothing, so that ranks may make
    different numbers of them (generation: a rank's rows finish at their own step)."""
    if not units:
        yield
        return
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


def set_gradient_sync(units: list[torch.nn.Module], sync: bool) -> None:
    """FSDP reduce-scatters gradients after a backward only when `sync`: the last micro-batch's, once the
    others have accumulated into the unsharded gradients."""
    for unit in units:
        unit.set_requires_gradient_sync(sync, recurse=False)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a DTensor), or `t`."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def whole_state(module: torch.nn.Module | None) -> dict[str, torch.Tensor] | None:
    """The whole state dict of a sharded module on rank 0, in CPU memory (a collective: every rank calls it;
    the other ranks get an empty dict). None for None."""
    if module is None:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
