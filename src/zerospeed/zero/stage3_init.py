"""`zerospeed.zero.Init`: build a model already partitioned, so no rank ever holds all of it.

ZeRO, Rajbhandari et al. 2020, §5.3; DeepSpeed's `deepspeed.zero.Init`. DeepSpeed patches every
`nn.Module.__init__`; we use torch's global registration hooks and a `TorchFunctionMode`:

* a parameter is partitioned as soon as it is registered on a module (`self.weight = Parameter(...)`),
  lazily: its full value stays until a parameter of *another* module is registered or used, then
  rank 0's value is cut into N slices and scattered (each rank keeps [ceil(numel / N)] elements).
  So a module's own `reset_parameters()` runs on full tensors, and a rank holds its slices plus the
  parameters of about one module at a time - never the model (a `ModuleList` built from a list of
  layers included);
* any op inside the context that uses a partitioned parameter (`normal_`, `zero_`, `copy_`,
  `torch.nn.init.*`, `weight[i]`, `p.data = x`, transformers' `post_init` / `_init_weights`, the
  loading of `from_pretrained`) runs on its full value: all-gathered first, or a fresh tensor when
  the op overwrites every element; it is re-partitioned (from rank 0) before the next module's
  parameters are used. The ops and the random draws are the same as without Init, so the weights
  are the same as a plain build with the same seed (rank 0's draws, if ranks seeded differently);
* inside the context, `p.shape`, `p.size()`, `p.dim()`, `p.numel()` of a partitioned parameter give
  its full shape (outside, `p.data` is empty [0]; `shape_of(p)` gives the full shape);
* parameters on the meta device (transformers' `from_pretrained` builds there first) stay as they
  are; the real tensors it then loads into the modules are partitioned as they are assigned.

Rules: construct on every rank in the same order (partitioning and gathering are collectives).
A tensor derived inside the context from a partitioned parameter (a view `w = p[0]`, a forward's
autograd graph, `model.state_dict()`) refers to the temporary full value: writes to it are lost once
the parameter is re-partitioned, and it keeps that memory alive. Only ZeRO stage 3 can train such a
model (`partitioned_parameters(model)` lists what is partitioned).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .stage3_init_shards import (_INTERNAL, InitShard, ShardState, drop_touched, eligible, init_shard, register,
                                 replaced, settle, touch)
from .stage3_init_shards import full_value, gather, partitioned_parameters, release, shape_of  # noqa: F401 (API)


class InitParameterError(RuntimeError):
    """Kept for code that catches it: Init used to raise it when a partitioned parameter was used
    inside the context; such ops now run on the parameter's full value instead."""


# attribute getters / methods that need no values (pass through on the empty tensor)
_PASS_GETTERS = {"grad_fn", "requires_grad", "is_leaf", "grad", "dtype", "device", "_base", "is_meta", "is_cuda",
                 "is_cpu", "layout", "is_sparse", "is_quantized", "is_nested", "itemsize", "name", "names", "_version",
                 "_grad", "_grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks"}
_PASS_METHODS = {"requires_grad_", "is_floating_point", "is_complex", "element_size", "get_device", "__hash__",
                 "register_hook", "register_post_accumulate_grad_hook", "retain_grad"}
# methods that write every element of their first argument: no gather needed before them
_OVERWRITE_METHODS = {"normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "exponential_", "log_normal_",
                      "cauchy_", "geometric_", "bernoulli_"}


_SHAPE_QUERIES = {"size", "dim", "ndimension", "numel", "nelement", "__len__"}


def _shape_answer(name: str, attr, st: InitShard, args, kwargs):
    """The full-shape answer to a metadata query (`_SHAPE_QUERIES`, `.shape`, `.ndim`) on a SHARDED parameter."""
    if name == "__get__":
        return st.shape if attr == "shape" else len(st.shape)
    if name == "size":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return st.shape if dim is None else st.shape[dim]
    if name in ("dim", "ndimension"):
        return len(st.shape)
    if name in ("numel", "nelement"):
        return st.numel
    return st.shape[0]  # __len__


