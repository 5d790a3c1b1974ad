"""DTensor weights (torch-native tensor parallelism): ``weight`` a ``Shard(0)`` DTensor on a
gloo DeviceMesh (DTensor's own uneven chunking, empty chunks included), hidden plain,
``Replicate()`` or sharded over the tokens; against the unsharded float64 reference and
against torch's ``loss_parallel()`` on materialised logits."""

from __future__ import annotations

import pytest
import torch
from helpers import triton_interpreter_cases
from multirank import run_ranks

from vocab_parallel.loss import MODES
from vocab_parallel.testing import DTENSOR_HIDDEN, Case, check_dtensor_case, grid

# Multi-process: out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow


def _check_all(group, jobs, extra=None):
    """The cases on this rank (a 1-D mesh over the group); with ``extra``, also
    ``extra(group)`` (one spawn of the ranks for both: it costs seconds)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(group),))
    results = [check_dtensor_case(case, mesh, hidden_as) for case, hidden_as in jobs]
    return results if extra is None else (results, extra(group))


def _assert_ok(per_rank: list[list[dict]]) -> None:
    bad = [r for rank in per_rank for r in rank if not r["ok"]]
    assert not bad, "mismatches:\n" + "\n".join(str(b) for b in bad[:10])
    assert len({len(rank) for rank in per_rank}) == 1


def _jobs(backend: str = "torch", **shape) -> list[tuple[Case, str]]:
    """Every mode, reduction, smoothing and dtype with a plain hidden; each hidden form on a
    few of them."""
    cases = grid(backends=(backend,), modes=MODES, **shape)
    jobs = [(c, "plain") for c in cases]
    few = [c for c in cases if c.label_smoothing and c.reduction != "sum"]
    jobs += [(c, how) for c in few for how in DTENSOR_HIDDEN if how != "plain"]
    return jobs


def _triton_jobs() -> list:
    """Triton kernels through the interpreter: tiny shapes, a subset."""
    return [(c, "plain") for c in triton_interpreter_cases()]


def test_world_2():
    """V=389: DTensor chunks of 195 and 194 rows; 37 tokens. Also the Triton subset, the
    ColwiseParallel head and torch's loss_parallel() (_colwise)."""
    per_rank = run_ranks(_check_all, 2, _jobs() + _triton_jobs(), _colwise)
    _assert_ok([cases for cases, _ in per_rank])
    _check_colwise([colwise for _, colwise in per_rank])


def test_world_4_with_an_empty_chunk():
    """V=5 on 4 ranks: DTensor's chunks are 2, 2, 1 and 0 rows; V=389: 98, 98, 98, 95."""
    small = [Case(tokens=9, vocab=5, reduction=r, backend="torch") for r in ("none", "mean")]
    jobs = [(c, "plain") for c in small]
    jobs += [(Case(tokens=9, vocab=5, backend="torch", label_smoothing=0.1), "shard_sp")]
    cases = grid(backends=("torch",), modes=MODES, dtypes=("bfloat16",), label_smoothing=(0.1,))
    jobs += [(c, how) for c in cases for how in ("plain", "shard_sp")]
    per_rank = run_ranks(_check_all, 4, jobs)
    _assert_ok(per_rank)
    assert [rank[0]["rows"] for rank in per_rank] == [2, 2, 1, 0]


