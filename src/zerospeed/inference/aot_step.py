"""The kernel-injected decode step as an AOTInductor package: the same compiled kernels, without dynamo at run time.

Kernel injection uses it on CPU for a single-process model (a step with collectives keeps the `torch.compile`
step) with fp32 or int8 weights, or as `ZEROSPEED_AOT_DECODE` says (`inject.aot_wanted`), and falls back to the
`torch.compile` step with a warning where export or compilation fails.

Kernel injection compiles HF's one-token forward with `torch.compile` (freezing, max-autotune, C++ wrapper). Each
call of that step then passes through dynamo's frame evaluation, AOT autograd's runtime wrappers and the
context managers around the call: ~0.7 ms per token at 124M parameters, batch 1 (5% of a token; bench/README.md,
sessions 34-35). `torch._inductor.aoti_compile_and_package` compiles the same graph (exported with
`torch.export`) into a shared library called from C++ with no Python between the kernels. Measured (session 35,
124M GPT-2, batch 1, one process, its constants moved onto huge pages): 0.962x the time per token of the
`torch.compile` step inside the same decode loop (16 interleaved pairs, faster in 14, identical greedy tokens);
built by the engine (`FrozenCompiledCall.aot_step`), 0.942x (16 pairs, faster in 16), and its first `generate`
(export + compile) took 43-45 s against the compiled step's 56 s. Session 36: fp32 0.937x (16 of 16 pairs),
int8 0.865x (8 of 8), bf16 1.054x (2 of 8 faster: not the default there).

Memory (`_settle`): the library embeds the constants and the runtime copies them out once at load; its file
pages are then dropped from the RSS and the heap the export left free is trimmed: the 124M GPT-2's RSS after
its first generate 2.96 GB without this, 1.70 GB with it.

How the step is exported: HF's static cache lives outside the model, so `_Step` wraps model and cache and
registers each layer's keys, values and `cumulative_length` as buffers; the package keeps them as named constants
(`k{i}`, `v{i}`, `c{i}`), and `bind` points those at the cache object's own tensors
(`load_constants(user_managed=True)`) - once per cache object. HF's `StaticLayer.update` writes at its
`cumulative_length` tensor and then adds the new length to it; frozen, that read is folded at export time, so the
step sets every layer's `cumulative_length` from a `column` input first (the write index: the same for every row
of a left-padded batch, where the position ids differ). The attention mask is the decode loop's 4-D mask cut to
the filled positions (`prefix_attention`), its length a dynamic dimension: one package per (batch, cache
length, dtype), as the compiled step now.
"""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch
from torch import nn

from ..offload.hostmem import collapse_huge_range, drop_file_pages, smaps_field, trim_heap

__all__ = ["AOTDecodeStep"]


class _Step(nn.Module):
    """One decode step of a HF causal LM over a static cache, for `torch.export`: (input_ids [B, 1], position_ids
    [B, 1], attention_mask [B, 1, 1, n] (n dynamic), column [] int64) -> logits [B, 1, vocab]."""

    def __init__(self, model: nn.Module, cache, cache_key: str, extra: dict):
        super().__init__()
        self.model = model
        self._cache, self._cache_key, self._extra = cache, cache_key, dict(extra)
        for i, layer in enumerate(cache.layers):
            self.register_buffer(f"k{i}", layer.keys, persistent=False)
            self.register_buffer(f"v{i}", layer.values, persistent=False)
            self.register_buffer(f"c{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids, position_ids, attention_mask, column):
        for layer in self._cache.layers:
            layer.cumulative_length.copy_(column)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=True, **{self._cache_key: self._cache}, **self._extra)
        return out.logits


