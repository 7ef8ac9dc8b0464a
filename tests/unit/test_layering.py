"""The import layering of DESIGN.md, enforced by reading the source (ast; nothing is imported).

Every ``import zerospeed...`` / ``from zerospeed... import`` / relative import in every module under
src/zerospeed, at any depth (function-level imports included), is checked against:

* the layers, each importing only itself and layers to its left::

      utils, accelerator <- config <- comm <- parallel <- precision <- offload <- zero <- optim <- ops <- runtime

  DESIGN.md's chain, plus: ``accelerator`` is lowest with ``utils`` (device queries, no zerospeed
  imports); ``parallel`` (the device mesh and its named process groups) sits just above ``comm``;
  ``ops`` is DeepSpeed's ``deepspeed.ops`` path, a thin shim over ``optim`` (FusedAdam = our Adam).
* side packages, which import only themselves and ``utils``/``accelerator``/``comm``, and are
  imported only by ``runtime`` and the tools: DESIGN.md's ``pipe``, ``tensor_parallel``, ``moe``,
  ``checkpointing``, plus the services ``runtime`` calls into (``monitor``, ``profiling``) and
  ``launcher`` (a thin layer over ``torch.distributed.run``).
* tools, which may import anything and are imported by no layer: the package ``__init__``,
  ``cli``, ``testing`` (spawn harness, tiny models, parity helpers), ``demo``, ``autotuning`` and
  ``inference`` (both drive whole engines).

A top-level package or module in none of these tables fails the test: place it here first.
Violations that exist today are listed, with the reason, in ``ALLOWED``; the list may only shrink
(an entry no longer needed fails the test too). A second test asserts the module-level imports
(those run at import time, outside functions and ``if TYPE_CHECKING:``) have no cycles.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "zerospeed"

LAYERS = [{"utils", "accelerator"}, {"config"}, {"comm"}, {"parallel"}, {"precision"}, {"offload"}, {"zero"},
          {"optim"}, {"ops"}, {"runtime"}]
SIDE = {"pipe", "tensor_parallel", "moe", "checkpointing", "monitor", "profiling", "launcher"}
SIDE_MAY_IMPORT = {"utils", "accelerator", "comm"}
# pipe: a pipeline's stages are the mesh's "pipe" dimension, so it reads parallel.topology (rank -> stage).
SIDE_EXTRA = {"pipe": {"parallel"}}
TOOLS = {"__init__", "cli", "testing", "demo", "autotuning", "inference"}
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}

# (importing module, imported module): why it is allowed for now. Only ever remove entries.
ALLOWED = {
    # DeepSpeed's `deepspeed.utils.safe_get_full_fp32_param` & co. live in `deepspeed.utils`, so
    # ours do too (utils/__init__ re-exports them); they read a ZeRO strategy's state through
    # function-level imports. To remove: implement them in zero/ and keep utils/ importing nothing above.
    ("zerospeed.utils.tensor_fragment", "zerospeed.zero.stage3_context"): "deepspeed.utils API path (safe_get_*)",
    ("zerospeed.utils.tensor_fragment", "zerospeed.zero.fragments"): "deepspeed.utils API path (safe_get_*)",
    ("zerospeed.utils.tensor_fragment", "zerospeed.zero.data_parallel"): "deepspeed.utils API path (safe_get_*)",
    ("zerospeed.utils.tensor_fragment", "zerospeed.comm.ops"): "deepspeed.utils API path (safe_get_*)",
    # DeepSpeed's `deepspeed.utils.zero_to_fp32` module path; the code is runtime's `zerospeed to-fp32`.
    ("zerospeed.utils.zero_to_fp32", "zerospeed.runtime.checkpoint_format"): "deepspeed.utils.zero_to_fp32 API path",
    ("zerospeed.utils.zero_to_fp32", "zerospeed.runtime.consolidate"): "deepspeed.utils.zero_to_fp32 API path",
    # retarget() re-registers optim's fused-CPU contiguity guard on the optimizer it re-targets (the
    # masters may live on the host). To remove: runtime calls optim.factory.guard_fused_cpu on
    # strategy.optimizer after building the strategy, and zero/ stops calling it.
    ("zerospeed.zero.param_groups", "zerospeed.optim.factory"): "fused-CPU guard after retarget",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _resolve(base: str, name: str, known: dict[str, Path]) -> str:
    """`from base import name`: the submodule base.name if it exists, else base."""
    return f"{base}.{name}" if f"{base}.{name}" in known else base


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, known: dict[str, Path], *, module_level_only: bool):
    """(imported module, line) for every intra-package import of `module`. module_level_only: skip
    function bodies and `if TYPE_CHECKING:` blocks (what does not run when the module is imported)."""
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if module_level_only and isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit_stmt(stmt)
                continue
            visit_stmt(child)

    def visit_stmt(node):
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_pkg else module.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] == PACKAGE:
                out.extend((_resolve(base, a.name, known), node.lineno) for a in node.names)
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _allowed(src: str, dst: str) -> bool:
    if src == dst or src in TOOLS:
        return True
    if dst in TOOLS:
        return False
    if src == "runtime":
        return True
    if src in SIDE:
        return dst in SIDE_MAY_IMPORT or dst in SIDE_EXTRA.get(src, set())
    return dst in RANK and RANK[dst] <= RANK[src]


def _violations() -> list[tuple[str, str, int]]:
    known = _modules()
    found = []
    for module, path in known.items():
        for target, line in _imports(module, path, known, module_level_only=False):
            if not _allowed(_top(module), _top(target)):
                found.append((module, target, line))
    return found


def test_every_top_level_package_has_a_place_in_the_layering():
    placed = set(RANK) | SIDE | TOOLS
    unplaced = sorted({_top(m) for m in _modules()} - placed)
    assert not unplaced, (f"{unplaced} are in no layer of tests/unit/test_layering.py: add each to LAYERS, SIDE "
                          "or TOOLS (and say why in its docstring)")


def test_imports_follow_the_layering():
    found = _violations()
    new = [f"{path_of(m)}:{line}: {m} imports {t} ({_top(m)} may not import {_top(t)})"
           for m, t, line in found if (m, t) not in ALLOWED]
    assert not new, ("imports against the layering (DESIGN.md; the table is this file's docstring); move the "
                     "code to the right layer or pass the object in as an argument:\n" + "\n".join(new))
    stale = sorted(set(ALLOWED) - {(m, t) for m, t, _ in found})
    assert not stale, f"ALLOWED entries no longer needed (remove them from tests/unit/test_layering.py): {stale}"


def path_of(module: str) -> str:
    return str(_modules()[module].relative_to(SRC.parent))


def test_module_level_imports_have_no_cycles():
    known = _modules()
    graph = {m: sorted({t for t, _ in _imports(m, p, known, module_level_only=True)} - {m}) for m, p in known.items()}
    cycles = _cycles(graph)
    assert not cycles, ("module-level import cycles (move the shared code into a module both import, as "
                        "optim/schedule_base.py); modules importing each other, directly or through the others listed:\n"
                        + "\n".join(", ".join(c) for c in cycles))


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_checker_sees_relative_function_level_and_cyclic_imports(tmp_path):
    """The parser resolves relative and nested imports, and the cycle finder finds a two-module cycle."""
    pkg = tmp_path / "zerospeed" / "zero"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom ..optim.x import y\n\ndef f():\n    import zerospeed.runtime.engine\n")
    known = {"zerospeed.zero": pkg / "__init__.py", "zerospeed.zero.a": pkg / "a.py", "zerospeed.zero.b": pkg / "b.py"}
    every = [t for t, _ in _imports("zerospeed.zero.a", pkg / "a.py", known, module_level_only=False)]
    assert every == ["zerospeed.zero.b", "zerospeed.optim.x", "zerospeed.runtime.engine"]
    assert [_allowed("zero", _top(t)) for t in every] == [True, False, False]
    top = [t for t, _ in _imports("zerospeed.zero.a", pkg / "a.py", known, module_level_only=True)]
    assert top == ["zerospeed.zero.b", "zerospeed.optim.x"]
    assert _cycles({"a": ["b"], "b": ["a", "c"], "c": []}) == [["a", "b"]]
