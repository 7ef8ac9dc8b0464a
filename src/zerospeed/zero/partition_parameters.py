"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters` names, at that path (also reachable as
`zerospeed.runtime.zero.partition_parameters`): `ZeroParamStatus`, `Init`, `GatheredParameters`,
`register_external_parameter`, `unregister_external_parameter`."""
from .ds_markers import ZeroParamStatus
from .stage3_context import GatheredParameters, register_external_parameter, unregister_external_parameter
from .stage3_init import Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
