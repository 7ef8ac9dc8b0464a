"""The data loader `initialize(training_data=...)` builds (DeepSpeed's `deepspeed_io`)."""
from __future__ import annotations

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def build_dataloader(dataset: Dataset, *, micro_batch_size: int, group: dist.ProcessGroup | None,
                     collate_fn=None, drop_last: bool = False, seed: int = 0, shuffle: bool = True) -> DataLoader:
    """A DataLoader yielding micro-batches of `micro_batch_size` samples of this rank's share of `dataset`.

    The share comes from a `DistributedSampler` over the data-parallel group (rank, world size);
    call `loader.sampler.set_epoch(e)` for a new shuffle each epoch.
    """
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(group), rank=dist.get_rank(group),
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last)
