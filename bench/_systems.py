"""The systems the benchmark compares, each behind the same small interface.

A runner wraps one model for one system (DDP, FSDP2, DeepSpeed, zerospeed) at one ZeRO stage and
precision. The worker (`_worker.py`) calls, per step: `forward_backward(x, y) -> loss` then
`step()`; once, between the two on the last step, `state_bytes()` (what the rank holds now).

Every system trains the same thing: AdamW(lr, betas=(0.9, 0.999), eps=1e-8), no gradient clipping, no
LR schedule, gradient accumulation 1, loss averaged over the ranks, over the same parameter groups
(`param_groups`): by default (2) weight decay 0.1 on parameters with ndim >= 2 and 0.0 on the rest
(biases, LayerNorm), HF Trainer's decay/no-decay split; with 1, the model's parameters as one group
with weight decay 0.0 (the benchmark's setting before issue 17).
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

ADAM = {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
WEIGHT_DECAY = 0.1  # on the decay group (ndim >= 2) when param_groups == 2
PARAM_GROUPS = (2, 1)


def optimizer_groups(params, n_groups: int) -> list:
    """What every system's optimizer is built over: with n_groups == 2, [{"params": ndim >= 2,
    "weight_decay": WEIGHT_DECAY}, {"params": the rest, "weight_decay": 0.0}] (DTensors report their
    global ndim, so FSDP2's sharded parameters split as the unsharded ones do); with 1, the parameter
    list itself (one group, ADAM's weight_decay 0.0)."""
    params = [p for p in params if p.requires_grad]
    if n_groups == 1:
        return params
    if n_groups != 2:
        raise ValueError(f"param_groups must be one of {PARAM_GROUPS}, not {n_groups}")
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


# Objects whose attributes the tensor walker follows (everything else is a leaf or ignored).
_WALK_PREFIXES = ("deepspeed", "zerospeed", "torch.optim", "torch.distributed.fsdp", "collections")
# Attribute names that hold communication buffers rather than model states, and their category
# (categories starting with "_" are reported apart and left out of the model-state total).
_BUFFER_NAMES = re.compile(r"ipg|bucket", re.IGNORECASE)
BUFFERS = "_buffers"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (FSDP2); the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class HeldTensors:
    """Bytes of distinct storages reachable from some roots, by category, each storage counted once.

    A view into a flat buffer counts the whole buffer (that is what the rank holds); a storage
    already counted under an earlier category is not counted again.
    """

    def __init__(self, max_depth: int = 10):
        self.max_depth = max_depth
        self.seen_storages: set[int] = set()
        self.by_category: dict[str, int] = {}
        self._seen_objects: set[int] = set()

    def add_tensor(self, category: str, t) -> None:
        if not torch.is_tensor(t):
            return
        t = _local(t)
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if n == 0 or ptr in self.seen_storages:
            return
        self.seen_storages.add(ptr)
        self.by_category[category] = self.by_category.get(category, 0) + n

    def walk(self, category: str, obj, depth: int = 0) -> None:
        """Count every tensor reachable from `obj` (containers, parameters' attributes such as
        DeepSpeed's `ds_tensor`, and the attributes of optimizer / engine objects)."""
        if obj is None or depth > self.max_depth or isinstance(obj, (str, bytes, int, float, bool)):
            return
        if torch.is_tensor(obj):
            self.add_tensor(category, obj)
            if isinstance(obj, nn.Parameter):
                if obj.grad is not None:
                    self.add_tensor(category, obj.grad)
                if id(obj) not in self._seen_objects:
                    self._seen_objects.add(id(obj))
                    for v in vars(obj).values():
                        self.walk(category, v, depth + 1)
            return
        if id(obj) in self._seen_objects:
            return
        self._seen_objects.add(id(obj))
        if isinstance(obj, nn.Module):
            for t in obj.parameters():
                self.walk(category, t, depth + 1)
            for t in obj.buffers():
                self.add_tensor(category, t)
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                self.walk(category, k, depth + 1)
                self.walk(category, v, depth + 1)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                self.walk(category, v, depth + 1)
            return
        if type(obj).__module__.startswith(_WALK_PREFIXES):
            try:
                attrs = vars(obj)
            except TypeError:
                return
            for key, v in list(attrs.items()):
                # communication buckets (DeepSpeed's ipg_buckets, ...) are buffers, not model states
                sub = BUFFERS if category != BUFFERS and _BUFFER_NAMES.search(key) else category
                self.walk(sub, v, depth + 1)

    def total(self) -> int:
        return sum(self.by_category.values())


def _params_grads_opt(params, optimizer) -> dict[str, int]:
    held = HeldTensors()
    for p in params:
        held.add_tensor("params", p)
    for p in params:
        if p.grad is not None:
            held.add_tensor("grads", p.grad)
    if optimizer is not None:
        for s in optimizer.state.values():
            for v in s.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    held.add_tensor("optimizer_states", v)
    return held.by_category


class DDPRunner:
    """torch DistributedDataParallel (default buckets); bf16 = autocast("cpu", bfloat16) around forward."""

    name = "DDP"

    def __init__(self, model: nn.Module, *, stage: int, precision: str, micro_batch: int, world_size: int,
                 param_groups: int = 2):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(model)
        self.params = list(model.parameters())
        self.bf16 = precision == "bf16"
        self.optimizer = torch.optim.AdamW(optimizer_groups(self.params, param_groups), **ADAM)

    def forward_backward(self, x, y):
        if self.bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.model(x, y)
        else:
            loss = self.model(x, y)
        loss.backward()
        return loss

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        # DDP's reducer also keeps its own gradient buckets (a second copy of the gradients, since
        # gradient_as_bucket_view=False by default); they are not reachable from Python.
        return _params_grads_opt(self.params, self.optimizer)


class DDPNoCommRunner(DDPRunner):
    """DDP with its gradient all-reduce skipped (`no_sync` around every forward and backward): the
    compute floor of a data-parallel step on this machine, for judging how much of any system's step
    is communication. Not a valid training run: each rank steps on its own gradients, so its losses
    are not compared with DDP's."""

    name = "DDP, no all-reduce"

    def forward_backward(self, x, y):
        with self.model.no_sync():
            return super().forward_backward(x, y)


class FSDP2Runner:
    """torch FSDP2: `fully_shard` on every transformer block, then on the root (tied embedding there).
    bf16 = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)."""

    name = "FSDP2"

    def __init__(self, model: nn.Module, *, stage: int, precision: str, micro_batch: int, world_size: int,
                 param_groups: int = 2):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if precision == "bf16" else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.model = model
        self.params = list(model.parameters())  # the sharded DTensor parameters
        self.optimizer = torch.optim.AdamW(optimizer_groups(self.params, param_groups), **ADAM)

    def forward_backward(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        return loss

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        return _params_grads_opt(self.params, self.optimizer)


def _ds_config(*, stage: int, precision: str, micro_batch: int, world_size: int, deepspeed: bool) -> dict:
    adam = {"lr": ADAM["lr"], "betas": list(ADAM["betas"]), "eps": ADAM["eps"], "weight_decay": ADAM["weight_decay"]}
    if deepspeed:
        adam["torch_adam"] = True  # torch.optim.AdamW: no JIT-built CPU Adam op
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "optimizer": {"type": "AdamW", "params": adam},
        "gradient_clipping": 0.0,  # DeepSpeed defaults to 1.0
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class _EngineRunner:
    """A DeepSpeed-style engine: loss = engine(x, y); engine.backward(loss); engine.step()."""

    engine = None

    def forward_backward(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss

    def step(self):
        self.engine.step()


class DeepSpeedRunner(_EngineRunner):
    name = "DeepSpeed"

    def __init__(self, model: nn.Module, *, stage: int, precision: str, micro_batch: int, world_size: int,
                 param_groups: int = 2):
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        cfg = _ds_config(stage=stage, precision=precision, micro_batch=micro_batch, world_size=world_size,
                         deepspeed=True)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=optimizer_groups(model.parameters(), param_groups), config=cfg)

    def state_bytes(self) -> dict[str, int]:
        held = HeldTensors()
        module = self.engine.module
        params = list(module.parameters())
        for p in params:  # stage 3: the parameter itself is empty, its shard is p.ds_tensor
            held.add_tensor("params", p)
            for v in vars(p).values():
                if torch.is_tensor(v):
                    held.add_tensor("params", v)
        for p in params:
            if p.grad is not None:
                held.add_tensor("grads", p.grad)
        # flat fp32/bf16 groups, partitioned gradients, optimizer states, buckets
        held.walk("optimizer_and_buffers", self.engine.optimizer)
        return held.by_category


class ZeroSpeedRunner(_EngineRunner):
    name = "zerospeed"

    def __init__(self, model: nn.Module, *, stage: int, precision: str, micro_batch: int, world_size: int,
                 param_groups: int = 2):
        import zerospeed

        cfg = _ds_config(stage=stage, precision=precision, micro_batch=micro_batch, world_size=world_size,
                         deepspeed=False)
        self.engine, self.optimizer, _, _ = zerospeed.initialize(
            model=model, model_parameters=optimizer_groups(model.parameters(), param_groups), config=cfg)

    def state_bytes(self) -> dict[str, int]:
        out = dict(self.engine.memory_breakdown())
        held = HeldTensors()  # cross-check: what a walk over the engine's objects finds
        held.walk("all", self.engine.module)
        held.walk("all", self.engine.strategy)
        held.walk("all", self.engine.optimizer)
        out["_walker_total"] = held.total()
        return out


RUNNERS = {"ddp": DDPRunner, "ddp_nocomm": DDPNoCommRunner, "fsdp2": FSDP2Runner, "deepspeed": DeepSpeedRunner,
           "zerospeed": ZeroSpeedRunner}


def state_total(state: dict[str, int]) -> int:
    """Sum of the categories (keys starting with "_" are diagnostics, not counted)."""
    return sum(v for k, v in state.items() if not k.startswith("_"))


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (same length on every rank), as [rank][i]."""
    t = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64)
    t[dist.get_rank()] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()
