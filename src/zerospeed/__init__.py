"""zerospeed: a DeepSpeed-compatible distributed training engine for PyTorch.

    engine, optimizer, loader, scheduler = zerospeed.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()
"""
__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import zerospeed` stays cheap for the CLI and forkserver preload
    if name in ("initialize", "add_config_arguments", "ZeroSpeedEngine"):
        from . import runtime

        return getattr(runtime, name)
    if name == "init_distributed":
        from .comm import init_distributed

        return init_distributed
    raise AttributeError(f"module 'zerospeed' has no attribute {name!r}")


__all__ = ["initialize", "add_config_arguments", "init_distributed", "ZeroSpeedEngine", "__version__"]
