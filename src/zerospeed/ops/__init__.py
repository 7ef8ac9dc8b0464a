"""DeepSpeed's `deepspeed.ops` optimizer names, so `from deepspeed.ops.adam import FusedAdam` needs only
its import line changed:

    from zerospeed.ops.adam import FusedAdam, DeepSpeedCPUAdam   # torch.optim.Adam (fused kernel where torch has one)
    from zerospeed.ops.lamb import FusedLamb                     # zerospeed.optim.Lamb
    from zerospeed.ops.lion import FusedLion, DeepSpeedCPULion   # zerospeed.optim.Lion

Same constructor signatures and defaults as DeepSpeed's; no custom kernels are built.
"""
