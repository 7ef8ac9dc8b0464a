"""Pipeline partition math: which contiguous run of layers each stage holds. Pure functions over lists.

A partition of `n` layers into `p` stages is a list `parts` of p + 1 layer indices with
`parts[0] == 0`, `parts[p] == n`, and stage `s` holding layers `parts[s] <= i < parts[s + 1]`
(DeepSpeed's `PipelineModule.parts`). `partition_uniform` and `partition_balanced` return exactly what
DeepSpeed 0.19.8's `deepspeed.runtime.utils.partition_uniform` / `partition_balanced` return, ties
included (tests/unit/test_pipe_module.py compares them); the rest validates a plan and explains a bad one.

No processes, no tensors, no numpy: `PipelineModule` (module.py) computes the weights (trainable parameter
counts, or 0/1 per layer for `type:<regex>`) and hands them here.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..utils.partition import partition_uniform as _uniform

__all__ = ["PipelineError", "PARTITION_METHODS", "partition_uniform", "partition_balanced", "partition_from_bounds",
           "type_weights", "check_partition", "stage_owner", "stage_sizes"]

#: The partition methods `PipelineModule(partition_method=...)` accepts (case-insensitive), besides an
#: explicit list of boundaries.
PARTITION_METHODS = ("parameters", "uniform", "type:<regex>", "[0, b1, ..., num_layers] (explicit boundaries)")


class PipelineError(ValueError, RuntimeError):
    """Bad pipeline input: a partition, a stage id, a layer list. A ValueError (it is the caller's input)
    and a RuntimeError, the type DeepSpeed raises for the same cases, so either `except` catches it."""


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`zerospeed.utils.partition.partition_uniform` (DeepSpeed 0.19.8's, exactly): `num_parts` contiguous
    parts of sizes differing by at most one, larger first; num_parts + 1 boundaries. Example: (10, 4) ->
    [0, 3, 6, 8, 10]. Raises PipelineError if num_parts < 1 or num_items < 0.
    """
    try:
        return _uniform(num_items, num_parts)
    except ValueError as e:
        raise PipelineError(str(e)) from None


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Split `weights` (one non-negative number per layer, e.g. its trainable parameter count) into
    `num_parts` contiguous, non-empty parts minimising the spread max(part sum) - min(part sum).

    Dynamic programming over (first i layers, j parts), O(n^2 p) for n layers: the Linear Partition
    Problem (Skiena, The Algorithm Design Manual, §8.5) with DeepSpeed's cost (spread, not the max) and
    its tie-break (the last split point of equal cost wins), so the result is DeepSpeed 0.19.8's
    `deepspeed/runtime/utils.py: partition_balanced` exactly. With len(weights) <= num_parts it returns
    `partition_uniform(len(weights), num_parts)` (as DeepSpeed; parts past the last layer are empty).
    Returns the num_parts + 1 boundaries. Raises PipelineError if num_parts < 1 or a weight is negative or
    not finite.
    """
    n, m = len(weights), num_parts
    if m < 1:
        raise PipelineError(f"partition_balanced: need num_parts >= 1, got {num_parts}")
    bad = [(i, w) for i, w in enumerate(weights) if not (math.isfinite(w) and w >= 0)]
    if bad:
        raise PipelineError(f"partition_balanced: weights must be finite and >= 0; (layer, weight) {bad[:5]}")
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    prefix = [0.0] * (n + 1)
    running = 0
    for i, w in enumerate(weights):
        running += w  # exact for integer weights, as numpy's cumsum before its cast to float
        prefix[i + 1] = float(running)
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = 0.0
    dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            best_cost, best_max, best_min, best_k = dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j]
            for k in range(i):
                s = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], s)
                min_sum = min(dp_min[k][j - 1], s)
                cost = max_sum - min_sum
                if best_cost >= cost:
                    best_cost, best_max, best_min, best_k = cost, max_sum, min_sum, k
            dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = best_cost, best_max, best_min, best_k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    parts.reverse()
    return parts


def partition_from_bounds(bounds: Sequence[int], num_layers: int, num_parts: int) -> list[int]:
    """Validate explicit stage boundaries `[0, b1, ..., num_layers]` (num_parts + 1 integers, increasing)
    and return them as a list. An extension: DeepSpeed 0.19.8 accepts only the string methods.

    Raises PipelineError naming what is wrong: the length, the first/last value, or a boundary that does
    not increase (which would leave a stage empty).
    """
    try:
        parts = [int(b) for b in bounds]
    except (TypeError, ValueError):
        raise PipelineError(f"partition_method={list(bounds)!r}: explicit boundaries must be integers") from None
    if any(int(b) != b for b in bounds):
        raise PipelineError(f"partition_method={list(bounds)!r}: explicit boundaries must be integers")
    if len(parts) != num_parts + 1:
        raise PipelineError(f"partition_method={parts}: {num_parts} stages need {num_parts + 1} boundaries "
                            f"[0, ..., {num_layers}], got {len(parts)}")
    if parts[0] != 0 or parts[-1] != num_layers:
        raise PipelineError(f"partition_method={parts}: boundaries must start at 0 and end at the number of "
                            f"layers ({num_layers}), e.g. {partition_uniform(num_layers, num_parts)}")
    check_partition(parts, num_layers, method=repr(parts))
    return parts


def type_weights(names: Sequence[str | None], pattern: str) -> list[int]:
    """1 for each layer whose name (class name; None for an unnamed callable, never matching) matches
    `pattern` (`re.search`, case-insensitive, as DeepSpeed's `_find_layer_type`), else 0: the weights of
    `partition_method="type:<pattern>"`. Raises PipelineError if the regex is invalid or matches no layer.
    """
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise PipelineError(f"partition_method='type:{pattern}': invalid regular expression ({e})") from None
    weights = [1 if name is not None and regex.search(name) else 0 for name in names]
    if not any(weights):
        shown = sorted({n for n in names if n is not None})
        example = shown[0] if shown else "Linear"
        raise PipelineError(f"partition_method='type:{pattern}' matches no layer; the layer class names are "
                            f"{shown}: give a regex that matches the layers to balance, e.g. 'type:{example}'")
    return weights


def stage_sizes(parts: Sequence[int]) -> list[int]:
    """Number of layers of each stage: parts[s + 1] - parts[s]."""
    return [b - a for a, b in zip(parts[:-1], parts[1:])]


def check_partition(parts: Sequence[int], num_layers: int, *, method: str) -> None:
    """Raise PipelineError unless `parts` covers 0..num_layers with every stage non-empty. The message
    names the first empty stage, the partition method and every stage's layer count."""
    if len(parts) < 2 or parts[0] != 0 or parts[-1] != num_layers:
        raise PipelineError(f"partition_method={method}: boundaries {list(parts)} do not cover the {num_layers} "
                            "layers (they must start at 0 and end at the number of layers)")
    sizes = stage_sizes(parts)
    for stage, size in enumerate(sizes):
        if size <= 0:
            raise PipelineError(
                f"partition_method={method} leaves pipeline stage {stage} with {size} layers (layers per stage "
                f"{sizes}, boundaries {list(parts)}, {num_layers} layers): every stage needs at least one layer; "
                "use fewer stages, partition_method='uniform', or boundaries that increase")


def stage_owner(parts: Sequence[int], layer_idx: int) -> int:
    """The stage holding layer `layer_idx` under `parts`. Raises PipelineError if it is out of range."""
    if not 0 <= layer_idx < parts[-1]:
        raise PipelineError(f"layer {layer_idx} is outside the {parts[-1]} layers of the pipeline")
    for stage in range(len(parts) - 1):
        if parts[stage] <= layer_idx < parts[stage + 1]:
            return stage
    raise PipelineError(f"layer {layer_idx} is owned by no stage of partition {list(parts)}")


#: How model stages sit on pipeline ranks when each rank holds several (`PipelineModule(chunks=...)`).
CHUNK_LAYOUTS = ("interleaved", "v")


def chunk_stages(rank: int, num_stages: int, chunks: int, layout: str = "interleaved") -> list[int]:
    """The model stages (0 .. num_stages * chunks - 1) pipeline rank `rank` holds, ascending.

    "interleaved": stage c * num_stages + rank for each chunk c (Narayanan et al. 2021 §2.2, Megatron's virtual
    pipeline stages; `schedule.interleaved_1f1b`). "v": two chunks, stages rank and 2 * num_stages - 1 - rank, so
    rank 0 holds the first and the last stage (Qi et al. 2024 §6 ZB-V, DeepSeek-V3's DualPipeV;
    `schedule.zb_v`). One chunk: [rank]. Raises PipelineError for an unknown layout, chunks < 1, or "v" with a
    chunk count other than 2.
    """
    if layout not in CHUNK_LAYOUTS:
        raise PipelineError(f"unknown chunk layout {layout!r}; valid: {', '.join(CHUNK_LAYOUTS)}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise PipelineError(f"chunks must be an integer >= 1, got {chunks!r}")
    if chunks == 1:
        return [rank]
    if layout == "v":
        if chunks != 2:
            raise PipelineError(f"the 'v' layout holds exactly 2 chunks per rank, got chunks={chunks}")
        return [rank, 2 * num_stages - 1 - rank]
    return [c * num_stages + rank for c in range(chunks)]


def stage_rank(model_stage: int, num_stages: int, chunks: int, layout: str = "interleaved") -> int:
    """The pipeline rank holding `model_stage` (the inverse of `chunk_stages`)."""
    if chunks > 1 and layout == "v":
        return model_stage if model_stage < num_stages else 2 * num_stages - 1 - model_stage
    return model_stage % num_stages
