"""`engine.save_checkpoint` / `engine.load_checkpoint`: sharded, topology-independent, crash-safe.

Layout: `checkpoint_format.py`. Each rank writes only what it owns (`ZeroStrategy.owned_fragments`):
logical per-parameter fp32 masters and optimizer states as flat fragments, so a checkpoint loads at
any world size and any ZeRO stage (`ZeroStrategy.load_owned_fragments`), with no conversion step.

Why safetensors + JSON rather than `torch.distributed.checkpoint` (DCP): DCP pickles its metadata
(`.metadata` holds torch classes), describes shards of DTensors / ShardedTensors (our stage 1/2
partitions are chunk-strided ranges of a flat buffer that cross parameters), and its offline
consolidation loads whole state dicts; safetensors + a JSON index is readable by any tool, needs no
pickle, and `zerospeed to-fp32` can stream it one tensor at a time.

Both calls are collective (every rank of the data-parallel group calls them). Errors on one rank
(a failed write, an unreadable file) are gathered and raised on every rank, never left as a hang.
Crash safety: ranks write into `<tag>.tmp-zs<random>/`, files are fsynced; rank 0 writes the index
last, fsyncs, renames the directory to `<tag>` and only then rewrites `latest` (atomic_write).
A crash at any point leaves the previous checkpoint and `latest` untouched.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..utils.io import atomic_write
from .checkpoint_format import (ENGINE_STATE, FORMAT, INDEX, LATEST, VERSION, CheckpointError,
                                CheckpointMismatchError, CheckpointReader, fragment_key, rank_file, read_index,
                                read_json, scalar_key)
from .checkpoint_io import dtype_code, fsync_dir, write_safetensors
from .checkpoint_state import capture_rng, check_group_members, engine_state, restore_engine_state, restore_rng

log = logging.getLogger(__name__)
_TMP, _OLD = ".tmp-zs", ".old-zs"


class CheckpointTagMismatchError(CheckpointError):
    """Ranks called save_checkpoint / load_checkpoint with different tags."""


# -- collectives ----------------------------------------------------------------------------------------
def _translation(engine):
    """How this rank's parameters map onto the checkpoint's full, global tensors (`checkpoint_tp.TPTranslation`
    under tensor parallelism, `checkpoint_pipe.PipeTranslation` in a pipeline), or None (they are the same)."""
    return getattr(engine, "checkpoint_translation", None)


def _group(engine):
    """The ranks that write and read a checkpoint together: the data-parallel group, or the whole world
    with a translation (every tensor-parallel rank writes its own shards' fragments, every pipeline stage its
    own layers')."""
    return None if _translation(engine) is not None else engine.group


def _all_gather_object(obj: Any, group) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    with record_function("zerospeed::checkpoint_all_gather_object"):
        dist.all_gather_object(out, obj, group=group)
    return out


def _agree_on_tag(tag: str, mode: str, group) -> str:
    """The tag every rank uses. An all-gather of a 64-bit hash; on a mismatch the tags are gathered for
    the message and modes "Fail" and "Warn" (the default) raise CheckpointTagMismatchError on every rank;
    "Ignore" uses rank 0's tag. Deliberate difference from DeepSpeed, whose "Warn" only logs: different
    tags on different ranks are almost always a bug in the training script (issue 4), so the default
    is an error. A checkpoint is never split over two tags."""
    digest = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64)
    hashes = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    with record_function("zerospeed::checkpoint_tag_check"):
        dist.all_gather(hashes, mine, group=group)
    if all(int(h) == digest for h in hashes):
        return tag
    tags = _all_gather_object(tag, group)
    listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if mode in ("Fail", "Warn"):
        raise CheckpointTagMismatchError(f"checkpoint tags differ across ranks ({listing}); every rank must pass "
                                         "the same tag (or none: the default is global_step<N>); "
                                         "checkpoint.tag_validation='Ignore' uses rank 0's tag instead")
    return tags[0]


