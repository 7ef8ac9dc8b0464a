"""The ``optimizer`` block: ``{"type": ..., "params": {...}}`` mapped onto a ``torch.optim`` class.

DeepSpeed semantics kept here (``engine.py::_configure_basic_optimizer``):

* ``type`` is matched case-insensitively; the canonical spelling is stored.
* **"Adam" means AdamW** (decoupled weight decay) unless ``params.adam_w_mode`` is false;
  "AdamW" is always AdamW. ``torch_class_name`` gives the resolved class.
* ``adam_w_mode`` and ``torch_adam`` are DeepSpeed switches, never passed to torch. Adam/AdamW run
  torch's fused kernel on every device that has one, CPU included (``fused_kernel``; DeepSpeed's
  default is its FusedAdam kernel); ``torch_adam: true`` asks for torch's own default implementation,
  as in DeepSpeed (bit-for-bit what plain PyTorch computes on CPU).
  ``bias_correction: true`` (a FusedAdam argument) is accepted and dropped: torch always corrects.
* DeepSpeed's Adam kernels default ``weight_decay`` to 0.0 whereas ``torch.optim.AdamW`` defaults to
  0.01; ``torch_kwargs()`` fills 0.0 so the same config trains the same way.
* ``max_grad_norm`` in the params is an error: use the top-level ``gradient_clipping``.

``"auto"`` values (Hugging Face convention) for lr / betas / eps / weight_decay are copied from the
client optimizer (its ``param_groups[0]``, else its ``defaults``) passed to ``load_config``.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from ._base import ConfigModel, is_auto
from .errors import ConfigIssue, closest_key, short_repr
from .keys import REMOVED_OPTIMIZERS, UNSUPPORTED_OPTIMIZERS

__all__ = ["OptimizerConfig", "SUPPORTED_OPTIMIZERS", "client_hyperparam", "torch_optimizer_kwargs"]

#: optimizer.type (lower case) -> canonical spelling = torch.optim class name.
SUPPORTED_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}

#: params that may be "auto" (filled from the client optimizer).
AUTO_PARAMS = ("lr", "betas", "eps", "weight_decay")

_ADAM_SWITCHES = ("adam_w_mode", "torch_adam", "bias_correction")
_ADAM_DEFAULTS = {"weight_decay": 0.0}  # FusedAdam / DeepSpeedCPUAdam default (torch AdamW: 0.01)
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "alpha", "lr_decay", "dampening")


@functools.lru_cache(maxsize=None)
def torch_optimizer_kwargs(class_name: str) -> tuple[str, ...]:
    """The keyword arguments ``torch.optim.<class_name>`` accepts (besides ``params``)."""
    import torch.optim

    sig = inspect.signature(getattr(torch.optim, class_name).__init__)
    return tuple(name for name, p in sig.parameters.items()
                 if name not in ("self", "params") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item) and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()  # a 0-d tensor (torch allows Tensor lr)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def client_hyperparam(client_optimizer: Any, key: str) -> tuple[bool, Any]:
    """(found, value) of ``key`` in the client optimizer's ``param_groups[0]``, else its ``defaults``."""
    if client_optimizer is None:
        return False, None
    groups = getattr(client_optimizer, "param_groups", None)
    if groups and isinstance(groups[0], Mapping) and key in groups[0]:
        return True, _plain(groups[0][key])
    defaults = getattr(client_optimizer, "defaults", None)
    if defaults is None and isinstance(client_optimizer, Mapping):
        defaults = client_optimizer
    if isinstance(defaults, Mapping) and key in defaults:
        return True, _plain(defaults[key])
    return False, None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_value(key: str, value: Any) -> tuple[Any, str | None]:
    """Normalise one param value; return (value, problem or None)."""
    if key in _NON_NEGATIVE:
        if not _is_number(value) or value < 0:
            return value, f"must be a number >= 0, got {short_repr(value)}"
    elif key == "betas":
        if (not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_number(b) for b in value)
                or not all(0 <= b < 1 for b in value)):
            return value, f"must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]; got {short_repr(value)}"
        return [float(b) for b in value], None
    elif key in ("adam_w_mode", "torch_adam", "amsgrad", "nesterov", "maximize", "centered"):
        if not isinstance(value, bool):
            return value, f"must be true or false, got {short_repr(value)}"
    elif key == "bias_correction":
        if value is not True:
            return value, ("torch.optim Adam/AdamW always apply bias correction; only bias_correction=true is "
                           "supported (or leave it out)")
    return value, None


