"""The modules' old import paths, kept working with a ``DeprecationWarning``.

``vocab_parallel`` was one flat folder; its modules now live in subpackages that show the
architecture (``docs/design.md``, "Layout"). ``import vocab_parallel.precision`` (and every
other old spelling) still works: a finder on ``sys.meta_path`` hands out the module at its
new path, under the old name too, and warns once per name which path to use instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old name (vocab_parallel.<old>) -> new module path
MOVED = {
    "entry": "engine.entry",
    "autograd": "engine.autograd",
    "grad_in_forward": "engine.grad_in_forward",
    "chunking": "engine.chunking",
    "filtering": "engine.filtering",
    "precision": "engine.precision",
    "reduction": "engine.reduction",
    "stats": "objectives.cross_entropy",
    "topk": "objectives.topk",
    "distill_stats": "objectives.distill",
    "agreement": "parallel.agreement",
    "checks": "parallel.checks",
    "distributed": "parallel.collectives",
    "dtensor": "parallel.dtensor",
    "layout": "parallel.layout",
    "sequence_parallel": "parallel.sequence_parallel",
    "sharded": "parallel.sharded",
    "backend": "backends.registry",
    "interface": "backends.interface",
    "torch_backend": "backends.torch_backend",
    "triton_backend": "backends.triton_backend",
    "memory": "engine.memory_policy",
    "objective": "engine.objective",
}
PACKAGE = __name__.rpartition(".")[0]


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)  # the one module object, shared

    def exec_module(self, module):
        pass


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds ``vocab_parallel.<old>`` for each entry of :data:`MOVED`."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, old = fullname.rpartition(".")
        if head != PACKAGE or old not in MOVED:
            return None
        new = f"{PACKAGE}.{MOVED[old]}"
        warnings.warn(
            f"{fullname} moved to {new}; import it from there",
            DeprecationWarning,
            stacklevel=3,
        )
        return importlib.util.spec_from_loader(fullname, _Loader(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
