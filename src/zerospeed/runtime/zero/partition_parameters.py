"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters` path: the names of `zerospeed.zero.partition_parameters`."""
from ...zero.partition_parameters import *  # noqa: F401,F403
from ...zero.partition_parameters import __all__  # noqa: F401
