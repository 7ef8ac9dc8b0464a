"""DeepSpeed hostfile parsing: one ``hostname slots=N`` line per node.

The format is DeepSpeed's (``deepspeed/launcher/runner.py::_parse_hostfile``)::

    # comment lines and blank lines are skipped
    worker-0 slots=4
    worker-1 slots=4   # a trailing comment is allowed too

Parsing is pure (text in, mapping out) so it is unit-tested without touching a cluster.
"""
from __future__ import annotations

import os
import re

__all__ = ["parse_hostfile", "parse_hostfile_text"]

_LINE = re.compile(r"(?P<host>\S+)\s+slots=(?P<slots>[+-]?\d+)")


def parse_hostfile_text(text: str, *, source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile contents into ``{hostname: slots}`` in file order.

    Args:
        text: the hostfile's contents. Each meaningful line is ``hostname slots=N``; ``#`` starts a
            comment (whole line or trailing), blank lines are skipped, surrounding whitespace is ignored.
        source: name used in error messages (normally the file path).

    Returns:
        An insertion-ordered dict mapping each host to its positive slot count.

    Raises:
        ValueError: on a line that is not ``hostname slots=N``, a slot count that is not a positive
            integer, a host listed twice, or a file with no host lines at all. The message names
            ``source``, the 1-based line number and the offending text.
    """
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise ValueError(
                f"{source}:{lineno}: expected 'hostname slots=N', got {raw.strip()!r}"
            )
        host, slots = match["host"], int(match["slots"])
        if slots <= 0:
            raise ValueError(
                f"{source}:{lineno}: slot count must be a positive integer, got slots={slots} "
                f"in {raw.strip()!r}"
            )
        if host in hosts:
            raise ValueError(
                f"{source}:{lineno}: host {host!r} is listed twice (first on line "
                f"{first_line[host]}): {raw.strip()!r}"
            )
        hosts[host] = slots
        first_line[host] = lineno
    if not hosts:
        nlines = len(text.splitlines())
        raise ValueError(
            f"{source}: hostfile is empty ({nlines} line(s), none of the form 'hostname slots=N')"
        )
    return hosts


def parse_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Read a DeepSpeed hostfile and return ``{hostname: slots}`` in file order.

    Args:
        path: path of the hostfile (``hostname slots=N`` per line, ``#`` comments, blank lines).

    Returns:
        An insertion-ordered dict mapping each host to its positive slot count; the first host is
        the one the launcher uses as the default master address.

    Raises:
        FileNotFoundError: if ``path`` does not exist (the message names the path).
        ValueError: for a malformed line, a non-positive slot count, a duplicate host or an empty
            file; see :func:`parse_hostfile_text`. The message names the file and line.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"hostfile {path!r} not found; write one 'hostname slots=N' line per node, "
            f"or drop --hostfile to run on this machine only"
        ) from None
    return parse_hostfile_text(text, source=path)
