"""Full weights in one place: `zerospeed to-fp32` (offline, from a checkpoint) and `engine.save_16bit_model`.

`zerospeed to-fp32 CHECKPOINT_DIR OUTPUT [--tag T] [--max-shard-size 5GB] [--exclude-frozen-parameters]`
is DeepSpeed's `zero_to_fp32.py` without its pains (reference §4 row 4): one process, no model code,
no zerospeed classes unpickled (nothing is), and streaming: each output tensor is assembled from its
fragments, written and dropped, so peak memory is about the largest tensor, not the model. Output:
`OUTPUT/model.safetensors`, or above --max-shard-size the Hugging Face layout
`model-00001-of-0000N.safetensors` + `model.safetensors.index.json` ({"metadata": {"total_size"},
"weight_map": {key: file}}). Trainable parameters are the fp32 masters; buffers and frozen
parameters keep their dtype. Tied parameters are written under every name (the bytes repeated), so
`model.load_state_dict(load_file(...))` works strictly on a fresh module.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..utils.io import atomic_write
from .checkpoint import _all_gather_object, _raise_gathered, module_extras
from .checkpoint_format import CheckpointError, CheckpointReader, read_index, resolve_tag_dir
from .checkpoint_io import CODE_DTYPES, parse_size, write_safetensors

SINGLE, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"


def _plan(index: dict, exclude_frozen: bool) -> list[tuple[str, str, torch.dtype, tuple[int, ...]]]:
    """(output key, stored name, output dtype, shape) for every tensor, aliases after their parameter."""
    out = []
    for name, e in index["tensors"].items():
        if e["kind"] == "frozen" and exclude_frozen:
            continue
        dtype = torch.float32 if e["kind"] == "param" else CODE_DTYPES[e["dtype"]]
        out += [(key, name, dtype, tuple(e["shape"])) for key in [name, *e.get("aliases", [])]]
    return out


def _shards(plan, max_bytes: int) -> list[list]:
    """Greedy, in order; a tensor larger than max_bytes gets a shard of its own (as Hugging Face does)."""
    shards, size = [[]], 0
    for item in plan:
        nbytes = math.prod(item[3]) * item[2].itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def convert_to_fp32(checkpoint_dir, output, *, tag: str | None = None, max_shard_size: str | int = "5GB",
                    exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the consolidated weights of a zerospeed checkpoint as safetensors; returns the files written.

    checkpoint_dir: a save_dir (tag from `latest` unless `tag`) or a tag directory. output: a
    directory, or a path ending in ".safetensors" for one unsharded file. Each file is written under a
    temporary name, fsynced and renamed. Raises CheckpointError / CheckpointFileError (named file),
    ValueError (bad size).
    """
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    if tag_dir is None:
        raise CheckpointError(f"{checkpoint_dir} holds no 'latest' file and no index.json; pass --tag or a "
                              "tag directory")
    index = read_index(tag_dir)
    plan = _plan(index, exclude_frozen_parameters)
    output = Path(output)
    single_file = output.suffix == ".safetensors"
    shards = [plan] if single_file else _shards(plan, parse_size(max_shard_size))
    out_dir = output.parent if single_file else output
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    names = [output.name] if single_file else \
        [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written = []
    with CheckpointReader(tag_dir, index) as reader:
        for fname, shard in zip(names, shards):
            entries = [(key, dtype, shape, lambda s=stored, d=dtype: reader.read_full(s).to(d))
                       for key, stored, dtype, shape in shard]
            written.append(atomic_write(out_dir / fname, lambda p, e=entries: write_safetensors(
                p, e, metadata={"format": "pt"}, fsync=False)))
    if n > 1:
        weight_map = {key: fname for fname, shard in zip(names, shards) for key, *_ in shard}
        total = sum(math.prod(shape) * dtype.itemsize for _, _, dtype, shape in plan)
        body = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        written.append(atomic_write(out_dir / INDEX_NAME, lambda p: p.write_text(body)))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerospeed to-fp32", description="Consolidate a zerospeed checkpoint into fp32 "
                                "safetensors (offline, one process, streaming; DeepSpeed's zero_to_fp32).")
    p.add_argument("checkpoint_dir", help="the save_dir given to save_checkpoint (or one tag directory in it)")
    p.add_argument("output", help="output directory (or a path ending in .safetensors for one file)")
    p.add_argument("--tag", "-t", default=None, help="checkpoint tag (default: the one in CHECKPOINT_DIR/latest)")
    p.add_argument("--max-shard-size", "--max_shard_size", default="5GB",
                   help="split into Hugging Face shards above this size (default 5GB; e.g. 500MB, 2GiB)")
    p.add_argument("--exclude-frozen-parameters", "--exclude_frozen_parameters", action="store_true")
    ns = p.parse_args(argv)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        files = convert_to_fp32(ns.checkpoint_dir, ns.output, tag=ns.tag, max_shard_size=ns.max_shard_size,
                                exclude_frozen_parameters=ns.exclude_frozen_parameters)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"zerospeed to-fp32: error: {exc}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in files)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    print(f"wrote {len(files)} file(s), {size / 1e6:.1f} MB, to {Path(ns.output)} in "
          f"{time.perf_counter() - start:.1f} s (peak RSS growth {grew:.1f} MB)")
    return 0


