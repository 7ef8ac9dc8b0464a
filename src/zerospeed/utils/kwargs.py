"""Checking keyword arguments against a callable's signature, with did-you-mean messages."""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable


def check_kwargs(fn: Callable, given: Iterable[str], *, skip: tuple[str, ...], owner: str) -> inspect.Signature:
    """Raise ValueError if a name in `given` is not a keyword parameter of `fn`.

    skip: leading parameters filled by the caller (e.g. "self", "params"). owner: how the message
    names `fn` ("torch.optim.AdamW"). The message names the closest valid parameter and lists
    them all. Returns fn's signature for further checks.
    """
    signature = inspect.signature(fn)
    accepted = [name for name, p in signature.parameters.items()
                if name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in given:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.0)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown parameter {key!r} for {owner}.{hint} Valid parameters: {', '.join(accepted)}")
    return signature


def required_params(signature: inspect.Signature, *, skip: tuple[str, ...]) -> list[str]:
    """Names of `signature`'s keyword-capable parameters that have no default (excluding `skip`)."""
    return [name for name, p in signature.parameters.items()
            if name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is inspect.Parameter.empty]
