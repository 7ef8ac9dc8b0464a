"""The gradient divide factors of a data-parallel reduction: one pure function for every ZeRO stage.

Stage 0's bucketed all-reduce (`data_parallel.GradientAllReducer`), stages 1-2's chunked
reduce-scatter (`stage12_grads._ChunkReducer`) and stage 3's unit reduce-scatter
(`stage3_schedule.GatherScheduler`) all scale a gradient the same way: divide each rank's
contribution by `pre` before the sum (so a low-precision sum of N contributions stays in range) and
the summed result by `post` after it. This module decides the pair once.

Source: FSDP2's `_get_gradient_divide_factors`
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), which returns (pre, post) factors with
`pre * post` = the data-parallel size when averaging. We keep DeepSpeed's semantics for the split:
`gradient_predivide_factor` (with `prescale_gradients`) is the user's `pre`, and `post = world / pre`
(`gradient_allreduce_op: mean`) or `1 / pre` (sum: undo the pre-division, so the result is the plain
sum), where FSDP2 picks `pre` itself (about sqrt(N) for fp16). A factor of 1.0 means "no division"
(FSDP2 uses None); callers skip the `div_` then, so the numbers are the same as without it.
"""
from __future__ import annotations


def gradient_divide_factors(world_size: int, *, average: bool = True,
                            predivide_factor: float = 1.0) -> tuple[float, float]:
    """(pre, post) divisors for a gradient reduction over `world_size` data-parallel ranks.

    world_size: ranks in the data-parallel group the gradient is summed over (>= 1).
    average: divide the sum by the group size (`gradient_allreduce_op: mean`, the default); False
    keeps the plain sum. predivide_factor: DeepSpeed's `gradient_predivide_factor` (> 0; 1.0 when
    `prescale_gradients` is off). Returns (pre, post): each rank divides its gradient by `pre` before
    the collective and the reduced result is divided by `post` after it, so the result is
    sum / world_size (average) or sum (not average). Both are plain Python floats, 1.0 for "none".
    Raises ValueError for world_size < 1 or predivide_factor <= 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (the data-parallel group's size); got {world_size}")
    if not predivide_factor > 0:
        raise ValueError(f"predivide_factor must be > 0 (gradient_predivide_factor); got {predivide_factor}")
    post = (world_size / predivide_factor) if average else (1.0 / predivide_factor)
    return float(predivide_factor), post
