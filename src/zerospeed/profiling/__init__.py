"""Profiling: the DeepSpeed-compatible flops profiler (`flops_profiler` config block).

`get_model_profile(model, args=...)` profiles one call; `FlopsProfiler(model)` profiles a
window of a training loop; `measure_matmul_peak_flops()` gives the device peak used for MFU.
"""
import importlib

# Loaded on first use (PEP 562): the engine imports only `profiling.peak` unless the flops
# profiler is enabled, which keeps torch.utils.flop_counter out of ordinary training processes.
_WHERE = {"FlopsProfiler": "flops_profiler", "get_model_profile": "flops_profiler",
          "measure_matmul_peak_flops": "peak", **{name: "format" for name in (
              "ModuleStats", "bytes_to_string", "duration_to_string", "flops_to_string", "macs_to_string",
              "number_to_string", "params_to_string")}}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = [
    "FlopsProfiler", "get_model_profile", "measure_matmul_peak_flops", "ModuleStats", "number_to_string",
    "flops_to_string", "macs_to_string", "params_to_string", "duration_to_string", "bytes_to_string",
]
