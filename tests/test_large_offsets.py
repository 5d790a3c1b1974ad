"""Address offsets past 2^31 in every Triton kernel, under the interpreter.

Triton passes an int argument below 2^31 as i32 and ``program_id``/``arange`` are i32, so
``rows * stride`` computed in i32 wraps once an offset passes 2^31 elements: a saved fp32
softmax of Llama-3's 128,256 columns does from BT = 16,744 (TP 1, high-performance mode),
a weight shard from V_local x H = 2^31.

Materialising such tensors is out of reach in CI, so each case builds a small view with a
huge row stride over a huge ``torch.empty`` buffer: only the pages the view touches cost
memory, yet the last rows sit past 2^31 elements. The Triton launchers (interpreted) and
the torch backend run on the same views and must agree. A wrapped offset reads or writes
elsewhere: wrong values, or a segfault, which is why every case runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Tensors past 2^31 elements (seconds each): out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    import vocab_parallel as vp
    from vocab_parallel.backends import torch_backend
    from vocab_parallel.backends import triton_backend

    LIMIT = 2**31
    case = sys.argv[1]
    gen = torch.Generator().manual_seed(0)


    def far_rows(values):
        # values [R, C] copied into a view whose row stride puts its last row past 2^31
        # elements, in a buffer whose untouched pages cost nothing.
        rows, cols = values.shape
        stride = LIMIT // (rows - 1) + 1  # < 2^31: Triton passes it as i32
        buf = torch.empty(stride * (rows - 1) + cols, dtype=values.dtype)
        view = buf.as_strided((rows, cols), (stride, 1))
        view.copy_(values)
        assert (rows - 1) * stride >= LIMIT
        return view


    def check(name, actual, expected, rel):
        a, e = actual.double(), expected.double()
        err = (a - e).abs().max().item()
        scale = e.abs().max().item()
        print(f"{case} {name}: max error {err:.3e} (max |value| {scale:.3e})")
        assert torch.isfinite(a).all() and err <= rel * scale + 1e-6, name


    def stats_agree(x, w, target, rel):
        t = triton_backend.forward_stats(x, w, target, logit_sum=True)
        r = torch_backend.forward_stats(x, w, target, logit_sum=True)
        for name, a, e in zip(("max", "sum_exp", "predicted", "logit_sum"), t, r):
            check(name, a, e, rel)


    def grads_agree(x, w, target, rel, **stats):
        bt = x.shape[0]
        grad = torch.randn(bt, generator=gen)
        not_here = target < 0
        args = (grad, x, w, not_here, target.clamp(min=0), 0.1)
        kw = dict(global_vocab_size=1000, **stats)
        out = vp.fused_linear_cross_entropy_loss_grad(*args, backend="triton", **kw)
        ref = vp.fused_linear_cross_entropy_loss_grad(*args, backend="torch", **kw)
        check("grad_input", out[0], ref[0], rel)
        check("grad_weight", out[1], ref[1], rel)


    def problem(bt, h, v, dtype):
        x = torch.randn(bt, h, generator=gen).to(dtype)
        w = (torch.randn(v, h, generator=gen) * 0.5).to(dtype)
        target = torch.randint(0, v, (bt,), generator=gen)
        target[::3] = -1  # some rows' targets live on another shard
        logits = x.double() @ w.double().T
        lmax = logits.max(dim=1).values
        sumexp = torch.exp(logits - lmax[:, None]).sum(dim=1)
        softmax = torch.exp(logits - lmax[:, None]) / sumexp[:, None]
        return x, w, target, lmax.float(), sumexp.float(), softmax.float()


    if case == "softmax":  # high-performance backward: the saved fp32 softmax
        x, w, target, lmax, sumexp, softmax = problem(6, 16, 40, torch.float32)
        grads_agree(x, w, target, 1e-5, softmax=far_rows(softmax))
    elif case == "logits_out":  # high-performance forward: logits stored into the softmax
        x, w, target, *_ = problem(6, 16, 40, torch.float32)
        view = far_rows(torch.zeros(6, 40))
        t = triton_backend.forward_stats(x, w, target, logits_out=view, logit_sum=True)
        dense = torch.zeros(6, 40)
        r = torch_backend.forward_stats(x, w, target, logits_out=dense, logit_sum=True)
        check("stored logits", view, dense, 1e-6)
        for name, a, e in zip(("max", "sum_exp", "predicted", "logit_sum"), t, r):
            check(name, a, e, 1e-6)
    elif case == "weight":  # a shard of more than 2^31 weight elements (V x H)
        x, w, target, lmax, sumexp, _ = problem(6, 16, 40, torch.bfloat16)
        w = far_rows(w)
        stats_agree(x, w, target, 1e-5)
        grads_agree(x, w, target, 1e-2, logits_max=lmax, sum_exp_logits=sumexp)
    elif case == "input":  # more than 2^31 input elements (BT x H)
        x, w, target, lmax, sumexp, _ = problem(40, 16, 6, torch.bfloat16)
        x = far_rows(x)
        stats_agree(x, w, target, 1e-5)
        grads_agree(x, w, target, 1e-2, logits_max=lmax, sum_exp_logits=sumexp)
    elif case == "rows_in_place":  # grad_in_forward: G written over far kept logits
        from vocab_parallel.backends.interface import GradTerms, Logits, Outputs

        x, w, target, lmax, sumexp, _ = problem(6, 16, 40, torch.bfloat16)
        z = (x.float() @ w.float().T)
        grad = torch.rand(6, generator=gen) + 0.5
        out = Outputs(need_input=True, need_weight=True)
        grads = []
        for saved, reuse in ((far_rows(z), True), (z.clone(), False)):
            terms = GradTerms(grad=grad, on_target=1.0, logits_max=lmax, sum_exp=sumexp,
                              logits=saved, reuse_logits=reuse)
            grads.append(triton_backend.fused_backward(x, w, target, Logits(), terms, out))
        check("grad_input", grads[0].input, grads[1].input, 1e-2)
        check("grad_weight", grads[0].weight, grads[1].weight, 1e-2)
    elif case == "divergence":  # the fused distillation epilogue over far blocks
        from vocab_parallel.backends import triton_epilogues as te

        s_blk = torch.randn(6, 40, generator=gen)
        t_blk = torch.randn(6, 40, generator=gen)
        inv_t = torch.rand(6, generator=gen) + 0.5
        far = (far_rows(s_blk), far_rows(t_blk))
        for kind in ("forward_kl", "reverse_kl", "jsd"):
            for name, a, e in zip(("m_s", "S_s", "A_s", "m_t", "S_t", "A_t"),
                                  te.divergence_stats(kind, *far, inv_t),
                                  te.divergence_stats(kind, s_blk, t_blk, inv_t)):
                check(f"{kind} {name}", a, e, 1e-6)
        ls, lt = torch.rand(6, generator=gen) + 4, torch.rand(6, generator=gen) + 4
        coef, c = torch.rand(6, generator=gen), torch.rand(6, generator=gen)
        check("jsd K", te.divergence_second(*far, inv_t, ls, lt, 0.3),
              te.divergence_second(s_blk, t_blk, inv_t, ls, lt, 0.3), 1e-6)
        for kind in ("forward_kl", "reverse_kl", "jsd"):
            args = (inv_t, ls, lt, coef, c, 0.3, torch.float32)
            check(f"{kind} G", te.divergence_grad(kind, *far, *args),
                  te.divergence_grad(kind, s_blk, t_blk, *args), 1e-6)
    else:
        raise SystemExit(f"unknown case {case}")
    print("ok")
    """
)


@pytest.mark.parametrize(
    "case", ["softmax", "logits_out", "weight", "input", "rows_in_place", "divergence"]
)
def test_offsets_past_2_31_elements(case):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, case],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    if out.returncode != 0 and "can't allocate memory" in out.stderr:
        pytest.skip("cannot reserve the address space of a 2^31-element buffer here")
    assert out.returncode == 0, (
        f"exit code {out.returncode} (negative: killed by that signal, e.g. -11, a segfault "
        f"at a wrapped address)\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    )
    assert out.stdout.strip().endswith("ok"), out.stdout
