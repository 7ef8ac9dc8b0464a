"""ZeRO: partitioned data parallelism (Rajbhandari et al. 2020).

Stages 1 and 2 live in stage12*.py, stage 3 in stage3*.py; `build_strategy` (factory.py) picks one.
"""
from . import partition_parameters
from .ds_markers import ZeroParamStatus
from .memory import estimate_model_states_memory
from .stage3 import ParameterNotGatheredError, Stage3Strategy
from .stage3_init import Init, InitParameterError
from .stage3_context import (GatheredParameters, register_external_parameter, unregister_external_parameter,
                             unwrap_for_generation)
from .stage3_params import ParamStatus
from .stage3_units import plan_units
from .tiling import TiledLinear, TiledLinearReturnBias

__all__ = ["estimate_model_states_memory", "Init", "InitParameterError", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "unwrap_for_generation", "ParamStatus", "ParameterNotGatheredError", "Stage3Strategy", "plan_units",
           "TiledLinear", "TiledLinearReturnBias", "ZeroParamStatus", "partition_parameters"]