class OptimizerConfig(ConfigModel):
    """``optimizer``: the optimizer zerospeed builds when the client does not pass one.

    Read ``torch_class_name`` (e.g. "AdamW") and ``torch_kwargs()`` to build it:
    ``getattr(torch.optim, cfg.torch_class_name)(params, **cfg.torch_kwargs())``.
    """

    type: str
    """Canonical optimizer name: "Adam", "AdamW", "SGD", "Adagrad" or "RMSprop" (given in any case).
    "Adam" runs AdamW unless params.adam_w_mode is false (DeepSpeed's rule)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments as written (with "auto" values resolved). Includes the DeepSpeed
    switches adam_w_mode / torch_adam / bias_correction; ``torch_kwargs()`` leaves them out."""
    legacy_fusion: bool = False
    """DeepSpeed's legacy fused-optimizer flag (no effect in zerospeed)."""

    @classmethod
    def _prepare(cls, data: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        issues: list[tuple[tuple, str]] = []
        for key in list(data):
            if key not in cls.config_keys() and (key in _ADAM_SWITCHES or key in AUTO_PARAMS
                                                 or key == "max_grad_norm"):
                issues.append(((key,), f"'{key}' is an optimizer parameter: put it inside optimizer.params "
                                       "(DeepSpeed ignores it here)"))
        name = data.get("type")
        canonical = None
        if name is None or is_auto(name):
            issues.append((("type",), f"required: one of {', '.join(SUPPORTED_OPTIMIZERS.values())}"))
        elif not isinstance(name, str):
            issues.append((("type",), f"must be a string, got {short_repr(name)}"))
        elif name.lower() in REMOVED_OPTIMIZERS:
            issues.append((("type",), f"'{REMOVED_OPTIMIZERS[name.lower()]}' was removed from DeepSpeed in 0.19.8 "
                                      "(1-bit Adam / 1-bit LAMB / 0-1 Adam); use Adam or AdamW"))
        elif name.lower() in UNSUPPORTED_OPTIMIZERS:
            issues.append((("type",), f"'{UNSUPPORTED_OPTIMIZERS[name.lower()]}' is a DeepSpeed optimizer that "
                                      f"zerospeed does not support yet; supported: "
                                      f"{', '.join(SUPPORTED_OPTIMIZERS.values())}"))
        elif name.lower() not in SUPPORTED_OPTIMIZERS:
            best = closest_key(name, SUPPORTED_OPTIMIZERS.values())
            hint = f"did you mean '{best}'? " if best else ""
            issues.append((("type",), f"unknown optimizer '{name}': {hint}supported: "
                                      f"{', '.join(SUPPORTED_OPTIMIZERS.values())}"))
        else:
            canonical = SUPPORTED_OPTIMIZERS[name.lower()]
            data["type"] = canonical

        params = data.get("params")
        if params is None or is_auto(params):
            params = {}
        if not isinstance(params, dict):
            issues.append((("params",), f"must be a JSON object of constructor arguments, got {short_repr(params)}"))
        elif canonical is not None:
            params, param_issues = _check_params(canonical, dict(params), context.get("client_optimizer"))
            issues.extend((("params",) + p, m) for p, m in param_issues)
        data["params"] = params
        if issues:
            raise ConfigIssue(issues)
        return data

    @property
    def adam_w_mode(self) -> bool:
        """DeepSpeed's ``adam_w_mode`` switch (default true); only meaningful for "Adam"."""
        return bool(self.params.get("adam_w_mode", True))

    @property
    def torch_class_name(self) -> str:
        """The ``torch.optim`` class to build: "Adam" with adam_w_mode true (default) gives "AdamW"."""
        if self.type == "Adam":
            return "AdamW" if self.adam_w_mode else "Adam"
        return self.type

    @property
    def fused_kernel(self) -> bool:
        """True for Adam/AdamW unless ``params.torch_adam`` is true: build with torch's fused kernel on
        CPU too (``build_optimizer(..., fused_cpu=...)``), DeepSpeed's FusedAdam counterpart."""
        return self.type in ("Adam", "AdamW") and not self.params.get("torch_adam", False)

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.optim.<torch_class_name>`` (betas as a tuple).

        DeepSpeed switches are left out; for Adam/AdamW an unset weight_decay is 0.0 (DeepSpeed's
        default), not torch's 0.01.
        """
        kwargs: dict[str, Any] = dict(_ADAM_DEFAULTS) if self.type in ("Adam", "AdamW") else {}
        for key, value in self.params.items():
            if key in _ADAM_SWITCHES:
                continue
            kwargs[key] = tuple(value) if key == "betas" else value
        return kwargs


def _check_params(canonical: str, params: dict[str, Any], client: Any) -> tuple[dict[str, Any], list]:
    issues: list[tuple[tuple, str]] = []
    torch_name = canonical
    if canonical == "Adam" and params.get("adam_w_mode", True) is False:
        torch_name = "Adam"
    elif canonical == "Adam":
        torch_name = "AdamW"
    accepted = list(torch_optimizer_kwargs(torch_name))
    extras = list(_ADAM_SWITCHES) if canonical in ("Adam", "AdamW") else []
    for key in list(params):
        value = params[key]
        if key == "max_grad_norm":
            issues.append(((key,), "not supported as an optimizer parameter: use the top-level "
                                   "'gradient_clipping' (DeepSpeed raises ValueError for this too)"))
        elif key not in accepted and key not in extras:
            best = closest_key(key, accepted + extras)
            hint = f"did you mean '{best}'? " if best else ""
            issues.append(((key,), f"unknown parameter for torch.optim.{torch_name}: {hint}valid: "
                                   f"{', '.join(accepted + extras)}"))
        elif is_auto(value):
            if key not in AUTO_PARAMS:
                issues.append(((key,), f"'auto' is only supported for {', '.join(AUTO_PARAMS)}; set a value"))
                continue
            found, resolved = client_hyperparam(client, key)
            if not found:
                where = ("the client optimizer has no such hyper-parameter" if client is not None
                         else "no client optimizer was given to copy it from")
                issues.append(((key,), f"is 'auto' but {where}: set a value, or pass the optimizer whose "
                                       f"'{key}' should be used (load_config(..., client_optimizer=opt))"))
                continue
            params[key], problem = _check_value(key, resolved)
            if problem:
                issues.append(((key,), f"value copied from the client optimizer {problem}"))
        else:
            params[key], problem = _check_value(key, value)
            if problem:
                issues.append(((key,), problem))
    return params, issues
