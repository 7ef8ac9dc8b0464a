"""`engine.save_16bit_model` for a pipeline engine: every stage's weights in one file, written by global rank 0.

Each pipeline rank holds only its stage's layers, under the `PipelineModule`'s global names (`"<layer
index>.<param>"`, `"tied_modules.<key>.<param>"`). Pipelines run at ZeRO 0-2 (`initialize` refuses ZeRO 3), so
every data-parallel replica holds its stage's parameters whole: only the pipe group of data-parallel rank 0
(the replica holding global rank 0) takes part in the transfer, and the other replicas only join the final
agreement. The protocol over that pipe group:

1. one `all_gather_object` of each rank's (name, dtype, shape) list, so every rank knows the entries, their
   order and their owner: a name held by several ranks (a `TiedLayerSpec` module) belongs to the first pipe
   rank holding it, the rank whose tied weights `TiedWeights.owned_elsewhere()` does not exclude;
2. pipe rank 0 (global rank 0) writes the entries in that order, its own from memory and the others' as they
   arrive, one point-to-point receive each from the owner; each owner sends its entries in the same order
   (messages between two ranks match in posting order). A `.safetensors` name is streamed (rank 0 holds one
   received tensor at a time); any other name is a `torch.save` dict received whole first;
3. if rank 0 fails (disk full, bad path), it still receives every remaining entry so no owner hangs; then the
   outcome is agreed over the world and every rank raises (`checkpoint._raise_gathered`).

With expert parallelism every rank of a stage first gathers its experts over its expert group
(`expert_items`), so the replica of global rank 0 offers every expert under its global id.

The file order is the order of the same model built at one stage (tie modules by their first layer, then the
layers; parameters, then persistent buffers), so the file equals the one a one-stage engine with the same
weights writes, header and bytes.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm.ops import recv, start_send
from ..utils.io import atomic_write
from .checkpoint import _all_gather_object, _raise_gathered, module_extras
from .checkpoint_io import write_safetensors
from .checkpoint_moe import _EXPERT

__all__ = ["save_16bit_model_pipeline", "local_items", "expert_items", "offer", "plan_entries"]


def local_items(module, not_written=frozenset(), exclude_frozen: bool = False) -> list:
    """(name, tensor, kind 0 = parameter / 1 = buffer) one pipe rank offers, as `consolidate.save_16bit_model`
    lists them, without the tied weights another pipe rank owns (not_written: `PipeTranslation.not_written`)."""
    elsewhere = {id(p) for n, p in module.named_parameters() if n in not_written}
    items = [(n, p, 0) for n, p in module.named_parameters(remove_duplicate=False)
             if (p.requires_grad or not exclude_frozen) and id(p) not in elsewhere]
    items += [(n, b, 1) for n, b, kind in module_extras(module) if kind == "buffer"]
    return items


def expert_items(items, ex) -> list:
    """`local_items` with expert parallelism (ex: `checkpoint_moe.ExpertTranslation`): each local expert
    parameter of an `MoE` layer becomes the entries of every rank of its expert group under their global ids
    (one all-gather each, over the group), ordered as the same layer at ep 1 holds them (expert by expert);
    AutoEP's fused experts become their full [E, ...] tensors. Collective over each expert group, in the same
    order on its ranks (they hold the same stage)."""
    out = []  # (sort key, name, tensor, kind)
    first: dict[str, int] = {}  # an expert layer's prefix -> the position of its first local expert entry
    tails: dict[str, list[str]] = {}
    for pos, (name, t, kind) in enumerate(items):
        spread = ex.spread(name)
        if spread is None:
            out.append(((pos, 0, 0), name, ex.gather_full(t, t.detach()), kind))
            continue
        values = ex.gather_spread(t.detach())
        m = _EXPERT.match(name)
        head, tail = m["head"], m["tail"]
        first.setdefault(head, pos)
        order = tails.setdefault(head, [])
        if tail not in order:
            order.append(tail)
        for (global_name, r) in spread:
            index = int(_EXPERT.match(global_name)["index"])
            out.append(((first[head], index, order.index(tail)), global_name, values[r], kind))
    out.sort(key=lambda e: e[0])
    return [(name, t, kind) for _, name, t, kind in out]


def offer(items) -> list[tuple[str, int, str, tuple]]:
    """What a rank tells the others of `local_items`: (name, kind, dtype name, shape), picklable."""
    return [(n, kind, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t, kind in items]


def _order_key(module, kind: int, name: str) -> tuple:
    """Where `name` sits in the one-stage module: parameters before buffers; `tied_modules` (registered first,
    in the order of each key's first layer), then the layers by index; the rank's own order within a layer."""
    head, _, rest = name.partition(".")
    if head == "tied_modules":
        key = rest.partition(".")[0]
        first = module.tied_layers(key)[0] if key in module.tied_stage_map else 0
        return kind, 0, first
    return (kind, 1, int(head)) if head.isdigit() else (kind, 2, 0)


def plan_entries(module, offers: list[list[tuple[str, int, str, tuple]]]) -> list[tuple[str, torch.dtype, tuple, int]]:
    """(name, dtype, shape, owner pipe rank) for every entry of the file, in file order. offers[r]: pipe rank r's
    `offer`. A name offered by several ranks belongs to the first. Pure (module: any stage of the PipelineModule,
    for the tie keys' first layers)."""
    seen, out = set(), []
    for rank, listed in enumerate(offers):
        for name, kind, dtype, shape in listed:
            if name not in seen:
                seen.add(name)
                out.append((_order_key(module, kind, name), name, getattr(torch, dtype), tuple(shape), rank))
    out.sort(key=lambda e: e[0])  # stable: a layer's entries keep their owner's order
    return [e[1:] for e in out]


class _Incoming:
    """Rank 0's side: value(j) is entry j, from memory when rank 0 owns it, else received from its owner (call
    in entry order); drain() receives every remote entry not read yet, so the owners' sends all complete."""

    def __init__(self, entries, local: dict, group, device, logger):
        self.entries, self.local, self.group, self.device, self.logger = entries, local, group, device, logger
        self._next = 0  # the first entry not read yet
        self._broken = False  # a receive failed: the link is down, draining would only wait out more timeouts

    def value(self, j: int) -> torch.Tensor:
        if j != self._next:
            raise RuntimeError(f"entry {j} read out of order (expected {self._next}): the owners send in order")
        self._next += 1
        name, dtype, shape, owner = self.entries[j]
        if owner == 0:
            return self.local[name].detach()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        if buf.numel():
            try:
                recv(buf, owner, group=self.group, logger=self.logger)
            except Exception:
                self._broken = True
                raise
        return buf

    def drain(self) -> None:
        while self._next < len(self.entries) and not self._broken:
            self.value(self._next)


def _send_owned(entries, local: dict, me: int, group, logger) -> None:
    """An owner's side: send its entries to pipe rank 0, in entry order, one at a time."""
    for name, _, shape, owner in entries:
        if owner == me and math.prod(shape):
            start_send(local[name].detach().contiguous(), 0, group=group, logger=logger).wait()


def save_16bit_model_pipeline(engine, save_dir, save_filename: str = "model.safetensors",
                              exclude_frozen_parameters: bool = False) -> bool:
    """Write every pipeline stage's weights to `save_dir/save_filename` on global rank 0. Collective over the world.

    The keys are the PipelineModule's global names, each tensor once (a weight tied across stages from the
    first stage holding it), in the module's own dtypes (bf16 under bf16 training), parameters (trainable only
    with exclude_frozen_parameters) and persistent buffers: the result loads with `load_state_dict(strict=True)`
    into the same PipelineModule built with num_stages=1. `.safetensors` streams (rank 0 holds one received
    tensor at a time, the file is written under a temporary name, then renamed); any other name writes a
    `torch.save` dict (loadable with weights_only=True), received whole on rank 0 first. Communication: one
    `all_gather_object` of names, dtypes and shapes over the pipe group of data-parallel rank 0; every tensor
    another stage owns sent to rank 0 once, point-to-point (its bytes: numel x element size, in the module
    dtype); one `all_gather_object` over the world to agree the outcome. Peak extra memory on rank 0: the
    largest received tensor (.safetensors) or every other stage's tensors (torch.save). Returns True.
    Raises CheckpointError on every rank if a rank failed (the failing rank raises its own exception, e.g.
    OSError), NotImplementedError at ZeRO stage 3 (pipelines refuse it).
    """
    if engine.zero_optimization_stage() >= 3:
        raise NotImplementedError("save_16bit_model of a pipeline at ZeRO stage 3: pipelines run at stages 0-2")
    group, logger = engine.pipe_group, engine.comms_logger
    path = Path(save_dir) / save_filename
    own = None
    ex, sender = engine.expert_translation, dist.get_rank(engine.group) == 0
    if sender or ex is not None:
        items = local_items(engine.module, engine.pipe_translation.not_written, exclude_frozen_parameters)
    if ex is not None:  # every rank of a stage's expert group takes part in gathering its experts
        items = expert_items(items, ex)
    if sender:  # the replica holding global rank 0 sends; the others only agree below
        local = {n: t for n, t, _ in items}
        entries = plan_entries(engine.module, _all_gather_object(offer(items), group))
        me = dist.get_rank(group)
        try:
            if me == 0:
                _write(path, entries, _Incoming(entries, local, group, engine.device, logger))
            else:
                _send_owned(entries, local, me, group, logger)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            own = exc
    errors = _all_gather_object(None if own is None else (type(own).__name__, str(own)), None)
    _raise_gathered(errors, own, f"save_16bit_model to {path}")
    return True


def _write(path: Path, entries, incoming: _Incoming) -> None:
    """Rank 0: write the file from `incoming`; on failure drain the receives still due, then re-raise."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            rows = [(name, dtype, shape, lambda j=j: incoming.value(j))
                    for j, (name, dtype, shape, _) in enumerate(entries)]
            atomic_write(path, lambda tmp: write_safetensors(tmp, rows, metadata={"format": "pt"}, fsync=False))
        else:
            sd = {}
            for j, (name, _, _, owner) in enumerate(entries):
                t = incoming.value(j)
                sd[name] = t.clone() if owner == 0 else t
            atomic_write(path, lambda tmp: torch.save(sd, tmp))
    except Exception:
        incoming.drain()  # the owners are still sending: take the rest, so nobody hangs
        raise
