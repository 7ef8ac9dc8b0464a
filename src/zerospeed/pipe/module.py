"""`LayerSpec`, `TiedLayerSpec` and `PipelineModule`: a model as a list of layers, split into pipeline stages.

DeepSpeed 0.19.8's API (`deepspeed/runtime/pipe/module.py`, exported as `deepspeed.pipe`): the same names,
constructor signatures, attributes (`forward_funcs`, `fwd_map`, `parts`, `_local_start`, `_local_stop`,
`tied_modules`, `tied_weight_attrs`, `stage_id`, `num_stages`), parameter names (`"<layer index>.<param>"`,
`"tied_modules.<key>.<param>"`) and partition methods, so a DeepSpeed pipeline model definition runs
unchanged. Pipeline parallelism itself: Huang et al. 2019 (GPipe), Narayanan et al. 2019 (PipeDream, 1F1B).

Differences from DeepSpeed (each beyond it, none changes a DeepSpeed program's partition or weights with
`seed_layers=True`):
* no process group is needed: `stage_id=` (keyword-only) builds any stage in one process; with
  torch.distributed initialised and no `stage_id`, the stage is the rank's pipe coordinate (DeepSpeed's).
* `partition_method` also takes explicit boundaries `[0, b1, ..., num_layers]`.
* the "parameters" method counts parameters by building each LayerSpec on the meta device (no memory, no
  draw from the RNG); DeepSpeed builds every layer of the whole model on every rank to count them.
* the module is not moved to a device and tied weights are not broadcast here: the engine does both
  (the next increment of issue 24); `tied_stages(key)` / `tied_rank_lists(key)` say who holds a tie.
* forward re-seeding under `seed_layers` uses the global layer index also inside checkpointed blocks
  (DeepSpeed offsets by the block's position); the Megatron `GPTModelPipe` special case of
  `_is_checkpointable` is left out.
"""
from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from ..parallel.topology import PipeDataParallelTopology, ProcessTopology
from .partition import (PARTITION_METHODS, PipelineError, check_partition, chunk_stages, partition_balanced,
                        partition_from_bounds, partition_uniform, stage_owner, stage_rank, type_weights)

from .spec import LayerSpec, TiedLayerSpec, _layer_name, _recursive_getattr, _trainable_count, set_random_seed

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "DualPipeVModule", "PipelineError", "set_random_seed"]


def _takes_use_reentrant(func: Callable) -> bool:
    """Whether `func` names a `use_reentrant` parameter (torch.utils.checkpoint.checkpoint does); a bare
    **kwargs does not count, since torch's checkpoint forwards those to the checkpointed function."""
    try:
        return "use_reentrant" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


