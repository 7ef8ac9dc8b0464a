"""Pipeline parallelism (issue 24), DeepSpeed's `deepspeed.pipe` API: `PipelineModule(layers, num_stages=...)`
of `LayerSpec`s / `TiedLayerSpec`s, split into stages by `partition.py`'s pure partition math; schedules as
data (`schedule.py`: gpipe, one_f_one_b, interleaved_1f1b, zb_h1, zb_v) checked and timed by `simulate.py`.

So far: the module and its partitioning, the schedules and their simulator (one process, no engine, no
communication). The engine, point-to-point activations and the tied-gradient all-reduce come next.
`DualPipeVModule` (also in `deepspeed.pipe`) comes with its engine.
"""
from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from .schedule import candidate_schedules, gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_v
# simulate.simulate is not re-exported: the name would shadow the submodule zerospeed.pipe.simulate.
from .simulate import StageTimes, best_schedule, validate

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec",
           "candidate_schedules", "gpipe", "interleaved_1f1b", "one_f_one_b", "zb_h1", "zb_v",
           "StageTimes", "best_schedule", "validate"]
