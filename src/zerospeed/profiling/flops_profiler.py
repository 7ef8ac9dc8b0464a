"""DeepSpeed-compatible flops profiler built on `torch.utils.flop_counter.FlopCounterMode`.

Counting: `FlopCounterMode` intercepts aten ops and counts the matmul-type ones (mm, addmm, bmm,
baddbmm, convolution, scaled-dot-product attention) with 2 FLOPs per multiply-accumulate, and
attributes each op to every module on the call stack, so a module's count includes its
children. Hence MACs = FLOPs / 2 here. Element-wise ops (activations, norms, softmax, bias adds)
are not counted, which is the convention behind the usual "6 x params x tokens" training
estimate; DeepSpeed adds rough estimates for them, so its FLOPs can be ~1-2 % higher while its
MACs agree with ours (LeNet5 at batch 1024: 426,516,480 MACs in both).

Latency: forward pre/post hooks on every module, with the accelerator synchronised before each
timer read when the model lives on one.

Typical use in a training loop (the engine does this for you from the `flops_profiler` block)::

    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(batch)
    prof.stop_profile()          # stop counting before backward
    prof.print_model_profile(profile_step=step)
    prof.end_profile()
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .format import (ModuleStats, aggregated_lines, detailed_lines, duration_to_string, macs_to_string,
                     number_to_string, params_to_string, summary_lines)
from .peak import cached_peak_flops, default_device, measure_matmul_peak_flops, sync

__all__ = ["FlopsProfiler", "get_model_profile", "measure_matmul_peak_flops"]

logger = logging.getLogger(__name__)

_counter_warmed = False


def _extra_formulas() -> dict[Any, Any]:
    """FLOP formulas for attention kernels torch's registry lacks (the CPU flash-attention op that
    `F.scaled_dot_product_attention` dispatches to on CPU), counted like the other SDPA kernels:
    4 * batch * heads * q_len * kv_len * head_dim forward, 2.5x that backward."""
    def fwd(query, key, value, *args, out_shape=None, **kwargs) -> int:  # receives shapes
        return sdpa_flop_count(query, key, value)

    def bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)

    ops = torch.ops.aten
    found = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", fwd),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", bwd)):
        if hasattr(ops, name):
            found[getattr(ops, name)] = formula
    return found


def _new_counter() -> FlopCounterMode:
    """A FlopCounterMode with our extra formulas; the first one in a process is exercised once so
    its one-off start-up cost (about 2 s importing torch._dynamo) is not timed as model latency."""
    global _counter_warmed
    if not _counter_warmed:
        with FlopCounterMode(display=False):
            torch.mm(torch.ones(1, 1), torch.ones(1, 1))
        _counter_warmed = True
    return FlopCounterMode(display=False, custom_mapping=_extra_formulas())


class FlopsProfiler:
    """Per-module FLOPs, MACs, parameters and forward latency of `model` (DeepSpeed's API).

    model: the module to profile. ds_engine: optional engine; when given, its `world_size`,
    `dp_world_size`, `mp_world_size` and `train_micro_batch_size_per_gpu()` are printed in the
    summary (missing attributes are skipped). recompute_fwd_factor: extra forward passes per
    step due to activation checkpointing (0 = none, 1 = everything recomputed); backward is
    taken as (2 + factor) x forward FLOPs. peak_tflops: the device's peak in TFLOP/s for MFU;
    None measures it once with `measure_matmul_peak_flops` on the model's device, in `peak_dtype`
    (default: the model's floating parameter dtype; pass the autocast dtype under mixed precision).
    Raises TypeError if model is not an nn.Module, ValueError for a negative factor or a
    non-positive peak.
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0, *,
                 peak_tflops: float | None = None, peak_dtype: torch.dtype | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if recompute_fwd_factor < 0:
            raise ValueError(f"recompute_fwd_factor must be >= 0, got {recompute_fwd_factor}")
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be > 0 TFLOP/s, got {peak_tflops}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.peak_tflops = peak_tflops
        self.peak_dtype = peak_dtype
        self.started = False
        self.flops: int | None = None
        self.macs: int | None = None
        self.params: int | None = None
        self._counter: FlopCounterMode | None = None
        self._counting = False
        self._handles: list[Any] = []
        self._durations: dict[nn.Module, float] = {}
        self._starts: dict[nn.Module, list[float]] = {}
        self._ignore: tuple[type, ...] = ()
        self._device: torch.device | None = None

    # ----------------------------------------------------------------- lifecycle
    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Start counting FLOPs and timing every module's forward.

        ignore_list: module classes (exact types, as in DeepSpeed) whose FLOPs, and their
        children's, are left out of every count and which are not timed. Raises RuntimeError if
        this profiler is already counting (call stop_profile() first).
        """
        if self._counting:
            raise RuntimeError("flops profiler is already running; call stop_profile() before start_profile()")
        self.reset_profile()
        self._ignore = tuple(ignore_list or ())
        first = next(self.model.parameters(), None)
        self._device = first.device if first is not None else None
        for module in self.model.modules():
            if type(module) in self._ignore:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        self._counter = _new_counter()
        self._counter.__enter__()
        self._counting = True
        self.started = True
        logger.info("flops profiler started")

    def stop_profile(self) -> None:
        """Stop counting and timing; the counts stay readable until end_profile()."""
        if self._counting and self._counter is not None:
            self._counter.__exit__(None, None, None)
        self._counting = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset_profile(self) -> None:
        """Zero the FLOP counts and latencies gathered so far (keeps profiling if running)."""
        if self._counter is not None:
            self._counter.flop_counts.clear()
        self._durations.clear()
        self._starts.clear()

    def end_profile(self) -> None:
        """Stop profiling and drop all gathered data."""
        if not self.started:
            return
        self.stop_profile()
        self.reset_profile()
        self._counter = None
        self.started = False
        logger.info("flops profiler finished")

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        sync(self._device)
        self._starts.setdefault(module, []).append(time.perf_counter())

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._starts.get(module)
        if stack:
            sync(self._device)
            self._durations[module] = self._durations.get(module, 0.0) + time.perf_counter() - stack.pop()

    # ----------------------------------------------------------------- results
    def get_module_profile(self) -> dict[str, ModuleStats]:
        """Per-module profile keyed by fully qualified name ("" = the model), in module order."""
        named = list(self.model.named_modules())
        counts = self._counter.get_flop_counts() if self._counter is not None else {}
        known = getattr(self._counter.mod_tracker, "_known_modules", None) if self._counter else None
        root_name = type(self.model).__name__
        flops: dict[str, int] = {}
        macs: dict[str, int] = {}
        for fqn, mod in named:
            key = known.get(mod) if known is not None else None
            if key is None:
                key = f"{root_name}.{fqn}" if fqn else root_name
            ops = counts.get(key, {})
            flops[fqn] = int(sum(ops.values()))
            macs[fqn] = int(sum(v // 2 for v in ops.values()))  # every counted op is a matmul/conv/attention
        self._drop_ignored(named, flops, macs)
        durations: dict[int, float] = {}

        def duration(mod: nn.Module) -> float:
            if id(mod) not in durations:
                own = self._durations.get(mod, 0.0)
                durations[id(mod)] = own if own > 0 else sum(duration(c) for c in mod.children())
            return durations[id(mod)]

        return {
            fqn: ModuleStats(name=fqn, kind=type(mod).__name__, depth=fqn.count(".") + 1 if fqn else 0,
                             params=sum(p.numel() for p in mod.parameters()), flops=flops[fqn], macs=macs[fqn],
                             duration=duration(mod), extra=mod.extra_repr())
            for fqn, mod in named
        }

    def _drop_ignored(self, named: Sequence[tuple[str, nn.Module]], flops: dict[str, int],
                      macs: dict[str, int]) -> None:
        ignored = [fqn for fqn, mod in named if type(mod) in self._ignore]
        outer = [x for x in ignored if not any(x != y and (y == "" or x.startswith(y + ".")) for y in ignored)]
        for x in outer:
            fx, mx = flops[x], macs[x]
            for fqn in flops:
                if fqn == x or fqn.startswith(x + ".") or x == "":
                    flops[fqn] = macs[fqn] = 0
                elif fqn == "" or x.startswith(fqn + "."):
                    flops[fqn] -= fx
                    macs[fqn] -= mx

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the model over the profiled window ("1.2 G" when as_string)."""
        total = self.get_module_profile()[""].flops
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates of the model ("600 MMACs" when as_string)."""
        total = self.get_module_profile()[""].macs
        return macs_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameter elements held by the model on this rank, each tensor once ("1.8 M")."""
        total = sum(p.numel() for p in self.model.parameters())
        return params_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward wall time of the model in seconds over the profiled window ("12.3 ms")."""
        total = self.get_module_profile()[""].duration
        return duration_to_string(total) if as_string else total

    def get_peak_flops(self) -> float:
        """Peak FLOP/s of one device: peak_tflops * 1e12, else measured once per process (cached)
        for peak_dtype (or the model's floating dtype) on the model's device."""
        if self.peak_tflops is not None:
            return self.peak_tflops * 1e12
        param = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        dtype = self.peak_dtype or (param.dtype if param is not None else torch.float32)
        device = param.device if param is not None else default_device()
        return cached_peak_flops(dtype, device)

    def get_mfu(self, iter_latency: float | None = None) -> float:
        """Model FLOPs utilisation as a fraction of peak (0.25 = 25 %).

        Without iter_latency: forward FLOPs / forward latency / peak. With iter_latency (seconds
        for forward + backward + step): (3 + recompute_fwd_factor) x forward FLOPs / iter_latency
        / peak. Raises ValueError if the latency is not positive.
        """
        flops = self.get_total_flops()
        if iter_latency is None:
            latency, factor = self.get_total_duration(), 1.0
        else:
            latency, factor = iter_latency, 3.0 + self.recompute_fwd_factor
        if latency <= 0:
            raise ValueError(f"latency must be > 0 s to compute MFU, got {latency}; profile at least one forward")
        return factor * flops / latency / self.get_peak_flops()

    # ----------------------------------------------------------------- report
    def _engine_info(self) -> dict[str, int]:
        eng, info = self.ds_engine, {}
        if eng is None:
            return info
        for key in ("world_size", "dp_world_size", "mp_world_size"):
            if isinstance(getattr(eng, key, None), int):
                info[key] = getattr(eng, key)
        if callable(getattr(eng, "train_micro_batch_size_per_gpu", None)):
            info["batch_size"] = int(eng.train_micro_batch_size_per_gpu())
        return info

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None, *,
                            fwd_latency: float | None = None, bwd_latency: float | None = None,
                            step_latency: float | None = None) -> str:
        """Print (or write to output_file) the profile and return its text.

        Layout as in DeepSpeed: a summary (params, forward MACs and FLOPs, latency, achieved
        FLOP/s, peak and MFU), the top `top_modules` module classes per depth (depths below
        `module_depth`, -1 = all), then with `detailed` the module tree naming every module.
        fwd_latency / bwd_latency / step_latency: seconds measured by the engine's timers for
        this step; fwd_latency defaults to the model's hooked forward time, and the backward and
        iteration lines appear only when bwd_latency (and step_latency) are given.
        Returns "" with a warning if start_profile() was not called.
        """
        if not self.started:
            logger.warning("print_model_profile() called before start_profile(); nothing to print")
            return ""
        stats = self.get_module_profile()
        root = stats[""]
        self.flops, self.macs, self.params = root.flops, root.macs, self.get_total_params()
        fwd = fwd_latency if fwd_latency is not None else root.duration
        out = summary_lines(step=profile_step, params=self.params, flops=root.flops, macs=root.macs, fwd=fwd,
                            peak=self.get_peak_flops(), bwd=bwd_latency, step_latency=step_latency,
                            peak_source="given" if self.peak_tflops is not None else "measured matmul n=1024",
                            recompute_fwd_factor=self.recompute_fwd_factor, engine=self._engine_info())
        totals = {"params": root.params, "macs": root.macs, "duration": root.duration}
        out += ["", "----------------------------- Aggregated Profile per device -----------------------------"]
        out += aggregated_lines(stats.values(), module_depth, top_modules)
        if detailed:
            out += ["", "------------------------------ Detailed Profile per device ------------------------------",
                    "Each module profile is listed after its name in the following order:",
                    "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
                    "percentage of total fwd latency, fwd FLOPS", "",
                    "Note: 1. Ops called directly by a module (not through a submodule) make up the difference "
                    "between a parent's MACs (or latency) and the sum of its submodules'.",
                    "2. Only matmul-type ops (linear, conv, attention) are counted; element-wise ops are not.", ""]
            out += detailed_lines(list(stats.values()), totals, module_depth)
        out.append("------------------------------------------------------------------------------")
        text = "\n".join(out)
        if output_file:
            os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            print(text)
        return text


def get_model_profile(model: nn.Module, input_shape: tuple[int, ...] | None = None, args: Sequence[Any] | None = None,
                      kwargs: dict[str, Any] | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Iterable[type] | None = None,
                      mode: str = "forward", *, peak_tflops: float | None = None):
    """Profile one forward (or generate) call of `model`; returns (flops, macs, params).

    input_shape: builds one input of ones with that shape in the model's parameter dtype and
    device (for models taking token ids, pass `args` instead). args / kwargs: the call's
    arguments. warm_up: untimed calls before the profiled one. The model runs in eval mode
    under torch.no_grad() and its training flag is restored afterwards. as_string: return
    DeepSpeed-style strings ("853.03 M", "426.52 MMACs", "61.71 K") instead of ints.
    mode: "forward" calls model(...), "generate" calls model.generate(...).
    Raises TypeError for a non-module, ValueError for a bad mode, input_shape or no inputs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or len(input_shape) < 1:
            raise ValueError(f"input_shape must be a non-empty tuple, got {input_shape!r}")
        p = next(model.parameters(), None)
        args = [torch.ones(input_shape, dtype=p.dtype if p is not None else None,
                           device=p.device if p is not None else None)]
    if not args and not kwargs:
        raise ValueError("give input_shape, args or kwargs: the model needs an input to profile")
    call = model if mode == "forward" else model.generate
    was_training = model.training
    model.eval()
    prof = FlopsProfiler(model, peak_tflops=peak_tflops)
    try:
        with torch.no_grad():
            for _ in range(warm_up):
                call(*args, **kwargs)
            prof.start_profile(ignore_list=ignore_modules)
            try:
                call(*args, **kwargs)
            finally:
                prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    finally:
        prof.end_profile()
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
