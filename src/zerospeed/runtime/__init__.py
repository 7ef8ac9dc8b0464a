"""The engine and `initialize`."""
from .engine import ZeroSpeedEngine
from .initialize import add_config_arguments, initialize

__all__ = ["ZeroSpeedEngine", "add_config_arguments", "initialize"]
