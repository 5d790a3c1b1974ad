"""The documentation as the tests read it: its files, their code blocks, links and headings.

``README.md`` and ``docs/*.md`` are the documentation. ``docs/design.md`` is left out of
the blocks that run and of the commit-hash check (``DOCS``); its links are checked with
the rest (``ALL_DOCS``).

Conventions of the blocks (docs/testing.md says them to readers):

- A ```` ```python ```` block is a whole program and runs as it is, from the repository
  root; a fragment or a signature is a ```` ```text ```` block.
- A block that starts a process group (``init_process_group``, ``init_device_mesh``,
  DeepSpeed's ``init_distributed``) runs under ``torchrun`` on 2 gloo ranks.
- A block whose first line is ``# requires: a, b.c`` needs those modules; every other
  module it imports is the standard library's, torch's or this project's.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL_DOCS = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
DOCS = [path for path in ALL_DOCS if path != "docs/design.md"]
README_MAX_LINES = 350

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
REQUIRES = re.compile(r"#\s*requires:\s*(.+)")
STARTS_A_GROUP = re.compile(r"\b(init_process_group|init_device_mesh|init_distributed)\(")
# A commit hash: a word of 7 to 40 hex digits with at least one digit and one letter.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{7,40}\b")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# What any block may import without saying so.
ALWAYS_THERE = set(sys.stdlib_module_names) | {"torch", "vocab_parallel", "framework_shims"}


def read(path: str) -> str:
    return (ROOT / path).read_text()


def python_blocks(path: str) -> list[str]:
    return PYTHON_BLOCK.findall(read(path))


def all_python_blocks() -> list[tuple[str, int, str]]:
    """``(path, index, code)`` of every Python block of the documentation that runs."""
    return [(path, i, code) for path in DOCS for i, code in enumerate(python_blocks(path))]


def requirements(code: str) -> list[str]:
    """The modules a block's first-line ``# requires:`` names (none without one)."""
    first = code.split("\n", 1)[0]
    match = REQUIRES.fullmatch(first.strip())
    return [name.strip() for name in match.group(1).split(",")] if match else []


def imported_packages(code: str) -> set[str]:
    """The top-level packages a block imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def starts_a_group(code: str) -> bool:
    return STARTS_A_GROUP.search(code) is not None


def prose(text: str) -> str:
    """The text without its fenced code blocks (their ``#`` lines are no headings)."""
    return FENCE.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a file's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(read(path))):
        base = anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: str) -> list[str]:
    """The relative links of a file whose file (or heading, for ``#anchor``) is missing."""
    broken = []
    for target in LINK.findall(prose(read(path))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (ROOT / path).parent / file_part if file_part else ROOT / path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif (
            fragment
            and resolved.suffix == ".md"
            and fragment not in anchors(str(resolved.relative_to(ROOT)))
        ):
            broken.append(f"{target}: no such heading")
    return broken
