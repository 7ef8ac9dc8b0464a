"""Rank topologies: pure maps between global ranks and named Cartesian coordinates.

Row-major over the named axes, as DeepSpeed's `deepspeed.runtime.pipe.topology.ProcessTopology`: with
axes ["pipe", "data", "model"] and dims [P, D, M] (DeepSpeed's `PipeModelDataParallelTopology`), the
last axis is innermost, so the M ranks of one tensor-parallel group are adjacent global ranks (on one
node, over its fast links) and the pipeline axis is outermost (point-to-point traffic only, fine across
nodes). Megatron-LM orders its groups the same way (Shoeybi et al. 2019, §3; Narayanan et al. 2021, §3).

No processes, no tensors: `ParallelMesh` (mesh.py) builds the process groups from these lists.
"""
from __future__ import annotations

import itertools
import math
from collections import namedtuple

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "carve_expert_lists",
           "expert_rank_lists"]


class ProcessTopology:
    """Maps global ranks 0..prod(dims)-1 to coordinates over named `axes`, row-major (last axis innermost).

    axes: axis names, e.g. ["pipe", "data", "model"]; dims: the size of each axis (>= 1).
    Method names and results are DeepSpeed's (`get_rank`, `get_coord`, `get_axis_comm_lists`,
    `filter_match`, `get_axis_list`, `get_dim`, `get_rank_repr`, `world_size`), so code written against
    DeepSpeed's topology runs unchanged. Raises ValueError for mismatched or non-positive dims,
    duplicate axis names, and coordinates or ranks outside the topology.
    """

    def __init__(self, axes: list[str], dims: list[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: duplicate axis names in {axes}")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dict(zip(axes, dims))}")
        self.axes, self.dims = axes, dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self._strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]

    def world_size(self) -> int:
        """Number of ranks: the product of the dims."""
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Size of `axis`; 0 for an axis the topology does not have (as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord) -> int:
        """The global rank at the coordinates given for every axis, e.g. `get_rank(pipe=0, data=1, model=0)`.
        Raises ValueError if an axis is missing (use `filter_match` for slices) or a coordinate is out of range."""
        if set(coord) != set(self.axes):
            raise ValueError(f"get_rank() needs a coordinate for every axis {self.axes}, got {sorted(coord)}; "
                             "use filter_match() for slices")
        rank = 0
        for axis, dim, stride in zip(self.axes, self.dims, self._strides):
            c = coord[axis]
            if not 0 <= c < dim:
                raise ValueError(f"coordinate {axis}={c} is outside [0, {dim})")
            rank += c * stride
        return rank

    def get_coord(self, rank: int):
        """The coordinates (a `ProcessCoord` namedtuple, one field per axis) of global `rank`."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} not found in topology of {self.world_size()} ranks ({self})")
        return self.ProcessCoord(*((rank // s) % d for s, d in zip(self._strides, self.dims)))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists of the process groups along `axis`: ranks whose coordinates agree on every other
        axis, one list per combination of the other coordinates (row-major), each in `axis` order.
        [] for an axis the topology does not have. Example: axes [pipe, data, model], dims [2, 2, 2]:
        'pipe' -> [[0, 4], [1, 5], [2, 6], [3, 7]]."""
        if axis not in self.axes:
            return []
        k = self.axes.index(axis)
        others = [range(d) for i, d in enumerate(self.dims) if i != k]
        lists = []
        for rest in itertools.product(*others):
            base = sum(c * s for c, s in zip(rest, [s for i, s in enumerate(self._strides) if i != k]))
            lists.append([base + j * self._strides[k] for j in range(self.dims[k])])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        """Global ranks whose coordinates equal every given one, ascending. E.g. `filter_match(pipe=0, data=1)`."""
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match(): unknown axes {sorted(unknown)}; the topology has {self.axes}")
        return [r for r in range(self.world_size())
                if all(getattr(self.get_coord(r), a) == v for a, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Global ranks whose coordinate on `axis` is `idx`, ascending."""
        return self.filter_match(**{axis: idx})

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        """A rank's coordinates as text, e.g. 'model_01' (DeepSpeed's checkpoint naming)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in set(omit_axes))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(zip(self.axes, self.dims))})"

    __str__ = __repr__


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ["pipe", "data"] (DeepSpeed's class of the same name)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor (model) parallelism: axes ["pipe", "data", "model"], tensor innermost
    (DeepSpeed's class of the same name; note the argument order pp, mp, dp)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def expert_rank_lists(topology: ProcessTopology, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel and expert-data-parallel rank lists carved from the "data" axis of `topology`.

    Each data-parallel group (`get_axis_comm_lists("data")`, in data order) is cut into dp/ep runs of `ep`
    consecutive data ranks: each run is an expert-parallel group (the ranks that hold different experts
    and exchange tokens all-to-all); the ranks at the same position of every run form an
    expert-data-parallel group (the replicas of one expert, over which its gradients are reduced).
    DeepSpeed's `deepspeed.utils.groups._get_expert_parallel_ranks` (the "E + M + D" layout used with an
    mpu, `use_data_before_expert_parallel_=False`), e.g. pipe 1, data 8, model 2, ep 4:
    expert [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]],
    expert_data [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]].

    Returns (expert lists, expert-data lists); each partitions the ranks. Raises ValueError when the
    topology has no "data" axis, ep < 1, or ep does not divide the data-parallel size.
    """
    if "data" not in topology.axes:
        raise ValueError(f"expert groups are carved from the data axis; the topology {topology} has none")
    dp = topology.get_dim("data")
    if ep < 1 or dp % ep:
        raise ValueError(f"the expert-parallel size ep={ep} must be >= 1 and divide the data-parallel size "
                         f"dp={dp}; choose ep among {[d for d in range(1, dp + 1) if dp % d == 0]}")
    return carve_expert_lists(topology.get_axis_comm_lists("data"), ep)


def carve_expert_lists(data_lists, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """`expert_rank_lists`' cut of given data-parallel rank lists (each of the same length dp, ep dividing
    it): each list into runs of `ep` consecutive ranks (the expert groups), the ranks at the same place of
    every run of a list together (the expert-data groups). Pure."""
    expert, expert_data = [], []
    for data_ranks in data_lists:
        data_ranks = list(data_ranks)
        runs = [data_ranks[i:i + ep] for i in range(0, len(data_ranks), ep)]
        expert.extend(runs)
        expert_data.extend([list(pos) for pos in zip(*runs)])
    return expert, expert_data
