"""The base of every config section model, and the translation of pydantic errors into our own.

`ConfigModel` is DeepSpeed's ``DeepSpeedConfigModel`` made strict: frozen, ``extra="forbid"``,
``populate_by_name=True``, and a before-validator that

1. accepts ``None`` for a section (= all defaults) and rejects non-objects with a clear message;
2. rejects a key given both by its name and by its alias (``prefetch_bucket_size`` and
   ``stage3_prefetch_bucket_size``);
3. runs the section's ``_prepare`` hook (removed / unsupported / deprecated keys, "auto");
4. drops every *known* key whose value is ``"auto"`` so that the default applies, as DeepSpeed
   does for the Hugging Face convention. An unknown key is never dropped, whatever its value.
"""
from __future__ import annotations

import re
import types
import typing
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from .errors import ConfigIssue, closest_key, short_repr

__all__ = ["ConfigModel", "is_auto", "issues_from_validation_error", "model_types"]

AUTO = "auto"


def is_auto(value: Any) -> bool:
    """True for the Hugging Face placeholder ``"auto"`` (exact match, as DeepSpeed checks)."""
    return isinstance(value, str) and value == AUTO


class ConfigModel(BaseModel):
    """Base of all config sections: frozen, unknown keys forbidden, aliases and names accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, use_attribute_docstrings=True)

    @classmethod
    def config_keys(cls) -> dict[str, str]:
        """Every key this section accepts (field names and aliases), mapped to the field name."""
        keys: dict[str, str] = {}
        for name, field in cls.model_fields.items():
            keys[name] = name
            if field.alias:
                keys[field.alias] = name
        return keys

    @classmethod
    def _prepare(cls, data: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        """Section-specific rewriting of the raw dict before field validation (override)."""
        return data

    @model_validator(mode="before")
    @classmethod
    def _zerospeed_before(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, BaseModel):
            return data
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigIssue.at((), f"expected a JSON object with the keys of this section, got "
                                     f"{type(data).__name__} {short_repr(data)}")
        data = dict(data)
        both = [
            ((name,), f"given both as '{field.alias}' and as '{name}' (the same setting); keep one")
            for name, field in cls.model_fields.items()
            if field.alias and field.alias != name and name in data and field.alias in data
        ]
        if both:
            raise ConfigIssue(both)
        data = cls._prepare(data, info.context if isinstance(info.context, dict) else {})
        keys = cls.config_keys()
        return {k: v for k, v in data.items() if not (k in keys and is_auto(v))}


# ----------------------------------------------------------------------------------------------
# pydantic ValidationError -> list of (path, message)

_TAG = re.compile(r"^(int|float|str|bool|none|bytes|list|dict|tuple|set|any|model|\[key\]|"
                  r"function-\w+|lax-or-strict|json-or-python|tagged-union|literal|nullable|"
                  r"is-instance|chain|constrained-\w+)(\[.*\])?$|.*\[.*\]$")


def model_types(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic model classes an annotation refers to (``Optional[X]`` -> ``[X]``)."""
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return [m for arg in typing.get_args(annotation) for m in model_types(arg)]
    if origin is typing.Annotated:
        return model_types(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _model_at(root: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    cls = root
    for part in path:
        if not isinstance(part, str) or not hasattr(cls, "config_keys"):
            return None
        name = cls.config_keys().get(part)
        if name is None:
            return None
        found = model_types(cls.model_fields[name].annotation)
        if not found:
            return None
        cls = found[0]
    return cls


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _expected(root: type[BaseModel], path: tuple) -> str:
    if not path:
        return ""
    parent = _model_at(root, path[:-1])
    if parent is None or not hasattr(parent, "config_keys"):
        return ""
    name = parent.config_keys().get(path[-1]) if isinstance(path[-1], str) else None
    if name is None:
        return ""
    return f"; expected {_type_name(parent.model_fields[name].annotation)}"


def _all_paths(root: type[BaseModel], prefix: tuple = (), depth: int = 0) -> dict[str, list[str]]:
    """Every key in the schema tree -> the dotted paths where it is valid (for misplaced keys)."""
    out: dict[str, list[str]] = {}
    if depth > 4 or not hasattr(root, "config_keys"):
        return out
    for key, name in root.config_keys().items():
        out.setdefault(key, []).append(".".join(prefix + (key,)))
        if key == name:
            for sub in model_types(root.model_fields[name].annotation):
                for k, paths in _all_paths(sub, prefix + (key,), depth + 1).items():
                    out.setdefault(k, []).extend(paths)
    return out


def _unknown_key(root: type[BaseModel], path: tuple) -> str:
    key = path[-1]
    parent = _model_at(root, path[:-1])
    candidates = list(parent.config_keys()) if parent is not None and hasattr(parent, "config_keys") else []
    message = "unknown key"
    best = closest_key(str(key), candidates)
    if best is not None:
        return f"{message}; did you mean '{best}'?"
    elsewhere = [p for p in _all_paths(root).get(str(key), []) if p != ".".join(map(str, path))]
    if elsewhere:
        return f"{message} here; '{key}' belongs at {' or '.join(elsewhere[:3])}"
    if candidates:
        shown = ", ".join(sorted(set(candidates))[:40])
        return f"{message}; valid keys here: {shown}"
    return message


def issues_from_validation_error(exc: ValidationError, root: type[BaseModel]) -> list[tuple[tuple, str]]:
    """Translate a pydantic ValidationError raised while validating ``root`` into (path, message)."""
    issues: list[tuple[tuple, str]] = []
    plain: dict[tuple, list[dict]] = {}
    for err in exc.errors(include_url=False):
        path = tuple(p for p in err["loc"] if isinstance(p, int) or not _TAG.match(str(p)))
        etype = err["type"]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigIssue):
            issues.extend((path + sub, msg) for sub, msg in cause.issues)
        elif etype == "extra_forbidden":
            issues.append((path, _unknown_key(root, path)))
        elif etype == "missing":
            issues.append((path, "required key is missing"))
        elif etype in ("value_error", "assertion_error"):
            msg = err["msg"]
            for prefix in ("Value error, ", "Assertion failed, "):
                if msg.startswith(prefix):
                    msg = msg[len(prefix):]
            issues.append((path, f"{msg} (got {short_repr(err.get('input'))})"))
        else:
            if path not in plain:
                issues.append((path, ""))  # placeholder keeps the order
            plain.setdefault(path, []).append(err)
    out = []
    for path, msg in issues:
        if msg:
            out.append((path, msg))
            continue
        errs = plain[path]  # several errors at one path = one per member of a union type
        text = errs[0]["msg"] if len(errs) == 1 else "invalid value"
        out.append((path, f"{text} (got {short_repr(errs[0].get('input'))}{_expected(root, path)})"))
    return list(dict.fromkeys(out))
