"""Errors raised while reading a ds_config, and the helpers that make their messages useful.

Every problem a user can cause in a config ends up as one `ConfigError` (a `ValueError`) whose
message lists all the problems found, each prefixed with the dotted path of the key
(``zero_optimization.offload_optimizer.devcie: unknown key; did you mean 'device'?``). Users
never see a raw pydantic traceback.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "ConfigDeprecationWarning",
    "closest_key",
    "format_path",
    "short_repr",
]


class ConfigError(ValueError):
    """A ds_config that zerospeed cannot accept. ``problems`` lists each problem as one line."""

    def __init__(self, problems: str | Sequence[str]):
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = [str(p) for p in problems] or ["invalid ds_config"]
        if len(self.problems) == 1:
            message = f"invalid ds_config: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"invalid ds_config ({len(self.problems)} problems):\n{lines}"
        super().__init__(message)


class ConfigIssue(ValueError):
    """Raised inside a model validator: one or more problems, each at a path relative to the model.

    pydantic wraps it in a ValidationError at the model's location; `load_config` joins that
    location with each relative path. Not part of the public API.
    """

    def __init__(self, issues: Iterable[tuple[Sequence[str | int], str]]):
        self.issues: list[tuple[tuple[str | int, ...], str]] = [(tuple(p), m) for p, m in issues]
        super().__init__("; ".join(_join(p, m) for p, m in self.issues))

    @classmethod
    def at(cls, path: Sequence[str | int] | str, message: str) -> ConfigIssue:
        if isinstance(path, str):
            path = (path,) if path else ()
        return cls([(tuple(path), message)])


class ConfigDeprecationWarning(UserWarning):
    """A deprecated DeepSpeed key was remapped to its replacement (shown by default)."""


def closest_key(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name`` (exact case-insensitive match first), or None."""
    candidates = [c for c in dict.fromkeys(candidates) if isinstance(c, str)]
    if not isinstance(name, str) or not candidates:
        return None
    lowered = {c.lower(): c for c in candidates}
    if name.lower() in lowered:
        return lowered[name.lower()]
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if match:
        return match[0]
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def format_path(path: Sequence[str | int]) -> str:
    """``("zero_optimization", "offload_param", "device")`` -> ``zero_optimization.offload_param.device``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _join(path: Sequence[str | int], message: str) -> str:
    where = format_path(path)
    return f"{where}: {message}" if where else message
