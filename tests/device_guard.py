"""The device guard of the Triton tests: what a GPU would refuse fails on every machine.

On a GPU a Triton test that builds its inputs on the host fails (the backend refuses CPU
tensors, or Triton cannot read them), and so does one that compares a CUDA result with a
CPU reference without moving one of them. On a machine without a GPU ``helpers.DEVICE``
is the CPU, the same test passes under the interpreter, and the mistake would only show
on the next GPU run. While :func:`guarded` is active (``conftest.py``: every test whose id
says "triton"), :class:`HostTracker` follows where each tensor would be on a GPU machine
and fails the test at the first call that a GPU would refuse:

- a Triton kernel launched on a tensor off ``DEVICE``, or made on the host;
- a torch call given tensors made on the host and tensors on ``DEVICE`` together (the
  0-dim ones aside: torch mixes those with any device), other than the moves
  (``copy_``, ``to``, indexing).

A tensor is *made on the host* when a factory named no device (``torch.randn(n,
generator=g)``) or a host one (``device="cpu"``, ``torch.device("cpu")``, the ``.device``
of a host tensor), when ``.cpu()`` or ``.to(<host>)`` moved it, or when it was computed
from such tensors (a ``Parameter`` of one too); ``device=DEVICE``, ``.to(DEVICE)``,
``device=x.device`` of a ``DEVICE`` tensor ``x`` put it on ``DEVICE``. The mark is an
attribute of the tensor object; as on a GPU, ``.to(DEVICE)`` of a host tensor that does
not require grad is another tensor object (an alias of the same memory here). A tensor
the tracker did not see being made (a gradient that autograd made, a tensor made before
the test) carries no mark and fails nothing: the guard errs on the side of silence; a
failure names the call that a GPU would refuse.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

HOST = "_made_on_the_host"  # the mark: an attribute of the tensor object
NAMES_NONE = object()  # an argument, or a call, that names no device

# Calls that may take tensors of two devices (on a GPU too): moves, indexing, metadata.
_CROSS_DEVICE = {
    torch.Tensor.copy_,
    torch.Tensor.to,
    torch.Tensor.set_,
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.data.__set__,
    torch.Tensor.grad.__set__,
    torch.as_tensor,
    torch.Tensor.new_tensor,
    torch.result_type,
    torch.is_same_size,
    torch._has_compatible_shallow_copy_type,
}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
_DEVICE_OF = torch.Tensor.device.__get__
_SET_DATA = torch.Tensor.data.__set__


def is_host_made(t: torch.Tensor) -> bool:
    return getattr(t, HOST, None) is True


def _mark(t: torch.Tensor) -> bool | None:
    """True: made on the host; False: on DEVICE; None: not seen being made."""
    return getattr(t, HOST, None)


def _combined(marks: set) -> bool | None:
    """The mark of a result of tensors (or devices) marked ``marks``: the host's if any
    is the host's, else DEVICE's if any is DEVICE's, else unknown."""
    return True if True in marks else False if False in marks else None


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class HostTracker(TorchFunctionMode):
    """Marks the tensors made on the host (see the module) and fails a call that mixes them
    with tensors on ``device``."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.devices = {id(device): (device, False)}  # torch.device -> on the host?

    def host_device(self, dev):
        """Whether the device ``dev`` names is the host where ``device`` is not (None: a
        tensor's device that was not seen being made); ``NAMES_NONE`` when ``dev`` is not
        a device (a string, an ordinal or a ``torch.device``)."""
        if isinstance(dev, torch.device):
            if id(dev) in self.devices:  # a tensor's .device, or made during the test
                return self.devices[id(dev)][1]
            return dev.type != self.device.type or dev.type == "cpu"  # made before: CPU
        if isinstance(dev, str):
            return torch.device(dev).type == "cpu" or torch.device(dev).type != self.device.type
        if isinstance(dev, int) and not isinstance(dev, bool):  # a CUDA ordinal
            return self.device.type != "cuda"
        return NAMES_NONE

    def remember(self, devices: list[torch.device], func, args: tuple, kwargs: dict) -> None:
        """Records whether each new ``torch.device`` object names the host: a tensor's
        ``.device`` as the tensor, one made from device names as those names."""
        if func == _DEVICE_OF:
            host = _mark(args[0])
        else:
            named = {self.host_device(a) for a in tree_flatten((args, kwargs))[0]} - {NAMES_NONE}
            host = _combined(named) if named else self.host_device(str(devices[0]))
        for d in devices:
            self.devices.setdefault(id(d), (d, host))

    def destination(self, func, args: tuple, kwargs: dict):
        """Where ``func`` puts its result when it names a device: the host (True), ``device``
        (False), unknown (None); ``NAMES_NONE`` when it names none."""
        if func is torch.Tensor.cpu:
            return True
        if func is torch.Tensor.cuda:
            return False
        if "device" in kwargs:
            return self.host_device(kwargs["device"])
        if func is torch.Tensor.to:
            for a in args[1:2]:
                if isinstance(a, torch.Tensor):  # .to(other): other's device
                    return _mark(a) if a.device.type == self.device.type else True
                return self.host_device(a)
        return NAMES_NONE

    def verdict(self, func, args: tuple, kwargs: dict) -> bool | None:
        """Whether the tensors ``func(*args, **kwargs)`` returns are made on the host
        (None: computed from tensors not seen being made)."""
        where = self.destination(func, args, kwargs)
        if where is not NAMES_NONE:
            return where
        tensors = _tensors((args, kwargs))
        if not tensors:  # a factory that named no device: the host's default
            return True
        return _combined({_mark(t) for t in [t for t in tensors if t.dim() > 0] or tensors})

    def check_mixing(self, func, args: tuple, kwargs: dict) -> None:
        """Fails a call given tensors made on the host and tensors on DEVICE (dims > 0)."""
        if func in _CROSS_DEVICE:
            return
        sized = [t for t in _tensors((args, kwargs)) if t.dim() > 0 and _mark(t) is not None]
        if len({_mark(t) for t in sized}) == 2:
            shapes = [f"{tuple(t.shape)} {'host' if _mark(t) else 'DEVICE'}" for t in sized]
            pytest.fail(
                f"{getattr(func, '__name__', func)} mixes tensors made on the host with tensors"
                f" on DEVICE ({', '.join(shapes)}): on a GPU it fails; move one side (compare"
                " results with .cpu(), make the test's inputs on DEVICE, tests/helpers.py)",
                pytrace=False,
            )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.check_mixing(func, args, kwargs)
        out = func(*args, **kwargs)
        if func == _SET_DATA:  # ``param.data = t`` (Module.to): the tensor takes t's mark
            setattr(args[0], HOST, _mark(args[1]))
            return out
        devices = [d for d in tree_flatten(out)[0] if isinstance(d, torch.device)]
        if devices:  # x.device, torch.device("cpu"), Module.to's parse: remember whose
            self.remember(devices, func, args, kwargs)
        outs = _tensors(out)
        if not outs:
            return out
        host = self.verdict(func, args, kwargs)
        if args and out is args[0]:  # in place, or a move that moved nothing
            if func not in _MOVES or host is None or host == _mark(out):
                return out  # the tensor keeps its mark
            # ``host.to(DEVICE)`` on the CPU is ``host`` itself: an alias takes the new mark
            # (a tensor that requires grad stays itself, a leaf; it takes the mark)
            out = out if out.requires_grad else out.detach()
            outs = [out]
        if host is not None:
            for t in outs:
                with contextlib.suppress(AttributeError, RuntimeError):
                    setattr(t, HOST, host)
        return out


def off_device(names: list[str], args, kwargs, device: torch.device) -> list[str]:
    """The tensor arguments of a launch (``names``: the kernel's parameters) that are not on
    ``device``'s type or were made on the host, each as ``"name (why)"``."""
    bad = []
    for name, a in [*zip(names, args, strict=False), *kwargs.items()]:
        if not isinstance(a, torch.Tensor):
            continue
        if a.device.type != device.type:
            bad.append(f"{name} (on {a.device}, {tuple(a.shape)} {a.dtype})")
        elif is_host_made(a):
            bad.append(f"{name} (made on the host, {tuple(a.shape)} {a.dtype})")
    return bad


def _signature(kernel) -> tuple[str, list[str]]:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", repr(kernel)), list(inspect.signature(fn).parameters)


@contextlib.contextmanager
def guarded(device: torch.device):
    """While active: tensors are followed by a :class:`HostTracker`, and a Triton launch
    (``kernel[grid](...)``) given a tensor off ``device`` or made on the host fails the
    test, naming the kernel and the tensors."""
    from triton.runtime.jit import KernelInterface

    original = KernelInterface.__getitem__

    def launcher(kernel, grid):
        run = original(kernel, grid)

        def checked(*args, **kwargs):
            name, params = _signature(kernel)
            bad = off_device(params, args, kwargs, device)
            if bad:
                pytest.fail(
                    f"{name} launched on tensors off DEVICE ({device}): {', '.join(bad)}; "
                    "make the test's inputs with device=DEVICE or .to(DEVICE) "
                    "(tests/helpers.py)",
                    pytrace=False,
                )
            with torch._C.DisableTorchFunction():  # the launch itself is not the test's
                return run(*args, **kwargs)

        return checked

    def parameter(cls, data=None, requires_grad=True):  # a Parameter takes its data's mark
        p = make_parameter(cls, data, requires_grad)
        if data is not None and is_host_made(data):
            setattr(p, HOST, True)
        return p

    make_parameter = torch.nn.Parameter.__new__
    original_new = vars(torch.nn.Parameter)["__new__"]
    KernelInterface.__getitem__ = launcher
    torch.nn.Parameter.__new__ = staticmethod(parameter)
    try:
        with HostTracker(device):
            yield
    finally:
        KernelInterface.__getitem__ = original
        torch.nn.Parameter.__new__ = original_new
