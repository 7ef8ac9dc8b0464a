"""The `zerospeed` logger: INFO to stderr with the rank, unless the application configured logging."""
from __future__ import annotations

import logging
import os


def setup_logger(level: int = logging.INFO) -> logging.Logger:
    """Give the package logger a stderr handler (once), as DeepSpeed's logger has; returns it.

    Applications that configure logging themselves can remove it: `logging.getLogger("zerospeed").handlers.clear()`.
    """
    logger = logging.getLogger("zerospeed")
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(logging.Formatter(f"[zerospeed rank {rank}] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return logger


def __getattr__(name):  # `from zerospeed.utils.logging import logger`, as DeepSpeed's `deepspeed.utils.logging.logger`
    if name == "logger":
        return setup_logger()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
