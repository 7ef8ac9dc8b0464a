"""Plain-PyTorch references and comparison helpers for parity tests.

A parity test trains the same model (same seed) on the same global batches twice: once with
zerospeed on N ranks, once here in one process with plain PyTorch, and compares per-step losses
and final parameters to a stated tolerance.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


def global_batches(tokens: torch.Tensor, global_batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split token rows [n, seq+1] into `steps` global batches of (inputs, targets), each [global_batch, seq]."""
    need = global_batch * steps
    if tokens.shape[0] < need:
        raise ValueError(f"need {need} token rows for {steps} steps of {global_batch}, got {tokens.shape[0]}")
    return [(tokens[i:i + global_batch, :-1], tokens[i:i + global_batch, 1:])
            for i in range(0, need, global_batch)]


def micro_batches(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int,
                  gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's `gas` micro-batches of a global batch: rank r takes rows [r*B/W, (r+1)*B/W), split in gas."""
    x, y = batch
    per_rank = x.shape[0] // world_size
    xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    return list(zip(xs.chunk(gas), ys.chunk(gas)))


def train_reference(model: nn.Module, optimizer: torch.optim.Optimizer,
                    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, clip: float = 0.0,
                    scheduler=None, norms: list | None = None) -> list[float]:
    """Plain PyTorch: one full-batch step per batch (loss = model(x, y)); returns the per-step losses.

    clip > 0 clips with `clip_grad_norm_`; `norms`, if given, receives each step's total gradient
    norm before clipping (what `engine.get_global_grad_norm()` reports)."""
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        if clip > 0 or norms is not None:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            if norms is not None:
                norms.append(float(total))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def train_engine(engine, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                 on_step: Callable | None = None, after_backward: Callable | None = None,
                 after_forward: Callable | None = None) -> list[float]:
    """Train `engine` one step per global batch on this rank's micro-batches; returns the per-step
    global loss (the mean over micro-batches and ranks, all-reduced). on_step(engine): after each
    global step; after_forward(engine) / after_backward(engine): after each micro-batch's forward /
    backward (the latter before its `step()`). Ranks are data-parallel ranks (`engine.group`): the ranks of
    one model-parallel group (a mesh's tensor/pipe dimension) take the same micro-batches."""
    group = getattr(engine, "group", None)  # a DeepSpeed engine (cross-checks): the world
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gas = engine.gradient_accumulation_steps()
    losses = []
    for batch in batches:
        total = torch.zeros((), dtype=torch.float64)
        for x, y in micro_batches(batch, rank, world, gas):
            loss = engine(x.to(engine.device), y.to(engine.device))
            if after_forward is not None:
                after_forward(engine)
            engine.backward(loss)
            if after_backward is not None:
                after_backward(engine)
            engine.step()
            total += loss.item()
        dist.all_reduce(total, group=group)
        losses.append(float(total) / (gas * world))
        if on_step is not None:
            on_step(engine)
    return losses


def max_rel_diff(a: Iterable[float], b: Iterable[float]) -> float:
    """max_i |a_i - b_i| / max(|b_i|, 1e-12)."""
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise ValueError(f"length mismatch: {len(a)} vs {len(b)}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def state_max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest over tensors of max|a - b| / max|b| (keys must match)."""
    if a.keys() != b.keys():
        raise ValueError(f"key mismatch: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))
               for k in a)


def train_lm_engine(engine, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                    lrs: list | None = None) -> list[float]:
    """A Hugging Face causal LM (`engine(input_ids=x, labels=x).loss`, labels shifted inside the model):
    one step per global batch, this rank taking rows [r*B/N, (r+1)*B/N) of the inputs [B, T]; returns the
    per-step loss averaged over the ranks (all-reduced). Ranks are data-parallel ranks (`engine.group`): the
    ranks of one tensor-parallel group take the same rows. lrs: if given, receives `engine.get_lr()` per step."""
    group = getattr(engine, "group", None)  # a DeepSpeed engine (cross-checks): the world
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for x, _ in batches:
        per = x.shape[0] // world
        mine = x[rank * per:(rank + 1) * per].to(engine.device)
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        if lrs is not None:
            lrs.append(engine.get_lr())
        t = loss.detach().double()
        dist.all_reduce(t, group=group)
        losses.append(float(t) / world)
    return losses


def injected_generates_like(build: Callable[[], nn.Module], generate: Callable, ids: torch.Tensor,
                            mask: torch.Tensor, calls: int = 2, **init_kwargs) -> list[bool]:
    """Kernel-injection parity: `zerospeed.init_inference(build(), replace_with_kernel_inject=True, **init_kwargs)`
    against a plain `build()` in the same process. `generate(model, ids, mask)` runs `calls` times on the engine's
    module (the second and later reuse the compiled decode step); one bool per call: its token ids [batch,
    prompt + new] equal the plain model's."""
    import zerospeed

    ref = build()
    engine = zerospeed.init_inference(build(), replace_with_kernel_inject=True, **init_kwargs)
    with torch.no_grad():
        want = generate(ref, ids, mask)
        return [torch.equal(generate(engine.module, ids, mask), want) for _ in range(calls)]
