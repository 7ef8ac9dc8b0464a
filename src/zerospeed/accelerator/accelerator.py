"""One `Accelerator` object for whichever device this process trains on (DeepSpeed's `DeepSpeedAccelerator`).

Device types torch knows as accelerators (cuda, xpu, mps, hpu, ...) go through `torch.accelerator`
(and `torch.<type>` for what that lacks); the host is "cpu" and behaves as DeepSpeed's
`CPU_Accelerator`: device_name() "cpu", device_count() = $LOCAL_SIZE or the number of NUMA nodes
with cores, memory figures = this process's resident set size (RSS, bytes, via psutil) with the peak
tracked between `reset_peak_memory_stats()` calls, Stream/Event None, pin_memory() a no-op.
"""
from __future__ import annotations

import contextlib
import glob
import os

import torch
import torch.distributed as dist

__all__ = ["Accelerator"]


def _numa_nodes_with_cores() -> int:
    """NUMA nodes that have CPUs (an HBM-only node in flat mode has none), at least 1."""
    count = 0
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        try:
            with open(path) as f:
                count += bool(f.read().strip())
        except OSError:
            continue
    return max(count, 1)


class Accelerator:
    """The device API DeepSpeed code calls as `get_accelerator().<method>()`.

    device_type: "cpu" or a torch accelerator type (`torch.accelerator.current_accelerator().type`). Byte
    counts are ints;
    device_index None means the current device. On "cpu" every device index is ignored.
    """

    def __init__(self, device_type: str):
        self._name = device_type
        self._cpu = device_type == "cpu"
        self._module = None if self._cpu else getattr(torch, device_type, None)
        self._peak_rss = self._rss() if self._cpu else 0
        self._ranges: list = []  # open range_push() ranges

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    # ---- identity -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The device type: "cpu" or the torch accelerator's type."""
        return self._name

    def device_name(self, device_index: int | None = None) -> str:
        """"cpu" on the host; the device type for device_index None, else "<type>:<device_index>"."""
        if self._cpu or device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: "gloo" on the host, "nccl" on CUDA, xccl, ..."""
        return dist.Backend.default_device_backend_map.get(self._name, "gloo")

    def is_available(self) -> bool:
        return True if self._cpu else torch.accelerator.is_available()

    def is_synchronized_device(self) -> bool:
        """True on the host: kernels finish before the call returns (no streams)."""
        return self._cpu

    def use_host_timers(self) -> bool:
        return self._cpu

    def resolves_data_dependency(self) -> bool:
        return self._cpu

    def handles_memory_backpressure(self) -> bool:
        return self._cpu

    def get_compile_backend(self) -> str:
        return "inductor"

    # ---- devices --------------------------------------------------------------------------------
    def device_count(self) -> int:
        """Devices on this node; on the host $LOCAL_SIZE if set, else the NUMA nodes with cores."""
        if self._cpu:
            local = int(os.environ.get("LOCAL_SIZE", 0))
            return local if local > 0 else _numa_nodes_with_cores()
        return torch.accelerator.device_count()

    def current_device(self) -> int:
        """The current device index; on the host $LOCAL_RANK (0 if unset). DeepSpeed's CPU accelerator
        returns the variable's string; this returns it as an int."""
        if self._cpu:
            return int(os.environ.get("LOCAL_RANK", 0))
        return torch.accelerator.current_device_index()

    def current_device_name(self) -> str:
        """"cpu", or "cuda:<current index>"."""
        return self._name if self._cpu else f"{self._name}:{self.current_device()}"

    def set_device(self, device_index: int) -> None:
        """Make `device_index` current (no-op on the host)."""
        if not self._cpu:
            torch.accelerator.set_device_index(device_index)

    def device(self, device_index: int | None = None):
        """A context manager making `device_index` current inside it (a no-op context on the host;
        DeepSpeed's CPU accelerator returns None there)."""
        if self._cpu:
            return contextlib.nullcontext()
        return torch.accelerator.device_index(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all kernels on the device (no-op on the host)."""
        if not self._cpu:
            torch.accelerator.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True if `tensor` lives on this device type."""
        return tensor.device.type == self._name

    def lazy_call(self, callback):
        """Run `callback` now (CUDA defers until initialization; here nothing needs deferring)."""
        return callback()

    # ---- random numbers -------------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int) -> torch.Generator:
        """Seed the host generator and every device's (torch.manual_seed seeds all of them)."""
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cpu or self._module is None:
            return torch.get_rng_state()
        return self._module.get_rng_state() if device_index is None else self._module.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cpu or self._module is None:
            torch.set_rng_state(new_state)
        elif device_index is None:
            self._module.set_rng_state(new_state)
        else:
            self._module.set_rng_state(new_state, device_index)

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        if self._cpu or self._module is None:
            return torch.default_generator
        return self._module.default_generators[self.current_device() if device_index is None else device_index]

    # ---- streams and events ---------------------------------------------------------------------
    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name
        """`torch.Stream` on accelerators; None on the host (no streams)."""
        return None if self._cpu else torch.Stream

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name
        """`torch.Event` on accelerators; None on the host."""
        return None if self._cpu else torch.Event

    def stream(self, stream):
        """Context manager running work on `stream` (a no-op context on the host or for None)."""
        return contextlib.nullcontext() if self._cpu or stream is None else stream

    def current_stream(self, device_index: int | None = None):
        return None if self._cpu else torch.accelerator.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        if self._cpu or self._module is None or not hasattr(self._module, "default_stream"):
            return None
        return self._module.default_stream(device_index)

    # ---- memory (bytes) -------------------------------------------------------------------------
    def _rss(self) -> int:
        import psutil

        rss = psutil.Process().memory_info().rss
        self._peak_rss = max(getattr(self, "_peak_rss", 0), rss)
        return rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes of tensors allocated on the device; on the host the process RSS."""
        return self._rss() if self._cpu else torch.accelerator.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of memory_allocated since start or the last reset; on the host the RSS peak sampled at
        each memory_* call (not a true high-water mark between calls)."""
        if self._cpu:
            self._rss()
            return self._peak_rss
        return torch.accelerator.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes held by the caching allocator; on the host the process RSS."""
        return self._rss() if self._cpu else torch.accelerator.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cpu:
            return self.max_memory_allocated()
        return torch.accelerator.max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart the peak counters (on the host: the peak becomes the current RSS)."""
        if self._cpu:
            self._peak_rss = 0
            self._rss()
        else:
            torch.accelerator.reset_peak_memory_stats(device_index)

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index: int | None = None) -> dict:
        """The allocator's statistics; on the host only allocated_bytes.all.current / .peak (RSS)."""
        if self._cpu:
            current = self._rss()
            return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._peak_rss}
        return dict(torch.accelerator.memory_stats(device_index))

    def total_memory(self, device_index: int | None = None) -> int:
        """The device's memory in bytes; on the host the machine's RAM."""
        if self._cpu:
            import psutil

            return psutil.virtual_memory().total
        return torch.accelerator.get_memory_info(device_index)[1]

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory in bytes; on the host the RAM available to new processes."""
        if self._cpu:
            import psutil

            return psutil.virtual_memory().available
        return torch.accelerator.get_memory_info(device_index)[0]

    def empty_cache(self) -> None:
        """Return cached blocks to the device (no-op on the host)."""
        if not self._cpu:
            torch.accelerator.empty_cache()

    # ---- data types and tensors -----------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        if self._cpu:
            return True
        check = getattr(self._module, "is_bf16_supported", None)
        return bool(check()) if check is not None else True

    def is_fp16_supported(self) -> bool:
        """On the host: whether oneDNN has fp16 kernels for this CPU (as DeepSpeed checks)."""
        if self._cpu:
            try:
                return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
            except (AttributeError, RuntimeError):
                return False
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """`tensor` in page-locked host memory for fast copies to the device; on a CPU-only host the
        tensor itself (nothing to copy to, as DeepSpeed's CPU accelerator)."""
        return tensor if self._cpu else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False if self._cpu else tensor.is_pinned()

    # ---- profiler ranges ------------------------------------------------------------------------
    def range_push(self, msg: str) -> None:
        """Open a named range (`torch.profiler.record_function`, on every device: it shows in torch.profiler
        traces, and as NVTX ranges under `torch.autograd.profiler.emit_nvtx`). Close it with range_pop()."""
        ctx = torch.profiler.record_function(msg)
        ctx.__enter__()
        self._ranges.append(ctx)

    def range_pop(self) -> None:
        """Close the range the last range_push() opened (no-op if none is open)."""
        if self._ranges:
            self._ranges.pop().__exit__(None, None, None)

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that select this node's devices for a process."""
        return {"xpu": ["ZE_AFFINITY_MASK"], "hpu": ["HABANA_VISIBLE_MODULES"]}.get(self._name,
                                                                                  ["CUDA_VISIBLE_DEVICES"])
