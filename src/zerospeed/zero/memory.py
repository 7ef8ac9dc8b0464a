"""Model-state memory per rank for ZeRO stages 0-3: the formulas of ZeRO, Rajbhandari et al. 2020, §3.1 and
§5 (Figure 1), for comparing against what `engine.memory_breakdown()` measures.

Model states per parameter, Adam (bytes):

| precision | params | grads | optimizer states | master weights | total |
| --------- | ------ | ----- | ---------------- | -------------- | ----- |
| mixed     | 2      | 2     | 8 (momentum, variance, fp32) | 4 (fp32) | 16 |
| fp32      | 4      | 4     | 8                | 0 (the parameters are the master) | 16 |

Stage 1 partitions optimizer states and master weights over the N data-parallel ranks, stage 2
also the gradients, stage 3 also the parameters. Mixed precision gives the paper's numbers:
16Ψ (stage 0), 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; its 7.5B-parameter, 64-rank example is
120 -> 31.4 -> 16.6 -> 1.9 GB (1 GB = 1e9 bytes). Activations, buffers and fragmentation are
not model states and are not counted.

Tensor and pipeline parallelism (`estimate_model_parallel_memory`) first cut the parameters a rank
holds: the Ψ_s parameters of tensor-parallel layers are split tp ways and the Ψ_r others (embeddings,
norms, an unmatched lm_head: zerospeed replicates them) are whole, then balanced pipeline stages split
that pp ways: Ψ_rank = (Ψ_s / tp + Ψ_r) / pp. ZeRO then partitions Ψ_rank over dp = world / (tp x pp)
ranks with the formulas above (Megatron-LM with ZeRO-1, Narayanan et al. 2021; Megatron shards the
embeddings too, Ψ_r = 0).

What zerospeed itself holds under bf16/fp16 (`engine.memory_breakdown()`) differs from the paper's
2-byte gradients where it accumulates gradients in fp32: stage 0 keeps fp32 gradient buckets (4Ψ),
stages 2 and 3 an fp32 gradient partition (4Ψ/N); stage 1 matches the paper (2Ψ at rest, plus a
transient fp32 partition gradient during the step).
"""
from __future__ import annotations

import math

# bytes per parameter for each model state, by precision
BYTES_PER_PARAM = {
    "mixed": {"params": 2, "grads": 2, "optimizer_states": 8, "master_weights": 4},
    "fp32": {"params": 4, "grads": 4, "optimizer_states": 8, "master_weights": 0},
}
# the states each stage partitions (Pos, Pos+g, Pos+g+p)
PARTITIONED = {0: (), 1: ("optimizer_states", "master_weights"),
               2: ("optimizer_states", "master_weights", "grads"),
               3: ("optimizer_states", "master_weights", "grads", "params")}
STATES = ("params", "grads", "optimizer_states", "master_weights")


def estimate_model_states_memory(num_params: float, stage: int, dp_world_size: int,
                                 precision: str = "mixed") -> dict[str, int]:
    """Bytes of model states one rank holds under ZeRO `stage`, with Adam.

    num_params: Ψ, the trainable parameter count (elements; a float such as 7.5e9 is accepted and
    rounded). dp_world_size: N, the data-parallel ranks. precision: "mixed" (fp16/bf16 compute with
    fp32 master weights) or "fp32". A partitioned state holds ceil(Ψ / N) elements per rank.
    Returns {"params", "grads", "optimizer_states", "master_weights", "total"} in bytes per rank.
    Raises ValueError for Ψ < 0, N < 1, a stage outside 0-3 or an unknown precision.
    Source: ZeRO, Rajbhandari et al. 2020, §5 and Figure 1.
    """
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(BYTES_PER_PARAM)}, got {precision!r}")
    if stage not in PARTITIONED:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp_world_size < 1:
        raise ValueError(f"dp_world_size must be >= 1, got {dp_world_size}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    psi = int(round(num_params))
    shard = math.ceil(psi / dp_world_size)
    out = {state: BYTES_PER_PARAM[precision][state] * (shard if state in PARTITIONED[stage] else psi)
           for state in STATES}
    out["total"] = sum(out.values())
    return out


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1) -> int:
    """dp = world_size / (tp x pp). Raises ValueError for sizes < 1 or a world tp x pp does not divide,
    naming the numbers."""
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if world_size % (tp * pp):
        raise ValueError(f"the world size {world_size} is not divisible by tensor x pipeline parallel size "
                         f"{tp} x {pp} = {tp * pp}; use a world that is a multiple of {tp * pp}")
    return world_size // (tp * pp)


def model_parallel_params(num_params: float, *, tp: int = 1, pp: int = 1, replicated_params: float = 0) -> float:
    """Ψ_rank, the parameters one rank holds before ZeRO: (Ψ_s / tp + Ψ_r) / pp with Ψ_r =
    `replicated_params` (kept whole on every tensor-parallel rank) and Ψ_s = num_params - Ψ_r (in
    tensor-parallel layers); pipeline stages are assumed balanced (each holds 1/pp of the layers'
    parameters, the replicated ones included). Raises ValueError for Ψ_r outside [0, num_params] or
    tp / pp < 1."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if not 0 <= replicated_params <= num_params:
        raise ValueError(f"replicated_params={replicated_params:g} must lie in [0, num_params={num_params:g}]")
    return ((num_params - replicated_params) / tp + replicated_params) / pp


def estimate_model_parallel_memory(num_params: float, stage: int, world_size: int, *, tp: int = 1, pp: int = 1,
                                   replicated_params: float = 0, precision: str = "mixed") -> dict[str, int]:
    """Bytes of model states per rank with tensor parallelism `tp`, `pp` balanced pipeline stages and ZeRO
    `stage` over the dp = world_size / (tp x pp) data-parallel ranks, with Adam:
    `estimate_model_states_memory(model_parallel_params(...), stage, dp, precision)`.

    num_params: Ψ, all trainable parameters; replicated_params: Ψ_r, those outside tensor-parallel
    layers (default 0: Megatron's assumption, every parameter sharded, a lower bound for zerospeed,
    which replicates embeddings and norms; `zerospeed tp-plan` prints the count for a HF model).
    Returns the same keys as `estimate_model_states_memory` ("params", "grads", "optimizer_states",
    "master_weights", "total"). Raises ValueError for a world tp x pp does not divide and for the
    arguments `estimate_model_states_memory` / `model_parallel_params` refuse.
    """
    dp = data_parallel_size(world_size, tp, pp)
    local = model_parallel_params(num_params, tp=tp, pp=pp, replicated_params=replicated_params)
    return estimate_model_states_memory(math.ceil(local), stage, dp, precision)
