"""`zerospeed.zero.Init`: build a model already partitioned, so no rank ever holds all of it.

ZeRO, Rajbhandari et al. 2020, §5.3. DeepSpeed's `zero.Init` patches `nn.Module.__init__` and the
tensor constructors. We use torch's global module-registration hook instead: a sub-module's
parameters are partitioned the moment it is attached to its parent, i.e. right after its own
`__init__` (so `reset_parameters()` ran on full tensors with the usual random draws, and the weights
equal an ordinary build with the same seed). A rank holds at most the sub-module being built in full,
plus 1/N of everything built before. `zerospeed.initialize(...)` with stage 3 then turns the
per-parameter slices into its gather units, one unit at a time.

Rules (errors say so too):
* construct on every rank in the same order: partitioning broadcasts rank 0's values (one collective
  per parameter) so the ranks agree;
* code in an enclosing `__init__` that touches an already partitioned parameter (say
  `self.apply(init_fn)`) raises InitParameterError inside the context: do it in the sub-module's own
  `__init__`, or wrap it in `zerospeed.zero.GatheredParameters(params, modifier_rank=0)`;
* parameters registered directly on the outermost module stay whole (they are usually small);
* only ZeRO stage 3 can train such a model (`partitioned_parameters(model)` lists what is partitioned).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.overrides import TorchFunctionMode

from ..comm.ops import broadcast, start_all_gather


class InitParameterError(RuntimeError):
    """A parameter partitioned by `zerospeed.zero.Init` was used while only its slice exists."""


@dataclass
class InitShard:
    """One parameter partitioned by Init: shape / numel of the full parameter; local: this rank's
    slice [ceil(numel / N)] of the flattened parameter, zero-padded; gathered: its .data is full now."""

    shape: torch.Size
    numel: int
    local: torch.Tensor
    group: dist.ProcessGroup | None
    gathered: bool = False


# id(param) -> (weak reference, slice); keyed by id because tensors compare elementwise
_SHARDS: dict[int, tuple[weakref.ref, InitShard]] = {}
_INTERNAL = [0]  # > 0 while our own code touches parameters (the guard lets it through)
_ALLOWED_GETTERS = {"grad_fn", "requires_grad", "is_leaf", "grad", "dtype", "device", "_base"}


def init_shard(param: torch.Tensor) -> InitShard | None:
    """The Init slice of `param`, or None if Init did not partition it (or it was handed over)."""
    entry = _SHARDS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def _put(param: nn.Parameter, st: InitShard) -> None:
    _SHARDS[id(param)] = (weakref.ref(param), st)
    weakref.finalize(param, _SHARDS.pop, id(param), None)


def _pop(param: torch.Tensor) -> InitShard | None:
    st = init_shard(param)
    if st is not None:
        del _SHARDS[id(param)]
    return st


def partitioned_parameters(module: nn.Module) -> list[str]:
    """Names of `module`'s parameters partitioned by Init and not yet handed to a stage-3 strategy."""
    return [n for n, p in module.named_parameters() if init_shard(p) is not None]


def shape_of(param: torch.Tensor) -> torch.Size:
    st = init_shard(param)
    return st.shape if st is not None else param.shape


