"""Process-group start-up from the standard launcher environment (torchrun, SLURM, or none)."""
from __future__ import annotations

import atexit
import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, as read from the environment: rank, world size, local rank.

    source: "torchrun" (RANK/WORLD_SIZE/LOCAL_RANK), "slurm" (SLURM_PROCID/SLURM_NTASKS/
    SLURM_LOCALID) or "none" (a plain `python train.py`: world size 1).
    """

    rank: int
    world_size: int
    local_rank: int
    source: str


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Read rank / world size / local rank; raises ValueError on a malformed or partial environment."""
    env = os.environ if environ is None else environ
    try:
        if "RANK" in env or "WORLD_SIZE" in env:
            if not ("RANK" in env and "WORLD_SIZE" in env):
                raise ValueError("both RANK and WORLD_SIZE must be set (torchrun sets both)")
            return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                             int(env.get("SLURM_LOCALID", 0)), "slurm")
    except ValueError as exc:
        raise ValueError(f"bad distributed environment: {exc}") from exc
    return LaunchEnv(0, 1, 0, "none")


def default_device(local_rank: int = 0) -> torch.device:
    """The accelerator device for this local rank if there is one, else the default (host) device."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        return torch.device(acc.type, local_rank % torch.accelerator.device_count())
    return torch.get_default_device()


def default_backend(device: torch.device) -> str:
    """nccl on CUDA, the registered backend for other accelerators, gloo on the host."""
    return dist.Backend.default_device_backend_map.get(device.type, "gloo")


def _restart_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under torchrun's elastic agent after a restart: the agent's store with a per-attempt key prefix.

    torchrun keeps one agent store across restarts of the worker group, and `env://` reads it
    without a prefix, so a restarted rank that starts later than its peers can read a dead
    rank's gloo address from the previous attempt and fail with "connectFullMesh ... Connection
    refused" (pytorch/pytorch#167288). None when not restarted under the agent store.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"zerospeed/restart_{restart}", store)


def init_distributed(dist_backend: str | None = None, *, timeout: timedelta = DEFAULT_TIMEOUT,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1,
                     dist_init_required: bool | None = None, verbose: bool = False) -> None:
    """Create the default process group unless one exists (DeepSpeed's `init_distributed`).

    Reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT or SLURM's SLURM_PROCID/
    SLURM_NTASKS/SLURM_LOCALID (MASTER_ADDR and MASTER_PORT must then be exported); with neither,
    starts a single-rank group so a plain `python train.py` runs as world size 1.
    dist_backend: None picks nccl on CUDA and gloo on the host. timeout: per collective.
    Raises ValueError for a partial environment and RuntimeError when SLURM lacks MASTER_ADDR.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("dist_init_required=False but no process group exists: call "
                           "torch.distributed.init_process_group first, or leave dist_init_required unset")
    env = read_launch_env()
    rank = env.rank if rank < 0 else rank
    world_size = env.world_size if world_size < 0 else world_size
    device = default_device(env.local_rank)
    if device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.set_device_index(device.index)
    backend = dist_backend or default_backend(device)
    if env.source == "none" and world_size == 1 and init_method is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if env.source == "slurm" and init_method is None:
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise RuntimeError(
                    f"running under SLURM but {', '.join(missing)} is not set; export e.g. "
                    "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29500")
        store = _restart_store(world_size, timeout) if init_method is None else None
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                    world_size=world_size, timeout=timeout)
    global _created_default_group
    if not _created_default_group:
        atexit.register(_destroy_own_group)
    _created_default_group = True
    if verbose:
        log.info("initialized %s process group: rank %d of %d (%s)", backend, rank, world_size, env.source)


_created_default_group = False  # init_distributed created the default process group (atexit destroys it)


def _destroy_own_group() -> None:
    """At interpreter exit, destroy the default process group `init_distributed` created, unless the
    program already did, and collect it so its worker threads are joined while Python is alive.

    Otherwise a gloo worker thread can still be releasing the last collective's work (and the
    tensors it holds, which needs the GIL) when the interpreter finalizes, and the rank dies with
    SIGABRT ("terminate called without an active exception", pytorch/pytorch#190489) after the
    program has finished: 3 of 11 runs of the elastic-restart test here, whose last collective is
    `save_checkpoint`'s all-gather. No reference to the group is held here, so nothing keeps it
    alive past the collection."""
    if _created_default_group and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()
