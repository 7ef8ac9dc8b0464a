"""Profiling: the DeepSpeed-compatible flops profiler (`flops_profiler` config block).

`get_model_profile(model, args=...)` profiles one call; `FlopsProfiler(model)` profiles a
window of a training loop; `measure_matmul_peak_flops()` gives the device peak used for MFU.
"""
from .flops_profiler import FlopsProfiler, get_model_profile
from .peak import measure_matmul_peak_flops
from .format import (ModuleStats, bytes_to_string, duration_to_string, flops_to_string, macs_to_string,
                     number_to_string, params_to_string)

__all__ = [
    "FlopsProfiler", "get_model_profile", "measure_matmul_peak_flops", "ModuleStats", "number_to_string",
    "flops_to_string", "macs_to_string", "params_to_string", "duration_to_string", "bytes_to_string",
]