def _raise_gathered(errors: list[tuple[str, str] | None], own: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed: this rank's own exception, else a CheckpointError naming the rank."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if own is not None:
        raise own
    r, (kind, msg) = failed[0]
    raise CheckpointError(f"{what} failed on rank {r} ({kind}: {msg})")


def _check_tag_name(tag: str) -> None:
    if not tag or "/" in tag or os.sep in tag or tag.startswith(".") or _TMP in tag or _OLD in tag:
        raise ValueError(f"invalid checkpoint tag {tag!r}: it names a directory inside save_dir, so it must be "
                         "non-empty, contain no path separator and not start with '.'")


# -- what a module holds besides the trainable parameters ----------------------------------------------
def module_extras(module, *, exclude_frozen: bool = False) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, kind) for persistent buffers ("buffer") and frozen parameters ("frozen"), each once."""
    out, seen = [], set()
    for name, p in module.named_parameters():
        if not p.requires_grad and not exclude_frozen and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p, "frozen"))
    for mod_name, m in module.named_modules():
        for b_name, b in m._buffers.items():
            if b is None or b_name in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mod_name}.{b_name}" if mod_name else b_name, b, "buffer"))
    return out


# -- save ---------------------------------------------------------------------------------------------------
def _extras_writers(engine, exclude_frozen: bool, group) -> dict[str, int]:
    """{name: the rank that writes it} for the buffers and frozen parameters (`module_extras`): the holders of
    each (every rank, unless pipeline stages hold different ones) take turns over the sorted names, so the
    replicated tensors spread over the files. Collective over `group`."""
    mine = sorted(n for n, _, _ in module_extras(engine.module, exclude_frozen=exclude_frozen))
    holders: dict[str, list[int]] = {}
    for r, names in enumerate(_all_gather_object(mine, group)):
        for n in names:
            holders.setdefault(n, []).append(r)
    return {n: holders[n][i % len(holders[n])] for i, n in enumerate(sorted(holders))}


def _write_rank(engine, tmp: Path, rank: int, world: int, client_state, exclude_frozen: bool, writers: dict):
    """Write this rank's file; returns (its index metadata, engine_state on rank 0 else None)."""
    entries, frags, scalars, elem, scal = [], [], [], {}, {}
    for f in engine.strategy.owned_fragments(engine.module, _translation(engine)):
        n = f.end - f.start
        entries.append((fragment_key(f.name, "master", f.start), f.master.dtype, (n,), lambda t=f.master: t))
        for k, v in f.states.items():
            entries.append((fragment_key(f.name, k, f.start), v.dtype, (n,), lambda t=v: t))
            elem[k] = dtype_code(v.dtype)
        for k, v in f.scalars.items():
            entries.append((scalar_key(f.name, k), v.dtype, (), lambda t=v: t))
            scal[k] = dtype_code(v.dtype)
        frags.append((f.name, f.start, f.end))
        if f.scalars:
            scalars.append(f.name)
    extras = []
    for name, t, kind in module_extras(engine.module, exclude_frozen=exclude_frozen):
        if writers[name] == rank:
            entries.append((fragment_key(name, "value", 0), t.dtype, tuple(t.shape), lambda t=t: t))
            extras.append((name, list(t.shape), dtype_code(t.dtype), kind))
    rng, meta = capture_rng()
    entries += [(k, v.dtype, tuple(v.shape), lambda t=v: t) for k, v in rng.items()]
    state = None
    if rank == 0:
        tensors: dict[str, torch.Tensor] = {}
        state = engine_state(engine, client_state, tensors)
        entries += [(k, v.dtype, tuple(v.shape), lambda t=v: t) for k, v in tensors.items()]
    info = write_safetensors(tmp / rank_file(rank), entries, metadata=meta)
    params = [(lp.name, list(lp.shape), dtype_code(lp.dtype), list(lp.aliases))
              for lp in engine.strategy.logical_params(engine.module, _translation(engine))]
    return {"file": rank_file(rank), "bytes": info["bytes"], "crc32": info["crc32"], "fragments": frags,
            "scalars": scalars, "elementwise_states": elem, "scalar_states": scal, "params": params,
            "extras": extras}, state


