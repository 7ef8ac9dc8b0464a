"""ZeRO stages 1 and 2 over parameter sets partitioned over different groups, one optimizer: a mixture of
experts with expert parallelism.

With ep_size > 1 the ranks of a mesh "expert" group hold different experts, so an expert's replicas are only
the ranks of its "expert_data" group (dp / ep of them). Its optimizer states and gradients are partitioned
over that group, the dense parameters' over the whole data-parallel group: DeepSpeed does the same, with one
flat partition per optimizer param group and each group's own data-parallel process group
(`real_dp_process_group`, DeepSpeed-MoE, Rajbhandari et al. 2022 §4, composed with ZeRO §5.1-5.2).

`GroupedStage12Strategy` holds one `Stage12Strategy` per set (each its own flat buffer, layout, reduce-
scatter and all-gather over its group), built without an optimizer, and re-targets the user's one
optimizer to the segments of all of them (`param_groups.retarget`): one `optimizer.step()` per step
updates every partition, and the object the user holds (its param groups, a scheduler on it) is the one
that steps. The expert set's gradients are summed over "expert_data" and divided by the data-parallel size
(the loss is the mean over every data-parallel rank, and each expert's local gradient already sums its
expert group's tokens through the all-to-all).

With the optimizer on NVMe (`offload_optimizer.device` "nvme", ZeRO-Infinity) the parts share one
`SwappedOptimizer`: each part's fp32 partition is one of its masters, so the expert and dense partitions
stream through the same tile buffers in one pass, and the user's optimizer is re-targeted to the tiles.

Global gradient norm: every element of every set is owned by exactly one rank of the world (a dense element
by one rank of the data-parallel group; an expert element by one rank of its expert-data group, and the
different experts of an expert group by different ranks), so the sum of every rank's partition squares
over the data-parallel group (which contains the expert and expert-data groups) is the squared norm of the
whole gradient, every expert counted once: one 1-element all-reduce, as for a single partition.

Checkpoints and `safe_get_full_*`: the sub-strategies register themselves (`stage3_context`), so a
parameter is found in the set holding it and its full value is all-reduced over that set's group (an
expert over its expert-data group: this rank's experts, as DeepSpeed's expert parameters). The checkpoint
protocol concatenates the sets' slots in the module's parameter order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import GroupCollectives
from ..comm.logger import CommsLogger
from ..precision import MixedPrecisionPolicy
from . import fragments
from .data_parallel import ReducePhase
from .param_groups import by_group, group_index, retarget
from .stage12 import Stage12Strategy, new_swapped_optimizer
from .strategy import ExpertGroup, ZeroStrategy

__all__ = ["GroupedStage12Strategy"]


class GroupedStage12Strategy(ZeroStrategy):
    """ZeRO stage 1 or 2 with the trainable parameters in `sets` partitioned over each set's group and the
    rest over `group` (the data-parallel group), one optimizer over all of them.

    module, params, optimizer, stage, group, bucket sizes, average, predivide_factor, logger, policy,
    master_values, offload, collectives: as `Stage12Strategy` (each set gets its own flat buffer and chunks
    of at most the bucket size). sets: `strategy.ExpertGroup`s (parameter ids, their group, the ranks their
    mean is over: the experts over "expert_data", averaged over the data-parallel size). With the optimizer
    on NVMe one `SwappedOptimizer` holds every part's partition (master k = part k) and steps them in one
    pass. Raises ValueError (a parameter in two sets, the optimizer's groups as `Stage12Strategy`).
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], optimizer, *, stage: int,
                 group: dist.ProcessGroup | None, sets: list[ExpertGroup], reduce_bucket_size: int,
                 allgather_bucket_size: int = 0, reduce_scatter: bool = True, allgather_partitions: bool = True,
                 average: bool = True, predivide_factor: float = 1.0, logger: CommsLogger | None = None,
                 policy: MixedPrecisionPolicy | None = None, master_values: dict[int, torch.Tensor] | None = None,
                 offload=None, collectives: type[GroupCollectives] = GroupCollectives):
        self.stage, self.params, self.group, self.logger = stage, list(params), group, logger
        self.policy = policy or MixedPrecisionPolicy()
        self.reduce_every_micro_step = stage == 2
        all_names = {id(p): n for n, p in module.named_parameters()}
        self.names = [all_names.get(id(p), f"#{i}") for i, p in enumerate(self.params)]
        group_of = group_index(optimizer, self.params, self.names) if optimizer is not None else [0] * len(params)
        where = {}
        for s, pset in enumerate(sets):
            for i, p in enumerate(self.params):
                if id(p) in pset.params:
                    if i in where:
                        raise ValueError(f"parameter {self.names[i]!r} is in two parameter sets")
                    where[i] = s + 1
        # (indices into params, group, average_over) per part: the rest over `group` first
        layout = [([i for i in range(len(self.params)) if i not in where], group, None)] + \
                 [([i for i, s in where.items() if s == k + 1], pset.group, pset.average_over)
                  for k, pset in enumerate(sets)]
        # the optimizer on NVMe: one tier, each part's partition one of its masters (master k = part k)
        self.swapped = None
        if offload is not None and offload.policy.optimizer == "nvme":
            self.swapped = new_swapped_optimizer(offload, optimizer, len(optimizer.param_groups) if optimizer else 1,
                                                 self.policy.master_dtype)
        self.parts: list[tuple[list[int], Stage12Strategy]] = []
        for idx, grp, avg in layout:
            if not idx:
                continue
            idx = sorted(idx)
            sub = Stage12Strategy(module, [self.params[i] for i in idx], None, stage=stage, group=grp,
                                  reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=allgather_bucket_size,
                                  reduce_scatter=reduce_scatter, allgather_partitions=allgather_partitions,
                                  average=average, predivide_factor=predivide_factor, logger=logger,
                                  policy=self.policy, master_values=master_values, offload=offload,
                                  collectives=collectives, average_over=avg, group_of=[group_of[i] for i in idx],
                                  swapped=self.swapped)
            self.parts.append((idx, sub))
        self.comms = self.parts[0][1].comms
        self.optimizer = None
        if optimizer is not None and self.swapped is not None:  # re-targeted to the tiles of every part
            self.optimizer = self.swapped.build()
            for _, sub in self.parts:
                sub.optimizer = self.optimizer
        elif optimizer is not None:  # one optimizer over every part's segments, in the user's groups
            self.optimizer = retarget(optimizer, by_group(
                ((seg.group, t) for _, sub in self.parts for seg, t in zip(sub.segments, sub.master_params)),
                len(optimizer.param_groups)))
            for _, sub in self.parts:
                sub.optimizer = self.optimizer  # its checkpoint slots find their states there
                sub._attach_grad()

    @property
    def master_params(self) -> list[torch.Tensor]:
        return [t for _, sub in self.parts for t in sub.master_params]

    @property
    def subs(self) -> list[Stage12Strategy]:
        return [sub for _, sub in self.parts]

    # -- the ZeroStrategy protocol: every part in turn --------------------------------------------------
    @property
    def phase(self) -> ReducePhase:
        return self.parts[0][1].phase

    def arm(self) -> None:
        for sub in self.subs:
            sub.arm()

    def finish(self) -> None:
        for sub in self.subs:
            sub.finish()

    def disarm(self) -> None:
        for sub in self.subs:
            sub.disarm()

    def clip_and_norm(self, max_norm: float, *, loss_scale: float = 1.0) -> float:
        """Unscale every part's partition gradient; the global 2-norm is the sum of all of them over the
        data-parallel group (each element owned by one rank: module docstring), clipped as `clip_and_norm`."""
        grads = []
        for sub in self.subs:
            sub.grads.materialize()
            g = sub.grads.partition_grad
            if loss_scale != 1.0:
                g.mul_(1.0 / loss_scale)
            grads.append(g)
        return self._norm(grads, max_norm, (self.group,))  # + tensor parallelism: the replicated counted once

    def nonfinite_grad_names(self, limit: int = 5) -> list[str]:
        """Each part's (collective over its group), the dense parameters' first."""
        out: list[str] = []
        for sub in self.subs:
            out += sub.nonfinite_grad_names(limit)
        return out[:limit]

    def optimizer_step(self) -> None:
        """Every part's gradient to its segments, one `optimizer.step()`, then every part's master into its
        shard and its all-gather (over its group)."""
        if self.optimizer is None:
            return
        if self.swapped is not None:  # NVMe: every part's tiles streamed, each into its part's shard
            subs = self.subs
            for sub in subs:
                sub.grads.materialize()
            self.swapped.step([sub.swap_grad() for sub in subs],
                              lambda m, rows, values: subs[m].write_swapped(rows, values))
            for sub in subs:
                sub.all_gather_params()
            return
        for sub in self.subs:
            sub.prepare_step()
        self.optimizer.step()
        for sub in self.subs:
            sub.finish_step()

    def zero_grad(self) -> None:
        for sub in self.subs:
            sub.zero_grad()

    def remove(self) -> None:
        for sub in self.subs:
            sub.remove()

    # -- checkpoints: the parts' slots, parameters in the module's order --------------------------------
    def checkpoint_params(self) -> list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]:
        entries: list = [None] * len(self.params)
        for idx, sub in self.parts:
            for i, entry in zip(idx, sub.checkpoint_params()):
                entries[i] = entry
        return entries

    def checkpoint_slots(self, names, *, load: bool) -> list[fragments.Slot]:
        return [slot for sub in self.subs for slot in sub.checkpoint_slots(names, load=load)]

    def refresh_params_from_master(self) -> None:
        for sub in self.subs:
            sub.refresh_params_from_master()

    def locate(self, param: torch.Tensor):
        """((part, key in it), shape, device) of `param`, or None."""
        for k, sub in enumerate(self.subs):
            found = sub.locate(param)
            if found is not None:
                return (k, found[0]), found[1], found[2]
        return None

    def fragment_group(self, key) -> dist.ProcessGroup | None:
        return self.subs[key[0]].group

    def reduced_grad_pieces(self, key) -> list[tuple[int, int, torch.Tensor]] | None:
        part, sub_key = key
        return self.subs[part].reduced_grad_pieces(sub_key)

    def memory_breakdown(self) -> dict[str, int]:
        """The parts' bytes, summed (the optimizer states counted once: they share the optimizer)."""
        out: dict[str, int] = {}
        for n, sub in enumerate(self.subs):
            for k, v in sub.memory_breakdown().items():
                if k != "optimizer_states" or n == 0:
                    out[k] = out.get(k, 0) + v
        return out
