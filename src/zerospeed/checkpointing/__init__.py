"""Activation checkpointing: DeepSpeed's `deepspeed.checkpointing` surface.

    import zerospeed.checkpointing as ckpt
    ckpt.configure(None, deepspeed_config="ds_config.json")   # optional
    y = ckpt.checkpoint(block, x)                             # in model code, or:
    ckpt.checkpoint_modules(model, Block)                     # every Block, model code unchanged
"""
from .activation import (CheckpointingSettings, checkpoint, checkpoint_modules, configure, get_profile_stats,
                         get_settings, is_checkpointed, is_configured, model_parallel_cuda_manual_seed,
                         non_reentrant_checkpoint, remove_checkpointing, reset, validate_activation_checkpointing)
from .rng import (MODEL_PARALLEL_RNG_TRACKER_NAME, RNGStatesTracker, get_device_rng_state, get_rng_tracker,
                  model_parallel_seed, set_device_rng_state)

get_cuda_rng_tracker = get_rng_tracker  # DeepSpeed's name; tracks the current accelerator (or host) RNG

__all__ = [
    "checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset", "get_settings",
    "get_profile_stats", "CheckpointingSettings", "validate_activation_checkpointing", "checkpoint_modules",
    "remove_checkpointing", "is_checkpointed", "RNGStatesTracker", "get_rng_tracker", "get_cuda_rng_tracker",
    "model_parallel_seed", "model_parallel_cuda_manual_seed", "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "get_device_rng_state", "set_device_rng_state",
]
