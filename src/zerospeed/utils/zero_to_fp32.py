"""DeepSpeed's `deepspeed.utils.zero_to_fp32` API on zerospeed checkpoints, in memory.

`get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None)` returns the consolidated state
dict (trainable parameters as their fp32 masters, buffers and frozen parameters in their stored
dtype, tied parameters under every name sharing one tensor); `load_state_dict_from_zero_checkpoint(
model, checkpoint_dir, tag=None)` loads it into `model` (moved to CPU, `strict=False`, as DeepSpeed
does) and returns the model; `convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir)`
writes safetensors. One process, no distributed setup, no zerospeed objects unpickled. All three are
the `zerospeed to-fp32` code (`runtime/consolidate.py`): the same plan of keys and dtypes, the same
reader; any world size and stage that saved the checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn

from ..runtime.checkpoint_format import CheckpointError, CheckpointReader, read_index, resolve_tag_dir
from ..runtime.consolidate import _plan, convert_to_fp32

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict of a zerospeed checkpoint (CPU tensors). checkpoint_dir: the save_dir given to
    `save_checkpoint` (tag from its `latest` file unless `tag`) or a tag directory. Raises CheckpointError."""
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    if tag_dir is None:
        raise CheckpointError(f"{checkpoint_dir} holds no 'latest' file and no index.json; pass tag= or a "
                              "tag directory")
    index = read_index(tag_dir)
    out: dict[str, torch.Tensor] = {}
    read: dict[str, torch.Tensor] = {}  # stored name -> tensor (aliases share it, as tied weights do)
    with CheckpointReader(tag_dir, index) as reader:
        for key, stored, dtype, shape in _plan(index, exclude_frozen_parameters):
            if stored not in read:
                read[stored] = reader.read_full(stored).to(dtype).reshape(shape).clone()
            out[key] = read[stored]
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir, tag: str | None = None) -> nn.Module:
    """Load the consolidated fp32 weights of a checkpoint into `model` (on CPU, strict=False); returns it.
    Use it on a plain model after training, not on one an engine still manages (as in DeepSpeed)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, tag: str | None = None,
                                               max_shard_size: str | int = "5GB",
                                               exclude_frozen_parameters: bool = False):
    """Write the consolidated weights as safetensors (`zerospeed to-fp32`); returns the files written."""
    return convert_to_fp32(checkpoint_dir, output_dir, tag=tag, max_shard_size=max_shard_size,
                           exclude_frozen_parameters=exclude_frozen_parameters)
