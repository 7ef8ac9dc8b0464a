"""The batch-size triple: ``train_batch_size = micro_batch x grad_accum x dp_world_size``.

`resolve_batch` is a pure function implementing DeepSpeed's derivation rules
(``DeepSpeedConfig._set_batch_related_parameters``), except that zerospeed never floor-divides
silently: when the numbers do not divide, the error shows them, the data-parallel world size and
two consistent completions.

=====================  ====================================================
given                  derived
=====================  ====================================================
tb, mb, ga             checked only
tb, mb                 ga = tb / (mb * dp)
tb, ga                 mb = tb / (ga * dp)
mb, ga                 tb = mb * ga * dp
tb                     ga = 1, mb = tb / dp
mb                     ga = 1, tb = mb * dp
ga only, or nothing    error: give train_batch_size or train_micro_batch_size_per_gpu
=====================  ====================================================
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .errors import ConfigError

__all__ = ["BatchSizes", "resolve_batch"]

TB, MB, GA = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


class BatchSizes(NamedTuple):
    """Resolved batch sizes, all in samples except ``gradient_accumulation_steps`` (micro-steps)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _as_positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a positive integer, got {value!r} ({type(value).__name__})")
    if isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        value = int(value)
    if value <= 0:
        raise ConfigError(f"{name} must be a positive integer (> 0), got {value}")
    return value


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _completions(tb: int, mb: int | None, ga: int | None, dp: int) -> list[str]:
    """Up to two consistent ways to fix (tb, mb, ga) at world size dp, most conservative first."""
    out: list[str] = []

    def add(text: str) -> None:
        if text not in out:
            out.append(text)

    if mb is not None and ga is not None:
        add(f"set {TB}={mb * ga * dp} (keeping {MB}={mb}, {GA}={ga})")
    if mb is not None and tb % (mb * dp) == 0:
        add(f"set {GA}={tb // (mb * dp)} (keeping {TB}={tb}, {MB}={mb})")
    if tb % ((ga or 1) * dp) == 0:
        add(f"set {MB}={tb // ((ga or 1) * dp)} (keeping {TB}={tb}, {GA}={ga or 1})")
    if tb % dp == 0 and mb is not None:  # keep tb: the micro-batch closest to the requested one
        per_rank = tb // dp
        best = min(_divisors(per_rank), key=lambda d: (abs(d - mb), -d))
        add(f"set {MB}={best} and {GA}={per_rank // best} (keeping {TB}={tb})")
    if mb is not None:  # keep mb: the global batches nearest to tb
        step = mb * dp
        lower, upper = (tb // step) * step, -(-tb // step) * step
        for cand in sorted({lower, upper} - {0}, key=lambda c: (abs(c - tb), c)):
            add(f"set {TB}={cand} and {GA}={cand // step} (keeping {MB}={mb})")
    else:  # keep ga: the global batches nearest to tb that split evenly over the ranks
        step = (ga or 1) * dp
        lower, upper = (tb // step) * step, -(-tb // step) * step
        for cand in sorted({lower, upper} - {0}, key=lambda c: (abs(c - tb), c)):
            add(f"set {TB}={cand} (giving {MB}={cand // step} with {GA}={ga or 1})")
    return out[:2]


def _mismatch(tb: int, mb: int | None, ga: int | None, dp: int, what: str) -> ConfigError:
    fixes = _completions(tb, mb, ga, dp)
    hint = f" Consistent choices: {'; or '.join(fixes)}." if fixes else ""
    return ConfigError(
        f"batch sizes do not fit: {what}, with dp_world_size={dp} (the number of data-parallel "
        f"ranks; {TB} = {MB} x {GA} x dp_world_size).{hint}"
    )


def resolve_batch(
    train_batch_size: Any,
    train_micro_batch_size_per_gpu: Any,
    gradient_accumulation_steps: Any,
    dp_world_size: int,
) -> BatchSizes:
    """Complete and check the batch triple; None means "not given". Raises ConfigError."""
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(f"dp_world_size must be a positive integer, got {dp_world_size!r}")
    dp = dp_world_size
    tb = _as_positive_int(TB, train_batch_size)
    mb = _as_positive_int(MB, train_micro_batch_size_per_gpu)
    ga = _as_positive_int(GA, gradient_accumulation_steps)

    if tb is None and mb is None:
        given = f" (only {GA}={ga} is set)" if ga is not None else ""
        raise ConfigError(
            f"Either {TB} or {MB} needs to be provided{given}: set {MB} (samples per rank per "
            f"micro-step), or {TB} (samples per optimizer step over all {dp} data-parallel rank(s))"
        )
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * dp:
            raise _mismatch(tb, mb, ga, dp, f"{TB}={tb} is not {MB} {mb} x {GA} {ga} x dp {dp} = {mb * ga * dp}")
    elif tb is not None and mb is not None:
        if tb % (mb * dp):
            raise _mismatch(tb, mb, None, dp,
                            f"{TB}={tb} is not a multiple of {MB} {mb} x dp {dp} = {mb * dp}, so "
                            f"{GA} cannot be derived")
        ga = tb // (mb * dp)
    elif tb is not None and ga is not None:
        if tb % (ga * dp):
            raise _mismatch(tb, None, ga, dp,
                            f"{TB}={tb} is not a multiple of {GA} {ga} x dp {dp} = {ga * dp}, so {MB} "
                            f"cannot be derived")
        mb = tb // (ga * dp)
    elif mb is not None and ga is not None:
        tb = mb * ga * dp
    elif tb is not None:
        if tb % dp:
            raise _mismatch(tb, None, 1, dp, f"{TB}={tb} is not a multiple of dp {dp}, so {MB} cannot be derived")
        ga, mb = 1, tb // dp
    else:
        assert mb is not None
        ga, tb = 1, mb * dp
    return BatchSizes(tb, mb, ga)
