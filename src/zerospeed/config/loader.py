"""Read a ds_config from wherever the user keeps it, as DeepSpeed's ``DeepSpeedConfig`` does.

Accepted sources (``parse_source``):

* a ``dict`` (any Mapping): deep-copied, so validation never mutates the caller's dict;
* a path (``str`` or ``os.PathLike``) to a JSON file;
* a JSON string (starts with ``{``);
* a urlsafe-base64 string of JSON (DeepSpeed's launcher passes configs this way).

Differences from DeepSpeed, on purpose: hjson is not a dependency, so a file must be strict JSON;
when it is not, the error gives the JSON parser's line and column and the offending line.
Duplicate keys at any depth are an error naming the key (DeepSpeed does the same for files, but
not for base64 strings).
"""
from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError, short_repr

__all__ = ["parse_source", "loads_json"]

_HJSON_HINT = ("zerospeed reads strict JSON: hjson extensions (comments, unquoted keys or strings, "
               "trailing commas, single quotes) are not supported")


def _no_duplicates(origin: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                siblings = ", ".join(repr(k) for k in list(out)[:6])
                raise ConfigError(
                    f"duplicate key '{key}' in {origin} (in the object with keys {siblings}): JSON "
                    f"objects must not repeat a key; keep one '{key}' entry"
                )
            out[key] = value
        return out

    return hook


def loads_json(text: str, origin: str) -> dict[str, Any]:
    """Parse ``text`` as strict JSON with duplicate-key detection; ``origin`` names it in errors."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates(origin))
    except json.JSONDecodeError as exc:
        lines = exc.doc.splitlines()
        line = lines[exc.lineno - 1] if 0 < exc.lineno <= len(lines) else ""
        pointer = f"\n    {line.rstrip()}\n    {' ' * (exc.colno - 1)}^" if line.strip() else ""
        raise ConfigError(
            f"{origin} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
            f"{pointer}\n  ({_HJSON_HINT})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must hold a JSON object at the top level, got {type(data).__name__}")
    return data


def _load_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {str(path)!r} (working directory {os.getcwd()!r})")
    if path.is_dir():
        raise ConfigError(f"config path {str(path)!r} is a directory, expected a JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
    return loads_json(text, f"config file {str(path)!r}")


def _try_base64(text: str) -> str | None:
    compact = "".join(text.split())
    if not compact or len(compact) < 4:
        return None
    padded = compact + "=" * (-len(compact) % 4)
    try:
        decoded = base64.urlsafe_b64decode(padded).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def parse_source(source: Any) -> dict[str, Any]:
    """Turn a config source (dict, path, JSON string, base64 JSON) into a fresh plain dict."""
    if isinstance(source, Mapping):
        try:
            return copy.deepcopy(dict(source))
        except Exception:  # non-copyable values: a shallow copy still protects the top level
            return dict(source)
    if isinstance(source, os.PathLike):
        return _load_file(Path(os.fspath(source)))
    if isinstance(source, bytes):
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("config given as bytes that are not UTF-8 text") from None
    if isinstance(source, str):
        text = source.strip()
        if not text:
            raise ConfigError("config is an empty string; pass a dict, a JSON file path or a JSON string")
        if text.startswith("{"):
            return loads_json(text, "config JSON string")
        if os.path.exists(source):
            return _load_file(Path(source))
        decoded = _try_base64(text)
        if decoded is not None:
            return loads_json(decoded, "base64 config string")
        if text.endswith((".json", ".hjson", ".conf", ".config", ".txt")) or os.sep in text:
            return _load_file(Path(source))  # raises "config file not found"
        raise ConfigError(
            f"cannot read config {short_repr(source)}: it is not an existing file, a JSON object "
            "string or a urlsafe-base64 JSON string"
        )
    raise ConfigError(
        f"config must be a dict, a path to a JSON file, a JSON string or a base64 JSON string; got "
        f"{type(source).__name__}"
    )
