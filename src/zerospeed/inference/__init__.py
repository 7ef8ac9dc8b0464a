"""Serving: `zerospeed.init_inference(model, tensor_parallel={"tp_size": N}, dtype=...)` (DeepSpeed's API).

See `engine.py` for what it does in order, `tp.py` for the tensor-parallel sharding (the training AutoTP's)
and `quant.py` for int8 weights.
"""
from .engine import InferenceEngine, init_inference

__all__ = ["init_inference", "InferenceEngine"]