class _Guard(TorchFunctionMode):
    """Runs every op that uses a partitioned parameter on its full value (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _INTERNAL[0]:
            return func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        params = []
        for a in leaves:
            if isinstance(a, nn.Parameter):
                st = init_shard(a)
                if st is not None and st.state is not ShardState.GATHERED and not any(q is a for q, _ in params):
                    params.append((a, st))
        if not params:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        attr = getattr(getattr(func, "__self__", None), "__name__", None)  # the attribute of a getter / setter
        if (name == "__get__" and attr in _PASS_GETTERS) or (name == "__set__" and attr != "data") \
                or name in _PASS_METHODS:
            return func(*args, **kwargs)
        if name in _SHAPE_QUERIES or (name == "__get__" and attr in ("shape", "ndim")):  # never a collective
            first, st0 = params[0]
            if args and args[0] is first and st0.state is ShardState.SHARDED:
                return _shape_answer(name, attr, st0, args, kwargs)
            if all(st.state is ShardState.TOUCHED for _, st in params):
                return func(*args, **kwargs)
        settle(keep_owners=tuple(o for o in (st.owner() if st.owner is not None else None for _, st in params)
                                 if o is not None))
        if name == "__set__":  # `p.data = value`: the value replaces every element of p
            for p, st in params:
                if p is not args[0] and st.state is ShardState.SHARDED:
                    touch(p, overwrite=False)  # the value is itself a partitioned parameter
            out = func(*args, **kwargs)
            replaced(args[0])
            return out
        dest = args[0] if args else kwargs.get("tensor")
        overwrite = (getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_")
                     and not name.startswith("_")) or name in _OVERWRITE_METHODS
        for p, st in params:
            if st.state is ShardState.SHARDED:
                touch(p, overwrite=overwrite and p is dest and sum(x is p for x in leaves) == 1)
        return func(*args, **kwargs)


def _ensure_dist() -> None:
    from ..comm import init_distributed

    init_distributed()  # a no-op when a process group exists (DeepSpeed's zero.Init does the same)


class Init:
    """`with zerospeed.zero.Init(): model = MyModel()` - build `model` partitioned (DeepSpeed's signature).

    Works for transformers models too: `GPT2LMHeadModel(config)`, `AutoModelForCausalLM.from_config(c)`,
    `AutoModelForCausalLM.from_pretrained(dir)` under the context give the weights of a plain build /
    the checkpoint, each rank holding [ceil(numel / N)] elements of every parameter (see the module
    docstring for how). Collective: enter, build and exit on every rank of the group, in the same order.

    data_parallel_group: ranks to partition over (default: the world). enabled=False: a no-op.
    module: the function form `Init(module=model)` partitions an existing model's sub-modules now.
    remote_device: None / "none" / "cpu" keep each rank's slices in memory (on this machine the host;
    `offload_param` in the config decides where `zerospeed.initialize` then puts them); "nvme" writes
    every slice as soon as it is cut to `zero_optimization.offload_param.nvme_path` of
    `config_dict_or_path` (dict or JSON path) and reads it back when used, so a model whose fp32 slices
    do not fit in RAM can be built (ZeRO-Infinity, Rajbhandari et al. 2021, §5; `stage3_init_spill`).
    dtype must be None or torch.float32; other DeepSpeed arguments are accepted and ignored. Creates the
    default process group (`zerospeed.init_distributed()`, from torchrun's / SLURM's environment) if
    none exists, as DeepSpeed does. Raises ValueError for an unsupported dtype / remote_device or a
    remote_device="nvme" without the config key; OffloadResourceError for an unusable directory.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype=None, mpu=None, **ignored):
        if dtype not in (None, torch.float32):
            raise ValueError(f"zerospeed.zero.Init(dtype={dtype}): only fp32 is supported for now")
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"zerospeed.zero.Init(remote_device={remote_device!r}): use None, 'cpu' or 'nvme' "
                             "(DeepSpeed's values)")
        self.group, self.enabled = data_parallel_group, enabled
        self._hooks: list = []
        self._guard = None
        self._spill = None
        if remote_device == "nvme" and enabled:
            from .stage3_init_spill import InitSpill, nvme_path_from_config

            path = nvme_path_from_config(config_dict_or_path, config)
            _ensure_dist()
            self._spill = InitSpill(path, rank=dist.get_rank())
        if module is not None and enabled:
            _ensure_dist()
            for child in module.children():
                self._attach(module, "", child)
            if self._spill is not None:
                self._spill.detach()

    def _attach(self, parent, name, child) -> None:
        """Module registration hook: partition the parameters of `child` built outside the context."""
        if _INTERNAL[0] or child is None:
            return None
        new = False
        for m in child.modules():
            for p in m._parameters.values():
                if eligible(p):
                    register(p, self.group, m, self._spill)
                    new = True
        if new:
            settle()
        return None

    def _on_parameter(self, module, name, param):
        """Parameter registration hook: partition `param` (lazily; see `settle`)."""
        if _INTERNAL[0] or param is None or not eligible(param):
            return None
        settle(keep_owners=(module,))
        register(param, self.group, module, self._spill)
        return None

    def __enter__(self) -> Init:
        if self.enabled:
            _ensure_dist()
            self._hooks = [register_module_module_registration_hook(self._attach),
                           register_module_parameter_registration_hook(self._on_parameter)]
            self._guard = _Guard()
            self._guard.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._guard is None:
            return
        try:
            if exc_type is None:
                settle()  # collective: re-partition what is still full
            else:
                drop_touched()  # no collective on a failing rank
        finally:
            self._guard.__exit__(None, None, None)
            for h in self._hooks:
                h.remove()
            self._guard, self._hooks = None, []
            if self._spill is not None:
                self._spill.detach()  # its files go once the strategy took every slice
