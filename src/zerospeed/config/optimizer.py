"""The ``optimizer`` block: ``{"type": ..., "params": {...}}`` mapped onto an optimizer class.

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
* "Lamb" and "Lion" name zerospeed's own classes (``zerospeed.optim.Lamb`` / ``Lion``, torch has
  none) and take DeepSpeed's FusedLamb / FusedLion params (``OWN_OPTIMIZER_PARAMS``); FusedLion's
  ``set_grad_none`` is accepted and dropped (the engine always sets gradients to None). Lamb's trust
  ratio needs whole parameters, so ``check_optimizer_for_stage`` refuses it at ZeRO stages 1-3.

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

__all__ = ["OptimizerConfig", "SUPPORTED_OPTIMIZERS", "OWN_OPTIMIZER_PARAMS", "check_optimizer_for_stage",
           "client_hyperparam", "optimizer_kwargs", "torch_optimizer_kwargs"]

#: optimizer.type (lower case) -> canonical spelling = the class name (torch.optim's, or zerospeed.optim's
#: for Lamb and Lion).
SUPPORTED_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop",
                        "lamb": "Lamb", "lion": "Lion"}

#: The keyword arguments of zerospeed's own optimizers (``zerospeed.optim.Lamb`` / ``Lion``, DeepSpeed's
#: FusedLamb / FusedLion arguments); written out because config sits below optim in the layering
#: (tests/unit/test_lamb_lion.py checks them against the classes' signatures).
OWN_OPTIMIZER_PARAMS = {
    "Lamb": ("lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm",
             "max_coeff", "min_coeff", "amsgrad"),
    "Lion": ("lr", "betas", "weight_decay"),
}

#: params that may be "auto" (filled from the client optimizer).
AUTO_PARAMS = ("lr", "betas", "eps", "weight_decay")

_ADAM_SWITCHES = ("adam_w_mode", "torch_adam", "bias_correction")
_LION_SWITCHES = ("set_grad_none",)  # FusedLion's; zero_grad always sets None in the engine
_ADAM_DEFAULTS = {"weight_decay": 0.0}  # FusedAdam / DeepSpeedCPUAdam default (torch AdamW: 0.01)
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "alpha", "lr_decay", "dampening", "max_coeff", "min_coeff")


def _switches(canonical: str) -> tuple[str, ...]:
    """DeepSpeed arguments accepted in params but never passed to the class."""
    if canonical in ("Adam", "AdamW"):
        return _ADAM_SWITCHES
    return _LION_SWITCHES if canonical == "Lion" else ()


@functools.lru_cache(maxsize=None)
def torch_optimizer_kwargs(class_name: str) -> tuple[str, ...]:
    """The keyword arguments ``torch.optim.<class_name>`` accepts (besides ``params``)."""
    import torch.optim

    sig = inspect.signature(getattr(torch.optim, class_name).__init__)
    return tuple(name for name, p in sig.parameters.items()
                 if name not in ("self", "params") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def optimizer_kwargs(class_name: str) -> tuple[str, ...]:
    """The keyword arguments the optimizer class ``class_name`` accepts: zerospeed's own (Lamb, Lion)
    from ``OWN_OPTIMIZER_PARAMS``, else ``torch.optim``'s."""
    if class_name in OWN_OPTIMIZER_PARAMS:
        return OWN_OPTIMIZER_PARAMS[class_name]
    return torch_optimizer_kwargs(class_name)


def check_optimizer_for_stage(optimizer: "OptimizerConfig | None", stage: int) -> None:
    """Refuse an optimizer that cannot run at ZeRO ``stage``: Lamb at stages 1-3.

    Lamb's trust ratio ||x|| / ||update|| is a norm over each whole parameter tensor, but from stage 1
    on the optimizer steps flat partition slices that cut across parameters, so no per-parameter
    ratio exists there (DeepSpeed lists FusedLamb as untested with ZeRO for the same reason).
    Raises NotImplementedError naming the stage and the fix. Lion and the torch optimizers are
    elementwise and run at every stage.
    """
    if optimizer is not None and optimizer.type == "Lamb" and stage >= 1:
        raise NotImplementedError(
            f"optimizer.type 'Lamb' cannot run at zero_optimization.stage={stage}: its trust ratio is a norm over "
            "each whole parameter, and ZeRO stages 1-3 step flat partition slices that cut across parameters. "
            "Use \"zero_optimization\": {\"stage\": 0} with Lamb, or another optimizer (Lion, Adam, AdamW) "
            f"at stage {stage}")


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


