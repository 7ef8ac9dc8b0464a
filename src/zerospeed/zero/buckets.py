"""The gradient bucket size of stages 0-3 (the bucket plans themselves are in `partition.py`)."""
from __future__ import annotations

# Elements per gradient bucket (stages 0-3) when the config leaves `reduce_bucket_size` unset: 25 MiB of fp32,
# PyTorch DDP's `bucket_cap_mb` default. DeepSpeed's 5e8 exceeds any model under 500M parameters, so
# its one all-reduce can start only after backward ends (profiled: 122 ms waited after backward,
# small GPT, 10.8M parameters); with 25 MiB buckets all but the last overlap backward, as in DDP.
DEFAULT_BUCKET_SIZE = 25 * 2**20 // 4


def bucket_elements(configured: int, user_set: bool) -> int:
    """The gradient bucket size of stages 0-3 (stage 0's all-reduce buckets, stages 1-2's reduce-scatter
    chunks, stage 3's reduce-scatter buckets of whole units): `configured` (`reduce_bucket_size`, DeepSpeed semantics,
    even its 5e8) when the user set it, else DEFAULT_BUCKET_SIZE (the key was absent:
    `"reduce_bucket_size" not in zero_cfg.model_fields_set`). Raises ValueError if configured < 1."""
    if configured < 1:
        raise ValueError(f"reduce_bucket_size must be >= 1 element, got {configured}")
    return int(configured) if user_set else DEFAULT_BUCKET_SIZE

