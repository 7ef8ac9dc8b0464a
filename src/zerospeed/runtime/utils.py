"""DeepSpeed's `deepspeed.runtime.utils` helpers that user scripts call: `set_random_seed`, `see_memory_usage`."""
from __future__ import annotations

import gc

import psutil
import torch.distributed as dist

from ..pipe.spec import set_random_seed

GIB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print `message`, the accelerator's allocated / peak / reserved memory (GB = 2**30 bytes) and the host's used
    memory, then reset the accelerator's peak counters - as DeepSpeed's `see_memory_usage`. Prints nothing unless
    `force` is true, and only on global rank 0 when `torch.distributed` is initialized. On a CPU the accelerator's
    figures are the process's resident set (`accelerator.memory_allocated`)."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    from ..accelerator import get_accelerator

    acc = get_accelerator()
    gc.collect()  # so that freed tensors are not counted
    print(message)
    print(f"MA {acc.memory_allocated() / GIB:.2f} GB Max_MA {acc.max_memory_allocated() / GIB:.2f} GB "
          f"CA {acc.memory_reserved() / GIB:.2f} GB Max_CA {acc.max_memory_reserved() / GIB:.2f} GB")
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / GIB:.2f} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()


__all__ = ["see_memory_usage", "set_random_seed"]
