"""ZeRO-3 state dicts that never contain placeholders (DeepSpeed pain point: "saved weights are empty").

Under ZeRO-3 a parameter's `.data` is a 0-element placeholder between uses. Hooks on every module
holding managed parameters make

* `module.state_dict()` (and the engine's) return full clones (in the parameter dtype): the outermost call gathers one
  unit at a time, clones its parameters into the dict and releases it again. It is therefore a
  *collective* (every rank must call it) unless every unit is already gathered - inside
  `GatheredParameters(...)` / `unwrap_for_generation(...)` a single rank may call it;
* `module.load_state_dict(sd)` load full tensors: the outermost call gathers the units involved, the
  normal copy writes into the full buffers, and each rank re-partitions its slice. Collective; every
  rank must load the same values.

`consolidated_state_dict(rank=...)` builds the same dict, optionally only on one rank.
ZeRO, Rajbhandari et al. 2020, §5.3 (parameters partitioned); FSDP2 hooks state_dict similarly.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .stage3_params import ParamStatus


class StateDictHooks:
    """state_dict / load_state_dict hooks for one Stage3Strategy (`strategy.module` and its submodules)."""

    def __init__(self, strategy):
        self.s = strategy
        self._save: list[nn.Module] = []   # modules whose state_dict() is running (outermost first)
        self._load: list[nn.Module] = []
        self._load_taken = None
        self._clone = True
        self._filled: set[str] = set()
        self._hooks = []
        for m in strategy.module.modules():
            if any(strategy.managed(p) is not None for p in m.parameters()):
                # a partial, not a bound method: torch tags post hooks with an attribute
                self._hooks += [m.register_state_dict_pre_hook(self._pre_save),
                                m.register_state_dict_post_hook(functools.partial(StateDictHooks._post_save, self)),
                                m.register_load_state_dict_pre_hook(self._pre_load),
                                m.register_load_state_dict_post_hook(self._post_load)]

    def reset(self) -> None:
        """Forget calls that raised midway (called at every forward)."""
        self._save, self._load = [], []

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _units_under(self, module: nn.Module, prefix: str = "") -> dict[int, list[tuple[str, object]]]:
        by_unit: dict[int, list] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            sp = self.s.managed(p)
            if sp is not None:
                by_unit.setdefault(sp.unit.index, []).append((prefix + name, sp))
        return by_unit

    # -- state_dict -------------------------------------------------------------------------------
    def _pre_save(self, module, prefix, keep_vars) -> None:
        self._save.append(module)

    def _post_save(self, module, state_dict, prefix, local_metadata) -> None:
        if self._save and self._save[-1] is module:
            self._save.pop()
        if self._save:
            return  # an enclosing module's state_dict() fills everything once, at its end
        self._filled = set()
        for index, entries in sorted(self._units_under(module, prefix).items()):
            u = self.s.units[index]
            was_sharded = u.status is ParamStatus.SHARDED
            self.s.scheduler.gather(u)
            for key, sp in entries:
                if key in state_dict:
                    if self._clone:
                        state_dict[key] = sp.view.detach().clone()
                    self._filled.add(key)
            if was_sharded and not u.pins:
                u.release()

    def consolidated(self, *, rank: int | None = None) -> dict[str, torch.Tensor]:
        """Full state dict of the strategy's module: clones of every parameter and buffer. Collective.
        rank: only that (data-parallel) rank builds it, the others return {}."""
        keep = rank is None or rank == self.s.rank
        self._clone = keep
        try:
            sd = self.s.module.state_dict()
        finally:
            self._clone = True
        if not keep:
            return {}
        return {k: v if k in self._filled else v.detach().clone() for k, v in sd.items()}

    # -- load_state_dict --------------------------------------------------------------------------
    def _pre_load(self, module, state_dict, prefix, *rest) -> None:
        if not self._load:
            units = [self.s.units[i] for i in sorted(self._units_under(module))]
            self._load_taken = (units, self.s.pin(units))
        self._load.append(module)

    def _post_load(self, module, incompatible_keys) -> None:
        if self._load and self._load[-1] is module:
            self._load.pop()
        if self._load or self._load_taken is None:
            return
        units, was_sharded = self._load_taken
        self._load_taken = None
        for u in units:
            u.write_back()
        self.s.unpin(units, was_sharded, modifier_rank=None)