def _build_index(engine, tag: str, metas: list[dict], exclude_frozen: bool) -> dict[str, Any]:
    """The index from every rank's metadata: the union of their parameters (pipeline stages hold different
    ones), each tiled by the ranks' fragments, and the extras where their writers put them."""
    world = len(metas)
    tensors: dict[str, dict[str, Any]] = {}
    for meta in metas:
        for name, shape, dtype, aliases in meta["params"]:
            tensors.setdefault(name, {"kind": "param", "shape": shape, "dtype": dtype, "aliases": aliases,
                                      "fragments": [], "scalar_rank": None})
    for r, meta in enumerate(metas):
        for name, a, b in meta["fragments"]:
            tensors[name]["fragments"].append([r, a, b])
        for name in meta["scalars"]:
            tensors[name]["scalar_rank"] = r
    for name, entry in tensors.items():
        entry["fragments"].sort(key=lambda f: f[1])
        numel = 1
        for s in entry["shape"]:
            numel *= s
        pos = 0
        for _, a, b in entry["fragments"]:
            if a != pos:
                break
            pos = b
        if pos != numel:  # a strategy bug, never a user error: refuse to commit a checkpoint with holes
            raise CheckpointError(f"internal error: the ranks' fragments of {name!r} do not tile [0, {numel}): "
                                  f"{entry['fragments']}")
    for r, meta in enumerate(metas):
        for name, shape, dtype, kind in meta["extras"]:
            tensors[name] = {"kind": kind, "shape": shape, "dtype": dtype, "aliases": [],
                             "fragments": [[r, 0, math.prod(shape)]], "scalar_rank": None}
    elem = {k: v for m in metas for k, v in m["elementwise_states"].items()}
    scal = {k: v for m in metas for k, v in m["scalar_states"].items()}
    opt = engine.optimizer
    return {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": world,
            "zero_stage": engine.zero_optimization_stage(), "optimizer": type(opt).__name__ if opt else None,
            "elementwise_states": elem, "scalar_states": scal, "excluded_frozen": exclude_frozen,
            "files": {m["file"]: {"rank": r, "bytes": m["bytes"], "crc32": m["crc32"]} for r, m in enumerate(metas)},
            "tensors": tensors}


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _commit(save_dir: Path, tmp: Path, tag: str, save_latest: bool) -> None:
    """Rank 0: move `tmp` to `<tag>` (an existing `<tag>` is moved aside first, then deleted; a crash in
    between leaves it aside, where load_checkpoint finds it), then `latest`; finally remove the
    directories left by interrupted saves (any `*.tmp-zs*` / `*.old-zs*` in save_dir)."""
    final, old = save_dir / tag, None
    if final.exists():
        old = save_dir / f"{tag}{_OLD}{secrets.token_hex(4)}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    if save_latest:
        atomic_write(save_dir / LATEST, lambda p: p.write_text(tag))
    for stale in save_dir.iterdir():
        if stale.is_dir() and (_TMP in stale.name or _OLD in stale.name):
            shutil.rmtree(stale, ignore_errors=True)


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Save under `save_dir/<tag>` (tag default `global_step<N>`) and point `save_dir/latest` at it.

    Collective. client_state: a dict of JSON values and tensors returned by load_checkpoint (objects
    are refused with TypeError: nothing is pickled). Returns True. Raises CheckpointTagMismatchError
    (tags differ and checkpoint.tag_validation is "Fail"), ValueError (bad tag), TypeError
    (client_state), CheckpointError naming the failed rank; on any error nothing is committed.
    """
    group = _group(engine)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mode = getattr(engine, "checkpoint_tag_validation", "Warn")
    tag = _agree_on_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}", mode, group)
    _check_tag_name(tag)
    save_dir = Path(save_dir)
    tmp = save_dir / _all_gather_object(f"{tag}{_TMP}{secrets.token_hex(4)}", group)[0]
    writers = _extras_writers(engine, exclude_frozen_parameters, group)
    own, meta, state = None, None, None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        meta, state = _write_rank(engine, tmp, rank, world, client_state, exclude_frozen_parameters, writers)
    except Exception as exc:  # noqa: BLE001 - gathered and raised on every rank below
        own = exc
    gathered = _all_gather_object((meta, None if own is None else (type(own).__name__, str(own))), group)
    errors = [e for _, e in gathered]
    if rank == 0 and own is None and not any(errors):
        try:
            _write_json(tmp / ENGINE_STATE, state)
            _write_json(tmp / INDEX, _build_index(engine, tag, [m for m, _ in gathered], exclude_frozen_parameters))
            fsync_dir(tmp)
            _commit(save_dir, tmp, tag, save_latest)
        except Exception as exc:  # noqa: BLE001
            own = exc
    if rank == 0 and (own is not None or any(errors)):
        shutil.rmtree(tmp, ignore_errors=True)
    outcome = _all_gather_object(None if own is None else (type(own).__name__, str(own)), group)
    _raise_gathered(outcome, own, f"save_checkpoint to {save_dir / tag} (nothing was committed)")
    return True


# -- load ---------------------------------------------------------------------------------------------------
class _ModelReader:
    """Maps the engine's parameter names (aliases included) onto the checkpoint's; None for what the
    checkpoint lacks (non-strict loads keep current values)."""

    def __init__(self, reader: CheckpointReader, lookup: dict[str, str]):
        self.reader, self.lookup = reader, lookup
        self.elementwise_states, self.scalar_states = reader.elementwise_states, reader.scalar_states

    def read(self, name, field, start, end):
        stored = self.lookup.get(name)
        if stored is None:
            return None
        kind = self.reader.tensors[stored]["kind"]
        if kind != "param":
            return self.reader.read(stored, "value", start, end) if field == "master" else None
        return self.reader.read(stored, field, start, end)

    def scalar(self, name, field):
        stored = self.lookup.get(name) if name is not None else None
        if stored is not None and self.reader.tensors[stored].get("scalar_rank") is None:
            stored = None
        return self.reader.scalar(stored, field)


def _match_model(engine, index: dict[str, Any], strict: bool) -> dict[str, str]:
    """{engine name: checkpoint name}. Raises CheckpointMismatchError listing missing / unexpected keys
    (strict) and shape mismatches (always)."""
    stored = index["tensors"]
    by_name = {n: n for n in stored}
    by_name.update({a: n for n, e in stored.items() for a in e.get("aliases", [])})
    current = [(lp.name, (lp.name, *lp.aliases), lp.shape, "param")
               for lp in engine.strategy.logical_params(engine.module, _translation(engine))]
    current += [(n, (n,), tuple(t.shape), kind) for n, t, kind in module_extras(engine.module)]
    lookup, missing, shapes, used = {}, [], [], set()
    for name, names, shape, kind in current:
        hit = next((by_name[n] for n in names if n in by_name), None)
        if hit is None:
            if not (kind == "frozen" and index.get("excluded_frozen")):
                missing.append(f"{name} {list(shape)}")
            continue
        used.add(hit)
        if tuple(stored[hit]["shape"]) != tuple(shape):
            shapes.append(f"{name}: checkpoint {stored[hit]['shape']} vs model {list(shape)}")
            continue
        lookup[name] = hit
    owns = getattr(_translation(engine), "owns", lambda name: True)  # a pipeline stage: only its own layers
    unexpected = [f"{n} {e['shape']}" for n, e in stored.items() if n not in used and owns(n)]

    def listing(title, items):
        more = f", ... and {len(items) - 20} more" if len(items) > 20 else ""
        return f"{title} ({len(items)}): {', '.join(items[:20])}{more}"
    problems = [listing("shape mismatches", shapes)] if shapes else []
    if strict:
        problems += [listing("missing in the checkpoint", missing)] if missing else []
        problems += [listing("unexpected in the checkpoint", unexpected)] if unexpected else []
    if problems:
        raise CheckpointMismatchError(f"the checkpoint in {index.get('tag')!r} does not match the model: "
                                      + "; ".join(problems) + ("" if shapes else
                                      " (load_module_strict=False loads the matching keys only)"))
    if missing or unexpected:
        log.warning("non-strict checkpoint load: %d model keys missing in the checkpoint, %d checkpoint keys unused",
                    len(missing), len(unexpected))
    return lookup


def _load_local(engine, tag_dir: Path, *, strict: bool, optimizer_states: bool, scheduler: bool,
                module_only: bool) -> dict:
    """Everything a rank can do without collectives; returns the client_state."""
    index = read_index(tag_dir)
    state = read_json(tag_dir / ENGINE_STATE)
    lookup = _match_model(engine, index, strict)
    optimizer_states = optimizer_states and not module_only
    opt = engine.optimizer
    if optimizer_states and opt is not None and index.get("optimizer") not in (None, type(opt).__name__) \
            and index.get("elementwise_states"):
        raise CheckpointError(f"the checkpoint holds {index['optimizer']} states but the engine's optimizer is "
                              f"{type(opt).__name__}; pass load_optimizer_states=False to load the weights only")
    if optimizer_states and opt is not None:  # before anything is loaded: nothing half-restored on an error
        check_group_members(state.get("optimizer_param_group_names"), getattr(engine, "param_group_names", None))
    with CheckpointReader(tag_dir, index) as reader:
        model_reader = _ModelReader(reader, lookup)
        engine.strategy.load_owned_fragments(engine.module, model_reader, optimizer_states=optimizer_states,
                                             translate=_translation(engine))
        with torch.no_grad():
            for name, t, _ in module_extras(engine.module):
                if name in lookup:
                    t.copy_(reader.read_full(lookup[name]))
        if module_only:
            return {}
        client_state = restore_engine_state(engine, state, lambda k: reader.extra(0, k),
                                            load_optimizer_states=optimizer_states, load_lr_scheduler_states=scheduler)
        rank, world = dist.get_rank(_group(engine)), dist.get_world_size(_group(engine))
        if index["world_size"] == world:
            f = reader.file(rank)
            restore_rng(lambda k: reader.extra(rank, k), set(f.tensors), f.metadata)
        elif rank == 0:
            log.info("RNG states not restored: the checkpoint was saved by %d ranks, this run has %d",
                     index["world_size"], world)
        return client_state


def _existing(load_dir: Path, tag: str) -> Path:
    """`load_dir/<tag>`, or the complete copy a crash while re-saving the same tag left aside."""
    tag_dir = load_dir / tag
    if not tag_dir.is_dir():
        aside = sorted(p for p in load_dir.glob(f"{tag}{_OLD}*") if (p / INDEX).is_file())
        if aside:
            log.warning("%s is missing (a save of the same tag was interrupted); loading %s", tag_dir, aside[0])
            return aside[0]
    return tag_dir


def load_checkpoint(engine, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Load `load_dir/<tag>` (tag default: the content of `load_dir/latest`), saved at any world size
    and ZeRO stage. Collective. Returns (checkpoint directory, client_state), or (None, None) with a
    warning if no tag is given and `latest` does not exist (a first start).

    load_module_only: weights only (no optimizer, scheduler, counters, RNG). Raises
    CheckpointMismatchError (another model: lists missing / unexpected / mis-shaped keys),
    CheckpointFileError (a missing, truncated or corrupt file, named), CheckpointTagMismatchError,
    CheckpointError naming the rank that failed; on every rank.
    """
    group = _group(engine)
    load_dir = Path(load_dir)
    if tag is None:
        latest = load_dir / LATEST
        tag = latest.read_text().strip() if latest.is_file() else ""
    tag = _agree_on_tag(str(tag), "Fail", group)
    if not tag:
        log.warning("no checkpoint to load: %s does not exist (first start?)", load_dir / LATEST)
        return None, None
    tag_dir = _existing(load_dir, tag)
    own, client_state = None, None
    try:
        client_state = _load_local(engine, tag_dir, strict=load_module_strict, optimizer_states=load_optimizer_states,
                                   scheduler=load_lr_scheduler_states, module_only=load_module_only)
    except Exception as exc:  # noqa: BLE001 - gathered and raised on every rank below
        own = exc
    errors = _all_gather_object(None if own is None else (type(own).__name__, str(own)), group)
    _raise_gathered(errors, own, f"load_checkpoint from {tag_dir}")
    engine.strategy.refresh_params_from_master()
    return str(tag_dir), client_state
