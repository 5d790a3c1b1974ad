"""Every dotted name of the library that the code's docstrings and comments, the README
and docs/ cite resolves: a module of the library (at its path today, not an old one that
only a DeprecationWarning keeps working) and, after it, attributes that exist."""

from __future__ import annotations

import importlib
import importlib.util
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [  # _moved.py names the old paths on purpose
    *sorted(p for p in (ROOT / "vocab_parallel").rglob("*.py") if p.name != "_moved.py"),
    *sorted((ROOT / "kernels" / "src").glob("*.py")),
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
NAME = re.compile(r"\bvocab_parallel(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _resolves(dotted: str) -> str | None:
    """None when ``dotted`` resolves, else why not."""
    parts = dotted.split(".")
    module, i = None, len(parts)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # an old path does not count
        while i > 0:
            name = ".".join(parts[:i])
            try:
                module = importlib.import_module(name)
                break
            except DeprecationWarning:
                return f"{name} is an old module path"
            except ImportError:
                i -= 1
    obj = module
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            return f"{'.'.join(parts[:i])} has no {attr!r}"
        obj = getattr(obj, attr)
        i += 1
    return None


def _cited() -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    for path in SOURCES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in NAME.finditer(line):
                name = m.group(0).rstrip(".")
                cited.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{n}")
    return cited


def test_every_cited_name_resolves():
    pytest.importorskip("triton")  # vocab_parallel.kernels needs it
    bad = []
    for name, where in sorted(_cited().items()):
        why = _resolves(name)
        if why is not None:
            bad.append(f"{name} ({why}), cited at {', '.join(where[:3])}")
    assert not bad, "\n".join(bad)


def test_the_old_module_paths_still_import_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="vocab_parallel.engine.precision"):
        old = importlib.import_module("vocab_parallel.precision")
    assert old is importlib.import_module("vocab_parallel.engine.precision")
    from vocab_parallel.parallel import init_parallel_groups  # the package re-exports it

    assert callable(init_parallel_groups)
