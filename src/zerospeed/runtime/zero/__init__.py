"""`zerospeed.runtime.zero`: DeepSpeed's `deepspeed.runtime.zero` path (DeepSpeed's `deepspeed.zero` is the same
package). The code is `zerospeed.zero`; this re-exports its public names."""
from ...zero import *  # noqa: F401,F403
from ...zero import __all__  # noqa: F401
from . import partition_parameters  # noqa: F401
