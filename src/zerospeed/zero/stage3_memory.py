"""What a ZeRO-3 rank holds now, by model-state kind (`Stage3Strategy.memory_breakdown`)."""
from __future__ import annotations

from .strategy import _optimizer_state_bytes

__all__ = ["memory_breakdown"]


def memory_breakdown(s) -> dict[str, int]:
    """Bytes this rank holds now. params: shards in the parameter dtype + gathered full buffers +
    frozen parameters; grads: shard gradients (fp32, or the 2-byte reduced ones not yet converted)
    + full gradients not yet reduced; master_weights: the fp32 shards under mixed precision (0 in
    fp32, where they are the parameter shards). After backward in fp32 ≈ 4Ψ/N + 4Ψ/N (+ padding),
    plus Adam's 8Ψ/N in optimizer_states (ZeRO, Rajbhandari et al. 2020, §5.3); under bf16/fp16
    2Ψ/N + 2Ψ/N + 8Ψ/N + 4Ψ/N (4Ψ/N gradients with accumulation); no gradients after the step."""
    params = sum(u.shard_bytes() + u.gathered_bytes() for u in s.units)
    params += sum(p.numel() * p.element_size() for p in s._frozen)
    grads = sum(g.numel() * g.element_size() for u in s.units for g in (u.shard.grad, u.lp_grad)
                if g is not None)
    grads += sum(sp.param.grad.numel() * sp.param.grad.element_size() for u in s.units for sp in u.params
                 if sp.param.grad is not None)
    if s.grad_store is not None:  # NVMe: only the gradients still being written are in memory
        grads += s.grad_store.inflight_bytes()
    masters = sum(u.shard.untyped_storage().nbytes() for u in s.units if u.has_master)
    states = _optimizer_state_bytes(s.optimizer)
    if s.swapped is not None:  # NVMe: only the tile buffers are in memory (counted as states)
        states = s.swapped.resident_bytes()
        if s._backward_steps is not None:
            states += s._backward_steps.resident_bytes()
    if s.param_swapper is not None:  # the shard read buffers (shards kept in RAM are counted above)
        params += s.param_swapper.pool.nbytes
    return {"params": params, "grads": grads, "optimizer_states": states, "master_weights": masters}