def _check_value(key: str, value: Any, canonical: str = "Adam") -> tuple[Any, str | None]:
    """Normalise one param value of optimizer ``canonical``; return (value, problem or None)."""
    if key in _NON_NEGATIVE:
        if not _is_number(value) or value < 0:
            return value, f"must be a number >= 0, got {short_repr(value)}"
    elif key == "betas":
        if (not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_number(b) for b in value)
                or not all(0 <= b < 1 for b in value)):
            return value, f"must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]; got {short_repr(value)}"
        return [float(b) for b in value], None
    elif canonical == "Lamb" and key == "amsgrad" and value is not False:
        return value, "Lamb has no AMSGrad variant (DeepSpeed's FusedLamb refuses it too); remove the key"
    elif key in ("adam_w_mode", "torch_adam", "amsgrad", "nesterov", "maximize", "centered", "eps_inside_sqrt",
                 "set_grad_none") or (key == "bias_correction" and canonical == "Lamb"):
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
    """Canonical optimizer name: "Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Lamb" or "Lion" (given
    in any case). "Adam" runs AdamW unless params.adam_w_mode is false (DeepSpeed's rule). "Lamb"
    (You et al. 2020) runs at ZeRO stage 0 only; "Lion" (Chen et al. 2023) at every stage."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments as written (with "auto" values resolved). Includes the DeepSpeed
    switches adam_w_mode / torch_adam / bias_correction (Adam) and set_grad_none (Lion);
    ``torch_kwargs()`` leaves them out. Lamb: lr 1e-3, bias_correction true, betas [0.9, 0.999],
    eps 1e-8, eps_inside_sqrt false, weight_decay 0, max_coeff 10.0, min_coeff 0.01 unless given;
    Lion: lr 1e-3, betas [0.9, 0.999], weight_decay 0 (DeepSpeed's FusedLamb / FusedLion defaults)."""
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
        """The class to build, for ``optim.build_optimizer``: a ``torch.optim`` name ("Adam" with
        adam_w_mode true, the default, gives "AdamW"), or "Lamb" / "Lion" (``zerospeed.optim``)."""
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
            if key in _switches(self.type):
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
    accepted = list(optimizer_kwargs(torch_name))
    extras = [k for k in _switches(canonical) if k not in accepted]
    owner = f"zerospeed.optim.{torch_name}" if torch_name in OWN_OPTIMIZER_PARAMS else f"torch.optim.{torch_name}"
    for key in list(params):
        value = params[key]
        if key == "max_grad_norm":
            issues.append(((key,), "not supported as an optimizer parameter: use the top-level "
                                   "'gradient_clipping' (DeepSpeed raises ValueError for this too)"))
        elif key not in accepted and key not in extras:
            best = closest_key(key, accepted + extras)
            hint = f"did you mean '{best}'? " if best else ""
            issues.append(((key,), f"unknown parameter for {owner}: {hint}valid: "
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
            params[key], problem = _check_value(key, resolved, canonical)
            if problem:
                issues.append(((key,), f"value copied from the client optimizer {problem}"))
        else:
            params[key], problem = _check_value(key, value, canonical)
            if problem:
                issues.append(((key,), problem))
    lo, hi = params.get("min_coeff", 0.01), params.get("max_coeff", 10.0)
    if canonical == "Lamb" and _is_number(lo) and _is_number(hi) and lo > hi:
        issues.append((("min_coeff",), f"= {lo} is above max_coeff = {hi}: the trust ratio is clamped to "
                                       "[min_coeff, max_coeff] (defaults 0.01 and 10.0)"))
    return params, issues
