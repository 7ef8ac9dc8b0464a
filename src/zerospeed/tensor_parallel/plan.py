"""Tensor-parallel sharding plans as data: parameter-name pattern -> row | column (| fused blocks).

A plan is what DeepSpeed 0.19.8's `tensor_parallel.partition_config` writes:

    {"use_default_specs": false,
     "layer_specs": [{"patterns": [".*\\.o_proj\\.weight$", ".*\\.down_proj\\.weight$"], "partition_type": "row"},
                     {"patterns": [".*\\.[qkv]_proj\\.weight$"], "partition_type": "column"},
                     {"patterns": [".*\\.gate_up_proj\\.weight$"], "partition_type": "column", "shape": [2, -1]}]}

Patterns are regular expressions matched from the start (`re.match`, as DeepSpeed) against parameter names
(`model.layers.0.self_attn.q_proj.weight`); a matching layer (`nn.Linear`, or HF's GPT-2 `Conv1D`) is
sharded by output features ("column") or input features ("row"); "skip" keeps it whole. `shape: [B, -1]`
on the sharded dimension marks B fused projections, each split separately (GPT-2's c_attn is q|k|v:
B = 3; splitting it as one matrix would hand rank 0 all of q and half of k - DeepSpeed refuses GPT-2).
Everything not matched (embeddings, norms, lm_head) is replicated.

Presets by HF `config.model_type` (DeepSpeed's `preset_model` names where they exist) and, for other HF
models, their own `config.base_model_tp_plan` ("colwise" / "rowwise" entries).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["TPRule", "TPPlan", "PRESETS", "plan_from_config", "plan_for_model"]

PARTITION_TYPES = ("row", "column", "skip")


@dataclass(frozen=True)
class TPRule:
    """One `layer_specs` entry: parameter-name regexes, the partition type and the fused block count."""

    patterns: tuple[str, ...]
    partition_type: str
    blocks: int = 1

    def __post_init__(self):
        if self.partition_type not in PARTITION_TYPES:
            raise ValueError(f"partition_type {self.partition_type!r}: use one of {PARTITION_TYPES}")
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"partition_config pattern {p!r} is not a valid regular expression: {exc}") from None

    def matches(self, param_name: str) -> bool:
        """True if a pattern matches `param_name` from its start (`re.match`, as DeepSpeed; end with `$`)."""
        return any(re.match(p, param_name) for p in self.patterns)


@dataclass(frozen=True)
class TPPlan:
    """Rules in priority order (the first match wins) and where the plan came from (for messages)."""

    rules: tuple[TPRule, ...]
    source: str = "partition_config"
    attention_fixups: tuple[str, ...] = field(default=())  # module class names whose head counts are made local

    def rule_for(self, weight_name: str) -> TPRule | None:
        """The first rule matching the parameter name `<module>.weight`, or None (replicated)."""
        return next((r for r in self.rules if r.matches(weight_name)), None)

    def describe(self) -> list[str]:
        return [f"{r.partition_type:6s} {'x' + str(r.blocks) + ' fused ' if r.blocks > 1 else ''}{' | '.join(r.patterns)}"
                for r in self.rules]


def _rule(kind: str, *names: str, blocks: int = 1) -> TPRule:
    return TPRule(tuple(rf".*\.{n}\.weight$" for n in names), kind, blocks)


_LLAMA = (_rule("column", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), _rule("row", "o_proj", "down_proj"))
PRESETS: dict[str, TPPlan] = {
    "llama": TPPlan(_LLAMA, "preset llama"),
    "mistral": TPPlan(_LLAMA, "preset mistral"),
    "qwen2": TPPlan(_LLAMA, "preset qwen2"),
    "qwen3": TPPlan(_LLAMA, "preset qwen3"),
    # GPT-2: Conv1D layers ([in, out]); c_attn is q|k|v fused, split per head block
    "gpt2": TPPlan((_rule("column", r"attn\.c_attn", blocks=3), _rule("column", r"mlp\.c_fc"),
                    _rule("row", r"attn\.c_proj", r"mlp\.c_proj")), "preset gpt2", ("GPT2Attention",)),
}


def plan_from_config(partition_config: dict) -> TPPlan:
    """A plan from DeepSpeed's `partition_config` dict ({"layer_specs": [...], "use_default_specs": bool}).
    `shape: [B, -1]` (or [-1, B]... only a leading fused count is supported) sets the fused blocks.
    Raises ValueError naming the bad entry."""
    rules = []
    for i, spec in enumerate(partition_config.get("layer_specs") or []):
        unknown = set(spec) - {"patterns", "partition_type", "shape", "partition_dim", "model_types"}
        if unknown:
            raise ValueError(f"partition_config.layer_specs[{i}]: unknown keys {sorted(unknown)} "
                             "(valid: patterns, partition_type, shape, partition_dim, model_types)")
        pats = spec.get("patterns")
        if isinstance(pats, str):
            pats = [pats]
        if not pats:
            raise ValueError(f"partition_config.layer_specs[{i}] needs 'patterns': a list of regexes over parameter names")
        shape, blocks = spec.get("shape"), 1
        if shape is not None:
            if not (isinstance(shape, (list, tuple)) and len(shape) == 2 and shape[1] == -1 and int(shape[0]) >= 1):
                raise ValueError(f"partition_config.layer_specs[{i}].shape={shape!r}: only [blocks, -1] (fused "
                                 "projections along the sharded dimension) is supported")
            blocks = int(shape[0])
        rules.append(TPRule(tuple(pats), spec.get("partition_type", "column"), blocks))
    return TPPlan(tuple(rules), "partition_config")


def _from_hf_plan(hf_plan: dict, model_type: str) -> TPPlan | None:
    rules = []
    for pattern, style in hf_plan.items():
        kind = {"colwise": "column", "rowwise": "row"}.get(style)
        if kind is None:
            continue  # sequence-parallel / gather / packed styles are not translated
        regex = re.escape(pattern).replace(r"\*", r"\d+")
        rules.append(TPRule((rf"(.*\.)?{regex}\.weight$",), kind))
    return TPPlan(tuple(rules), f"{model_type}.base_model_tp_plan") if rules else None


def plan_for_model(model, *, preset_model: str | None = None, partition_config: dict | None = None) -> TPPlan:
    """The plan for `model`: `partition_config` rules first (then the preset's, unless
    `use_default_specs` is false), else the named or detected preset, else the model's HF
    `base_model_tp_plan`. Raises ValueError when nothing applies, naming the model type and how to
    write `partition_config`."""
    config = getattr(model, "config", None)
    model_type = preset_model or getattr(config, "model_type", None) or type(model).__name__
    if preset_model is not None and preset_model not in PRESETS:
        raise ValueError(f"tensor_parallel.preset_model={preset_model!r} is unknown; presets: {sorted(PRESETS)}, "
                         "or describe the layers with partition_config")
    base = PRESETS.get(model_type) or _from_hf_plan(getattr(config, "base_model_tp_plan", None) or {}, model_type)
    if partition_config:
        custom = plan_from_config(partition_config)
        if partition_config.get("use_default_specs", True) and base is not None:
            return TPPlan(custom.rules + base.rules, f"partition_config + {base.source}", base.attention_fixups)
        return custom
    if base is None:
        raise ValueError(f"no tensor-parallel sharding plan for model type {model_type!r}. Describe its linear "
                         "layers in the config: \"tensor_parallel\": {\"autotp_size\": 2, \"partition_config\": "
                         "{\"layer_specs\": [{\"patterns\": [\".*\\\\.q_proj\\\\.weight$\"], \"partition_type\": "
                         "\"column\"}, {\"patterns\": [\".*\\\\.o_proj\\\\.weight$\"], \"partition_type\": \"row\"}]}} "
                         f"(presets: {sorted(PRESETS)})")
    return base