# -- engine.save_16bit_model --------------------------------------------------------------------------------
def save_16bit_model(engine, save_dir, save_filename: str = SINGLE, exclude_frozen_parameters: bool = False) -> bool:
    """Write the full weights in the module's own dtypes to `save_dir/save_filename` on rank 0. Collective.

    Like DeepSpeed (which saves `module.state_dict()` as it is): bf16 when training in bf16, fp16 in
    fp16, and fp32 in fp32 training (the name is historical). Under ZeRO-3 the units are gathered
    one at a time and streamed into the file, so no rank holds the whole model; unlike DeepSpeed
    this needs no `stage3_gather_16bit_weights_on_model_save` (the flag is accepted and ignored).
    A name ending in .safetensors writes safetensors (tied weights under every name); any other
    name writes a `torch.save` dict of tensors (loadable with weights_only=True). Returns True.
    Raises CheckpointError on every rank if rank 0 could not write.
    """
    module, strategy, group = engine.module, engine.strategy, engine.group
    tp = getattr(engine, "tp_translation", None)
    # expert parallelism: each rank holds its experts only (`checkpoint_moe.ExpertTranslation` gathers them)
    ex = getattr(engine, "expert_translation", None)
    if tp is not None or ex is not None:  # every rank takes part in the gathers; global rank 0 writes
        group = None
    rank = dist.get_rank(group)
    items = []  # (key, tensor)
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.requires_grad or not exclude_frozen_parameters:
            items.append((name, p))
    items += [(name, b) for name, b, kind in module_extras(module) if kind == "buffer"]
    picks: list = [None] * len(items)
    if ex is not None:  # an MoE layer's local expert i: one entry per rank r of the group, global id r x L + i
        spread = [(n, t, ex.spread(n)) for n, t in items]
        items = [(g, t) for n, t, sp in spread for g, _ in (sp or [(n, None)])]
        picks = [r for _, _, sp in spread for _, r in (sp or [(None, None)])]
    path = Path(save_dir) / save_filename
    own = None
    with strategy.full_values([t for _, t in items]) as full:  # stage 3: one unit gathered at a time
        if tp is not None:
            full = _TensorParallelValues(full, [t for _, t in items], tp)
        if ex is not None:  # (after the tensor-parallel gathers: experts are replicated over the tensor group)
            full = _ExpertValues(full, [t for _, t in items], picks, ex)
        walk = [(items[i][0], items[i][1], i) for i in full.order]
        try:
            if rank == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.suffix == ".safetensors":
                    entries = [(k, t.dtype, full.shape(i), lambda i=i: full.value(i)) for k, t, i in walk]
                    atomic_write(path, lambda tmp: write_safetensors(tmp, entries, metadata={"format": "pt"},
                                                                     fsync=False))
                else:
                    sd = {k: full.value(i).clone() for k, _, i in walk}
                    atomic_write(path, lambda tmp: torch.save(sd, tmp))
            else:
                full.finish()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            own = exc
            full.finish()  # the collectives still due, so the other ranks do not hang
    errors = _all_gather_object(None if own is None else (type(own).__name__, str(own)), group)
    _raise_gathered(errors, own, f"save_16bit_model to {path}")
    return True


class _GatheredValues:
    """`FullValues` of a model-parallel run: value(i) assembles tensor i from the ranks holding its parts
    (`_gather`, a collective); shape(i) is its full shape. Every rank must read the same tensors in the same
    order: finish() reads the ones not read yet, then finishes the wrapped values."""

    def __init__(self, full, tensors):
        self.full, self.tensors = full, tensors
        self.order = full.order
        self._done: set[int] = set()

    def value(self, i: int) -> torch.Tensor:
        self._done.add(i)
        return self._gather(i)

    def finish(self) -> None:
        for i in self.order:
            if i not in self._done:
                self.value(i)
        self.full.finish()


class _ExpertValues(_GatheredValues):
    """Under expert parallelism: AutoEP's fused expert tensors all-gathered whole over the expert group
    (`ExpertTranslation.gather_full`), an `MoE` layer's local expert tensor all-gathered once and entry j
    reading rank picks[j]'s copy (`gather_spread`); the rest as they are."""

    def __init__(self, full, tensors, picks, ex):
        super().__init__(full, tensors)
        self.picks, self.ex = picks, ex
        self._last: tuple = (None, None)  # (id(tensor), its gathered copies): consecutive entries share it

    def shape(self, i: int):
        hit = self.ex._by_id.get(id(self.tensors[i]))
        return hit[1] if hit else tuple(self.full.shape(i))

    def _gather(self, i: int) -> torch.Tensor:
        t, r = self.tensors[i], self.picks[i]
        if r is None:
            return self.ex.gather_full(t, self.full.value(i))
        if self._last[0] != id(t):
            self._last = (id(t), self.ex.gather_spread(self.full.value(i)))
        return self._last[1][r]


class _TensorParallelValues(_GatheredValues):
    """Tensor-parallel shards all-gathered over the tensor group and assembled (`TPTranslation.gather_full`)."""

    def __init__(self, full, tensors, tp):
        super().__init__(full, tensors)
        self.tp = tp

    def shape(self, i: int):
        shape = tuple(self.full.shape(i))
        hit = self.tp._by_id.get(id(self.tensors[i]))
        return hit[1] if hit else shape

    def _gather(self, i: int) -> torch.Tensor:
        return self.tp.gather_full(self.tensors[i], self.full.value(i))
