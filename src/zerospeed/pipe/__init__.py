"""Pipeline parallelism (issue 24), DeepSpeed's `deepspeed.pipe` API: `PipelineModule(layers, num_stages=...)`
of `LayerSpec`s / `TiedLayerSpec`s, split into stages by `partition.py`'s pure partition math; schedules as
data (`schedule.py`: gpipe, one_f_one_b, interleaved_1f1b, zb_h1, zb_v) checked and timed by `simulate.py`.

So far: the module and its partitioning, the schedules and their simulator, and (in `runtime/pipe_engine.py`,
built by `zerospeed.initialize(model=pipeline_module)`) `engine.train_batch(data_iter)` running 1F1B with
ZeRO 0-2 over the data-parallel ranks. Other schedules in the engine, tied layers across stages,
fp16 and pipeline checkpoints in the topology-independent format come next.
`DualPipeVModule` (also in `deepspeed.pipe`) comes with its engine.
"""
from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from .schedule import candidate_schedules, gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_v
# simulate.simulate is not re-exported: the name would shadow the submodule zerospeed.pipe.simulate.
from .simulate import StageTimes, best_schedule, validate

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec",
           "candidate_schedules", "gpipe", "interleaved_1f1b", "one_f_one_b", "zb_h1", "zb_v",
           "StageTimes", "best_schedule", "validate"]