def _partition(param: nn.Parameter, group) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    with torch.no_grad():
        broadcast(param.data, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        flat, n = param.detach().reshape(-1), param.numel()
        per = -(-n // world)
        local = torch.zeros(per, dtype=param.dtype, device=param.device)
        lo, hi = min(rank * per, n), min((rank + 1) * per, n)
        local[:hi - lo] = flat[lo:hi]
        _put(param, InitShard(param.shape, n, local, group))
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _full(st: InitShard) -> torch.Tensor:
    world = dist.get_world_size(st.group)
    out = torch.empty(st.local.numel() * world, dtype=st.local.dtype, device=st.local.device)
    start_all_gather(out, st.local, group=st.group).wait()
    return out[:st.numel].view(st.shape)


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The full value of `param`: its data, or (collective) the all-gather of its Init slices, after
    which Init forgets it (a stage-3 strategy owns it from then on)."""
    st = _pop(param)
    if st is None:
        return param.data
    return param.data if st.gathered else _full(st)


def gather(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """GatheredParameters for Init-partitioned parameters: give each its full value. Collective."""
    taken = [p for p in params if init_shard(p) is not None and not init_shard(p).gathered]
    _INTERNAL[0] += 1
    try:
        for p in taken:
            p.data = _full(init_shard(p)).clone()
            init_shard(p).gathered = True
    finally:
        _INTERNAL[0] -= 1
    return taken


def release(params: list[nn.Parameter], modifier_rank: int | None) -> None:
    """Undo `gather`; with modifier_rank, that rank's values are broadcast and re-partitioned. Collective."""
    _INTERNAL[0] += 1
    try:
        for p in params:
            st = init_shard(p)
            if modifier_rank is None:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                st.gathered = False
                continue
            group = st.group
            src = dist.get_global_rank(group, modifier_rank) if group is not None else modifier_rank
            broadcast(p.data, src, group=group)  # _partition broadcasts from rank 0: do it from src here
            rank = dist.get_rank(group)
            st.local.zero_()
            lo, hi = min(rank * st.local.numel(), st.numel), min((rank + 1) * st.local.numel(), st.numel)
            st.local[:hi - lo] = p.detach().reshape(-1)[lo:hi]
            st.gathered = False
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    finally:
        _INTERNAL[0] -= 1


class _Guard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _INTERNAL[0] and getattr(func, "__name__", "") != "__set__" and \
                getattr(getattr(func, "__self__", None), "__name__", None) not in _ALLOWED_GETTERS:
            for a in (*args, *kwargs.values()):
                st = init_shard(a) if isinstance(a, nn.Parameter) else None
                if st is not None and not st.gathered:
                    name = getattr(getattr(func, "__self__", None), "__name__", None) or getattr(func, "__name__", func)
                    raise InitParameterError(
                        f"zerospeed.zero.Init: a parameter of shape {tuple(st.shape)} was used by {name} after it was "
                        "partitioned (its module was attached to its parent; each rank keeps 1/"
                        f"{dist.get_world_size(st.group)}). Initialise it in its own module's __init__, or wrap the "
                        "code in `with zerospeed.zero.GatheredParameters(params, modifier_rank=0):`.")
        return func(*args, **kwargs)


class Init:
    """`with zerospeed.zero.Init(): model = MyModel()` - build `model` partitioned (DeepSpeed's signature).

    data_parallel_group: ranks to partition over (default: the world). enabled=False: a no-op.
    module: the function form `Init(module=model)` partitions an existing model's sub-modules now.
    dtype must be None or torch.float32 and remote_device None or "none" (parameter offload is set by
    `offload_param` in the config); other DeepSpeed arguments are accepted and ignored. Raises RuntimeError if the process
    group is not initialised (call `zerospeed.init_distributed()` first), ValueError for an
    unsupported dtype / remote_device.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype=None, mpu=None, **ignored):
        if dtype not in (None, torch.float32):
            raise ValueError(f"zerospeed.zero.Init(dtype={dtype}): only fp32 is supported for now")
        if remote_device not in (None, "none"):
            raise ValueError(f"zerospeed.zero.Init(remote_device={remote_device!r}) is not supported: Init partitions on "
                             "the compute device; set zero_optimization.offload_param.device in the config and "
                             "zerospeed.initialize moves each rank's shards there")
        self.group, self.enabled = data_parallel_group, enabled
        self._hook = None
        self._guard = None
        if module is not None and enabled:
            self._check_dist()
            for child in module.modules():
                if child is not module:
                    self._attach(None, "", child)

    def _check_dist(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("zerospeed.zero.Init needs the process group: call zerospeed.init_distributed() "
                               "(or torch.distributed.init_process_group) before building the model")

    def _attach(self, parent, name, child) -> None:
        _INTERNAL[0] += 1
        try:
            for p in child.parameters():
                if init_shard(p) is None and p.numel():
                    _partition(p, self.group)
        finally:
            _INTERNAL[0] -= 1

    def __enter__(self) -> Init:
        if self.enabled:
            self._check_dist()
            self._hook = register_module_module_registration_hook(self._attach)
            self._guard = _Guard()
            self._guard.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._guard is not None:
            self._guard.__exit__(None, None, None)
            self._hook.remove()
            self._guard, self._hook = None, None
