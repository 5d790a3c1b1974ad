"""Packaging: the wheel holds the library alone and needs torch alone.

The wheel is built from a copy of the repository (what a clean checkout holds: the paths
``.gitignore`` names are left out) so that the build writes no ``build/`` or ``*.egg-info``
into the working tree, and no stale ``build/lib`` from an earlier build leaks into it.
"""

from __future__ import annotations

import ast
import email.parser
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vocab_parallel"
# The applications and their helpers stay out of the library.
NOT_LIBRARY = {"gpt.py", "data.py", "training.py", "memory.py"}
APP_DIRS = ("launch", "benchmarks")
# What the library must import without: the train/test extras, Triton and DeepSpeed.
OPTIONAL = ("numpy", "yaml", "triton", "deepspeed", "tokenizers", "tqdm", "matplotlib")


def _ignored_names() -> list[str]:
    """``.gitignore``'s patterns (as plain name globs) and ``.git``."""
    patterns = [".git"]
    gitignore = ROOT / ".gitignore"
    if gitignore.exists():
        for line in gitignore.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "!")):
                patterns.append(line.strip("/"))
    return patterns


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*_ignored_names()))
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "--quiet", "-w", str(out), str(src)]
    env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout}\n{done.stderr}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_wheel_holds_the_library(wheel):
    names = set(_names(wheel))
    assert f"{PACKAGE}/__init__.py" in names
    # Every module of the kernels (kernels/src/, installed as vocab_parallel.kernels)
    # and of the integrations.
    for src_dir, dest in (
        (ROOT / "kernels" / "src", f"{PACKAGE}/kernels"),
        (ROOT / PACKAGE / "integrations", f"{PACKAGE}/integrations"),
    ):
        expected = {f"{dest}/{p.name}" for p in src_dir.glob("*.py")}
        assert f"{dest}/__init__.py" in expected, f"{src_dir} is not a package"
        assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"


def test_wheel_holds_nothing_but_the_library(wheel):
    names = _names(wheel)
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and top - dist_info == {PACKAGE}, sorted(top)
    # A module of launch/ or benchmarks/ copied into the package: same bytes.
    app_files = {p.read_bytes() for d in APP_DIRS for p in (ROOT / d).glob("*.py")}
    app_files.discard(b"")
    with zipfile.ZipFile(wheel) as zf:
        unwanted = [
            n for n in names if n.rsplit("/", 1)[-1] in NOT_LIBRARY or zf.read(n) in app_files
        ]
    assert not unwanted, f"not library code, but in the wheel: {unwanted}"


def test_wheel_requires_torch_alone(wheel):
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(meta).decode()
    requires = email.parser.Parser().parsestr(text).get_all("Requires-Dist") or []
    unconditional = [r for r in requires if not re.search(r"\bextra\s*==", r)]
    names = [re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in unconditional]
    assert names == ["torch"], requires


def test_the_checkout_never_shadows_a_top_level_kernels(tmp_path):
    """``import kernels`` from a checkout's root gets the installed ``kernels``, not ours.

    The name is Hugging Face's distribution, which transformers imports; a ``kernels/``
    regular package at the repository root would shadow it whenever the root is on
    ``sys.path`` (kernels/README.md). A stand-in distribution placed *after* the root on
    ``sys.path`` (or the real one, where installed) must still win, and our kernels stay
    importable by their own name.
    """
    assert not (ROOT / "kernels" / "__init__.py").exists()
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path[:] = [{str(ROOT)!r}] + sys.path + [{str(other.parent)!r}]
        import kernels
        # The stand-in, or the real distribution where one is installed: a regular
        # package either way, never a folder of this checkout.
        assert kernels.__file__ is not None, kernels
        assert not kernels.__file__.startswith({str(ROOT / "kernels")!r}), kernels
        from vocab_parallel.kernels import backward, common, forward
        assert forward.__name__ == "vocab_parallel.kernels.forward"
        """
    )
    env = os.environ | {"TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr


def _imports(path: Path) -> list[tuple[int, str, int]]:
    """``(line, module, level)`` of every import in ``path`` (lazy ones too); ``level`` is
    the relative import's (0: absolute)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or "", node.level))
    return found


def test_the_kernels_import_nothing_of_the_library():
    """kernels/src/ holds Triton kernels only: they import triton, torch, the standard
    library and each other (relative imports, inside the package), never the library
    above them, whose Triton backend (``vocab_parallel.backends.triton_backend``) launches them."""
    allowed = {"triton", "torch", *sys.stdlib_module_names}
    modules = sorted((ROOT / "kernels" / "src").glob("*.py"))
    assert {p.name for p in modules} >= {"common.py", "forward.py", "backward.py"}
    bad = [
        f"{path.name}:{line}: {'.' * level}{module}"
        for path in modules
        for line, module, level in _imports(path)
        if level > 1 or (level == 0 and module.split(".")[0] not in allowed)
    ]
    assert not bad, f"kernels/src imports outside triton, torch and itself: {bad}"


def _name_comparisons(path: Path, names: set[str]) -> list[int]:
    """Lines of ``path`` that compare a value with one of ``names`` (``==``, ``!=``,
    ``in``/``not in`` a literal collection of them, ``match`` cases)."""

    def literal(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(literal(e) for e in node.elts)
        return False

    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            continue
        if any(map(literal, operands)):
            lines.append(node.lineno)
    return lines


def test_only_the_registry_compares_backend_names():
    """Backends implement the interface's primitives (``vocab_parallel.backends.interface``);
    which one runs is the registry's business (``backends/registry.py``, with the options' list of
    names): nothing else asks for a backend by comparing its name."""
    registry = {ROOT / PACKAGE / "backends" / "registry.py", ROOT / PACKAGE / "options.py"}
    names = {"torch", "triton"}
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / PACKAGE).rglob("*.py"))
        if path not in registry and "kernels" not in path.relative_to(ROOT / PACKAGE).parts
        for line in _name_comparisons(path, names)
    ]
    assert not found, f"backend names compared outside the registry: {found}"


@pytest.mark.slow
def test_imports_and_trains_without_the_optional_packages(wheel, tmp_path):
    """From the unpacked wheel, with every optional package unimportable.

    torch itself imports without numpy (it warns that NumPy is unavailable), so numpy is
    blocked too.
    """
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = textwrap.dedent(
        f"""
        import sys

        BLOCKED = {OPTIONAL!r}
        for name in BLOCKED:
            sys.modules[name] = None  # "import name" now raises ImportError

        import torch
        import torch.nn.functional as F

        import vocab_parallel as vp

        assert vp.__file__.startswith({str(site)!r}), vp.__file__
        assert vp.shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
        assert issubclass(vp.VocabParallelLMHead, torch.nn.Module)

        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
        weight = torch.randn(13, 8, generator=g, requires_grad=True)
        target = torch.randint(0, 13, (2, 5), generator=g)
        loss = vp.vocab_parallel_linear_cross_entropy(hidden, weight, target, backend="torch")
        loss.backward()
        ref = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), target.flatten())
        torch.testing.assert_close(loss, ref)
        assert hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0

        head = vp.VocabParallelLMHead(hidden_size=8, vocab_size=13, backend="torch")
        head(hidden.detach(), target).backward()
        assert head.weight.grad is not None

        still_blocked = [n for n in BLOCKED if sys.modules.get(n, None) is not None]
        assert not still_blocked, still_blocked
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
