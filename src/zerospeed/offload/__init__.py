"""ZeRO-Offload and ZeRO-Infinity: model states in host memory and on NVMe.

`OffloadPolicy` (where states live, from `offload_optimizer` / `offload_param`), `OffloadContext`
(pre-flight checks, async I/O, swap spaces), `SwappedOptimizer` (optimizer states on NVMe, stepped
in tiles of `sub_group_size` elements) and `ParamSwapper` (ZeRO-3 parameter shards on NVMe). The
I/O layer: `aio.AsyncIO` (thread-pool O_DIRECT file I/O), `swap.SwapSpace`, `swap.BufferPool`.
Sources: ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021.
"""
from .policy import OffloadPolicy

__all__ = ["OffloadPolicy", "OffloadContext", "SwappedOptimizer", "ParamSwapper", "OffloadResourceError"]


def __getattr__(name):  # the I/O layer is imported only when offload is used
    if name == "OffloadContext":
        from .context import OffloadContext
        return OffloadContext
    if name == "SwappedOptimizer":
        from .optimizer import SwappedOptimizer
        return SwappedOptimizer
    if name == "ParamSwapper":
        from .params import ParamSwapper
        return ParamSwapper
    if name == "OffloadResourceError":
        from .preflight import OffloadResourceError
        return OffloadResourceError
    raise AttributeError(name)
