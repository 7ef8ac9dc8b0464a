"""`RepeatingLoader`, as DeepSpeed's `deepspeed.utils.RepeatingLoader`."""


class RepeatingLoader:
    """An iterator over `loader` that starts it again when it runs out, so `next()` never raises
    StopIteration (unless `loader` yields nothing at all). DeepSpeed's `deepspeed.utils.RepeatingLoader`
    (`deepspeed/runtime/dataloader.py`), for `engine.train_batch()` loops that outlive an epoch.

    A `loader` with a sampler that has `set_epoch` (the engine's) is not moved to a new epoch here, as in
    DeepSpeed: every pass gives the same order unless the caller sets the epoch.
    """

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
