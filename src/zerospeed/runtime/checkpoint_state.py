"""The non-tensor-heavy part of a checkpoint: engine counters, LR scheduler, optimizer hyper-parameters,
loss scaler, data-loader position, client_state (-> engine_state.json) and every rank's RNG states
(-> that rank's safetensors file). Exact resume needs all of them.
"""
from __future__ import annotations

import json
import logging
import random
import sys
from typing import Any, Callable

import torch

from ..checkpointing.rng import get_rng_tracker
from .checkpoint_io import decode_json, encode_json

log = logging.getLogger(__name__)

RNG_META = "zerospeed.rng"  # key of the RNG metadata (JSON) in a rank file's __metadata__


# -- RNG -------------------------------------------------------------------------------------------------
def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's generator states: (tensors for its rank file, {RNG_META: JSON metadata}).

    torch host generator ("rng/torch", uint8), the accelerator's if any ("rng/accelerator"), Python's
    `random` ("rng/python", int64 [625]), numpy's legacy global generator if numpy is imported
    ("rng/numpy", int64 [624]) and the model-parallel tracker's streams ("rng/tracker/<name>")."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.accelerator.is_available():
        mod = torch.get_device_module(torch.accelerator.current_accelerator())
        tensors["rng/accelerator"] = mod.get_rng_state()
    version, internal, gauss = random.getstate()
    tensors["rng/python"] = torch.tensor(internal, dtype=torch.int64)
    meta: dict[str, Any] = {"python": {"version": version, "gauss_next": gauss}}
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state(legacy=True)
        tensors["rng/numpy"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    for name, state in get_rng_tracker().get_states().items():
        tensors[f"rng/tracker/{name}"] = state
    meta["tracker"] = sorted(get_rng_tracker().get_states())
    return tensors, {RNG_META: json.dumps(meta)}


def restore_rng(read: Callable[[str], torch.Tensor], keys: set[str], metadata: dict[str, str]) -> None:
    """Set every generator captured by `capture_rng`; read(key) returns a tensor of this rank's file,
    `keys` are the keys it has."""
    meta = json.loads(metadata[RNG_META])
    torch.set_rng_state(read("rng/torch"))
    if torch.accelerator.is_available() and "rng/accelerator" in keys:
        torch.get_device_module(torch.accelerator.current_accelerator()).set_rng_state(read("rng/accelerator"))
    py = meta["python"]
    random.setstate((py["version"], tuple(read("rng/python").tolist()), py["gauss_next"]))
    if "numpy" in meta and "numpy" in sys.modules:
        np, m = sys.modules["numpy"], meta["numpy"]
        keys = read("rng/numpy").numpy().astype(np.uint32)
        np.random.set_state((m["kind"], keys, m["pos"], m["has_gauss"], m["cached_gaussian"]))
    if meta.get("tracker"):
        get_rng_tracker().set_states({name: read(f"rng/tracker/{name}") for name in meta["tracker"]})


# -- engine_state.json -------------------------------------------------------------------------------------
def _sampler(engine):
    loader = getattr(engine, "training_dataloader", None)
    sampler = getattr(loader, "sampler", None)
    return sampler if hasattr(sampler, "state_dict") and hasattr(sampler, "load_state_dict") else None


def _loss_scaler(engine):
    scaler = getattr(engine, "loss_scaler", None)
    return scaler if hasattr(scaler, "state_dict") else None


def engine_state_precision(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def engine_state(engine, client_state: dict | None, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """engine_state.json's content; tensors found anywhere are moved into `tensors` ("state/<n>").

    Raises TypeError naming the key of anything that is neither a JSON value nor a tensor (in
    client_state, the scheduler's or the loss scaler's state): objects are never pickled."""
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}")

    def enc(value, path):
        return encode_json(value, tensors, prefix="state", path=path)

    opt, sched, scaler, sampler = engine.optimizer, engine.lr_scheduler, _loss_scaler(engine), _sampler(engine)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] if opt is not None else None
    return {
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
        "dp_world_size": engine.dp_world_size, "zero_stage": engine.zero_optimization_stage(),
        "train_batch_size": engine.train_batch_size(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "precision": engine_state_precision(engine),
        "optimizer_class": type(opt).__name__ if opt is not None else None,
        "optimizer_param_groups": enc(groups, "optimizer.param_groups"),
        "optimizer_param_group_names": getattr(engine, "param_group_names", None),
        "lr_scheduler": enc(sched.state_dict(), "lr_scheduler.state_dict()") if sched is not None else None,
        "loss_scaler": enc(scaler.state_dict(), "loss_scaler.state_dict()") if scaler is not None else None,
        "data_loader": enc(sampler.state_dict(), "data_loader.sampler") if sampler is not None else None,
        "client_state": enc(client_state or {}, "client_state"),
    }


def check_group_members(saved: list[list[str]] | None, ours: list[list[str]] | None) -> None:
    """Raise ValueError unless every parameter both the checkpoint and the engine have is in the same
    optimizer param group in both (parameters only on one side are for `load_module_strict` to judge).
    None on either side (a checkpoint from before groups were recorded, no optimizer): no check."""
    if saved is None or ours is None:
        return
    if len(saved) != len(ours):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} param groups, the engine's {len(ours)}; build "
                         "the optimizer with the same groups, or pass load_optimizer_states=False")
    then = {n: g for g, names in enumerate(saved) for n in names}
    moved = [(n, then[n], g) for g, names in enumerate(ours) for n in names if n in then and then[n] != g]
    if moved:
        desc = ", ".join(f"{n} (checkpoint: group {a}, engine: group {b})" for n, a, b in moved[:3])
        raise ValueError(f"{len(moved)} parameter(s) are in another optimizer param group than in the checkpoint, e.g. "
                         f"{desc}; build the optimizer with the same groups, or pass load_optimizer_states=False")


def _restore_groups(opt, saved: list[dict]) -> None:
    if len(saved) != len(opt.param_groups):
        raise ValueError(f"the checkpoint has {len(saved)} optimizer param groups, the engine's optimizer "
                         f"{len(opt.param_groups)}; pass load_optimizer_states=False")
    for group, values in zip(opt.param_groups, saved):
        for k, v in values.items():
            if torch.is_tensor(group.get(k)):
                group[k].copy_(v) if torch.is_tensor(v) else group[k].fill_(v)
            else:
                group[k] = v


def restore_engine_state(engine, state: dict[str, Any], get_tensor: Callable[[str], torch.Tensor], *,
                         load_optimizer_states: bool, load_lr_scheduler_states: bool) -> dict:
    """Counters, optimizer hyper-parameters (the LR the scheduler last wrote included), LR scheduler,
    loss scaler and data-loader position from engine_state.json. Returns the decoded client_state."""
    dec = lambda v: decode_json(v, get_tensor)  # noqa: E731
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]
    if state["gradient_accumulation_steps"] == engine.gradient_accumulation_steps():
        engine.micro_steps = state["micro_steps"]
    else:
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    if load_optimizer_states and engine.optimizer is not None and state.get("optimizer_param_groups") is not None:
        _restore_groups(engine.optimizer, dec(state["optimizer_param_groups"]))
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(dec(state["lr_scheduler"]))
    scaler = _loss_scaler(engine)
    same_precision = state.get("precision") == engine_state_precision(engine)
    if scaler is not None and state.get("loss_scaler") is not None and same_precision:
        scaler.load_state_dict(dec(state["loss_scaler"]))
    sampler = _sampler(engine)
    if sampler is not None and state.get("data_loader") is not None:
        sampler.load_state_dict(dec(state["data_loader"]))
    return dec(state["client_state"])
