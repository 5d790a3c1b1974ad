"""The verl plug-in against verl 0.9.1's own references: its chunked torch path
``FusedLinearForPPO`` (no TP) for ``linear_cross_entropy``, and its Megatron-based
``vocab_parallel_log_probs_from_logits`` / ``vocab_parallel_entropy`` on materialised
vocabulary-parallel logits at TP 2 (gloo), including verl's gradient convention: the
hidden gradient rank-local, summed by the caller; and ``fused_output_processor`` in a
real ``GPTModel`` at TP 2, sequence parallelism off and on, against verl's non-fused
Megatron path (every parameter's gradient). verl's modules are loaded without its
package init (``framework_shims.verl_module``: it imports ray)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from multirank import run_ranks

from vocab_parallel.integrations import verl as vp_verl
from vocab_parallel.parallel.layout import shard_bounds

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None, reason="verl is not installed"
)
N, H, V, TEMP = 37, 16, 130, 0.7


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, labels, a, b


def _rel(x, y):
    x, y = x.detach().double(), y.detach().double()
    return float((x - y).abs().max() / y.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_verls_torch_path(dtype):
    from framework_shims import verl_module

    ppo = verl_module("verl.utils.experimental.torch_functional").FusedLinearForPPO(chunk_size=8)
    hidden, weight, labels, a, b = _inputs(dtype)
    results = []
    for fn in (lambda h, w: ppo(h, w, labels, temperature=TEMP),
               lambda h, w: vp_verl.linear_cross_entropy(h, w, labels, TEMP)):  # fmt: skip
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = fn(h, w)
        (a * lp.float() + b * ent.float()).sum().backward()
        results.append((lp.float(), ent.float(), h.grad.float(), w.grad.float()))
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for name, theirs, ours in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"),
                                  *results, strict=True):  # fmt: skip
        assert _rel(ours, theirs) < tol, (name, _rel(ours, theirs))


def test_reductions_and_errors():
    hidden, weight, labels, *_ = _inputs()
    lp, _ = vp_verl.linear_cross_entropy(hidden, weight, labels, TEMP)
    total, ent = vp_verl.linear_cross_entropy(hidden, weight, labels, TEMP, "sum")
    mean, _ = vp_verl.linear_cross_entropy(hidden, weight, labels, TEMP, "mean")
    assert ent.shape == (N,) and total.shape == () == mean.shape
    torch.testing.assert_close(total, lp.sum())
    torch.testing.assert_close(mean, lp.mean())
    with pytest.raises(ValueError, match="^reduction:"):
        vp_verl.linear_cross_entropy(hidden, weight, labels, TEMP, "max")
    with pytest.raises(TypeError, match="^temperature:"):
        vp_verl.linear_cross_entropy(hidden, weight, labels, "hot")


def _tp2(group):
    """verl's Megatron references on this rank's materialised logits shard vs ours,
    the hidden gradients compared rank-local (verl's convention), and their sum over the
    ranks against the unsharded float64 gradient."""
    from framework_shims import megatron_on_cpu, verl_module

    megatron_on_cpu(tp_size=2)
    tp = verl_module("verl.utils.megatron.tensor_parallel")
    rank = torch.distributed.get_rank(group)
    hidden, weight, labels, a, b = _inputs()
    lo, hi = shard_bounds(V, 2)[rank]
    out = []
    for which in ("verl", "ours"):
        h = hidden.clone().requires_grad_(True)
        w = weight[lo:hi].clone().requires_grad_(True)
        if which == "verl":
            logits = (h @ w.T) / TEMP
            lp = tp.vocab_parallel_log_probs_from_logits(logits.clone(), labels)
            ent = tp.vocab_parallel_entropy(logits.clone())
        else:
            lp, ent = vp_verl.linear_cross_entropy(h, w, labels, TEMP, "none", group)
        (a * lp + b * ent).sum().backward()
        # Both hidden gradients are this rank's share (the logits' shard's): the caller sums.
        out.append((lp.detach(), ent.detach(), h.grad, w.grad))
    errors = [_rel(ours, theirs) for ours, theirs in zip(out[1], out[0], strict=True)]
    summed = out[1][2].clone()
    torch.distributed.all_reduce(summed, group=group)
    h64, w64 = hidden.double().requires_grad_(True), weight.double()
    lp64 = torch.log_softmax(h64 @ w64.T / TEMP, dim=-1)
    ent64 = -(lp64.exp() * lp64).sum(-1)
    (a.double() * lp64.gather(1, labels[:, None]).squeeze(1) + b.double() * ent64).sum().backward()
    errors.append(_rel(summed, h64.grad))
    return errors + _processor(group, weight[lo:hi], rank)


def _processor(group, shard, rank):
    """``fused_output_processor`` as Megatron calls it: hidden ``[s, b, h]`` (this rank's
    ``s / 2`` positions under sequence parallelism), labels ``[b, s]``; its ``log_probs``
    and ``entropy`` ``[b * s]`` in labels' order, equal with and without SP."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(1)
    s_len, b_len = 6, 3
    hidden = torch.randn(s_len, b_len, H, generator=g)
    labels = torch.randint(0, V, (b_len, s_len), generator=g)
    layer = SimpleNamespace(weight=shard)
    ctx = SimpleNamespace(temperature=TEMP)
    outs = []
    for sp in (False, True):
        mine = hidden[rank * 3 : rank * 3 + 3] if sp else hidden
        out = vp_verl.fused_output_processor(
            hidden_states=mine, output_layer=layer, output_weight=None, labels=labels,
            context=ctx, config=SimpleNamespace(sequence_parallel=sp),
        )  # fmt: skip
        outs.append((out.log_probs, out.entropy))
    want, _ = vp_verl.linear_cross_entropy(hidden.transpose(0, 1), shard, labels, TEMP,
                                           "none", group)  # fmt: skip
    return [_rel(outs[0][0], want), _rel(outs[1][0], want), _rel(outs[1][1], outs[0][1])]


@pytest.mark.slow
def test_tp2_matches_verls_megatron_functions():
    for errors in run_ranks(_tp2, 2):
        assert max(errors) < 1e-5, errors


def test_patch_verl_replaces_verls_function():
    from framework_shims import verl_module

    module = verl_module("verl.utils.kernel.linear_cross_entropy")
    original = module.linear_cross_entropy
    try:
        assert vp_verl.patch_verl() == [
            "verl.utils.kernel.linear_cross_entropy.linear_cross_entropy"
        ]
        assert module.linear_cross_entropy is vp_verl.linear_cross_entropy
    finally:
        module.linear_cross_entropy = original


# --- A real GPTModel at TP 2: the processor against verl's own Megatron path ------------

GPT_V, GPT_H, GPT_S, GPT_B = 130, 32, 8, 2  # shards of 65 rows


def _gpt(sequence_parallel: bool, tied: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=GPT_H, num_attention_heads=4, tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=GPT_V, max_sequence_length=GPT_S,
        share_embeddings_and_output_weights=tied,
    )  # fmt: skip


def _gpt_tp2(group):
    """A tiny GPTModel at TP 2, sequence parallelism off and on (and off with tied
    embeddings: the weight comes as ``output_weight``): ``fused_output_processor``
    against verl's own non-fused Megatron path (the model's vocabulary-parallel logits,
    ``/ temperature``, then ``vocab_parallel_log_probs_from_logits`` and
    ``vocab_parallel_entropy``): log-probs, entropy and every parameter's gradient.
    Returns ``{(sp, tied): (worst relative error, where)}``."""
    from types import SimpleNamespace

    from framework_shims import causal_mask, megatron_on_cpu, verl_module

    megatron_on_cpu(tp_size=2)
    tp = verl_module("verl.utils.megatron.tensor_parallel")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, GPT_V, (GPT_B, GPT_S), generator=g)
    labels = torch.randint(0, GPT_V, (GPT_B, GPT_S), generator=g)
    a, b = torch.randn(GPT_B * GPT_S, generator=g), torch.randn(GPT_B * GPT_S, generator=g)
    pos = torch.arange(GPT_S)[None].expand(GPT_B, GPT_S)
    result = {}
    for sp, tied in ((False, False), (True, False), (False, True)):
        outs = []
        for which in ("verl", "ours"):
            model = _gpt(sp, tied)
            if which == "verl":
                logits = model(ids, pos, causal_mask(GPT_S)) / TEMP  # [b, s, V/tp]
                lp = tp.vocab_parallel_log_probs_from_logits(logits.clone(), labels).reshape(-1)
                ent = tp.vocab_parallel_entropy(logits.clone()).reshape(-1)
            else:
                out = model(
                    ids, pos, causal_mask(GPT_S), labels=labels,
                    output_processor=vp_verl.fused_output_processor,
                    output_processor_context=SimpleNamespace(temperature=TEMP),
                )  # fmt: skip
                lp, ent = out.log_probs, out.entropy
            (a * lp + b * ent).sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            outs.append({"log_probs": lp, "entropy": ent, **grads})
        errors = {k: _rel(outs[1][k], outs[0][k]) for k in outs[0]}
        worst = max(errors, key=errors.get)
        result[sp, tied] = (errors[worst], worst)
    return result


@pytest.mark.slow
def test_gpt_model_tp2_processor_matches_verls_megatron_path():
    """Without sequence parallelism nothing else sums the hidden-state gradient over the
    TP ranks (Megatron's output layer would, and it is not called): the processor must."""
    for result in run_ranks(_gpt_tp2, 2):
        for (sp, tied), (error, where) in result.items():
            assert error < 1e-5, (f"sequence_parallel={sp}, tied={tied}", where, error)


def test_docs_patch_verl_snippet_runs_in_a_no_deps_install():
    """docs/integrations.md's way to try ``patch_verl()`` without ray, as pasted, from the
    repository root (``import verl`` itself needs ray, which the tests do not install)."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "integrations.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (code,) = [b for b in blocks if "patch_verl()" in b]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "verl.utils.kernel.linear_cross_entropy.linear_cross_entropy" in out.stdout
