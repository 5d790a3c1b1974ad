"""The layout's rules, checked on the source (no import of the library's internals):
a short top level, no function over 100 lines, one module with every chunk budget, no
import circle (lazy imports included), and the shared keyword documentation filled in."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import vocab_parallel as vp

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "vocab_parallel"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(LIB.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text())
    return out


def test_the_top_level_is_short_and_the_folders_show_the_architecture():
    top = sorted(p.name for p in LIB.glob("*.py"))
    assert len(top) <= 12, top
    for folder in ("engine", "objectives", "parallel", "backends", "integrations"):
        assert (LIB / folder / "__init__.py").is_file(), folder


def test_no_function_over_100_lines():
    long = [
        f"{name}.{n.name}: {n.end_lineno - n.lineno + 1}"
        for name, tree in _modules().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and n.end_lineno - n.lineno + 1 > 100
    ]
    assert not long, long


def test_one_module_holds_every_chunk_budget():
    budget = re.compile(r"^\s*[A-Z_]*(CHUNK|BLOCK|WORKSPACE)[A-Z_]*BYTES\b.*=", re.M)
    holders = [
        str(p.relative_to(ROOT))
        for p in [*LIB.rglob("*.py"), *(ROOT / "kernels" / "src").glob("*.py")]
        if budget.search(p.read_text())
    ]
    assert holders == ["vocab_parallel/engine/memory_policy.py"], holders


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The library's modules ``name`` imports anywhere (lazy imports included)."""
    out = set()
    package = name if name in known and (LIB / "/".join(name.split(".")[1:])).is_dir() else ""
    package = package or name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def test_no_import_circle():
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, tree, known) for name, tree in modules.items()}
    graph = {k: {t for t in v if t != "vocab_parallel"} for k, v in graph.items()}  # the face
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_shared_keyword_documentation_is_filled_in():
    public = (
        vp.vocab_parallel_linear_cross_entropy,
        vp.vocab_parallel_token_stats,
        vp.vocab_parallel_distillation_loss,
    )
    for func in public:
        assert "{shared" not in func.__doc__, func.__name__
        for keyword in ("process_group", "global_vocab_size", "softcap", "check_inputs"):
            assert f"{keyword}: " in func.__doc__, (func.__name__, keyword)
