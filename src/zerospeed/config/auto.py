"""``"auto"`` values that the Hugging Face Trainer fills in, resolved from the model or refused.

DeepSpeed itself never resolves ``"auto"``: its config models drop the key so the default applies.
The values an HF user actually runs with come from ``transformers/integrations/deepspeed.py``
(``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``), which fills them
from ``TrainingArguments`` and from the model. zerospeed has no Trainer, so per key:

=====================================================  =================================================
key                                                    ``"auto"`` means in zerospeed
=====================================================  =================================================
``train_batch_size`` / ``train_micro_batch_size_per_gpu``  completed from the other two (``batch.py``)
/ ``gradient_accumulation_steps``
``optimizer.params.{lr,betas,eps,weight_decay}``       copied from the client optimizer, else an error
``scheduler.params.warmup_max_lr``                     the optimizer's lr
``scheduler.params.warmup_min_lr``                     0 (HF's fill and DeepSpeed's default)
``scheduler.params.warmup_num_steps`` / ``total_num_steps``  error: HF derives them from the Trainer's
                                                       step count, zerospeed cannot; set them
``gradient_clipping``                                  1.0 (HF's default ``max_grad_norm`` and DeepSpeed
                                                       0.19's default)
``fp16.enabled`` / ``bf16.enabled``                    true when every floating-point parameter of the
                                                       model already has that dtype, else false (HF's
                                                       default ``fp16=False`` / ``bf16=False``)
``zero_optimization.reduce_bucket_size``               ``hidden_size ** 2`` (HF's formula)
``zero_optimization.stage3_prefetch_bucket_size``      ``int(0.9 * hidden_size ** 2)`` at stage 3 (HF)
``zero_optimization.stage3_param_persistence_threshold``  ``10 * hidden_size`` at stage 3 (HF)
``zero_optimization.stage``                            error: neither DeepSpeed nor HF fills it
                                                       (DeepSpeed would silently run stage 0)
=====================================================  =================================================

Below stage 3 the two stage-3 keys are unused and ``"auto"`` leaves their default, as HF does.

``hidden_size`` is read from the model passed to ``load_config(..., model=...)`` (``initialize``
passes its ``model``), in HF's order: ``model.config.hidden_size``, ``max(config.hidden_sizes)``,
``config.text_config.hidden_size`` / ``hidden_sizes``, then the names non-HF configs use,
``config.d_model`` and ``config.n_embd``; ``model.cfg`` is tried after ``model.config`` (zerospeed's
own test models). A model without such a config, or no model at all, makes a hidden-size "auto" an
error naming the key and the value HF would have used, rather than a guess from layer shapes.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ModelHints", "model_hints", "resolve_hidden_size_autos", "resolve_precision_autos",
           "HIDDEN_SIZE_KEYS", "STAGE_AUTO_MESSAGE"]

#: zero_optimization field name -> (the key HF fills, formula text, formula, stage-3 only)
HIDDEN_SIZE_KEYS: dict[str, tuple[str, str, Any, bool]] = {
    "reduce_bucket_size": ("reduce_bucket_size", "hidden_size**2", lambda h: h * h, False),
    "prefetch_bucket_size": ("stage3_prefetch_bucket_size", "int(0.9 * hidden_size**2)",
                             lambda h: int(0.9 * h * h), True),
    "param_persistence_threshold": ("stage3_param_persistence_threshold", "10 * hidden_size",
                                    lambda h: 10 * h, True),
}

STAGE_AUTO_MESSAGE = ("'auto' is not a ZeRO stage: neither DeepSpeed nor the Hugging Face Trainer fills it in "
                      "(DeepSpeed would silently run stage 0); set 0 (plain data parallel), 1 (optimizer "
                      "states partitioned), 2 (+ gradients) or 3 (+ parameters)")

_FLOAT_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32",
                 "torch.float64": "fp64"}


@dataclass(frozen=True)
class ModelHints:
    """What ``load_config`` may read from the model to resolve ``"auto"`` values.

    hidden_size: the model's hidden size, or None. hidden_size_source: where it was read
    (e.g. ``"model.config.hidden_size"``), or why it was not found. param_dtype: "fp16", "bf16",
    "fp32", "fp64" when every floating-point parameter has that dtype, else None.
    """

    hidden_size: Optional[int] = None
    hidden_size_source: str = "no model was given to load_config"
    param_dtype: Optional[str] = None


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _positive_int(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, (list, tuple)):
        ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        return max(ints) if ints and len(ints) == len(value) else None
    return None


def _hidden_size(model: Any) -> tuple[Optional[int], str]:
    tried = []
    for attr in ("config", "cfg"):
        config = _get(model, attr)
        if config is None or isinstance(config, (str, bytes, int, float)):
            continue
        candidates = [("hidden_size", config), ("hidden_sizes", config)]
        text_config = _get(config, "text_config")
        if text_config is not None:
            candidates += [("text_config.hidden_size", text_config), ("text_config.hidden_sizes", text_config)]
        candidates += [("d_model", config), ("n_embd", config)]
        for name, holder in candidates:
            value = _positive_int(_get(holder, name.rsplit(".", 1)[-1]))
            if value is not None:
                return value, f"model.{attr}.{name}"
        tried.append(f"model.{attr}")
    if tried:
        return None, (f"{' and '.join(tried)} has no hidden_size, hidden_sizes, text_config.hidden_size, "
                      "d_model or n_embd")
    return None, f"{type(model).__name__} has no .config to read hidden_size, d_model or n_embd from"


def _param_dtype(model: Any) -> Optional[str]:
    params = getattr(model, "parameters", None)
    if not callable(params):
        return None
    try:
        dtypes = {str(p.dtype) for p in params() if getattr(p, "is_floating_point", lambda: False)()}
    except Exception:  # not a torch module after all
        return None
    return _FLOAT_DTYPES.get(dtypes.pop()) if len(dtypes) == 1 else None


def model_hints(model: Any) -> ModelHints:
    """Read the hidden size and the parameter dtype of ``model`` (None -> empty hints). No side effects."""
    if model is None:
        return ModelHints()
    if isinstance(model, ModelHints):
        return model
    hidden, source = _hidden_size(model)
    return ModelHints(hidden_size=hidden, hidden_size_source=source, param_dtype=_param_dtype(model))


def resolve_hidden_size_autos(data: dict[str, Any], keys: dict[str, str], hints: Optional[ModelHints]
                              ) -> list[tuple[tuple, str]]:
    """Replace the hidden-size ``"auto"`` values of a raw ``zero_optimization`` dict in place.

    keys: every accepted spelling -> field name (``ZeroConfig.config_keys()``). Stage-3-only keys
    are left alone below stage 3 (their default applies, unused). Returns the problems found.
    """
    hints = hints or ModelHints()
    stage = data.get("stage", 0)
    issues = []
    for key in list(data):
        name = keys.get(key)
        if name not in HIDDEN_SIZE_KEYS or not (isinstance(data[key], str) and data[key] == "auto"):
            continue
        hf_key, formula, compute, stage3_only = HIDDEN_SIZE_KEYS[name]
        if stage3_only and stage != 3:
            continue  # dropped by the base model: the default applies, and is unused below stage 3
        if hints.hidden_size is not None:
            data[key] = compute(hints.hidden_size)
            continue
        hint = " (or pass model= to load_config)" if hints == ModelHints() else ""
        fallback = ("remove the key for PyTorch DDP's 25 MiB buckets, or " if name == "reduce_bucket_size"
                    else "remove the key for DeepSpeed's default, or ")
        issues.append(((key,), f"is 'auto', which the Hugging Face Trainer fills with {formula} from the model's "
                               f"config, but zerospeed found no hidden size ({hints.hidden_size_source}): "
                               f"{fallback}set an integer number of elements{hint}"))
    return issues


def resolve_precision_autos(data: dict[str, Any], hints: Optional[ModelHints]) -> None:
    """``fp16.enabled`` / ``bf16.enabled`` = ``"auto"`` -> true iff the model's parameters are all that
    dtype (and the other section is not explicitly enabled); false without a model. In place."""
    dtype = hints.param_dtype if hints is not None else None
    sections = {s: data.get(s) for s in ("fp16", "bf16")}
    explicit = {s: isinstance(v, Mapping) and v.get("enabled") is True for s, v in sections.items()}
    for name, section in sections.items():
        if isinstance(section, Mapping) and isinstance(section.get("enabled"), str) and section["enabled"] == "auto":
            other = "bf16" if name == "fp16" else "fp16"
            data[name] = {**section, "enabled": dtype == name and not explicit[other]}
