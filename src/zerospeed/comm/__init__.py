"""Process groups and collectives (`zerospeed.comm`)."""
from .init import LaunchEnv, default_backend, default_device, init_distributed, read_launch_env
from .logger import CommsLogger, OpStats
from .ops import CommHandle, all_reduce, broadcast, start_all_reduce

__all__ = ["CommHandle", "CommsLogger", "LaunchEnv", "OpStats", "all_reduce", "broadcast", "default_backend",
           "default_device", "init_distributed", "read_launch_env", "start_all_reduce"]
