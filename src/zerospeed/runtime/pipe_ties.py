"""Layers tied across pipeline stages (a `TiedLayerSpec` key held by several stages, e.g. an embedding reused
as the output head): DeepSpeed's `PipelineModule._index_tied_modules`, `_synchronize_tied_weights` and
`PipelineEngine._exec_reduce_tied_grads`.

Each stage holding a tie has its own copy of the weights named by `tied_weight_attr`. At start the copies
are made equal (broadcast from the first stage holding the tie); after each batch's backward their
gradients are summed over the stages holding it, so every copy takes the same step: the model trains as if
the module were one. The sum runs after the data-parallel reduction, on the reduced gradient the ZeRO
strategy holds (`ZeroStrategy.step_grad_pieces`): the mean over data ranks and the sum over stages
commute, and at stages 1-2 the gradient no longer exists anywhere else. There each data rank holds pieces
of the weight's gradient, laid out by its own stage's partition, so the pieces are first assembled into the
whole gradient (one all-reduce over the data group), then summed over the stages, then taken back.
The global gradient norm counts a tied weight once, and checkpoints write it once: on the first stage holding
it (`owned_elsewhere`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.ops import all_reduce, broadcast

__all__ = ["TiedWeights"]


@dataclass
class _Tie:
    key: str
    group: "dist.ProcessGroup | None"  # the ranks holding this tie at this rank's data coordinate
    src: int                           # the first holding stage's rank in `group`
    weights: list[torch.Tensor]        # this stage's copies (tied_weight_attr order)
    counted: bool                      # this stage is the first holding the tie: its norm counts the weights


class TiedWeights:
    """The ties this stage of `module` (a PipelineModule) takes part in. Building it is collective over the
    world: every rank creates the same sub-groups in the same order (DeepSpeed's order: sorted keys)."""

    def __init__(self, module, pipe_group, logger=None):
        self.logger, self.ties = logger, []
        for key in module.tied_stage_map:
            ranks = module.tied_pipe_ranks(key)  # one rank holding it twice (ZB-V: first and last stage) shares it
            if len(ranks) < 2:
                continue
            if len(ranks) == module.num_stages:
                group, src = pipe_group, ranks[0]
            else:
                group, src = dist.new_subgroups_by_enumeration(module.tied_rank_lists(key))[0], 0
            if module.stage_id in ranks:
                self.ties.append(_Tie(key, group, src, module.tied_weights(key), module.stage_id == ranks[0]))

    def __bool__(self) -> bool:
        return bool(self.ties)

    def owned_elsewhere(self) -> frozenset:
        """id() of the tied weights this stage holds but another stage owns: counts in the gradient norm and
        writes to checkpoints."""
        return frozenset(id(w) for t in self.ties if not t.counted for w in t.weights)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Every copy takes the first holding stage's values (before the ZeRO strategy copies them)."""
        for t in self.ties:
            for w in t.weights:
                broadcast(w.data, t.src, group=t.group, logger=self.logger)

    @torch.no_grad()
    def reduce_grads(self, strategy, data_group) -> None:
        """Sum each tied weight's reduced gradient over the stages holding it, in the strategy's storage."""
        assemble = strategy.stage >= 1 and dist.get_world_size(data_group) > 1
        for t in self.ties:
            for w in t.weights:
                where = strategy.locate(w)
                pieces = strategy.step_grad_pieces(where[0]) if where is not None else None
                if pieces is None:
                    raise RuntimeError(f"tied weight {t.key!r} has no reduced gradient on this rank; tied layers need "
                                       "trainable weights (requires_grad=True) on every stage that holds them")
                like = pieces[0][2] if pieces else strategy.master_params[0]  # ZeRO 1-2: this rank may hold none of it
                full = torch.zeros(w.numel(), dtype=like.dtype, device=like.device)
                for start, end, piece in pieces:
                    full[start:end] = piece
                if assemble:  # ZeRO 1-2: each data rank holds disjoint pieces (decided alike on every rank)
                    all_reduce(full, group=data_group, logger=self.logger)
                all_reduce(full, group=t.group, logger=self.logger)
                for start, end, piece in pieces:
                    piece.copy_(full[start:end])
