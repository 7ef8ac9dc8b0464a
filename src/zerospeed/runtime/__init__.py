"""The engine and `initialize`."""
from ..utils.logging import setup_logger
from .engine import ZeroSpeedEngine
from .initialize import add_config_arguments, initialize
from . import utils  # `zerospeed.runtime.utils.set_random_seed(...)` after `import zerospeed`, as DeepSpeed's

setup_logger()

__all__ = ["ZeroSpeedEngine", "add_config_arguments", "initialize"]
