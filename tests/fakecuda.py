"""A CUDA device on a machine without one, to catch device-placement bugs on the CPU.

On a CPU every tensor is on the same device, so a CPU tensor meeting a CUDA one (rewards scored on the CPU
added to a rollout on the GPU, a CPU generator's permutation indexing GPU tensors) cannot fail here: the
first run on a GPU found a whole layer of them. Inside `fake_cuda()`:

- `model.device=cuda` is accepted; whatever code puts on "cuda" (`.to("cuda")`, `.cuda()`, a factory's
  `device=`, `torch.Generator(device="cuda")`, `model.to(...)`) becomes a `CudaTensor`: a real CPU tensor
  (the arithmetic, autograd and the optimizer run on the CPU as ever) whose `.device` says `cuda:0`.
- every torch call whose tensors sit on two devices is checked against CUDA's rules, and where CUDA would
  raise, this raises the same "Expected all tensors to be on the same device" line, naming the call. What
  CUDA allows passes: a 0-dim CPU tensor as a scalar in an elementwise op, CPU indices into a CUDA tensor,
  copies and moves between devices. A CUDA tensor handed to numpy or given a CPU generator also fails.
- `torch.cuda`'s queries that lmrl makes answer as on a GPU with 80 GB (`is_available`, asked by lmrl's own
  code, device properties, synchronize); CUDA graphs, streams and the CUDA RNG are not emulated: capturing
  fails as on a broken driver, and lmrl falls back as it would there.

The checks run at the level of torch's Python API (a `TorchFunctionMode`): what happens inside one call
(a C++ kernel, a composite op) is not checked, which is where CUDA checks it too.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import types
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class CudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


_CUDA_STATE_MARK = torch.tensor(list(b"fake CUDA state!"), dtype=torch.uint8)


class FakeCudaGenerator(torch.Generator):
    """`torch.Generator(device="cuda")`: a CPU generator that says it is on cuda:0."""

    def __new__(cls, device: Any = "cpu"):
        return super().__new__(cls, "cpu")

    def __init__(self, device: Any = "cpu"):
        self.fake_device = _as_device(device)

    @property
    def device(self) -> torch.device:
        return self.fake_device

    # A CUDA generator's state is not a CPU one's (16 bytes against 5,056): one cannot take the other's
    def get_state(self) -> torch.Tensor:
        state = super().get_state()
        return torch.cat([state, _CUDA_STATE_MARK]) if self.fake_device.type == "cuda" else state

    def set_state(self, state: torch.Tensor) -> FakeCudaGenerator:
        if self.fake_device.type == "cuda":
            if state.numel() != super().get_state().numel() + len(_CUDA_STATE_MARK):
                raise RuntimeError("RNG state is wrong size")
            state = state[:-len(_CUDA_STATE_MARK)]
        super().set_state(state)
        return self


class DeviceMismatch(RuntimeError):
    """What CUDA would have raised."""


def _as_device(device: Any) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    d = torch.device(device)
    return torch.device("cuda", d.index or 0) if d.type == "cuda" else d


def device_of(t: torch.Tensor) -> torch.device:
    return CUDA if isinstance(t, CudaTensor) else t.device


def _cpu_scalar(t: torch.Tensor) -> bool:
    return not isinstance(t, CudaTensor) and t.dim() == 0


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (already where its data goes: the CPU) labelled with `device`."""
    cls = CudaTensor if device.type == "cuda" else torch.Tensor
    if type(t) is cls or (cls is torch.Tensor and not isinstance(t, CudaTensor)):
        return t
    if t.is_leaf and t.requires_grad:  # a leaf stays a leaf (as_subclass would make a view of it)
        return torch.Tensor._make_subclass(cls, t.detach(), True)
    return t.as_subclass(cls)


