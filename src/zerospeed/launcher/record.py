"""Each rank's entry point under ``zerospeed launch``: run the user's script as ``python`` would, and
hand an uncaught exception to the launcher instead of printing it on every rank.

    python -u -m zerospeed.launcher.record [--module] SCRIPT_OR_MODULE [ARGS...]

This is torch.distributed.elastic's ``@record`` applied to a script the user did not decorate: the
exception (type, message and traceback, trimmed to the user's frames) goes to the JSON error file
torchrun's agent names in ``TORCHELASTIC_ERROR_FILE``, the one the agent reads back into
``ChildFailedError.failures[rank].message``. ``zerospeed launch`` then prints one rank-tagged
summary. The rank exits with code 1 without printing its traceback; without
``TORCHELASTIC_ERROR_FILE`` (not under torchrun) the exception propagates as usual.

Semantics kept from ``python SCRIPT`` / ``python -m MODULE``: ``__name__ == "__main__"``,
``sys.argv``, ``sys.path[0]`` (the script's directory, or the working directory for a module), and
``SystemExit`` / ``KeyboardInterrupt`` pass through untouched (their exit codes are the rank's).
"""
from __future__ import annotations

import os
import runpy
import sys

__all__ = ["main", "run_recorded"]

_OWN_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}


def _user_traceback(tb):
    """Skip the leading frames of this wrapper and of runpy (the user's frames remain)."""
    def own(name: str) -> bool:
        return name in _OWN_FILES or (not name.startswith("<") and os.path.abspath(name) in _OWN_FILES)

    while tb is not None and tb.tb_next is not None and own(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _run_script(path: str) -> None:
    """``python PATH`` in this interpreter: a fresh ``__main__`` module with an absolute ``__file__``,
    ``sys.argv[0]`` left as given (``runpy.run_path`` would replace it with its argument)."""
    import builtins
    import io
    import types
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(path)
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __loader__=SourceFileLoader("__main__", path),
                         __spec__=None, __cached__=None, __package__=None)
    sys.modules["__main__"] = main  # pickling and multiprocessing find the script's definitions here
    exec(code, main.__dict__)


def run_recorded(target: str, args: list[str], *, module: bool = False) -> int:
    """Run ``target`` (a script path, or a module name when ``module``) with ``args`` as its argv.

    Returns 0 when it finishes, 1 after recording an uncaught exception in the torchelastic error
    file. Raises SystemExit / KeyboardInterrupt as the script does, and the exception itself when
    no error file is configured.
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()  # what @record does first (faulthandler for hard crashes)
    sys.argv = [target, *args]  # for a module, runpy replaces argv[0] with the module's file
    if not module:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` does
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            _run_script(target)
    except Exception as exc:
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            raise
        exc.__traceback__ = _user_traceback(exc.__traceback__)
        # record_exception formats sys.exc_info(), which is this exception with the trimmed traceback
        # on Python >= 3.11 (3.10 still shows the two wrapper frames above the user's)
        handler.record_exception(exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] == "--module"
    if module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m zerospeed.launcher.record [--module] SCRIPT_OR_MODULE [ARGS...]", file=sys.stderr)
        return 2
    return run_recorded(argv[0], argv[1:], module=module)


if __name__ == "__main__":
    sys.exit(main())
