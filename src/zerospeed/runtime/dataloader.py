"""The data loader `initialize(training_data=...)` builds (DeepSpeed's `deepspeed_io`), and `RepeatingLoader`."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..utils.repeating_loader import RepeatingLoader  # noqa: F401  (DeepSpeed's path for it: runtime/dataloader)


class ResumableDistributedSampler(DistributedSampler):
    """A `DistributedSampler` that knows its position, so a checkpoint can resume mid-epoch.

    It counts the indices handed out in the current epoch (the loader the engine builds has no
    worker processes, so that is exactly the samples consumed). `state_dict()` = {"epoch",
    "consumed" (this rank's samples), "num_replicas"}; after `load_state_dict` the next iteration
    skips what was consumed, converted to this world size (the same global position of the
    shuffled order when the data-parallel size changes), then continues normally.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._consumed = 0
        self._skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        self._consumed, self._skip = self._skip, 0
        for i in indices[self._consumed:]:
            self._consumed += 1
            yield i

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self._consumed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self._skip = int(state["consumed"]) * int(state["num_replicas"]) // self.num_replicas


def build_dataloader(dataset: Dataset, *, micro_batch_size: int, group: dist.ProcessGroup | None,
                     collate_fn=None, drop_last: bool = False, seed: int = 0, shuffle: bool = True) -> DataLoader:
    """A DataLoader yielding micro-batches of `micro_batch_size` samples of this rank's share of `dataset`.

    The share comes from a `ResumableDistributedSampler` over the data-parallel group (rank, world
    size); call `loader.sampler.set_epoch(e)` for a new shuffle each epoch. Its position is saved
    in checkpoints.
    """
    sampler = ResumableDistributedSampler(dataset, num_replicas=dist.get_world_size(group), rank=dist.get_rank(group),
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
    # its own generator: creating an iterator draws a base seed from it, and from the global RNG
    # otherwise, which would shift dropout masks depending on when a resumed run calls iter(loader)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, generator=torch.Generator().manual_seed(seed))