def _copied(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` moved to `device`: a copy when the device changes, as a real move makes one (writes to it stay there)."""
    if device_of(t) == device:
        return t
    return _moved(t.clone(), device)


# torch.Tensor dunders -> the aten op whose tags say whether it is elementwise
_DUNDER = {"truediv": "div", "rtruediv": "div", "floordiv": "floor_divide", "rfloordiv": "floor_divide", "mod": "remainder",
           "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not", "rsub": "rsub",
           "rpow": "pow", "radd": "add", "rmul": "mul", "iand": "bitwise_and_", "ior": "bitwise_or_", "ixor": "bitwise_xor_"}
_SCALAR_OK = {"fill_", "masked_fill", "masked_fill_", "index_fill", "index_fill_"}  # a 0-dim CPU tensor taken as a number
_pointwise_cache: dict[str, bool] = {}


def _elementwise(name: str) -> bool:
    """CUDA lets a 0-dim CPU tensor into elementwise ops (TensorIterator's CPU scalars) and foreach ops."""
    if name not in _pointwise_cache:
        base = name.strip("_") if name.startswith("__") else name
        if name.startswith("__i") and name != "__invert__":
            base = _DUNDER.get(base, base[1:] + "_")
        base = _DUNDER.get(base, base)
        op = getattr(torch.ops.aten, base, None)
        tags = set()
        if op is not None and hasattr(op, "overloads"):
            for overload in op.overloads():
                tags |= set(getattr(op, overload).tags)
        _pointwise_cache[name] = (torch.Tag.pointwise in tags or name.startswith("_foreach_") or name in _SCALAR_OK)
    return _pointwise_cache[name]


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or str(func)


def _mismatch(name: str, a: torch.device, b: torch.device) -> DeviceMismatch:
    return DeviceMismatch(f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
                          f"(fake CUDA: in {name})")


_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_", "_index_put_impl_"}
_MOVES = {"to", "cuda", "cpu", "copy_", "type", "new_tensor", "copy", "set_"}
_GETTERS = {"device", "is_cuda", "is_cpu", "grad", "data", "get_device"}


def _index_tensors(index: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(index)[0] if isinstance(t, torch.Tensor)]


def _check_indexing(name: str, args: tuple) -> torch.device:
    """CUDA: indices on the CPU or on the indexed tensor's device; a value put at tensor indices on that device or a
    CPU scalar (at slices and integers it is copied, from anywhere)."""
    self_device = device_of(args[0])
    index = args[1] if len(args) > 1 else ()
    for t in _index_tensors(index):
        d = device_of(t)
        if d != self_device and d.type != "cpu":
            raise DeviceMismatch(f"indices should be either on cpu or on the same device as the indexed tensor "
                                 f"({self_device}) (fake CUDA: in {name}, indices on {d})")
    if len(args) > 2 and _index_tensors(index):  # a value put by tensor indices (index_put_); else it is copied
        for t in _index_tensors(args[2]):
            if device_of(t) != self_device and not _cpu_scalar(t):
                raise _mismatch(name, self_device, device_of(t))
    return self_device


def _common_device(name: str, tensors: list[torch.Tensor]) -> torch.device:
    devices = {device_of(t) for t in tensors}
    if len(devices) <= 1:
        return devices.pop() if devices else CPU
    if _elementwise(name):
        devices = {device_of(t) for t in tensors if not _cpu_scalar(t)}
        if len(devices) <= 1:
            return devices.pop() if devices else CPU
    a, b = sorted(devices, key=str)[:2]
    raise _mismatch(name, b, a)


class FakeCudaMode(TorchFunctionMode):
    """The checks and labels of `fake_cuda()`, on every torch call."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_cuda = any(isinstance(t, CudaTensor) for t in tensors)
        if name == "__get__":  # a property of a tensor
            return self._property(func, args)
        if name in ("numpy", "__array__") and on_cuda:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                            "host memory first. (fake CUDA)")
        if name == "__deepcopy__" and on_cuda:  # a copy of the data, still on "cuda", with the tensor's attributes
            t, memo = args
            out = _moved(_moved(t, CPU).__deepcopy__({}), CUDA)  # a memo of its own: the alias is a temporary
            out.__dict__.update(copy.deepcopy(t.__dict__, memo))
            memo[id(t)] = out
            return out
        if name == "_has_compatible_shallow_copy_type":  # False across devices, so model.to(...) makes new parameters
            return device_of(args[0]) == device_of(args[1]) and func(*args, **kwargs)
        generator = kwargs.get("generator")
        explicit = kwargs.get("device")
        if name in _MOVES:
            return self._move(func, name, args, kwargs)
        if name in _INDEXING:
            device = _check_indexing(name, args)
        elif explicit is not None:
            device = _as_device(explicit)
            if device.type == "cuda":
                kwargs = {**kwargs, "device": CPU}
        elif not on_cuda:
            return func(*args, **kwargs)
        elif name.startswith("new_") or name.endswith("_like"):
            device = device_of(args[0])
        else:
            device = _common_device(name, tensors)
        if generator is not None and getattr(generator, "device", CPU) != device:
            raise DeviceMismatch(f"Expected a '{device.type}' device type for generator but found "
                                 f"'{generator.device.type}' (fake CUDA: in {name})")
        out = func(*args, **kwargs)
        if name.endswith("_") and not name.startswith("_foreach") and args and out is args[0]:
            return out  # in place: the tensor keeps its label
        return tree_map_only(torch.Tensor, lambda t: _moved(t, device), out)

    def _property(self, func, args):
        """A tensor's attribute (`func` is its descriptor's __get__): where it says it lives."""
        t, value, prop = args[0], func(*args), func.__self__.__name__
        cuda = isinstance(t, CudaTensor)
        if prop == "device":
            return CUDA if cuda else value
        if prop == "is_cuda":
            return cuda
        if prop == "is_cpu":
            return not cuda
        if prop in ("grad", "data") and isinstance(value, torch.Tensor):
            return _moved(value, device_of(t))
        return value

    def _move(self, func, name, args, kwargs):
        t = args[0]
        if name in ("cuda", "cpu"):
            return _copied(t, CUDA if name == "cuda" else CPU)
        if name == "copy_":  # across devices is what copy_ is for
            return func(*args, **kwargs)
        if name in ("new_tensor",):
            device = _as_device(kwargs["device"]) if kwargs.get("device") is not None else device_of(t)
            kwargs = {**kwargs, "device": CPU} if kwargs.get("device") is not None else kwargs
            return _moved(func(*args, **kwargs), device)
        if name == "to":
            rest = list(args[1:])
            target = None
            if rest and isinstance(rest[0], torch.Tensor):  # .to(other): its device and dtype
                target, rest[0] = device_of(rest[0]), rest[0].dtype
            elif isinstance(kwargs.get("other"), torch.Tensor):
                target, kwargs = device_of(kwargs["other"]), {**kwargs, "dtype": kwargs["other"].dtype}
                del kwargs["other"]
            kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # a move copies anyway; on one device, see below
            if len(rest) > 2 and isinstance(rest[-1], bool) and isinstance(rest[-2], bool):
                rest = rest[:-1]  # .to(device, dtype, non_blocking, copy)
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
            target = target or (_as_device(device) if device is not None else device_of(t))
            out = t
            if dtype is not None or memory_format is not None:
                out = func(t, dtype=dtype or t.dtype, non_blocking=non_blocking, memory_format=memory_format
                           or torch.preserve_format)
            return _copied(out, target)
        return func(*args, **kwargs)


_real_is_available = torch.cuda.is_available


def _available_to_lmrl() -> bool:
    """True when lmrl asks; torch's and transformers' own code keeps the CPU build's answer (they would go on to
    CUDA streams and kernels that are not there)."""
    caller = sys._getframe(1).f_globals.get("__name__", "")
    return caller == "lmrl" or caller.startswith("lmrl.") or _real_is_available()


def _properties(total_memory: int):
    return lambda device=None: types.SimpleNamespace(name="fake CUDA", total_memory=total_memory, major=9, minor=0,
                                                     multi_processor_count=132)


_real_bootstrap = threading.Thread._bootstrap_inner


def _thread_under_fake_cuda(self) -> None:
    """A thread started inside `fake_cuda()` (a gateway's batcher, a server's handlers) checks its torch calls too:
    torch function modes are per thread."""
    with FakeCudaMode():
        _real_bootstrap(self)


@contextlib.contextmanager
def fake_cuda(total_memory: int = 80 * 2**30):
    """Inside: "cuda" is a device (see the module docstring), in the threads started there too. One at a time."""
    patches = [
        mock.patch("torch.cuda.is_available", _available_to_lmrl),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.get_device_properties", _properties(total_memory)),
        mock.patch("torch.cuda.get_device_name", lambda device=None: "fake CUDA"),
        mock.patch("torch.cuda.synchronize", lambda device=None: None),
        mock.patch("torch.cuda.empty_cache", lambda: None),
        mock.patch("torch.cuda.memory_allocated", lambda device=None: 0),
        mock.patch("torch.cuda.max_memory_allocated", lambda device=None: 0),
        mock.patch("torch.cuda.reset_peak_memory_stats", lambda device=None: None),
        mock.patch("torch.Generator", FakeCudaGenerator),
        mock.patch.object(threading.Thread, "_bootstrap_inner", _thread_under_fake_cuda),
    ]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    # model.to("cuda") labels each parameter in place (swap_tensors): a tied weight stays one tensor
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            stack.enter_context(FakeCudaMode())
            yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
