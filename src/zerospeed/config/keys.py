"""DeepSpeed keys that zerospeed rejects: removed from DeepSpeed, or not implemented here yet.

Nothing is silently ignored. A key DeepSpeed 0.19.8 removed (``ds/runtime/config.py``,
``_REMOVED_TOP_LEVEL_CONFIG_KEYS``; tracking issue deepspeedai/DeepSpeed#8489) fails as it does in
DeepSpeed. A key DeepSpeed has but zerospeed does not implement yet fails with "not supported
yet", unless its value is DeepSpeed's default (a no-op), in which case it is accepted and dropped.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "REMOVED_TOP_LEVEL_KEYS",
    "REMOVED_ZERO_KEYS",
    "REMOVED_OPTIMIZERS",
    "UNSUPPORTED_OPTIMIZERS",
    "UNSUPPORTED_TOP_LEVEL_DEFAULTS",
    "removed_message",
    "unsupported_message",
    "split_top_level_unsupported",
]

_REMOVAL_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"

#: Top-level keys DeepSpeed 0.19.8 rejects (features removed in 2026).
REMOVED_TOP_LEVEL_KEYS = (
    "nebula",
    "compression_training",
    "amp",
    "quantize_training",
    "sparse_gradients",
    "eigenvalue",
    "sparse_attention",
    "elasticity",
    "graph_harvesting",
    "curriculum_learning",
    "progressive_layer_drop",
)

#: ``zero_optimization`` keys DeepSpeed 0.19.8 rejects (MiCS and LoCo-ZeRO++ were removed).
REMOVED_ZERO_KEYS = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")

#: optimizer.type (lower case) -> DeepSpeed's spelling, for optimizers removed in 0.19.8.
REMOVED_OPTIMIZERS = {"onebitadam": "OneBitAdam", "onebitlamb": "OneBitLamb", "zerooneadam": "ZeroOneAdam"}

#: optimizer.type (lower case) -> spelling, for DeepSpeed optimizers zerospeed does not have yet.
UNSUPPORTED_OPTIMIZERS = {
    "muon": "Muon",
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
}

_ENABLED_OFF = {"enabled": False}

#: DeepSpeed top-level keys zerospeed does not implement yet -> DeepSpeed's default value.
#: A value equal to the default (or a dict agreeing with it key by key, or a block with
#: ``"enabled": false``) is a no-op and is accepted; anything else is an error.
UNSUPPORTED_TOP_LEVEL_DEFAULTS: dict[str, Any] = {
    "compile": {"deepcompile": False},
    "hybrid_engine": _ENABLED_OFF,
    "data_efficiency": _ENABLED_OFF,
    "weight_quantization": None,
    "autotuning": _ENABLED_OFF,
    "timers": {"throughput": {"enabled": True, "synchronized": True}},
    "comet": _ENABLED_OFF,
    "sequence_parallel_size": 1,
    "seq_parallel_communication_data_type": "fp32",
    "use_data_before_expert_parallelism": False,
    "disable_allgather": False,
    "datastates_ckpt": _ENABLED_OFF,
}


def removed_message(key: str) -> str:
    return (f"'{key}' was removed from DeepSpeed (0.19.8 rejects it, see {_REMOVAL_ISSUE}); zerospeed "
            "follows DeepSpeed 0.19.8: remove this key")


def unsupported_message(key: str, default: Any = None) -> str:
    if default is None or isinstance(default, dict):
        fix = "remove it"
    else:
        fix = f"remove it or set it to DeepSpeed's default {default!r}"
    return f"'{key}' is a DeepSpeed key that zerospeed does not support yet ({fix})"


def _is_default(value: Any, default: Any) -> bool:
    if value is None or value == {} or value == default:
        return True
    if isinstance(value, dict) and isinstance(default, dict):
        if default.get("enabled") is False and value.get("enabled") is False:
            return True  # a disabled block, whatever else it says
        return all(k in default and _is_default(v, default[k]) for k, v in value.items())
    return False


def split_top_level_unsupported(data: dict[str, Any]) -> list[tuple[tuple[str], str]]:
    """Pop removed and not-yet-supported top-level keys from ``data``; return the problems found.

    Keys at their DeepSpeed default are popped silently (they change nothing).
    """
    issues: list[tuple[tuple[str], str]] = []
    for key in list(data):
        if key in REMOVED_TOP_LEVEL_KEYS:
            data.pop(key)
            issues.append(((key,), removed_message(key)))
        elif key in UNSUPPORTED_TOP_LEVEL_DEFAULTS:
            value = data.pop(key)
            default = UNSUPPORTED_TOP_LEVEL_DEFAULTS[key]
            if not _is_default(value, default):
                issues.append(((key,), unsupported_message(key, default)))
    return issues