class PipelineModule(nn.Module):
    """A sequence of layers split into `num_stages` pipeline stages; this object holds and runs one stage.

    layers: nn.Modules, LayerSpecs / TiedLayerSpecs (built here only if this stage owns them) and callables
        (e.g. lambdas, run as is); `forward` is `for f in layers: x = f(x)` over this stage's layers. An
        nn.Sequential works too. Nested PipelineModules are not supported (PipelineError).
    num_stages / topology: the number of stages, or a ProcessTopology with a "pipe" axis (its size is the
        number of stages). At least one; if both, they must agree. 1 <= num_stages <= len(layers).
    loss_fn: `loss = loss_fn(outputs, labels)`, kept for the engine.
    seed_layers, seed_fn, base_seed: seed (`seed_fn(seed)`, default `set_random_seed`) with base_seed + i
        before building layer i, and base_seed * (forward count + 1) + i before running it, so a stage's
        layers get the weights the same layers get in a one-stage module.
    partition_method: "parameters" (balance trainable parameter counts), "uniform" (balance layer
        counts), "type:<regex>" (balance the layers whose class name matches, case-insensitive), or the
        stage boundaries [0, b1, ..., len(layers)] (an extension). Case-insensitive strings.
    activation_checkpoint_interval: checkpoint every block of this many layers (0: off), through
        `activation_checkpoint_func(fn, *inputs)` (given `use_reentrant=False` if it names that argument).
        A block is checkpointed if it holds a module with parameters, or, with `checkpointable_layers`
        (class names), if all its layers are of those classes.
    dynamic_shape: kept for the engine (DeepSpeed's flag; allows activation shapes to change).
    stage_id (keyword-only, an extension): the stage to build; by default the pipe coordinate of this
        rank in `topology` (or in PipeDataParallelTopology(num_stages, world // num_stages)); required
        when torch.distributed is not initialised and num_stages > 1. Given explicitly, it is used as is
        (e.g. to build a reference stage inside a multi-rank test), and the world need not divide.

    Raises PipelineError (a ValueError and RuntimeError) for: neither num_stages nor topology, num_stages
    < 1 or > number of layers, a world size num_stages does not divide, an unknown partition method, a
    `type:` regex matching no layer, a partition leaving a stage empty, a stage_id out of range, a
    TiedLayerSpec whose `tied_weight_attr` its module lacks.
    Source: DeepSpeed 0.19.8 `deepspeed/runtime/pipe/module.py: PipelineModule`.
    """

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable[[int], Any] | None = None,
                 base_seed: int = 1234, partition_method: str | list[int] = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = torch.utils.checkpoint.checkpoint,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False, *,
                 stage_id: int | None = None, chunks: int = 1, chunk_layout: str = "interleaved"):
        super().__init__()
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise PipelineError(f"checkpointable_layers must be a list of class names, got {checkpointable_layers!r}")
        self.micro_offset = 0
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.dynamic_shape = dynamic_shape
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        chunk_stages(0, 1, chunks, chunk_layout)  # validates chunks and the layout
        self.chunks, self.chunk_layout = chunks, chunk_layout
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, PipelineModule):
                raise PipelineError(f"layer {idx} is a PipelineModule: nested pipelines are not supported; "
                                    "pass its layers (its _layer_specs) in the outer list instead")
            if not (isinstance(layer, LayerSpec) or callable(layer)):
                raise PipelineError(f"layer {idx} is a {type(layer).__name__}, not an nn.Module, LayerSpec or "
                                    "callable: every entry of `layers` must map the previous output to the next input")

        self._topo, self.num_stages, self.stage_id, self.global_rank = self._resolve_stage(
            num_stages, topology, stage_id)
        self.partition_method = partition_method
        self._local_start, self._local_stop = 0, None
        self.model_stages = chunk_stages(self.stage_id, self.num_stages, chunks, chunk_layout)
        self._partition_layers(method=partition_method)

        self.forward_funcs: list[Callable] = []
        self._func_layer: list[int] = []  # forward_funcs[i] is global layer _func_layer[i]
        self._chunk_funcs: dict[int, tuple[int, int]] = {}  # model stage -> its slice of forward_funcs
        self.fwd_map: dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self._checkpointable_cache: tuple[int, list[bool]] | None = None
        # forward_funcs ranges -> (trainable parameters, compound) and -> split-backward runs: fixed once built
        # (the trainable set is fixed at initialize, as the ZeRO strategy's), so not recomputed per micro-batch
        self._segment_cache: dict[tuple[int, int], list] = {}
        self._runs_cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._build()
        self.tied_stage_map = self._index_tied_stages()

    # ---- stage and partition -------------------------------------------------------------------------
    def _resolve_stage(self, num_stages, topology, stage_id):
        """(topology, num_stages, stage_id, global rank or -1) from the arguments and torch.distributed."""
        if num_stages is None and topology is None:
            raise PipelineError("PipelineModule needs num_stages or topology (a ProcessTopology with a 'pipe' axis)")
        if topology is not None:
            pipe = topology.get_dim("pipe")
            if pipe < 1:
                raise PipelineError(f"topology {topology} has no 'pipe' axis; use PipeDataParallelTopology or "
                                    "PipeModelDataParallelTopology")
            if num_stages is not None and num_stages != pipe:
                raise PipelineError(f"num_stages={num_stages} but the topology's pipe axis has {pipe} stages; "
                                    "pass one of them, or make them agree")
            num_stages = pipe
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise PipelineError(f"num_stages must be an integer >= 1, got {num_stages!r}")
        if num_stages * self.chunks > self._num_layers:
            what = f"num_stages={num_stages}" + (f" x chunks={self.chunks}" if self.chunks > 1 else "")
            raise PipelineError(f"{what} is more than the {self._num_layers} layers: every stage needs at least "
                                f"one layer; use at most {self._num_layers} model stages or split the model into "
                                "more layers")
        initialised = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if initialised else -1
        if initialised:
            world = dist.get_world_size()
            if topology is None and stage_id is not None and world % num_stages:
                topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=1)  # an explicit stage, e.g. a reference
            elif topology is None:
                if world % num_stages:
                    raise PipelineError(f"num_stages ({num_stages}) must divide the world size ({world}); the "
                                        "data-parallel degree is world // num_stages")
                topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
            elif topology.world_size() != world:
                raise PipelineError(f"topology {topology} has {topology.world_size()} ranks but the world has {world}")
            if stage_id is None:
                stage_id = topology.get_coord(rank).pipe
        else:
            if topology is None:
                topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=1)
            if stage_id is None:
                if num_stages > 1:
                    raise PipelineError(f"torch.distributed is not initialised, so the stage of this process is "
                                        f"unknown: pass stage_id= (0..{num_stages - 1}) or initialise the process "
                                        "group first")
                stage_id = 0
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or not 0 <= stage_id < num_stages:
            raise PipelineError(f"stage_id={stage_id!r} is outside the {num_stages} stages (0..{num_stages - 1})")
        return topology, num_stages, stage_id, rank

    def _partition_layers(self, method: str | list[int] = "uniform") -> None:
        """Set `self.parts` (num_stages x chunks + 1 boundaries) and this stage's bounds (its first chunk's);
        see the class docstring."""
        n, p = self._num_layers, self.num_stages * self.chunks
        if isinstance(method, (list, tuple)):
            self.parts = partition_from_bounds(method, n, p)
            label = repr(list(method))
        elif isinstance(method, str):
            name = method.lower()
            label = repr(method)
            if name == "uniform":
                self.parts = partition_uniform(num_items=n, num_parts=p)
            elif name == "parameters":
                self.parts = partition_balanced(weights=self._count_layer_params(), num_parts=p)
            elif name.startswith("type:"):
                weights = type_weights([_layer_name(layer) for layer in self._layer_specs], method[len("type:"):])
                self.parts = partition_balanced(weights=weights, num_parts=p)
            else:
                raise PipelineError(f"unknown partition_method {method!r}; valid: {', '.join(PARTITION_METHODS)}")
        else:
            raise PipelineError(f"partition_method must be a string or a list of boundaries, got {method!r}; "
                                f"valid: {', '.join(PARTITION_METHODS)}")
        check_partition(self.parts, n, method=label)
        first = self.model_stages[0]
        self._set_bounds(start=self.parts[first], stop=self.parts[first + 1])

    def _count_layer_params(self) -> list[int]:
        """Trainable parameter elements of each layer (0 for callables); see `_trainable_count`."""
        return [_trainable_count(layer) for layer in self._layer_specs]

    def _set_bounds(self, start: int | None = None, stop: int | None = None) -> None:
        """This process builds layers start <= i < stop (DeepSpeed's slice semantics)."""
        self._local_start, self._local_stop = start, stop

    def partitions(self) -> list[int]:
        """The stage boundaries: stage s holds layers parts[s] <= i < parts[s + 1]."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The (model) stage holding global layer `layer_idx` (PipelineError if out of range); its pipeline
        rank is `stage_rank(stage)`."""
        return stage_owner(self.parts, layer_idx)

    def topology(self) -> ProcessTopology:
        """The rank topology (pipe outermost) the stage was taken from."""
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self._topo.get_dim("pipe")

    def stage_rank(self, model_stage: int) -> int:
        """The pipeline rank (pipe coordinate) holding `model_stage`."""
        return stage_rank(model_stage, self.num_stages, self.chunks, self.chunk_layout)

    def is_first_stage(self) -> bool:
        """Whether this rank holds the first model stage (it reads the inputs)."""
        return 0 in self.model_stages

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last model stage (it reads the labels and computes the loss)."""
        return self.num_stages * self.chunks - 1 in self.model_stages

    # ---- building --------------------------------------------------------------------------------------
    def _seed(self, seed: int) -> None:
        (self.seed_fn or set_random_seed)(seed)

    def _build(self) -> None:
        """Build this rank's layers (chunk after chunk) in order, each after seeding with base_seed + its index
        (seed_layers)."""
        for stage in self.model_stages:
            start = len(self.forward_funcs)
            for layer_idx in range(self.parts[stage], self.parts[stage + 1]):
                self._build_layer(layer_idx)
            self._chunk_funcs[stage] = (start, len(self.forward_funcs))

    def _build_layer(self, layer_idx: int) -> None:
        layer = self._layer_specs[layer_idx]
        self._func_layer.append(layer_idx)
        if self.seed_layers:
            self._seed(self.base_seed + layer_idx)
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                module = layer.build()
                for attr in layer.tied_weight_attr:
                    try:
                        _recursive_getattr(module, attr)
                    except AttributeError:
                        raise PipelineError(
                            f"TiedLayerSpec key {layer.key!r} (layer {layer_idx}, {layer!r}) has no attribute "
                            f"{attr!r} named in tied_weight_attr={layer.tied_weight_attr}; name the shared "
                            "parameters, e.g. tied_weight_attr=['weight']") from None
                self.tied_modules[layer.key] = module
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
        elif isinstance(layer, (LayerSpec, nn.Module)):
            module = layer.build() if isinstance(layer, LayerSpec) else layer
            name = str(layer_idx)
            self.forward_funcs.append(module)
            self.fwd_map[name] = len(self.forward_funcs) - 1
            self.add_module(name, module)
        else:
            self.forward_funcs.append(layer)

    def _index_tied_stages(self) -> dict[str, list[int]]:
        """Every tie key of the whole model -> the sorted stages holding one of its layers."""
        out: dict[str, set[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                out.setdefault(layer.key, set()).add(stage_owner(self.parts, idx))  # model stages
        return {key: sorted(stages) for key, stages in sorted(out.items())}

    def tied_stages(self, key: str) -> list[int]:
        """The stages holding tie `key` (sorted); its gradients are summed over them. KeyError if unknown."""
        if key not in self.tied_stage_map:
            raise KeyError(f"no TiedLayerSpec with key {key!r}; the keys are {sorted(self.tied_stage_map)}")
        return self.tied_stage_map[key]

    def tied_layers(self, key: str) -> list[int]:
        """The global layer indices of tie `key`."""
        self.tied_stages(key)
        return [i for i, layer in enumerate(self._layer_specs) if isinstance(layer, TiedLayerSpec) and layer.key == key]

    def tied_pipe_ranks(self, key: str) -> list[int]:
        """The pipeline ranks holding tie `key` (sorted, distinct: with several chunks a rank may hold it twice,
        sharing one module)."""
        return sorted({self.stage_rank(s) for s in self.tied_stages(key)})

    def tied_rank_lists(self, key: str) -> list[list[int]]:
        """The global ranks whose tied weights `key` must agree: one list per coordinate of the other axes
        (data, model), each holding the ranks of `tied_pipe_ranks(key)` in order (the groups of
        DeepSpeed's `_index_tied_modules`)."""
        stages = self.tied_pipe_ranks(key)
        return [[ranks[s] for s in stages] for ranks in self._topo.get_axis_comm_lists("pipe")]

    def tied_weights(self, key: str) -> list[torch.Tensor]:
        """This stage's tensors of tie `key`, one per `tied_weight_attr` (empty if the stage does not hold it)."""
        if key not in self.tied_modules:
            self.tied_stages(key)
            return []
        return [_recursive_getattr(self.tied_modules[key], a) for a in self.tied_weight_attrs[key]]

    # ---- running ---------------------------------------------------------------------------------------
    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise PipelineError(f"activation_checkpoint_interval must be >= 0 (0: off), got {interval}")
        self.activation_checkpoint_interval = interval

    def _is_checkpointable(self, funcs: list[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def _checkpointable_blocks(self, interval: int, lo: int, hi: int) -> list[bool]:
        """Whether each block of `interval` functions of forward_funcs[lo:hi] is checkpointed (cached)."""
        if self._checkpointable_cache is None or self._checkpointable_cache[0] != interval:
            self._checkpointable_cache = (interval, {})
        cache = self._checkpointable_cache[1]
        if (lo, hi) not in cache:
            cache[lo, hi] = [self._is_checkpointable(self.forward_funcs[s:min(s + interval, hi)])
                             for s in range(lo, hi, interval)]
        return cache[lo, hi]

    def _exec_range_func(self, start: int, end: int, micro_offset: int) -> Callable:
        """A function running forward_funcs[start:end] (inputs as DeepSpeed: one argument is passed alone)."""
        def exec_func(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for idx in range(start, end):
                self.curr_layer = self._func_layer[idx]
                if self.seed_layers:
                    self._seed(self.base_seed * micro_offset + self.curr_layer)
                x = self.forward_funcs[idx](x)
            return x
        return exec_func

    def _chunk_range(self, model_stage: int | None) -> tuple[int, int]:
        if model_stage is None:
            if len(self.model_stages) > 1:
                raise PipelineError(f"this rank holds {len(self.model_stages)} model stages {self.model_stages}: name "
                                    "the one to run (forward_chunk(model_stage, x))")
            model_stage = self.model_stages[0]
        if model_stage not in self._chunk_funcs:
            raise PipelineError(f"model stage {model_stage} is not on this rank (it holds {self.model_stages})")
        return self._chunk_funcs[model_stage]

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers on `forward_input` (a tensor or a tuple, whatever the first layer takes);
        returns the last layer's output. Blocks of `activation_checkpoint_interval` layers are checkpointed.
        With several chunks per rank use `forward_chunk`."""
        return self.forward_chunk(None, forward_input)

    def forward_chunk(self, model_stage: int | None, forward_input: Any) -> Any:
        """`forward` through the layers of one model stage this rank holds (None: the only one)."""
        return self._run(*self._chunk_range(model_stage), forward_input, None)

    def forward_segments(self, forward_input: Any, model_stage: int | None = None) -> tuple[Any, list]:
        """`forward_chunk`, run as segments whose inputs are detached leaves, for a backward split into input-
        and weight-gradient passes (`pipe.backward_split`): one segment per layer with parameters (with the
        parameter-free layers after it), or per checkpointed block
        of `activation_checkpoint_interval` layers. Returns (output, [Segment, ...]); the output equals
        `forward`'s."""
        segments: list = []
        return self._run(*self._chunk_range(model_stage), forward_input, segments), segments

    def _run(self, lo: int, hi: int, x: Any, segments: list | None) -> Any:
        """forward_funcs[lo:hi] on x, in blocks (checkpointed ones through activation_checkpoint_func); with
        `segments` a list, each block starts from detached inputs and is recorded as a Segment."""
        from .backward_split import Segment, detach_input
        self.micro_offset += 1
        micro_offset = self.micro_offset + 1
        interval = self.activation_checkpoint_interval
        if interval == 0 and segments is None:
            return self._exec_range_func(lo, hi, micro_offset)(x)
        if interval:
            bounds = [(s, min(s + interval, hi)) for s in range(lo, hi, interval)]
            blocks = self._checkpointable_blocks(interval, lo, hi)
        else:
            bounds = self._weighted_runs(lo, hi)
            blocks = [False] * len(bounds)
        kwargs = {"use_reentrant": False} if _takes_use_reentrant(self.activation_checkpoint_func) else {}
        for (start, stop), checkpointable in zip(bounds, blocks):
            func = self._exec_range_func(start, stop, micro_offset)
            if segments:  # the stage's own input stays the leaf it is (its gradient is sent back)
                x = detach_input(x)
            inputs = x if isinstance(x, tuple) else (x,)
            out = self.activation_checkpoint_func(func, *inputs, **kwargs) if checkpointable else func(*inputs)
            if segments is not None:
                segments.append(Segment(inputs, out, self._segment_info(start, stop), recompute=checkpointable))
            x = out
        return x

    def _weighted_runs(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """forward_funcs[lo:hi] cut before each function with parameters (the segments of a split backward
        without checkpointing: one weighted layer with the parameter-free ones after it, e.g. Linear + ReLU,
        so W's few element-wise recomputations replace an autograd call per activation layer)."""
        if (lo, hi) not in self._runs_cache:
            starts = [i for i in range(lo, hi) if i == lo or self._segment_info(i, i + 1)]
            self._runs_cache[lo, hi] = list(zip(starts, starts[1:] + [hi]))
        return self._runs_cache[lo, hi]

    def _segment_info(self, start: int, stop: int) -> list[torch.nn.Parameter]:
        """`_segment_params` of forward_funcs[start:stop], computed once per range."""
        if (start, stop) not in self._segment_cache:
            self._segment_cache[start, stop] = self._segment_params(start, stop)
        return self._segment_cache[start, stop]

    def _segment_params(self, start: int, stop: int) -> list[torch.nn.Parameter]:
        """The distinct trainable parameters of forward_funcs[start:stop] (a tied module's too)."""
        seen, out = set(), []
        for f in self.forward_funcs[start:stop]:
            module = f.args[0] if isinstance(f, partial) and f.args and isinstance(f.args[0], nn.Module) else f
            if isinstance(module, nn.Module):
                for p in module.parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
        return out

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Model-specific extra losses to report ({name: value}) or None (DeepSpeed's hook)."""
        return None


class DualPipeVModule(PipelineModule):
    """DeepSpeed 0.19.8's `deepspeed.pipe.DualPipeVModule`: a PipelineModule cut into 2 x num_stages model stages,
    rank r holding stage r (phase 0) and stage 2 x num_stages - 1 - r (phase 1), so rank 0 holds the first and the
    last stage and a layer tied between them (embedding / head) is one module there, with no gradient exchange.
    Same arguments as PipelineModule (it is `PipelineModule(..., chunks=2, chunk_layout="v")`); `stage_owner`
    gives the pipeline rank, as DeepSpeed's. `zerospeed.initialize` runs it with the "dualpipev" schedule
    (unless the config's `pipeline.schedule` names another V schedule, "zb_v"), which needs
    gradient_accumulation_steps >= 2 x num_stages.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        for fixed in ("chunks", "chunk_layout"):
            if fixed in kwargs:
                raise PipelineError(f"DualPipeVModule takes no {fixed}= (it is always 2 chunks in a V); use "
                                    "PipelineModule(..., chunks=, chunk_layout=) for another layout")
        super().__init__(*args, **kwargs, chunks=2, chunk_layout="v")

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank holding global layer `layer_idx` (DeepSpeed's DualPipeVModule.stage_owner)."""
        return self.stage_rank(super().stage_owner(layer_idx))
