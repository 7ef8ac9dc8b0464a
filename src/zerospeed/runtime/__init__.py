"""The engine and `initialize`."""
from ..utils.logging import setup_logger
from .engine import ZeroSpeedEngine
from .initialize import add_config_arguments, initialize

setup_logger()

__all__ = ["ZeroSpeedEngine", "add_config_arguments", "initialize"]
