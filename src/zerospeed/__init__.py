"""zerospeed: a DeepSpeed-compatible distributed training engine for PyTorch.

    engine, optimizer, loader, scheduler = zerospeed.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()
"""
__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import zerospeed` stays cheap for the CLI and forkserver preload
    if name in ("initialize", "add_config_arguments", "ZeroSpeedEngine"):
        from . import runtime

        return getattr(runtime, name)
    if name == "tp_model_init":  # `zerospeed.tp_model_init(model, tp_size, dtype)` as `deepspeed.tp_model_init`
        from .runtime.tp_init import tp_model_init

        return tp_model_init
    if name in ("init_inference", "InferenceEngine"):  # `zerospeed.init_inference(model, ...)` as DeepSpeed's
        from . import inference

        return getattr(inference, name)
    if name == "init_distributed":
        from .comm import init_distributed

        return init_distributed
    if name == "OnDevice":  # `with zerospeed.OnDevice(dtype, device="meta"):` as `deepspeed.OnDevice`
        from .utils.init_on_device import OnDevice

        return OnDevice
    if name == "get_accelerator":  # `zerospeed.get_accelerator()` as `deepspeed.get_accelerator()`
        from .accelerator import get_accelerator

        return get_accelerator
    if name in _SUBPACKAGES:  # `zerospeed.zero.Init()` as `deepspeed.zero.Init()`, without an import first
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'zerospeed' has no attribute {name!r}")


_SUBPACKAGES = ("accelerator", "zero", "checkpointing", "comm", "config", "offload", "profiling", "monitor", "runtime",
                "testing", "inference", "pipe", "moe", "utils", "ops")


__all__ = ["initialize", "add_config_arguments", "init_distributed", "tp_model_init", "init_inference",
           "InferenceEngine", "ZeroSpeedEngine", "OnDevice", "__version__"]
