"""Kernel injection on any device (`replace_with_kernel_inject=True`): a static KV cache and a compiled decode step.

DeepSpeed swaps HF layers for its own CUDA kernels. Here the same goal - decoding at the memory-bandwidth
bound, each token reading every weight once - is reached with HF's and PyTorch's own machinery, on any
device:

* the KV cache is HF's `StaticCache` (`generation_config.cache_implementation = "static"`): preallocated
  [batch, kv heads (this rank's, under tensor parallelism), max length, head dim] per layer, updated in
  place, sized by `generate` to prompt + new tokens (and kept at the largest size seen, so later calls do
  not recompile);
* attention is `scaled_dot_product_attention` (HF's "sdpa" implementation), in the decode step over the
  cache's filled positions only (`prefix_attention`: the mask cut to them, rounded up to 32; one graph for every
  length; the cache gets one spare position so that the cut is never the whole cache);
* the one-token decode step runs through `torch.compile` (inductor, max-autotune, with `freezing`: the
  weights become constants and every linear layer a prepacked GEMM template). Measured on this machine's 2
  cores for a 124M-parameter GPT-2 at batch 1: 19 ms per decode step against 42 ms eager, i.e. the weights
  are read at ~26 GB/s where the eager fp32 GEMV reaches ~12-17 GB/s (bench/bench_inference.py). Freezing
  keeps a packed copy of the weights next to the originals (used by the eager prefill): ~2x weight memory.
  `set_empty_params=True` (DeepSpeed: the injected modules allocate no weights of their own, they use the
  model's) compiles without freezing: the step reads the model's tensors, no copy;
* the per-token overhead around the kernels is cut twice (`DECODE_COMPILE_OPTIONS`, `FrozenCompiledCall`):
  inductor's C++ wrapper (`cpp_wrapper`) launches the step's ~60 kernels instead of its Python wrapper (which
  also re-checks ~50 sizes and builds ~80 tensor views per call), and on CPU the step's attention is traced
  with SDPA's math backend, so inductor fuses the single query's scores, softmax and weighted sum into its own
  kernels instead of calling the flash kernel once per layer. Measured on the 124M GPT-2 at batch 1, each
  interleaved in one process against the step without it (10 pairs, medians of the pairwise ratios): the
  C++ wrapper 0.96x the time per token, the math attention on top 0.97x; at batch 8 0.96x and 0.94x; at 350M
  parameters no difference beyond noise (session 23, bench/README.md). The C++ wrapper costs ~14 s more
  compilation once. Under tensor parallelism on gloo the step's collectives are `comm.traced`'s point-to-point
  custom ops, which the C++ wrapper calls; on other backends they are torch's functional collectives, which it
  cannot call (torch 2.13), so the step keeps the Python wrapper there. Within one `generate` the decode loop
  runs the step from its third token without dynamo's guards where the step is one graph and its arguments'
  shapes are those of the guarded call before (`FrozenCompiledCall.again`: 0.968x per token at 124M, batch 1);
* on CPU the weights the step reads - the frozen, packed constants of each graph compiled, or with
  `set_empty_params=True` the module's own - and each KV cache are moved onto 2 MiB huge pages once
  (`offload.hostmem.collapse_huge_pages`, Linux >= 6.1; elsewhere nothing changes): every token streams all of
  them, and with 4 KiB pages that is a page walk per 4 KiB. Measured: a frozen GEMV over GPT-2's 154 MB lm_head
  1.11x faster (10 interleaved pairs); ~1.3 s per GB once, after the step compiles (bench/README.md, session 26).

Freezing also fixes the tensors HF marks as static addresses - the cache's keys, values and
`cumulative_length` - into the compiled step, so `generate` must reuse one cache per (batch, length)
instead of building a new one per call (HF 5's default): `_prepare_static_cache` is wrapped on this
instance to hand back the earlier cache of the same shape, reset in place (`StaticCache.reset` zeroes it).

HF's `generate` decides to call the compiled step (`_valid_auto_compile_criteria`, which needs
`compile_config._compile_all_devices` off CUDA); the model's `get_compiled_call` is replaced on this
instance so the step compiles with freezing (an inductor setting that `torch.compile(options=...)` does
not carry to the graph capture). The prefill stays eager: time to first token is HF's.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import types
import warnings

import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..offload.hostmem import collapse_huge_pages, trim_heap
from . import prefix_attention
from .decode import with_decode_loop

__all__ = ["inject_kernels", "FrozenCompiledCall", "DECODE_COMPILE_OPTIONS", "constants_onto_huge_pages"]

# inductor options of the decode step: those of mode "max-autotune-no-cudagraphs" (GEMM templates benchmarked
# against the library's) plus the C++ wrapper (the kernels launched from C++, not from a Python function per call)
DECODE_COMPILE_OPTIONS = {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), "cpp_wrapper": True}


RECOMPILE_LIMIT = 64  # compiled decode steps per code object (engines x batch sizes) before dynamo gives up
# what a fullgraph compile raises where the step is not one graph it can compile: a graph break, or dynamo's
# recompile limit reached (more engines or shapes than `torch._dynamo.config.recompile_limit`)
_NOT_ONE_GRAPH = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.FailOnRecompileLimitHit)


class FrozenCompiledCall:
    """`torch.compile(fn, fullgraph=True, options=DECODE_COMPILE_OPTIONS)` (on a graph break: compiled again with
    the break, `whole_graph` False), every call under inductor's `freezing=freeze`
    (compilation reads the setting when a new shape is first seen, which is during a call) and, with
    math_attention, SDPA's math backend (`torch.nn.attention.sdpa_kernel`: traced, the one query's attention
    becomes inductor's own fused kernels; see the module docstring - measured on CPU only, so `inject_kernels`
    asks for it there and leaves other devices their own SDPA kernels). freeze=False: the compiled step reads
    the module's own weight tensors (no packed copy). cpp_wrapper=False: inductor's Python wrapper instead (a step
    with torch's functional collectives, which the C++ wrapper cannot call in torch 2.13: "NotImplementedError: arg
    type Any is not yet supported by custom_op_wrapper"). huge_pages: after a call, the constants of the graphs it
    compiled and (once per cache object) the KV cache passed as `cache` (`past_key_values` in older transformers)
    move onto huge pages (see the module docstring)."""

    def __init__(self, fn, freeze: bool = True, math_attention: bool = False, cpp_wrapper: bool = True,
                 huge_pages: bool = False, aot_module: nn.Module | None = None):
        options = {**DECODE_COMPILE_OPTIONS, "cpp_wrapper": cpp_wrapper}
        self.compiled = torch.compile(fn, fullgraph=True, options=options)
        self._with_breaks = functools.partial(torch.compile, fn, options=options)
        self.whole_graph = True  # until the step hits a graph break: then compiled with breaks, always guarded
        self.freeze = freeze
        self.math_attention = math_attention
        self.huge_pages = huge_pages
        self._caches_on_huge_pages: set[int] = set()
        self._guarded: tuple | None = None  # the signature of the last call dynamo's guards passed
        self.unguarded_calls = 0  # how many calls `again` ran without the guards (tests read it)
        self.module, self.aot = aot_module, aot_module is not None  # `aot_step`: the step as an AOTInductor package
        self._aot_steps: dict[tuple, object] = {}  # (input ids shape, mask dtype, cache shape, dtype) -> package
        self.aot_calls = 0  # steps the package served (tests read it)
        self._aot_failed: set[tuple] = set()

    def __call__(self, *args, **kwargs):
        self._guarded = _signature(args, kwargs)
        # every engine over a model class, and every batch size, is a graph of its own for the one code object
        # (HF's forward): dynamo's default limit of 8 per code object would leave the ninth eager
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return self._call(contextlib.nullcontext(), args, kwargs)

    def again(self, *args, **kwargs):
        """The step once more, for a caller that knows nothing but the tensors' values changed since the last call
        (the decode loop within one `generate`): where the step compiles to one graph (`whole_graph`: the graphs
        after a break take inputs no signature here sees, e.g. routed rows under expert parallelism) and the
        arguments' signature (`_signature`: each tensor's shape, strides, dtype and device, each number's value,
        each other object's identity) equals the last guarded call's, dynamo's guards are skipped
        (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`: only those that tell its compiled graphs apart
        run); otherwise an ordinary, guarded call. Measured on the 124M GPT-2 at batch 1 (the decode loop with and
        without it, interleaved in one process): 0.968x the time per token, 16 pairs (bench/README.md, session
        33)."""
        if not self.whole_graph or _signature(args, kwargs) != self._guarded:
            return self(*args, **kwargs)
        self.unguarded_calls += 1
        return self._call(_skip_guards(), args, kwargs)

    def aot_step(self, inputs: dict, column: int, full: bool = False):
        """The step as an AOTInductor package (`aot_step.AOTDecodeStep`, built on first use per batch, cache
        length and dtype) for the decode loop's `inputs` (the 4-D mask cut to the filled positions) writing cache
        column `column`: an object with `.logits`, or None where the package does not apply (`aot` off, no static
        cache in the inputs, its build failed once: then the compiled step serves, as before)."""
        if not self.aot or self.module is None:
            return None
        key_name = "cache" if "cache" in inputs else "past_key_values"
        cache = inputs.get(key_name)
        mask = inputs.get("attention_mask")
        layers = getattr(cache, "layers", None)
        if not layers or not isinstance(mask, torch.Tensor) or mask.ndim != 4 or inputs.get("position_ids") is None:
            return None
        key = (tuple(inputs["input_ids"].shape), mask.dtype, tuple(layers[0].keys.shape), layers[0].keys.dtype)
        step = self._aot_steps.get(key)
        if step is None:
            if key in self._aot_failed:
                return None
            try:
                from .aot_step import AOTDecodeStep

                step = AOTDecodeStep.build(self.module, cache, key_name, inputs, column, DECODE_COMPILE_OPTIONS)
            except Exception as e:  # noqa: BLE001 - the compiled step serves instead
                return self._aot_off(key, "did not build", e)
            self._aot_steps[key] = step
        if self.huge_pages:
            self._cache_onto_huge_pages(cache)
        try:  # the package checks its inputs' shapes before any kernel runs: a refusal leaves the cache as it was
            out = step(inputs, column, cache, key_name, full)
        except Exception as e:  # noqa: BLE001
            return self._aot_off(key, "refused a step", e)
        self.aot_calls += 1
        return out

    def _aot_off(self, key: tuple, what: str, error: Exception) -> None:
        """The package of `key` given up (once, with a warning): the compiled step serves those calls."""
        self._aot_failed.add(key)
        self._aot_steps.pop(key, None)
        first = (str(error).splitlines() or [""])[0][:200]
        warnings.warn(f"kernel injection: the AOTInductor decode step {what} ({type(error).__name__}: {first}); "
                      "the torch.compile step serves instead")
        return None

    def _call(self, stance, args, kwargs):
        attention = sdpa_kernel(SDPBackend.MATH) if self.math_attention else contextlib.nullcontext()
        loaded = len(_code_modules())
        with torch.no_grad(), inductor_config.patch(freezing=self.freeze), attention, stance:
            try:
                out = self.compiled(*args, **kwargs)
            except _NOT_ONE_GRAPH:  # a graph break, or past the recompile limit (then eager, as without fullgraph)
                if not self.whole_graph:
                    raise
                self.whole_graph, self.compiled = False, self._with_breaks()
                out = self.compiled(*args, **kwargs)
        if self.huge_pages:
            constants_onto_huge_pages(loaded)
            self._cache_onto_huge_pages(kwargs.get("cache", kwargs.get("past_key_values")))
        if len(_code_modules()) > loaded:  # compiled: the heap the compilation left free back to the OS (124M
            trim_heap()  # GPT-2: RSS after the first generate 1.80 -> 1.49 GB; bench/README.md, session 36)
        return out

    def _cache_onto_huge_pages(self, cache) -> None:
        """Once per cache object, its keys and values (allocated by the prefill) onto huge pages."""
        if cache is not None and id(cache) not in self._caches_on_huge_pages:
            self._caches_on_huge_pages.add(id(cache))
            for layer in getattr(cache, "layers", ()):
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        collapse_huge_pages(t)


def _skip_guards():
    """A context in which dynamo runs only the guards that tell its compiled graphs apart; none (the guards run)
    where the compiler's stance is not the default one (e.g. the user's "force_eager") or this torch keeps it
    elsewhere. `torch.compiler.set_stance` applies its stance as soon as it is built, so it is built here, per call,
    and used at once in a `with`."""
    current = getattr(torch._dynamo.eval_frame, "_stance", None)
    if current is None or current.stance != "default" or current.backend is not None:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What `FrozenCompiledCall.again` compares: per argument, a tensor's (shape, strides, dtype, device), a
    number's, string's or None's type and value, and any other object's identity (the caller keeps it alive
    between the two calls: the KV cache)."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return (v.shape, v.stride(), v.dtype, v.device)
        if v is None or isinstance(v, (bool, int, float, str)):
            return (type(v), v)
        return id(v)

    return tuple(one(v) for v in args), tuple((k, one(v)) for k, v in kwargs.items())


@functools.cache
def _code_cache():
    """inductor's `PyCodeCache` class, looked up once (the decode step asks on every token); None where this torch
    has none."""
    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:
        return None
    return PyCodeCache


def _code_modules() -> list:
    """inductor's loaded output-code modules, in load order (a frozen graph's constants are their attributes);
    [] where this torch keeps them elsewhere (then nothing moves to huge pages)."""
    return getattr(_code_cache(), "modules", [])


def constants_onto_huge_pages(since: int) -> None:
    """The constants (frozen, packed weights) of every graph inductor loaded after the first `since`
    (`len(_code_modules())` taken before compiling) onto huge pages (`collapse_huge_pages`)."""
    for module in _code_modules()[since:]:
        for value in list(vars(module).values()):
            if isinstance(value, torch.Tensor):
                collapse_huge_pages(value)


AOT_BUILD_BYTES_PER_WEIGHT_BYTE = 5  # host memory a package's build may take, per byte of weights (measured 4.7)


def aot_wanted(module: nn.Module) -> bool:
    """Whether kernel injection on CPU serves the decode step of `module` as an AOTInductor package (`aot_step`)
    instead of the `torch.compile` step: the environment variable `ZEROSPEED_AOT_DECODE` when the engine is built,
    "1" always, "0" never; unset, where it was measured faster and its build fits in memory: fp32 and int8 weights
    (not bf16/fp16: a floating parameter in half precision) and the host's available memory (MemAvailable) at
    least `AOT_BUILD_BYTES_PER_WEIGHT_BYTE` x the weights' bytes. Measured at 124M parameters, batch 1, in one
    process, interleaved pairs: fp32 0.94x the time per token of the `torch.compile` step (16 of 16 pairs faster),
    int8 0.86x (8 of 8), bf16 1.05x (2 of 8 faster); building the package (export, compile, load) peaked 2.36 GB
    above the built engine for 0.50 GB of fp32 weights (4.7x), the compiled step's first call 1.29 GB (2.6x)
    (bench/README.md, sessions 35-36). Raises ValueError for another value."""
    value = os.environ.get("ZEROSPEED_AOT_DECODE")
    if value not in (None, "0", "1"):
        raise ValueError(f"ZEROSPEED_AOT_DECODE={value!r}: use 1 (the decode step as an AOTInductor package), 0 (the "
                         "torch.compile step), or leave it unset (the package for fp32 and int8 weights)")
    if value is not None:
        return value == "1"
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in module.parameters()):
        return False
    from .quant import weight_bytes

    available = _available_host_bytes()
    return available is None or available >= AOT_BUILD_BYTES_PER_WEIGHT_BYTE * weight_bytes(module)


def _available_host_bytes() -> int | None:
    """The host's available memory in bytes (/proc/meminfo MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_compiler(device: torch.device) -> None:
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ValueError("replace_with_kernel_inject=true compiles the decode step with torch.compile (inductor), "
                         "which needs a C++ compiler on CPU (none of g++, c++, clang++ is on PATH): install one, or "
                         "set replace_with_kernel_inject=false")


def inject_kernels(module: nn.Module, device: torch.device, freeze: bool = True,
                   collectives: bool = False) -> FrozenCompiledCall:
    """Switch a HF generation model to the static KV cache, SDPA attention and the compiled decode step
    (in place). freeze=False (`set_empty_params=True`): compile without freezing, so the step holds no copy of
    the weights. collectives=True (the step holds torch's functional collectives: tensor parallelism on a backend
    other than gloo, `comm.traced.needs_python_wrapper`): inductor's Python wrapper, not the C++ one
    (`FrozenCompiledCall`). Returns the compiled call `generate` will use. Raises ValueError for a module
    that is not a HF generation model (naming what to use instead) or a CPU without a C++ compiler."""
    gen = getattr(module, "generation_config", None)
    hooks = ("generate", "get_compiled_call", "_prepare_static_cache")
    if gen is None or not all(callable(getattr(module, h, None)) for h in hooks):
        raise ValueError(f"replace_with_kernel_inject=true works on Hugging Face generation models (a "
                         f"PreTrainedModel with generate, transformers >= 5); {type(module).__name__} is not one. Use "
                         "engine.compile() to compile its forward instead")
    _check_compiler(device)
    from transformers import CompileConfig

    impl = getattr(module.config, "_attn_implementation", None)
    if impl not in (None, "sdpa") and hasattr(module, "set_attn_implementation"):
        module.set_attn_implementation("sdpa")
    if getattr(module.config, "_attn_implementation", None) == "sdpa" and hasattr(module, "set_attn_implementation"):
        module.set_attn_implementation(prefix_attention.register())  # SDPA over the cache's filled part only
    gen.cache_implementation = "static"
    cc = CompileConfig(fullgraph=False, dynamic=False, mode="max-autotune-no-cudagraphs")
    cc._compile_all_devices = True  # HF compiles the decode step on CUDA/XPU only unless told otherwise
    gen.compile_config = cc
    on_cpu = device.type == "cpu"
    aot = aot_wanted(module)  # read (and checked) on every device; used on CPU
    call = FrozenCompiledCall(module.__call__, freeze, math_attention=on_cpu, cpp_wrapper=not collectives,
                              huge_pages=on_cpu,
                              aot_module=module if on_cpu and freeze and not collectives and aot else None)
    if on_cpu and not freeze:  # the step reads the module's own weights
        for t in [*module.parameters(), *module.buffers()]:
            collapse_huge_pages(t)
    module.get_compiled_call = types.MethodType(lambda self, compile_config=None: call, module)
    module._prepare_static_cache = types.MethodType(_reused_cache(module._prepare_static_cache), module)
    with_decode_loop(module)
    return call


def _reused_cache(prepare):
    """Wrap HF's `_prepare_static_cache(cache_implementation, batch_size, max_cache_len, ...)`: the cache it
    built earlier for the same batch size and (effective) length, reset, instead of a new one; max_cache_len
    asked `prefix_attention.SPARE` positions longer (the decode step's attention over the filled part is then
    never a cut of the whole cache: one compiled graph for every length)."""
    caches: dict[tuple, object] = {}

    def wrapped(self, *args, **kwargs):
        if "max_cache_len" in kwargs:
            kwargs["max_cache_len"] += prefix_attention.SPARE
        elif len(args) > 2:
            args = (*args[:2], args[2] + prefix_attention.SPARE, *args[3:])
        fresh = prepare(*args, **kwargs)  # lazy: its tensors are allocated on first use
        batch = kwargs.get("batch_size", args[1] if len(args) > 1 else None)
        key = (batch, getattr(self, "_previous_max_cache_length", None), self.dtype)
        old = caches.get(key)
        if old is None:
            caches[key] = fresh
            return fresh
        old.reset()
        return old

    return wrapped
