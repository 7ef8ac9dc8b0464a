"""Pipeline stages in the topology-independent checkpoint format.

Parameter names of a `PipelineModule` are global (DeepSpeed's: `"<layer index>.<param>"`,
`"tied_modules.<key>.<param>"`), whatever the pipeline size. So every rank of the world writes the fragments it
owns of its own stage's parameters into one checkpoint (no `mp_rank_XX` directories), a weight tied across
stages only from the first rank holding it (each element once), and a rank loads its own parameters by name:
a run saved at one pipeline x data size resumes at any other, and `zerospeed to-fp32` reads it as any
checkpoint. The translation protocol is `runtime.checkpoint_tp.TPTranslation`'s (`full_shape`, `frags`), plus
`owns(name)`: which checkpoint entries belong to this rank's layers (the others are other stages', not
unexpected).
"""
from __future__ import annotations

__all__ = ["PipeTranslation"]


class PipeTranslation:
    """Checkpoint translation of one pipeline rank's stage(s). module: the PipelineModule; ties: its
    `runtime.pipe_ties.TiedWeights` (or None)."""

    def __init__(self, module, ties=None):
        names = {id(p): n for n, p in module.named_parameters()}
        self.not_written = frozenset(names[i] for i in (ties.owned_elsewhere() if ties else ()))
        self.layers = frozenset(module._func_layer)  # the global layer indices this rank runs
        self.tie_keys = frozenset(module.tied_modules)

    def full_shape(self, name: str, shape) -> tuple:
        return tuple(shape)

    def frags(self, frags, *, load: bool):
        """On save, drop the tied weights another rank writes; on load, keep everything."""
        return frags if load else [f for f in frags if f[0].name not in self.not_written]

    def owns(self, name: str) -> bool:
        """Whether checkpoint entry `name` belongs to this rank's layers (a layer index or a tie it holds)."""
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            return rest.partition(".")[0] in self.tie_keys
        return not head.isdigit() or int(head) in self.layers
