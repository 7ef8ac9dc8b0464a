"""What a pipeline model is made of: `LayerSpec` and `TiedLayerSpec` (layers built later, only on the stage that
owns them) and the per-layer helpers `PipelineModule` uses (names for `type:` partitions, trainable parameter
counts for `parameters` partitions, DeepSpeed's seeding). Source: DeepSpeed 0.19.8
`deepspeed/runtime/pipe/module.py` (`LayerSpec`, `TiedLayerSpec`) and `deepspeed/runtime/utils.py`
(`set_random_seed`); both classes are re-exported by `zerospeed.pipe.module` and `zerospeed.pipe`.
"""
from __future__ import annotations

import random
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..utils.logging import setup_logger
from .partition import PipelineError

__all__ = ["LayerSpec", "TiedLayerSpec", "set_random_seed"]


def _call_to_str(base: str, args: tuple, kwargs: dict) -> str:
    inner = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(inner)})"


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator (if numpy is installed) and torch's generators of the CPU
    and of the accelerator in use, as DeepSpeed's `deepspeed/runtime/utils.py: set_random_seed`.

    Not `torch.manual_seed`: for every device type torch was built with but that is not available here (CUDA,
    XPU, MTIA on a CPU machine) it queues a lazy seed with `traceback.format_stack()`, ~0.7 ms a call inside a
    pipeline engine's stack; with `seed_layers=True` that runs before every layer of every micro-batch's forward
    (16% of an 8-layer MLP stage's step on this CPU). Generators of devices that are not available are not
    seeded."""
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % (2 ** 32))
    except ImportError:
        pass
    seed %= 2 ** 63
    torch.random.default_generator.manual_seed(seed)
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None:
        torch.get_device_module(accelerator).manual_seed_all(seed)


class LayerSpec:
    """A layer to build later: `LayerSpec(nn.Linear, 16, 32, bias=False).build()` is `nn.Linear(16, 32, bias=False)`.

    Holds the class and its arguments only; the PipelineModule builds it on the stage that owns the layer,
    so a stage never allocates another stage's weights. `typename` must be an nn.Module subclass (else
    PipelineError, a RuntimeError as DeepSpeed's). Source: DeepSpeed `runtime/pipe/module.py: LayerSpec`.
    """

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise PipelineError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}; wrap a function "
                                "in an nn.Module, or put the callable itself in the layer list")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1

    def __repr__(self) -> str:
        return _call_to_str(self.typename.__name__, self.module_args, self.module_kwargs)

    def build(self, log: bool = False) -> nn.Module:
        """Construct the module: `typename(*module_args, **module_kwargs)` (on the current default device)."""
        if log:
            setup_logger().info(f"RANK={self.global_rank} building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every occurrence of the same `key` (e.g. an embedding reused as the
    output head). A stage builds the module once and reuses the object; across stages the weights named
    by `tied_weight_attr` (attribute paths such as "weight" or "linear.weight") are the ones kept
    identical and whose gradients are summed. `forward_fn(module, inputs)`, if given, replaces
    `module(inputs)` at that position. Source: DeepSpeed `runtime/pipe/module.py: TiedLayerSpec`.
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = ["weight"], **module_kwargs: Any):  # noqa: B006 (DeepSpeed's default)
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _layer_name(layer: Any) -> str | None:
    """The name `type:<regex>` matches: a spec's class, a module's class, a callable's __name__ (else None)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_count(layer: Any) -> int:
    """Trainable (requires_grad) parameter elements of one layer, as DeepSpeed's `_count_layer_params`:
    a LayerSpec (tied ones at every occurrence) is built on the meta device, or, if its constructor cannot
    run there, on the default device with the RNG state restored; callables count 0."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # a constructor that reads tensor values; pay for one real build
            with torch.random.fork_rng(devices=[]):
                module = layer.build()
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _recursive_getattr(module: nn.Module, attr_name: str) -> Any:
    """`module.a.b` for attr_name "a.b" (DeepSpeed's `PipelineModule._recursive_getattr`)."""
    obj = module
    for item in attr_name.split("."):
        obj = getattr(obj, item)
    return obj