def _mappings() -> dict[int, tuple[int, str]]:
    """{start: (end, path)} of this process's read-write mappings (/proc/self/maps; path "" for anonymous
    memory); {} where there is none."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) >= 5 and parts[1].startswith("rw"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out[lo] = (hi, parts[5] if len(parts) > 5 else "")
    return out


def _settle(before: dict[int, tuple[int, str]]) -> None:
    """After a package is loaded on CPU: its constants (the packed weights, copied out of the library into fresh
    anonymous memory) onto huge pages in place; the library's own copy of them, read once, out of the resident set
    (`drop_file_pages`); the heap the export and compilation left free given back (`trim_heap`). Measured (124M
    GPT-2, batch 1): RSS after the first generate 2.96 GB without this, 1.70 GB with it (the `torch.compile`
    step's 1.80), the time per token unchanged (bench/README.md, session 36)."""
    new = {lo: v for lo, v in _mappings().items() if lo not in before}
    for lo, (hi, path) in new.items():
        if not path:
            collapse_huge_range(lo, hi)
    written = smaps_field("Anonymous")  # a file mapping's pages this process wrote (none: all the file's own)
    for lo, (hi, path) in new.items():
        if path.startswith("/") and written.get(lo) == 0:
            drop_file_pages(lo, hi)
    trim_heap()


class _Logits:
    """What the decode loop reads of a step's output: `.logits`."""
    __slots__ = ("logits",)

    def __init__(self, logits):
        self.logits = logits


class AOTDecodeStep:
    """A decode step compiled ahead of time for one (batch, cache length, dtype): call with the decode loop's
    inputs and the write column; `bind` it to each cache object before its first step."""

    def __init__(self, runner):
        self.runner, self._bound = runner, None

    @classmethod
    def build(cls, module: nn.Module, cache, cache_key: str, inputs: dict, column: int, options: dict,
              directory: str | None = None) -> "AOTDecodeStep":
        """Export and compile the step of `module` over `cache` from one step's `inputs` (input_ids, position_ids,
        attention_mask 4-D, and keys passed through unchanged, e.g. logits_to_keep) with inductor `options`
        (freezing on, the C++ wrapper being AOTInductor's own); the package file is written to `directory`, or to
        a temporary one deleted once it is loaded. Raises what export or compilation raise."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        extra = {k: v for k, v in inputs.items()
                 if k not in ("input_ids", "position_ids", "attention_mask", cache_key, "use_cache", "return_dict",
                              "cache_position")}
        step = _Step(module, cache, cache_key, extra)
        mask = inputs["attention_mask"]
        length = torch.export.Dim("filled", min=2, max=cache.layers[0].keys.shape[2] - 1)
        args = (inputs["input_ids"], inputs["position_ids"], mask, torch.tensor(column))
        attention = sdpa_kernel(SDPBackend.MATH) if mask.device.type == "cpu" else contextlib.nullcontext()
        with torch.no_grad(), attention:
            exported = torch.export.export(step, args, dynamic_shapes=({}, {}, {3: length}, {}), strict=True)
        opts = {k: v for k, v in options.items() if k != "cpp_wrapper"}
        opts["freezing"] = True
        # the package file (about the weights' size twice) only until it is loaded, unless a directory is given
        keep = contextlib.nullcontext(directory) if directory else tempfile.TemporaryDirectory(prefix="zerospeed_aot_")
        with keep as where:
            path = torch._inductor.aoti_compile_and_package(
                exported, package_path=os.path.join(where, "decode_step.pt2"), inductor_configs=opts)
            before = _mappings()
            runner = torch._inductor.aoti_load_package(path)
        if mask.device.type == "cpu":
            _settle(before)
        return cls(runner)

    def bind(self, cache) -> None:
        """Point the package's cache constants at `cache`'s tensors (no copy); once per cache object."""
        if self._bound is cache:
            return
        constants = {}
        for i, layer in enumerate(cache.layers):
            constants[f"k{i}"], constants[f"v{i}"] = layer.keys, layer.values
            constants[f"c{i}"] = layer.cumulative_length
        self.runner.load_constants(constants, check_full_update=False, user_managed=True)
        self._bound = cache

    def __call__(self, inputs: dict, column: int, cache, cache_key: str, full: bool = False):
        """The step's output: `.logits` [B, 1, vocab]; full=True a HF `CausalLMOutputWithPast` with the cache
        under `cache_key` (what HF's `_update_model_kwargs_for_generation` reads in the loop's first steps)."""
        self.bind(cache)
        logits = self.runner(inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"],
                             torch.tensor(column))
        if full:
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return CausalLMOutputWithPast(**{"logits": logits, cache_key: cache})
        return _Logits(logits)