def _colwise(group):
    """head_from_colwise on a ColwiseParallel projection; torch's loss_parallel() on the
    same projection's logits; the errors that name the offending argument."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    from vocab_parallel import vocab_parallel_linear_cross_entropy
    from vocab_parallel.integrations.torch_tp import head_from_colwise

    world = dist.get_world_size(group)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    H, V = 24, 67
    x, w = torch.randn(2, 9, H, generator=g), torch.randn(V, H, generator=g) / 3
    y = torch.randint(0, V, (2, 9), generator=g)
    y[0, ::4] = -100
    out = {}

    def model(output_layouts=None):
        m = nn.Module()
        m.output = nn.Linear(H, V, bias=False)
        with torch.no_grad():
            m.output.weight.copy_(w)
        style = ColwiseParallel() if output_layouts is None else ColwiseParallel(
            output_layouts=output_layouts, use_local_output=False
        )  # fmt: skip
        return parallelize_module(m, mesh, {"output": style})

    # ours through head_from_colwise: the same parameter, DTensor gradient, full_weight()
    m = model()
    param = m.output.weight
    head = head_from_colwise(m.output, backend="torch")
    out["same_param"] = head.weight is param and dict(head.named_parameters()) == {"weight": param}
    out["full_weight"] = torch.equal(head.full_weight(), w)
    hidden = x.clone().requires_grad_(True)
    loss = head(hidden, y)
    loss.backward()
    out["grad_type"] = (type(param.grad).__name__, tuple(map(repr, param.grad.placements)))

    # the reference, and torch's loss_parallel on materialised logits
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = F.cross_entropy(F.linear(x64, w64).flatten(0, 1), y.flatten())
    ref.backward()
    m2 = model(output_layouts=Shard(-1))
    h2 = distribute_tensor(x.clone(), mesh, [Replicate()]).requires_grad_(True)
    with loss_parallel():
        logits = m2.output(h2)
        tp_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        tp_loss.backward()
    full_grad = param.grad.full_tensor()
    out["vs_ref"] = [
        abs(float(loss.detach()) - float(ref.detach())),
        float((hidden.grad - x64.grad).abs().max()),
        float((full_grad - w64.grad).abs().max()),
    ]
    out["vs_loss_parallel"] = [
        abs(float(loss.detach()) - float(tp_loss.detach().full_tensor())),
        float((hidden.grad - h2.grad.full_tensor()).abs().max()),
        float((full_grad - m2.output.weight.grad.full_tensor()).abs().max()),
    ]
    head.load_full_weight_(2 * w)
    out["load_full_weight"] = torch.equal(param.full_tensor(), 2 * w)

    # sequence-parallel head: this rank's tokens, a Shard(1) DTensor hidden (the output of
    # torchtitan's SequenceParallel norm) and the full labels
    head_sp = head_from_colwise(model().output, backend="torch", sequence_parallel=True)
    hs = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_(True)
    loss_sp = head_sp(hs, y)
    loss_sp.backward()
    out["sp"] = [
        abs(float(loss_sp.detach()) - float(ref.detach())),
        tuple(hs.grad.placements) == (Shard(1),),
        float((hs.grad.full_tensor() - x64.grad).abs().max()),
    ]

    # a projection with a bias: both DTensor parameters, both gradients DTensors
    lin, b = nn.Linear(H, V), torch.randn(V, generator=g)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    lin = parallelize_module(lin, mesh, ColwiseParallel())
    head_b = head_from_colwise(lin, backend="torch")
    hb = x.clone().requires_grad_(True)
    head_b(hb, y).backward()
    b64 = b.double().requires_grad_(True)
    x64b, w64b = x.double().requires_grad_(True), w.double().requires_grad_(True)
    F.cross_entropy(F.linear(x64b, w64b, b64).flatten(0, 1), y.flatten()).backward()
    out["bias"] = [
        head_b.bias is lin.bias and "bias=True" in repr(head_b),
        tuple(lin.bias.grad.placements) == (Shard(0),),
        float((lin.bias.grad.full_tensor() - b64.grad).abs().max()),
        float((hb.grad - x64b.grad).abs().max()),
    ]

    def message(call):
        try:
            call()
        except (TypeError, ValueError) as exc:
            return str(exc)
        return "no error"

    wd = model().output.weight
    out["errors"] = {
        "replicate": message(lambda: vocab_parallel_linear_cross_entropy(
            x, distribute_tensor(w, mesh, [Replicate()]), y
        )),
        "start": message(lambda: vocab_parallel_linear_cross_entropy(
            x, wd, y, vocab_start_index=1
        )),
        "size": message(lambda: vocab_parallel_linear_cross_entropy(
            x, wd, y, global_vocab_size=V + 1
        )),
        "hidden_dim": message(lambda: vocab_parallel_linear_cross_entropy(
            distribute_tensor(x, mesh, [Shard(2)]), wd, y
        )),
        "replicate_sp": message(lambda: vocab_parallel_linear_cross_entropy(
            distribute_tensor(x, mesh, [Replicate()]), wd, y, sequence_parallel=True
        )),
        "bias": message(lambda: vocab_parallel_linear_cross_entropy(
            x, wd, y, bias=distribute_tensor(torch.zeros(V), mesh, [Replicate()])
        )),
        "plain": message(lambda: head_from_colwise(nn.Linear(H, V, bias=False))),
    }  # fmt: skip
    return out


def _check_colwise(per_rank: list[dict]) -> None:
    for r in per_rank:
        assert r["same_param"] and r["full_weight"] and r["load_full_weight"], r
        assert r["grad_type"][0] == "DTensor" and r["grad_type"][1] == ("Shard(dim=0)",), r
        assert max(r["vs_ref"]) < 1e-5, r
        assert max(r["vs_loss_parallel"]) < 1e-5, r
        assert r["sp"][0] < 1e-5 and r["sp"][1] and r["sp"][2] < 1e-5, r
        e = r["errors"]
        assert e["replicate"].startswith("weight: a DTensor placed Replicate()"), e
        assert e["start"].startswith("vocab_start_index: 1, but the DTensor weight says"), e
        assert e["size"].startswith("global_vocab_size: 68"), e
        assert e["hidden_dim"].startswith("hidden: a DTensor placed Shard(dim=2)"), e
        assert e["replicate_sp"].startswith("hidden: a Replicate() DTensor"), e
        assert r["bias"][0] and r["bias"][1] and max(r["bias"][2:]) < 1e-5, r
        assert e["bias"].startswith("bias: a DTensor of shape (67,) placed Replicate()"), e
        assert e["plain"].startswith("linear: expected a module whose weight is a DTensor"), e
