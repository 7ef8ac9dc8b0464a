"""Run a function on N real ranks (processes) joined in a gloo process group.

Ranks start from a `forkserver` context with torch and zerospeed preloaded, so a launch costs
about 0.1-0.2 s after the first. The parent creates the `TCPStore` on port 0 and holds it while
the ranks connect: no free-port race and no retries. Every collective has a timeout, so a bug
fails instead of hanging.

    def body(rank, world_size, scale):          # module level, picklable
        t = torch.ones(1) * scale
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(body, 2, 3.0) == [6.0, 6.0]
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

_CTX = None


class RankFailure(RuntimeError):
    """A rank raised, exited abnormally or timed out; the message holds each rank's traceback."""


class _Skip:
    def __init__(self, reason: str):
        self.reason = reason


def _context() -> mp.context.BaseContext:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch._dynamo: the first optimizer or checkpoint call imports it (about 4 s per rank otherwise)
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerospeed"])
    return _CTX


def _rank_main(fn, rank, world_size, port, timeout_s, args, kwargs, results, env):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world_size, *args, **kwargs)
        # plain pickle copies tensors by value; the queue's own pickler would share them through
        # file descriptors that die with this process
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        if type(exc).__name__ == "Skipped":  # pytest.skip inside a rank
            results.put((rank, "skip", str(exc)))
        else:
            results.put((rank, "error", "".join(traceback.format_exception(exc))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return per-rank results.

    fn must be a module-level (picklable) function; its return value must be picklable.
    timeout: seconds for the whole run and for each collective. env: extra environment variables.
    Raises RankFailure naming every failed rank with its traceback; calls pytest.skip if a rank
    skipped.
    """
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, store.port, timeout, args, kwargs, results, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
                outs[rank] = (status, payload)
                if status == "error":  # give the other ranks a moment to report, then stop
                    deadline = min(deadline, time.monotonic() + 5)
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in outs and p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
        del store
    skips = [payload for status, payload in outs.values() if status == "skip"]
    errors = {r: payload for r, (status, payload) in outs.items() if status == "error"}
    missing = [r for r in range(world_size) if r not in outs]
    if errors or missing:
        lines = [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
        lines += [f"--- rank {r} exited with code {procs[r].exitcode} or timed out after {timeout:.0f} s "
                  "without a result" for r in missing]
        raise RankFailure(f"{len(errors) + len(missing)} of {world_size} ranks failed:\n" + "\n".join(lines))
    if skips:
        import pytest

        pytest.skip(skips[0])
    return [pickle.loads(outs[r][1]) for r in range(world_size)]
