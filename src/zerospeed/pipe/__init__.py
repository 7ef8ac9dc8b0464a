"""Pipeline parallelism (issue 24), DeepSpeed's `deepspeed.pipe` API: `PipelineModule(layers, num_stages=...)`
of `LayerSpec`s / `TiedLayerSpec`s, split into stages by `partition.py`'s pure partition math (one chunk of
layers per rank, or several: `chunks=`, `chunk_layout="interleaved" | "v"`); schedules as data (`schedule.py`:
gpipe, one_f_one_b, interleaved_1f1b, zb_h1, zb_v, dualpipev; `build_schedule` by name) checked and timed by
`simulate.py`; activations between stages (`p2p.py`) and the zero-bubble backward split (`backward_split.py`).

`zerospeed.initialize(model=pipeline_module)` builds `runtime/pipe_engine.py`'s engine, whose
`train_batch(data_iter)` runs the configured schedule (`"pipeline": {"schedule": ...}`) with ZeRO 0-2 over the
data-parallel ranks (fp32, bf16, fp16), `eval_batch`, and checkpoints that load at any pipeline size
(`runtime/checkpoint_pipe.py`). `DualPipeVModule` is DeepSpeed's (the V layout, run with "dualpipev").
"""
from .module import DualPipeVModule, LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from .schedule import (build_schedule, candidate_schedules, dualpipev, gpipe, interleaved_1f1b, one_f_one_b, zb_h1,
                       zb_v)
# simulate.simulate is not re-exported: the name would shadow the submodule zerospeed.pipe.simulate.
from .simulate import StageTimes, best_schedule, validate

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec",
           "build_schedule", "candidate_schedules", "dualpipev", "gpipe", "interleaved_1f1b", "one_f_one_b", "zb_h1", "zb_v",
           "StageTimes", "best_schedule", "validate"]
