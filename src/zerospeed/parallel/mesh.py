"""The device mesh: ranks arranged as pipeline x data x tensor, and the named process groups along it.

One `torch.distributed.device_mesh.DeviceMesh` of shape (pp, dp, tp) with dimension names
("pipe", "data", "tensor"), in DeepSpeed's rank order (`PipeModelDataParallelTopology`: pipeline
outermost, tensor innermost, so a tensor-parallel group is adjacent ranks on one node). Every parallel
feature takes its sub-group from here by name instead of building groups of its own:

    "data"    ZeRO's data-parallel group: gradients are averaged and states sharded over it
    "tensor"  tensor (model) parallelism: the all-reduces inside a layer (Megatron-LM)
    "pipe"    pipeline stages: point-to-point activations between neighbours
    "model"   every non-data dimension (tensor x pipe): ranks that hold different parts of one replica
    "expert"       ep consecutive data-parallel ranks: the ranks that hold different experts (MoE all-to-all)
    "expert_data"  the data ranks at the same place of every expert group: one expert's replicas

A `ParallelMesh` is also a Megatron-style `mpu` (`get_data_parallel_group()`, ...), the object
`zerospeed.initialize(mpu=...)` takes, and `ParallelMesh.from_mpu` wraps a user's own mpu (Megatron-LM's
`parallel_state`, DeepSpeed's `PipelineParallelGrid`) into the same interface, as DeepSpeed accepts one.

The expert groups are carved from each data-parallel group as DeepSpeed carves them
(`topology.expert_rank_lists`): with dp 4, ep 2 and no model parallelism, "expert" is [0, 1], [2, 3] and
"expert_data" is [0, 2], [1, 3].

Group conventions: a group argument of None means the whole world (torch's default group). When a group
spans the world (the data group when tp = pp = 1) it *is* None, so data-parallel-only runs use exactly
the collectives they always did and no extra group is created.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from .topology import PipeModelDataParallelTopology, carve_expert_lists, expert_rank_lists

__all__ = ["ParallelDims", "ParallelMesh", "MpuError", "MPU_REQUIRED"]

MESH_DIMS = ("pipe", "data", "tensor")
GROUP_NAMES = ("data", "tensor", "pipe", "model", "expert", "expert_data")


class MpuError(TypeError):
    """A user-supplied `mpu` lacks the methods zerospeed needs."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions. dp=-1 means "the rest of the world": world / (tp x pp).
    ep: the expert-parallel size, carved from dp (it must divide dp); the expert-data size is dp / ep."""

    dp: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def sizes(self) -> dict[str, int]:
        """Ranks along each named group (dp resolved first): data, tensor, pipe, model, expert, expert_data."""
        return {"data": self.dp, "tensor": self.tp, "pipe": self.pp, "model": self.tp * self.pp,
                "expert": self.ep, "expert_data": self.dp // self.ep}

    def resolve(self, world_size: int) -> "ParallelDims":
        """The dims with dp filled in. Raises ValueError when a size is < 1, dp x tp x pp != world_size or ep
        does not divide dp, naming the numbers and the sizes that would fit."""
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: parallel sizes must be >= 1")
        model = self.tp * self.pp
        if world_size % model:
            raise ValueError(f"the world size {world_size} is not divisible by tensor x pipeline parallel size "
                             f"{self.tp} x {self.pp} = {model}; launch a multiple of {model} ranks or choose tp/pp "
                             f"whose product divides {world_size}")
        dp = world_size // model if self.dp == -1 else self.dp
        if dp < 1 or dp * model != world_size:
            raise ValueError(f"data x tensor x pipeline parallel size {dp} x {self.tp} x {self.pp} = "
                             f"{dp * model} != world size {world_size}; use dp={world_size // model} (or dp=-1)")
        if dp % self.ep:
            raise ValueError(f"the expert-parallel size ep={self.ep} does not divide the data-parallel size dp={dp} "
                             f"(world {world_size} / tensor {self.tp} x pipeline {self.pp}); expert groups are carved "
                             f"from the data-parallel ranks: choose ep among {[d for d in range(1, dp + 1) if dp % d == 0]}")
        return ParallelDims(dp=dp, tp=self.tp, pp=self.pp, ep=self.ep)


# what zerospeed calls on a user's mpu: (method, what it is for)
MPU_REQUIRED = ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank")
_MPU_MODEL = ("get_model_parallel_group", "get_tensor_model_parallel_group")


class ParallelMesh:
    """Named process groups of a pipeline x data x tensor layout; a Megatron-style mpu.

    Build with `ParallelMesh.build(tp=..., pp=..., dp=-1)` (collective: every rank calls it, after
    `torch.distributed` is initialised) or `ParallelMesh.from_mpu(mpu)`. Attributes: dims
    (ParallelDims), topology (PipeModelDataParallelTopology, or None for a user's mpu), device_mesh
    (the DeviceMesh, or None when every dimension but data has size 1, or for a user's mpu).
    `group(name)` gives the process group of "data", "tensor", "pipe", "model", "expert" or "expert_data"
    (None: the whole world, or no group at all for a dimension of size 1: check `size(name)`).
    """

    def __init__(self, dims: ParallelDims, groups: dict, *, topology=None, device_mesh=None):
        self.dims, self.topology, self.device_mesh = dims, topology, device_mesh
        self._groups = dict(groups)
        self._sizes = dims.sizes()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, *, tp: int = 1, pp: int = 1, dp: int = -1, ep: int = 1,
              device_type: str | None = None) -> "ParallelMesh":
        """The mesh for this world. Collective: every rank calls it and creates every group, in the same
        order. ep: the expert-parallel size, carved from the data-parallel ranks (`expert_rank_lists`).
        device_type: the DeviceMesh's device type (default: this rank's accelerator, as
        `comm.init.default_device`). Raises ValueError for sizes that do not multiply to the world size
        or an ep that does not divide dp, RuntimeError if torch.distributed is not initialised."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.build() needs torch.distributed initialised first "
                               "(zerospeed.comm.init_distributed(), or torchrun + dist.init_process_group)")
        world = dist.get_world_size()
        dims = ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep).resolve(world)
        topo = PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)
        if dims.tp == dims.pp == 1:  # data parallelism only: the world group, no new groups (but the expert ones)
            groups = {"data": None, "tensor": None, "pipe": None, "model": None}
            return cls(dims, {**groups, **_expert_groups(topo, dims, None)}, topology=topo)
        from torch.distributed.device_mesh import init_device_mesh

        if device_type is None:
            from ..comm.init import default_device, read_launch_env
            device_type = default_device(read_launch_env().local_rank).type
        mesh = init_device_mesh(device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=MESH_DIMS)
        groups = {"data": None if dims.dp == world else mesh.get_group("data"),
                  "tensor": mesh.get_group("tensor") if dims.tp > 1 else None,
                  "pipe": mesh.get_group("pipe") if dims.pp > 1 else None}
        if dims.tp > 1 and dims.pp > 1:  # ranks of one replica: same data coordinate
            lists = [topo.filter_match(data=d) for d in range(dims.dp)]
            groups["model"] = dist.new_subgroups_by_enumeration(lists)[0]
        else:
            groups["model"] = groups["tensor"] if dims.tp > 1 else groups["pipe"]
        groups.update(_expert_groups(topo, dims, groups["data"]))
        return cls(dims, groups, topology=topo, device_mesh=mesh)

    @classmethod
    def from_mpu(cls, mpu, ep: int = 1) -> "ParallelMesh":
        """Wrap a user's Megatron-style mpu (Megatron-LM's `parallel_state`, DeepSpeed's
        `PipelineParallelGrid`, or a `ParallelMesh`). Needs the data-parallel group/rank/world size and a
        model-parallel group (`get_model_parallel_group` or `get_tensor_model_parallel_group`). ep: the
        expert-parallel size, carved from the mpu's own data-parallel groups as `expert_rank_lists` carves
        them (collective over the world: the groups are exchanged with one all-gather). Raises MpuError
        naming the missing methods, ValueError for an ep that does not divide the data-parallel size (or a
        `ParallelMesh` built with another ep)."""
        if isinstance(mpu, ParallelMesh):
            return mpu.with_expert_parallel(ep) if ep > 1 else mpu
        missing = [m for m in MPU_REQUIRED if not callable(getattr(mpu, m, None))]
        if not any(callable(getattr(mpu, m, None)) for m in _MPU_MODEL):
            missing.append(" or ".join(_MPU_MODEL))
        if missing:
            raise MpuError(f"the mpu object ({type(mpu).__name__}) lacks {', '.join(missing)}; zerospeed needs "
                           f"{', '.join(MPU_REQUIRED)} and a model-parallel group from an mpu (Megatron-LM's "
                           "megatron.core.parallel_state has them), or pass mpu=zerospeed.parallel.ParallelMesh.build(...)")
        get = (lambda name: getattr(mpu, name)() if callable(getattr(mpu, name, None)) else None)
        model = get("get_model_parallel_group") or get("get_tensor_model_parallel_group")
        tensor = get("get_tensor_model_parallel_group") or model
        pipe = get("get_pipeline_model_parallel_group") or get("get_pipe_parallel_group")
        world = dist.get_world_size()
        size = lambda g: 1 if g is None else dist.get_world_size(g)  # noqa: E731
        dp = int(mpu.get_data_parallel_world_size())
        tp, pp = size(tensor), size(pipe)
        data = mpu.get_data_parallel_group()
        groups = {"data": None if dp == world else data, "tensor": tensor if tp > 1 else None,
                  "pipe": pipe if pp > 1 else None, "model": model if size(model) > 1 else None}
        if dp * size(groups["model"]) != world:
            raise MpuError(f"the mpu's data-parallel size {dp} x model-parallel size {size(model)} != world size "
                           f"{world}; every rank must be in exactly one data-parallel and one model-parallel group")
        groups.update(expert=None, expert_data=groups["data"])  # ep 1; with_expert_parallel carves the rest
        return cls(ParallelDims(dp=dp, tp=tp, pp=pp), groups).with_expert_parallel(ep)

    def with_expert_parallel(self, ep: int) -> "ParallelMesh":
        """This mesh with expert-parallel size `ep`: the "expert" and "expert_data" groups carved from each
        data-parallel group as `expert_rank_lists` carves them (from the topology; for a user's mpu from its
        data groups, exchanged with one all-gather), every other group kept. Collective over the world when
        new groups are made. Returns self when ep is already this mesh's. Raises ValueError for an ep that
        does not divide the data-parallel size, or a mesh already carved with another ep."""
        if ep == self.dims.ep:
            return self
        if self.dims.ep != 1:
            raise ValueError(f"this mesh already has expert-parallel size {self.dims.ep}, not {ep}: build it with "
                             f"ParallelMesh.build(..., ep={ep})")
        dp = self.dims.dp
        if ep < 1 or dp % ep:
            raise ValueError(f"the expert-parallel size ep={ep} must divide the data-parallel size dp={dp}; "
                             f"choose ep among {[d for d in range(1, dp + 1) if dp % d == 0]}")
        dims = replace(self.dims, ep=ep)
        if self.topology is not None:
            groups = _expert_groups(self.topology, dims, self.group("data"))
        elif ep == dp:
            groups = {"expert": self.group("data"), "expert_data": None}
        else:  # every rank's data group, in the order of their first ranks, cut into runs of ep
            world, data = dist.get_world_size(), self.group("data")
            mine = dist.get_process_group_ranks(data) if data is not None else list(range(world))
            everyone: list = [None] * world
            dist.all_gather_object(everyone, mine)
            expert, expert_data = carve_expert_lists(sorted({tuple(r) for r in everyone}), ep)
            groups = {"expert": dist.new_subgroups_by_enumeration(expert)[0],
                      "expert_data": dist.new_subgroups_by_enumeration(expert_data)[0]}
        return ParallelMesh(dims, {**self._groups, **groups}, topology=self.topology, device_mesh=self.device_mesh)

    # -- queries ------------------------------------------------------------------------------
    def group(self, name: str):
        """The process group along `name` ("data", "tensor", "pipe", "model", "expert", "expert_data"); None =
        the world when the dimension spans it, or no group when its size is 1. Raises KeyError for another name."""
        if name not in self._groups:
            raise KeyError(f"no parallel dimension {name!r}; the mesh has {sorted(self._groups)}")
        return self._groups[name]

    def size(self, name: str) -> int:
        """Ranks along `name` (1 for a dimension not in use)."""
        g = self.group(name)
        if g is None:
            return dist.get_world_size() if self._sizes[name] > 1 else 1
        return dist.get_world_size(g)

    def rank(self, name: str) -> int:
        """This rank's index along `name` (0 for a dimension not in use)."""
        g = self.group(name)
        if g is None:
            return dist.get_rank() if self._sizes[name] > 1 else 0
        return dist.get_rank(g)

    def __repr__(self) -> str:
        d = self.dims
        return f"ParallelMesh(pp={d.pp}, dp={d.dp}, tp={d.tp}" + (f", ep={d.ep})" if d.ep > 1 else ")")

    # -- Megatron-style mpu interface ---------------------------------------------------------
    def get_data_parallel_group(self):
        return self.group("data")

    def get_data_parallel_rank(self) -> int:
        return self.rank("data")

    def get_data_parallel_world_size(self) -> int:
        return self.size("data")

    def get_model_parallel_group(self):
        return self.group("model")

    def get_model_parallel_rank(self) -> int:
        return self.rank("model")

    def get_model_parallel_world_size(self) -> int:
        return self.size("model")

    def get_tensor_model_parallel_group(self):
        return self.group("tensor")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank("tensor")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.size("tensor")

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor-parallel rank 0 in this rank's tensor group."""
        g = self.group("tensor")
        return dist.get_rank() if g is None else dist.get_global_rank(g, 0)

    def get_pipeline_model_parallel_group(self):
        return self.group("pipe")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.rank("pipe")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.size("pipe")

    def get_expert_parallel_group(self):
        return self.group("expert")

    def get_expert_parallel_rank(self) -> int:
        return self.rank("expert")

    def get_expert_parallel_world_size(self) -> int:
        return self.size("expert")

    def get_expert_data_parallel_group(self):
        return self.group("expert_data")

    def get_expert_data_parallel_rank(self) -> int:
        return self.rank("expert_data")

    def get_expert_data_parallel_world_size(self) -> int:
        return self.size("expert_data")


def _expert_groups(topo, dims: ParallelDims, data_group) -> dict:
    """The "expert" and "expert_data" groups (collective: the same new groups in the same order on every
    rank). A group of the data group's size is the data group; a group of size 1 is None; otherwise one
    `new_subgroups_by_enumeration` per kind over `expert_rank_lists`, the expert groups first."""
    if dims.ep == 1:
        return {"expert": None, "expert_data": data_group}
    if dims.ep == dims.dp:
        return {"expert": data_group, "expert_data": None}
    expert, expert_data = expert_rank_lists(topo, dims.ep)
    return {"expert": dist.new_subgroups_by_enumeration(expert)[0],
            "expert_data": dist.new_subgroups_by_enumeration(expert_data)[0]}
