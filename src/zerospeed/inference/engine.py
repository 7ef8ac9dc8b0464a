"""`zerospeed.init_inference(model, config=None, **kwargs) -> InferenceEngine`, DeepSpeed's serving entry point.

    engine = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16)
    out = engine.module.generate(input_ids, max_new_tokens=32)     # HF's own generate on the sharded model
    logits = engine(input_ids).logits

What happens, in order (each step only when its option asks for it), all checked before any weight changes:
1. the config is read with DeepSpeed's keys (`zerospeed.config.inference`), config and kwargs merged;
2. the weights are cast to `dtype` (fp16 / bf16 / fp32; for int8 the float weights stay as they are);
3. with tp_size > 1: the ranks' weights are checked equal (unless a checkpoint is loaded), the linear
   layers are sharded by the AutoTP plan (`inference/tp.py`), the RNG state is broadcast so sampling
   agrees across ranks (as DeepSpeed);
3a. with moe.ep_size > 1: each MoE layer's experts spread over an expert group (`inference/ep.py`);
3b. `checkpoint`: a model on the meta device gets its shards allocated, and every rank reads its own part
   of each tensor from the file (`inference/load.py`); a materialised model is overwritten the same way;
3c. `save_mp_checkpoint_path`: every rank saves its shards for a fast reload (`inference/mp_checkpoint.py`);
4. int8: every remaining linear layer's weight is quantized to int8 per output channel (`inference/quant.py`);
5. the module moves to this rank's device unless `keep_module_on_host`;
6. `replace_with_kernel_inject`: static KV cache, SDPA and a compiled decode step (`inference/inject.py`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..accelerator import get_accelerator
from ..config.inference import InferenceConfig, load_inference_config
from .tp import TPGroup, check_same_weights, inference_plan, shard_for_inference, tp_group

__all__ = ["InferenceEngine", "init_inference"]


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> "InferenceEngine":
    """Wrap `model` (an unmodified `nn.Module`, typically a HF causal LM) for serving.

    config: None, a dict or a path to a JSON file with DeepSpeed's inference keys; kwargs: the same keys
    (`tensor_parallel={"tp_size": 2}`, `dtype=torch.bfloat16`, `replace_with_kernel_inject=True`, ...).
    A key in both with different values is an error (as DeepSpeed). Collective when tp_size > 1: every
    rank calls it with the same arguments and the same full weights.
    Returns an `InferenceEngine`. Raises ConfigError for bad keys or values; ValueError for a dtype the
    device cannot compute, a tp size the world, heads or widths do not divide, ranks holding different
    weights, or a model without a sharding plan (naming its layer types and how to give injection_policy).
    """
    return InferenceEngine(model, load_inference_config(config, kwargs))


class InferenceEngine(nn.Module):
    """The served model. `engine(*inputs, **kwargs)` is `engine.module(...)`; `engine.module` is the user's
    model, sharded / cast / quantized in place (its `generate` is HF's own). Attributes: `tp` (TPGroup:
    group, size, rank), `sharded` (names of the tensor-parallel layers), `ep` (the expert group, the same
    triple), `experts` (names of the experts modules split over it), `quantized` (names of the int8 layers)."""

    def __init__(self, model: nn.Module, config: InferenceConfig):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"init_inference(model=...) expects an nn.Module, got {type(model).__name__}")
        self._config = config
        _refuse_unbuilt(config)
        accel = get_accelerator()
        if not config.int8 and config.dtype not in accel.supported_dtypes():
            raise ValueError(f"dtype {config.dtype} is not supported by the {accel.name} accelerator "
                             f"(supported: {accel.supported_dtypes()}); DeepSpeed's default dtype is float16, so "
                             "pass dtype=torch.float32 or torch.bfloat16")
        if config.enable_cuda_graph and not callable(getattr(getattr(torch, accel.name, None), "graph", None)):
            raise ValueError(f"enable_cuda_graph=true needs a device with graph capture (CUDA); this process runs on "
                             f"{accel.name}. Remove it")
        plan = None
        tp = self._config.tensor_parallel
        want_tp = config.tp_size > 1 or tp.tp_group is not None or tp.mpu is not None
        if want_tp:
            plan = inference_plan(model, config.injection_policy)  # a missing plan fails before any collective
        from .ep import expert_plan
        experts = expert_plan(model, config)  # pure: a bad ep fails before any collective
        if config.int8:
            from .quant import check_quantizable
            check_quantizable(model)
        if config.injection_policy and config.replace_with_kernel_inject:
            raise ValueError("injection_policy and replace_with_kernel_inject=true are exclusive (as in DeepSpeed): "
                             "drop one")
        meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        if meta and config.checkpoint is None:
            raise ValueError("the model is on the meta device (no weights): pass checkpoint=<safetensors file or "
                             "directory> so each rank loads its shard")
        reader = None
        if config.checkpoint is not None:
            from .load import open_checkpoint
            reader = open_checkpoint(config.checkpoint, config.base_dir)  # a bad path fails here, before any change
            if not hasattr(reader, "bind"):  # a HF checkpoint in the original layout: experts fused as read
                from .hf_layout import converted
                reader = converted(reader, model)
        self.module = model
        self.zero_engine = None
        if config.zero.stage == 3:
            self._zero_inference(model, config, reader, meta)
            return
        if not config.int8:
            model.to(config.dtype)
        mesh = None
        if experts.size > 1 and config.moe.ep_group is None:  # one mesh: the expert groups carved beside tp
            from .ep import expert_mesh
            mesh = expert_mesh(config.tp_size, experts.size)
        self.tp: TPGroup = tp_group(config.tp_size, group=tp.tp_group, mpu=tp.mpu, mesh=mesh) if want_tp \
            else TPGroup(None, 1, 0)
        self.sharded: list[str] = []
        if self.tp.size > 1:
            if reader is None:
                check_same_weights(model, self.tp.group)
            self.sharded = shard_for_inference(model, plan, self.tp)
            _broadcast_rng(self.tp.group)
        self.ep: TPGroup = TPGroup(None, 1, 0)
        self.experts: list[str] = []
        if experts.size > 1:
            from .ep import expert_group, shard_experts
            self.ep = expert_group(experts.size, config.moe.ep_group, mesh)
            self.experts = shard_experts(model, experts, self.ep, same_weights=reader is None and not meta)
        if meta:  # allocate this rank's shards only, then fill them
            from .load import materialize
            materialize(model, torch.device("cpu") if config.keep_module_on_host else accel.current_device_name())
        if reader is not None:
            from .load import load_weights
            if hasattr(reader, "bind"):  # save_mp_checkpoint_path's files: this rank's own
                reader.bind(self.tp.rank, self.tp.size)
            load_weights(model, reader, buffers_required=meta)
        if config.save_mp_checkpoint_path:  # the float shards, before any quantization
            from .mp_checkpoint import save_mp_checkpoint
            save_mp_checkpoint(model, config.save_mp_checkpoint_path, self.tp, self.ep)
        self.quantized: list[str] = []
        if config.int8:
            from .quant import quantize_int8
            self.quantized = quantize_int8(model)
        if not config.keep_module_on_host:
            model.to(accel.current_device_name())
        if self.quantized:
            from .quant import select_kernel
            select_kernel(model)  # on the device the weights now live on
        self.decode_step = None  # the compiled decode step of kernel injection
        if config.replace_with_kernel_inject:
            from ..comm.traced import needs_python_wrapper
            from .inject import inject_kernels
            device = next((p.device for p in model.parameters()), torch.device(accel.current_device_name()))
            self.decode_step = inject_kernels(model, device, freeze=not config.set_empty_params,
                                              collectives=self.tp.size > 1 and needs_python_wrapper(self.tp.group))
        self._is_compiled = False
        self._model_times: list[float] = []

    def _zero_inference(self, model: nn.Module, config: InferenceConfig, reader, meta: bool) -> None:
        """ZeRO-Inference (ZeRO-Infinity, Rajbhandari et al. 2021, §5): a ZeRO-3 engine without optimizer over
        every rank; each layer's weights are gathered (read from host memory or NVMe ahead of use with
        `offload_param`) just before its forward and freed after, so a rank holds about one layer at a time.
        With `checkpoint`: a meta model is partitioned as it is read (`inference/zero_load.py`: no rank holds
        it whole); a materialised one is overwritten from the file, then partitioned. Parameters frozen by the
        user (`requires_grad_(False)`) are set trainable first: zerospeed's ZeRO-3 keeps frozen parameters whole
        on every rank, and serving computes no gradient."""
        clash = [name for name, on in (("tensor_parallel.tp_size > 1", config.tp_size > 1), ("dtype=torch.int8", config.int8),
                                        ("replace_with_kernel_inject", config.replace_with_kernel_inject),
                                        ("save_mp_checkpoint_path", bool(config.save_mp_checkpoint_path))) if on]
        if clash:
            raise ValueError(f"zero stage 3 (ZeRO-Inference) does not combine with {', '.join(clash)}; drop them, "
                             "or drop the zero block")
        from ..runtime import initialize

        zero = config.zero.model_dump(exclude_unset=True, exclude_none=True)
        param = zero.get("offload_param") or {}
        if param.get("device") == "nvme" and "offload_optimizer" not in zero:
            # no optimizer reads the ZeRO-3 fp32 master shard, but the stage keeps one per unit: on NVMe beside
            # the parameter shard (written once), host memory holds only the read buffers and gathered layers
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": param.get("nvme_path")}
        if hasattr(reader, "bind"):  # save_mp_checkpoint_path's files: one tp rank's
            reader.bind(0, 1)
        if reader is not None and meta:
            from .zero_load import build_partitioned
            build_partitioned(model, reader, zero, torch.float32)  # fp32 masters, as a zero.Init build
        elif reader is not None:
            from .load import load_weights
            load_weights(model, reader)
        for p in model.parameters():  # the ZeRO-3 engine keeps frozen parameters whole on every rank; serving
            p.requires_grad_(True)      # takes no gradient, so every parameter is partitioned (as DeepSpeed's)
        ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
        if config.dtype is torch.bfloat16:
            ds["bf16"] = {"enabled": True}
        elif config.dtype is torch.float16:
            ds["fp16"] = {"enabled": True}
        self.zero_engine, *_ = initialize(model=model, config=ds)
        self.module = self.zero_engine.module
        self.tp, self.sharded, self.quantized, self.decode_step = TPGroup(None, 1, 0), [], [], None
        self.ep, self.experts = TPGroup(None, 1, 0), []
        self._is_compiled, self._model_times = False, []

    # -- DeepSpeed's InferenceEngine surface ------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """`self.module(*inputs, **kwargs)`."""
        return self.module(*inputs, **kwargs)

    def generate(self, *inputs, **kwargs):
        """`self.module.generate(...)` (HF's), after DeepSpeed's check: a prompt longer than max_out_tokens
        is an error (RuntimeError naming both lengths)."""
        ids = kwargs.get("input_ids", inputs[0] if inputs and torch.is_tensor(inputs[0]) else None)
        if ids is not None and ids.shape[-1] > self._config.max_out_tokens:
            raise RuntimeError(f"input with {ids.shape[-1]} tokens exceeds max_out_tokens="
                               f"{self._config.max_out_tokens}; raise max_out_tokens (alias max_tokens) in the "
                               "inference config")
        return self.module.generate(*inputs, **kwargs)

    @property
    def config(self) -> InferenceConfig:
        return self._config

    def compile(self, backend: str | None = None, compile_kwargs: dict | None = None) -> None:
        """`torch.compile` the module in place (DeepSpeed's `engine.compile`); once."""
        if self._is_compiled:
            return
        self.module.compile(backend=backend or get_accelerator().get_compile_backend(), **(compile_kwargs or {}))
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def destroy(self) -> None:
        """Release references (DeepSpeed frees its kernel workspace here); ZeRO-Inference's engine too."""
        self._model_times.clear()
        if self.zero_engine is not None:
            self.zero_engine.destroy()

    def model_times(self) -> list[float]:
        """Forward times recorded by `profile_model_time` (milliseconds), then cleared."""
        times, self._model_times = self._model_times, []
        return times

    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Record each forward's wall time (ms; the accelerator synchronised around it) for `model_times`."""
        import time

        accel = get_accelerator()

        def pre(module, args):
            accel.synchronize()
            module._zs_t0 = time.perf_counter()

        def post(module, args, out):
            accel.synchronize()
            self._model_times.append((time.perf_counter() - module._zs_t0) * 1e3)

        if not getattr(self, "_profiling", False):
            self.module.register_forward_pre_hook(pre)
            self.module.register_forward_hook(post)
            self._profiling = True


def _broadcast_rng(group) -> None:
    """The RNG state of the group's first rank on every rank of it (sampling must draw the same tokens)."""
    import torch.distributed as dist

    accel = get_accelerator()
    state = accel.get_rng_state()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(state, src, group=group)
    accel.set_rng_state(state)


def _refuse_unbuilt(config: InferenceConfig) -> None:
    """Options whose implementation is not in yet: a clear error, never a silent ignore."""
    todo = []
    if 0 < config.zero.stage < 3:
        todo.append(f"zero stage {config.zero.stage} (ZeRO-Inference is stage 3: the weights partitioned over the "
                    "ranks, or streamed from offload_param cpu / nvme)")
    if todo:
        raise ValueError("init_inference: not implemented yet: " + "; ".join(todo))
