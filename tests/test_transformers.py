"""The transformers adapter: Hugging Face causal LMs trained with the vocabulary-parallel loss.

Tiny random-init Llama and Qwen2 models (vocabulary 257: odd, uneven shards at TP 2; hidden
32, 2 layers, sequences of 16, batches of 2; nothing downloaded), trained with the patched
forward, equal the UNPATCHED Hugging Face model (its logits and ``ForCausalLMLoss``) step by
step: losses, gradient norms and weights, fp32, within 1e-5. Every run uses gradient
accumulation over 2 micro-batches with uneven numbers of ignored (-100) labels, normalised
by ``num_items_in_batch`` (the tokens of the whole step) as the ``Trainer`` does, and
gradient clipping that is active (so a wrong norm shows in every weight).

Without DeepSpeed (in this process): TP 1 on a plain ``nn.Linear`` head, untied and tied,
in every mode of the loss, options passed through (also one the loss does not have yet);
Gemma 2's logit softcapping and Phi's head bias; no ``[tokens, V]`` logits in
memory-saving mode; logits only when asked; remove restores; errors; the ``Trainer``.
Under DeepSpeed (2 gloo ranks, one spawn for all, since importing DeepSpeed and
transformers takes most of its time): data parallel with the ``nn.Linear`` head, AutoTP
TP 2 with ``vocab_parallel_lm_head`` for both models untied and tied, the adapter applied
before or after ``deepspeed.initialize``, ZeRO 0 and 1, removal (DeepSpeed's own loss
again), and a checkpoint saved, loaded into a new engine, and resumed.
"""

from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # gloo ranks on CPU, also on a GPU machine
pytest.importorskip("transformers")

from multirank import run_ranks  # noqa: E402

from vocab_parallel.integrations.deepspeed import head_from_autotp  # noqa: E402
from vocab_parallel.integrations.transformers import (  # noqa: E402
    apply_vocab_parallel_loss,
    current_head,
    is_patched,
    remove_vocab_parallel_loss,
)
from vocab_parallel.loss import MODES  # noqa: E402

V, H, LAYERS, SEQ, BATCH = 257, 32, 2, 16, 2
GA = 2  # micro-batches per step
STEPS = 3
LR = 0.5
CLIP = 1.0  # below the gradient norms of these steps (1.5-2): clipping is active
REL = 1e-5
ARCHS = ("llama", "qwen2")


def make_model(arch: str, tied: bool, seed: int = 0) -> nn.Module:
    """A tiny random-init causal LM (the same weights for the same seed)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    return model


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``GA`` micro-batches of a step: ``(input_ids, labels)``, each micro-batch with
    another number of ignored labels (a prompt at the start, padding at the end)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for k in range(GA):
        ids = torch.randint(0, V, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : 2 + 5 * k + step] = -100
        labels[1, SEQ - 1 - 3 * k :] = -100
        out.append((ids, labels))
    return out


def num_items(batches) -> int:
    """The Trainer's count: labels that are predicted (``labels[..., 1:]``) and not -100."""
    return sum(int((labels[..., 1:] != -100).sum()) for _, labels in batches)


def train_plain(
    model: nn.Module, steps, as_tensor: bool = True, clip=torch.nn.utils.clip_grad_norm_
) -> dict:
    """Steps of plain PyTorch: per step the loss (sum of the micro-batch losses, i.e. the
    mean over the step's tokens), the gradient norm before clipping (``clip``), then SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for step in steps:
        batches = micro_batches(step)
        n = torch.tensor(num_items(batches)) if as_tensor else num_items(batches)
        total = 0.0
        for ids, labels in batches:
            out = model(ids, labels=labels, num_items_in_batch=n)
            out.loss.backward()
            total += out.loss.item()
        norms.append(float(clip(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return dict(losses=losses, norms=norms)


def close(actual, expected, what: str, rel: float = REL) -> None:
    """Max |difference| within ``rel`` of the largest |expected| value."""
    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    err = (a - e).abs().max().item()
    bound = rel * e.abs().max().item() + 1e-7
    assert err <= bound, f"{what}: max |diff| {err:.3e} > {bound:.3e}\n{a}\n{e}"


def reference(arch: str, tied: bool) -> dict:
    """The unpatched Hugging Face model's run (its logits and ForCausalLMLoss)."""
    model = make_model(arch, tied)
    out = train_plain(model, range(STEPS))
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


# ----------------------------------------------------------------------------- TP 1, no DeepSpeed


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_training_equals_unpatched(arch, tied):
    """A plain nn.Linear head (tied or not): losses, gradient norms and every final weight
    of the patched model equal the unpatched model's (gradient accumulation 2, uneven
    ignored tokens, num_items_in_batch as a tensor and as an int)."""
    ref = reference(arch, tied)
    assert min(ref["norms"]) > CLIP, "clipping must be active for the norm to matter"
    for as_tensor in (True, False):
        model = apply_vocab_parallel_loss(make_model(arch, tied))
        head = current_head(model)
        assert head.weight is model.lm_head.weight and head.process_group is None
        assert (head.vocab_start_index, head.vocab_end_index) == (0, V)
        got = train_plain(model, range(STEPS), as_tensor=as_tensor)
        close(got["losses"], ref["losses"], f"{arch} losses")
        close(got["norms"], ref["norms"], f"{arch} gradient norms")
        for name, value in model.state_dict().items():
            close(value, ref["state"][name], f"{arch} final {name}")


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_and_options_pass_through(mode):
    """Each mode of the loss gives the unpatched loss and gradients; options reach the
    loss (label smoothing against F.cross_entropy; a new option of the loss flows through
    without any change to the head or the adapter)."""
    import torch.nn.functional as F

    ref_model = make_model("llama", False)
    model = apply_vocab_parallel_loss(copy.deepcopy(ref_model), mode=mode)
    (ids, labels), _ = micro_batches(0)
    ref = ref_model(ids, labels=labels).loss
    got = model(ids, labels=labels).loss
    close(got.item(), ref.item(), f"{mode}: loss")
    ref.backward()
    got.backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        close(p.grad, q.grad, f"{mode}: grad of {name}")

    # label smoothing (not an option of ForCausalLMLoss: against F.cross_entropy)
    apply_vocab_parallel_loss(model, mode=mode, label_smoothing=0.1)
    with torch.no_grad():
        logits = ref_model(ids).logits[:, :-1]
        want = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), label_smoothing=0.1)
        close(model(ids, labels=labels).loss.item(), want.item(), f"{mode}: label smoothing")

    # options added to the loss later (this round: temperature, class_weight) flow through
    # the head and the adapter unchanged: one field of LossOptions each
    weights = torch.rand(V, generator=torch.Generator().manual_seed(1)) + 0.5
    apply_vocab_parallel_loss(model, mode=mode, temperature=2.0, class_weight=weights)
    with torch.no_grad():
        want = F.cross_entropy(logits.flatten(0, 1) / 2.0, labels[:, 1:].flatten(), weight=weights)
        close(model(ids, labels=labels).loss.item(), want.item(), f"{mode}: new options")
    assert current_head(model).loss_options["temperature"] == 2.0
    assert current_head(model).options.class_weight is weights


def test_memory_saving_allocates_no_logits():
    """Memory-saving mode: lm_head's forward never runs, and nothing of [tokens, V] is kept
    for the backward (saved tensors); the unpatched model keeps such tensors (the check
    sees them)."""
    batch, seq = 3, SEQ  # 48 tokens: no [V, H] weight looks like [V, tokens]
    tokens = batch * seq
    ids = torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(0))

    def saved_shapes(model) -> list[tuple[int, ...]]:
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids, labels=ids)
        out.loss.backward()
        return [s for s in shapes if V in s and torch.Size(s).numel() >= tokens * V]

    plain = make_model("llama", False)
    assert saved_shapes(plain), "the check must see the unpatched model's logits"
    model = apply_vocab_parallel_loss(make_model("llama", False), mode="memory_saving")
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    assert saved_shapes(model) == []
    assert calls == [], "lm_head ran: logits were computed"
    assert model(ids, labels=ids).logits is None


def test_logits_only_when_asked_and_remove_restores():
    plain = make_model("qwen2", True)
    model = apply_vocab_parallel_loss(copy.deepcopy(plain))
    assert is_patched(model) and "forward" in model.__dict__
    # the Trainer and generate() inspect the signature: the original's
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)
    (ids, labels), _ = micro_batches(1)
    ref = plain(ids, labels=labels)

    out = model(ids, labels=labels)
    assert out.logits is None
    close(out.loss.item(), ref.loss.item(), "loss")
    out = model(ids, labels=labels, return_logits=True)
    close(out.logits, ref.logits, "logits (return_logits=True)")
    close(out.loss.item(), ref.loss.item(), "loss with logits")
    out = model(ids, labels=labels, logits_to_keep=1)
    close(out.logits, ref.logits[:, -1:], "logits (logits_to_keep=1)")
    assert model(ids, labels=labels, logits_to_keep=1, return_logits=False).logits is None
    out = model(ids)  # no labels: the original forward
    assert out.loss is None
    close(out.logits, ref.logits, "logits without labels")
    as_tuple = model(ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple)
    close(as_tuple[0].item(), ref.loss.item(), "loss (return_dict=False)")
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    close(model(ids, shift_labels=shifted).loss.item(), ref.loss.item(), "shift_labels")

    # a copy is patched on its own (the patched forward is bound to each model)
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin and current_head(twin).weight is twin.lm_head.weight

    assert remove_vocab_parallel_loss(model) is model
    assert not is_patched(model) and "forward" not in model.__dict__
    out = model(ids, labels=labels)
    close(out.logits, ref.logits, "logits after remove")
    close(out.loss.item(), ref.loss.item(), "loss after remove")
    remove_vocab_parallel_loss(model)  # not patched: nothing to do


def test_head_per_call_options_and_errors():
    """The head's per-call reduction and num_items_in_batch; head_from_autotp on an
    nn.Linear (TP 1) and its errors; what the adapter refuses."""
    import transformers

    torch.manual_seed(0)
    linear = nn.Linear(8, 37, bias=False)
    head = head_from_autotp(linear)
    assert head.weight is linear.weight and head.process_group is None
    assert (head.vocab_start_index, head.vocab_end_index, head.vocab_size) == (0, 37, 37)
    assert not hasattr(linear.weight, "tensor_model_parallel"), "a whole head stays untagged"
    x, y = torch.randn(6, 8), torch.tensor([1, 2, -100, 3, 36, -100])
    total = head(x, y, reduction="sum")
    close(head(x, y).item(), total.item() / 4, "mean")
    assert head(x, y, reduction="none").shape == (6,)
    close(head(x, y, num_items_in_batch=10).item(), total.item() / 10, "int count")
    close(head(x, y, num_items_in_batch=torch.tensor([10.0])).item(), total.item() / 10, "")
    close(head(x, y.fill_(-100), num_items_in_batch=torch.tensor(0)).item(), 0.0, "0 items")
    close(head(x, y, num_items_in_batch=0).item(), 0.0, "0 items, an int")
    for bad, err in ((-3, ValueError), (True, TypeError), ("2", TypeError)):
        with pytest.raises(err, match="num_items_in_batch"):
            head(x, y, num_items_in_batch=bad)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        head(x, y, num_items_in_batch=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="reduction"):
        head(x, y, reduction="mean", num_items_in_batch=4)
    with pytest.raises(TypeError, match="nonsense"):
        head_from_autotp(linear, nonsense=1)
    with pytest.raises(ValueError, match="reduction"):
        head_from_autotp(linear, reduction="avg")

    # DeepSpeed AutoTP's gathered column-parallel head: the message names the option
    class LinearLayer(nn.Module):  # the attributes of deepspeed.module_inject.LinearLayer
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(19, 8))
            self.bias, self.gather_output, self.mp_group = None, True, None

    with pytest.raises(TypeError, match='"vocab_parallel_lm_head": true') as info:
        head_from_autotp(LinearLayer())
    assert '"autotp_size"' in str(info.value) and "gathers full logits" in str(info.value)
    biased = nn.Linear(8, 37)  # a bias goes to the loss's bias option, gradient included
    head = head_from_autotp(biased)
    assert head.loss_options["bias"] is biased.bias
    x, y = torch.randn(6, 8), torch.tensor([1, 2, -100, 3, 36, 0])
    close(head(x, y).item(), torch.nn.functional.cross_entropy(biased(x), y).item(), "bias")
    with pytest.raises(ValueError, match="bias"):
        head_from_autotp(biased, bias=torch.zeros(37))

    model = make_model("llama", False)
    with pytest.raises(TypeError, match="not an option"):
        apply_vocab_parallel_loss(model, nonsense=True)
    assert not is_patched(model)
    apply_vocab_parallel_loss(model, label_smoothing=0.1)
    with pytest.raises(ValueError, match="reduction"):
        apply_vocab_parallel_loss(model, reduction="avg")
    assert current_head(model).loss_options["label_smoothing"] == 0.1, "a failed call changed it"
    remove_vocab_parallel_loss(model)
    engine = nn.Module()  # what a DeepSpeed engine looks like here: the model as .module
    engine.module = model
    with pytest.raises(TypeError, match="engine.module"):
        apply_vocab_parallel_loss(engine)
    with pytest.raises(TypeError, match="base model"):
        apply_vocab_parallel_loss(model.model)
    model.lm_head = LinearLayer()
    with pytest.raises(TypeError, match="vocab_parallel_lm_head"):
        apply_vocab_parallel_loss(model)
    assert not is_patched(model)
    config = transformers.CohereConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="logit_scale"):
        apply_vocab_parallel_loss(transformers.CohereForCausalLM(config))
    with pytest.raises(ValueError, match="sequence_parallel"):
        model = apply_vocab_parallel_loss(make_model("llama", False), sequence_parallel=True)
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long))
    model = apply_vocab_parallel_loss(make_model("llama", False), ignore_index=-1)
    with pytest.raises(ValueError, match="ignore_index"):
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long),
              ignore_index=-100)  # fmt: skip


@pytest.mark.parametrize("arch", ["gemma2", "phi"])
def test_softcapped_and_biased_heads_equal_unpatched(arch):
    """Gemma 2 caps its logits (config.final_logit_softcapping: the loss's softcap); Phi's
    lm_head has a bias (the loss's bias option): loss and every gradient as unpatched."""
    import transformers

    common = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1)
    common |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    if arch == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0)
        plain = transformers.Gemma2ForCausalLM(config)
    else:
        plain = transformers.PhiForCausalLM(transformers.PhiConfig(**common))
        assert plain.lm_head.bias is not None
    model = apply_vocab_parallel_loss(copy.deepcopy(plain))
    if arch == "gemma2":
        assert current_head(model).loss_options["softcap"] == 2.0
    (ids, labels), _ = micro_batches(0)
    ref, got = plain(ids, labels=labels).loss, model(ids, labels=labels).loss
    close(got.item(), ref.item(), f"{arch}: loss")
    ref.backward()
    got.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        close(p.grad, q.grad, f"{arch}: grad of {name}")
    with torch.no_grad():
        want = plain(ids).logits
        close(model(ids, labels=labels, return_logits=True).logits, want, f"{arch}: logits")


def test_return_lse():
    import torch.nn.functional as F

    plain = make_model("llama", False)
    model = apply_vocab_parallel_loss(copy.deepcopy(plain), return_lse=True, z_loss=1e-3)
    (ids, labels), _ = micro_batches(0)
    out = model(ids, labels=labels)
    with torch.no_grad():
        logits = plain(ids).logits
    target = F.pad(labels, (0, 1), value=-100)[:, 1:]
    lse = torch.where(target != -100, logits.logsumexp(-1), 0.0)
    close(out.lse, lse, "lse")
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    want = (ce + 1e-3 * lse.flatten() ** 2).sum() / (target != -100).sum()
    close(out.loss.item(), want.item(), "loss with z_loss")


@pytest.mark.slow
def test_importing_the_adapter_does_not_import_transformers():
    code = (
        "import sys, vocab_parallel.integrations.transformers; "
        "assert 'transformers' not in sys.modules, 'imported transformers'; "
        "assert 'deepspeed' not in sys.modules, 'imported deepspeed'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_deepcopy_then_remove_restores_on_the_copy_and_the_original():
    """A deep copy of a patched model is patched on its own; removing the patch from the copy
    gives the copy the class's forward (not a copied placeholder), and the original stays
    patched until its own removal. A forward that was an instance attribute before patching
    comes back on the copy bound to the copy."""
    plain = make_model("llama", False)
    (ids, labels), _ = micro_batches(0)
    with torch.no_grad():
        ref = copy.deepcopy(plain).double()(ids, labels=labels)
    model = apply_vocab_parallel_loss(copy.deepcopy(plain))
    model(ids, labels=labels)  # a cached head on the original: not shared with the copy
    twin = copy.deepcopy(model)
    assert is_patched(twin) and current_head(twin).weight is twin.lm_head.weight
    assert remove_vocab_parallel_loss(twin) is twin and not is_patched(twin)
    assert "forward" not in twin.__dict__, "the copy keeps an instance forward"
    out = twin(ids, labels=labels)
    close(out.loss.item(), ref.loss.item(), "copy after remove: loss")
    close(out.logits.detach(), ref.logits, "copy after remove: logits")
    assert is_patched(model) and model(ids, labels=labels).logits is None
    close(model(ids, labels=labels).loss.item(), ref.loss.item(), "original, still patched")
    remove_vocab_parallel_loss(model)
    assert "forward" not in model.__dict__
    close(model(ids, labels=labels).logits.detach(), ref.logits, "original after remove")

    # an instance forward before patching (accelerate and others wrap forward so)
    wrapped = copy.deepcopy(plain)
    calls = []

    def own_forward(self, *args, **kwargs):
        calls.append(self)
        return type(self).forward(self, *args, **kwargs)

    wrapped.forward = types.MethodType(own_forward, wrapped)
    twin = copy.deepcopy(apply_vocab_parallel_loss(wrapped))
    remove_vocab_parallel_loss(twin)
    assert twin.forward.__func__ is own_forward and twin.forward.__self__ is twin
    close(twin(ids, labels=labels).loss.item(), ref.loss.item(), "copy's own forward")
    assert calls == [twin]
    remove_vocab_parallel_loss(wrapped)
    assert wrapped.forward.__func__ is own_forward and wrapped.forward.__self__ is wrapped


def test_eval_mode_returns_the_logits():
    """In eval mode a call with labels returns the loss and the logits (as the unpatched
    model does: what evaluation and compute_metrics read); eval_logits=False, or
    return_logits=False, keeps the training path's memory (no logits); training mode
    computes none unless asked."""
    plain = make_model("qwen2", False)
    ref64 = copy.deepcopy(plain).double().eval()
    model = apply_vocab_parallel_loss(copy.deepcopy(plain)).eval()
    (ids, labels), _ = micro_batches(2)
    with torch.no_grad():
        ref = ref64(ids, labels=labels)
        out = model(ids, labels=labels)
        close(out.logits, ref.logits, "eval logits")
        close(out.loss.item(), ref.loss.item(), "eval loss")
        assert model(ids, labels=labels, return_logits=False).logits is None
        apply_vocab_parallel_loss(model, eval_logits=False)
        assert model(ids, labels=labels).logits is None
        close(model(ids, labels=labels).loss.item(), ref.loss.item(), "eval loss, no logits")
        assert model.train()(ids, labels=labels).logits is None
    with pytest.raises(TypeError, match="eval_logits"):
        apply_vocab_parallel_loss(model, eval_logits="yes")
    with pytest.raises(TypeError, match="return_logits"):
        model(ids, labels=labels, return_logits=1)


def test_our_own_head_as_lm_head_is_used_as_it_is():
    """A VocabParallelLMHead in place of lm_head (the whole vocabulary here) is the head the
    adapter computes with, its own options included; options given to the adapter make a
    head with those on the same parameter. Calls without labels (generation, prediction)
    get their logits from it too: the original forward would call it without targets."""
    from vocab_parallel.lm_head import VocabParallelLMHead

    plain = make_model("llama", False)
    (ids, labels), _ = micro_batches(1)
    ref64 = copy.deepcopy(plain).double()
    ref = ref64(ids, labels=labels)
    ref.loss.backward()
    model = copy.deepcopy(plain)
    model.lm_head = VocabParallelLMHead.from_shard(model.lm_head.weight, V, 0, mode="memory_saving")
    apply_vocab_parallel_loss(model)
    assert current_head(model) is model.lm_head
    out = model(ids, labels=labels)
    assert out.logits is None
    close(out.loss.item(), ref.loss.item(), "own head: loss")
    out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref64.parameters(), strict=True):
        close(p.grad, q.grad, f"own head: grad of {name}")
    with torch.no_grad():
        close(model(ids).logits, ref.logits, "own head: logits without labels")
        close(model(ids, logits_to_keep=1).logits, ref.logits[:, -1:], "logits_to_keep=1")
    apply_vocab_parallel_loss(model, label_smoothing=0.1)
    head = current_head(model)
    assert head is not model.lm_head and head.weight is model.lm_head.weight
    assert head.loss_options["label_smoothing"] == 0.1
    assert head.loss_options["mode"] == "memory_saving", "the head's own options are kept"
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(
            ref.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), label_smoothing=0.1
        )
        close(model(ids, labels=labels).loss.item(), want.item(), "own head, label smoothing")


# ----------------------------------------------------------------------------- the Trainer


def test_trainer_gradient_accumulation_equals_unpatched(tmp_path):
    """Hugging Face's Trainer (gradient accumulation 2: it passes num_items_in_batch) logs
    the same losses and gradient norms with the patched model as with the unpatched one."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    rows = [
        {"input_ids": ids[i], "labels": labels[i]}
        for step in range(STEPS)
        for ids, labels in micro_batches(step)
        for i in range(BATCH)
    ]
    plain = make_model("llama", False)
    model = apply_vocab_parallel_loss(copy.deepcopy(plain))
    counts = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: counts.append(kwargs.get("num_items_in_batch")), with_kwargs=True
    )

    logs = {}
    for name, m in (("plain", plain), ("patched", model)):
        logs[name] = []

        class Keep(TrainerCallback):
            def on_log(self, args, state, control, logs=None, _out=logs[name], **kwargs):
                if logs and "loss" in logs:
                    _out.append((logs["loss"], logs["grad_norm"]))

        args = TrainingArguments(
            output_dir=str(tmp_path / name),
            use_cpu=True,
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=GA,
            max_steps=STEPS,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=CLIP,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
            disable_tqdm=True,
        )
        Trainer(model=m, args=args, train_dataset=rows, callbacks=[Keep()]).train()
    assert len(logs["plain"]) == STEPS, logs
    close([x[0] for x in logs["patched"]], [x[0] for x in logs["plain"]], "Trainer losses")
    close([x[1] for x in logs["patched"]], [x[1] for x in logs["plain"]], "Trainer norms")
    assert len(counts) == STEPS * GA and all(torch.is_tensor(n) for n in counts), counts


def test_trainer_predict_and_evaluate_get_the_logits(tmp_path):
    """Trainer.predict returns the logits of the whole vocabulary and the loss, and
    Trainer.evaluate hands the logits to compute_metrics: both as with the unpatched model
    (against its float64 copy)."""
    pytest.importorskip("accelerate")
    import numpy as np
    from transformers import Trainer, TrainingArguments

    batches = micro_batches(0)
    rows = [{"input_ids": i[k], "labels": y[k]} for i, y in batches for k in range(BATCH)]
    ids, labels = (torch.cat([b[j] for b in batches]) for j in (0, 1))
    plain = make_model("llama", False)
    with torch.no_grad():
        ref = copy.deepcopy(plain).double().eval()(ids, labels=labels)

    def accuracy(logits, labels):  # next-token accuracy over the predicted labels
        hit = (np.asarray(logits)[:, :-1].argmax(-1) == labels[:, 1:])[labels[:, 1:] != -100]
        return float(hit.mean())

    seen = []

    def compute_metrics(p):
        seen.append(np.shape(p.predictions))
        return {"accuracy": accuracy(p.predictions, p.label_ids)}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_eval_batch_size=len(rows),  # one batch: eval_loss is the batch's mean
        report_to=[],
        disable_tqdm=True,
    )
    model = apply_vocab_parallel_loss(copy.deepcopy(plain))
    trainer = Trainer(model=model, args=args, compute_metrics=compute_metrics)
    predicted = trainer.predict(rows)
    assert np.shape(predicted.predictions) == (len(rows), SEQ, V), type(predicted.predictions)
    close(predicted.predictions, ref.logits, "predict: logits")
    close(predicted.metrics["test_loss"], ref.loss.item(), "predict: loss")
    metrics = trainer.evaluate(rows)
    assert seen == [(len(rows), SEQ, V)] * 2, seen
    assert metrics["eval_accuracy"] == accuracy(ref.logits.numpy(), labels.numpy())
    close(metrics["eval_loss"], ref.loss.item(), "evaluate: loss")


# ----------------------------------------------------------------------------- DTensor


def _clip_full_model(params, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for a model with DTensor (sharded) and plain parameters,
    which torch's own refuses to mix: the norm of the whole model's gradient."""
    from vocab_parallel.parallel.dtensor import is_dtensor

    params = [p for p in params if p.grad is not None]
    grads = [p.grad.full_tensor() if is_dtensor(p.grad) else p.grad for p in params]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for p in params:
        p.grad.mul_(coef)
    return total


def _dtensor_runs(group) -> dict:
    """On this rank: a Llama whose lm_head is ColwiseParallel (DTensor weight over a 1-D mesh
    of both ranks), patched as it is, after head_from_colwise, and after head_from_colwise
    with options for the adapter; trained, then evaluated. And a head whose rows are wrong
    on rank 1 only."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from vocab_parallel.integrations.torch_tp import head_from_colwise
    from vocab_parallel.parallel.dtensor import is_dtensor

    rank = dist.get_rank(group)
    mesh = init_device_mesh("cpu", (dist.get_world_size(group),))
    (ids, labels), _ = micro_batches(STEPS)  # not a training batch
    out = {}
    for how, options in (("colwise", {}), ("head", {}), ("head", {"mode": "memory_saving"})):
        model = make_model("llama", False)
        model = parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})
        param = model.lm_head.weight
        if how == "head":
            model.lm_head = head_from_colwise(model.lm_head)
        apply_vocab_parallel_loss(model, **options)
        head = current_head(model)
        info = dict(
            head=type(head).__name__,
            own=head is model.lm_head,
            same_param=head.weight is param,
            rows=(head.vocab_start_index, head.vocab_end_index),
            mode=head.loss_options["mode"],
        )
        run = train_plain(model, range(STEPS), clip=_clip_full_model)
        state = {
            name: _np(v.full_tensor() if is_dtensor(v) else v)  # numpy: tensors would be
            for name, v in model.state_dict().items()  # shared with the exiting rank
        }
        model.eval()
        with torch.no_grad():
            evaluated = model(ids, labels=labels)
            logits = _np(model(ids).logits) if how == "head" else None  # no labels
        key = f"{how}/{','.join(options) or 'as is'}"
        out[key] = info | run | dict(
            state=state, eval_loss=evaluated.loss.item(), eval_logits=_np(evaluated.logits),
            logits=logits,
        )  # fmt: skip

    class Rows(nn.Module):  # the attributes of DeepSpeed's VocabParallelLinear
        def __init__(self):
            super().__init__()
            self.vocab_size, self.mp_group, self.bias = V, group, None
            self.vocab_start_index, self.vocab_end_index = [(0, 129), (129, V)][rank]
            rows = self.vocab_end_index - self.vocab_start_index + rank  # wrong on rank 1
            self.weight = nn.Parameter(torch.zeros(rows, H))

    model = make_model("llama", False)
    model.lm_head = Rows()
    try:
        apply_vocab_parallel_loss(model)
        out["refused"] = "no error"
    except (TypeError, ValueError) as exc:
        out["refused"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.slow
def test_dtensor_lm_head_trains_like_the_unsharded_model():
    """2 gloo ranks, a ColwiseParallel lm_head (DTensor Shard(0), 129 + 128 rows): the adapter
    takes it over as it is, after head_from_colwise (our head, used as it is) and with
    options of its own; losses, gradient norms and final weights equal the unsharded model's
    (float64), and in eval mode the loss and the whole vocabulary's logits on both ranks.
    A head refused on one rank only is refused on both, with that rank's message."""
    ref64 = make_model("llama", False).double()
    ref = train_plain(ref64, range(STEPS))
    ref_state = {k: v.detach().clone() for k, v in ref64.state_dict().items()}
    (ids, labels), _ = micro_batches(STEPS)
    with torch.no_grad():
        want = ref64.eval()(ids, labels=labels)
    per_rank = run_ranks(_dtensor_runs, 2, timeout=120)
    for rank, result in enumerate(per_rank):
        refused = result.pop("refused")
        assert refused.startswith("ValueError: layer.weight: expected a 2-D parameter of 128"), (
            rank,
            refused,
        )
        if rank == 0:
            assert "raised on rank 1" in refused, refused
        assert len(result) == 3, result.keys()
        for key, r in result.items():
            where = f"rank {rank}, {key}"
            assert r["head"] == "DTensorLMHead" and r["same_param"], (where, r)
            assert r["rows"] == [(0, 129), (129, V)][rank], (where, r)
            assert r["own"] == (key == "head/as is"), (where, r)
            assert r["mode"] == ("memory_saving" if "mode" in key else "auto"), (where, r)
            close(r["losses"], ref["losses"], f"{where}: losses")
            close(r["norms"], ref["norms"], f"{where}: gradient norms")
            for name, value in r["state"].items():
                close(value, ref_state[name], f"{where}: final {name}")
            close(r["eval_loss"], want.loss.item(), f"{where}: eval loss")
            assert r["eval_logits"].shape == (BATCH, SEQ, V), (where, r["eval_logits"].shape)
            close(r["eval_logits"], want.logits, f"{where}: eval logits")
            if key.startswith("head"):
                close(r["logits"], want.logits, f"{where}: logits without labels")


# ----------------------------------------------------------------------------- DeepSpeed


def _np(t: torch.Tensor):
    return t.detach().double().numpy().copy()


def _ds_config(tp: int, stage: int = 0) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": GA,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch's SGD: exact for ZeRO 1/2 anyway
        "steps_per_print": 10**9,
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp, "vocab_parallel_lm_head": True}
    return config


def _ds_train(engine, steps) -> dict:
    """The same steps as train_plain, through the engine: micro-batch losses normalised by
    num_items_in_batch, DeepSpeed's 1/GA scaling undone (the Trainer turns it off), the
    gradient norm before clipping (over the TP group)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    zero = engine.zero_optimization()
    losses, norms = [], []
    for step in steps:
        batches = micro_batches(step)
        n = torch.tensor(num_items(batches))
        total = 0.0
        for k, (ids, labels) in enumerate(batches):
            out = engine(ids, labels=labels, num_items_in_batch=n)
            assert out.logits is None
            # DeepSpeed divides by GA; the loss is normalised over the whole step already.
            # (Not scale_wrt_gas=False: DeepSpeed 0.19.8 still divides a loss that is the
            # model's own output tensor, by a backward hook it put on it in the forward.)
            engine.backward(out.loss * engine.gradient_accumulation_steps())
            total += out.loss.item()
            if k == GA - 1 and not zero:  # the step's gradient, before clipping: the same
                # function the engine clips with (max_norm inf: it scales them by exactly 1)
                params = engine.module.parameters()
                norms.append(clip_grad_norm_(params, float("inf"), mpu=engine.mpu).item())
            engine.step()
        if zero:  # ZeRO's optimizer keeps the gradients and reports the norm
            norms.append(float(engine.get_global_grad_norm()))
        losses.append(total)
    return dict(losses=losses, norms=norms)


def _deepspeed_runs(group, ckpt_dir) -> dict:
    """Every DeepSpeed case on this rank (one spawn for all)."""
    import logging

    import deepspeed
    from deepspeed.utils import logger

    from vocab_parallel.integrations import deepspeed as vp_deepspeed

    logger.setLevel(logging.WARNING)
    os.environ["LOCAL_RANK"] = str(torch.distributed.get_rank(group))  # torchrun's job
    vp_deepspeed.init_distributed()

    def no_logits(*args):
        raise AssertionError("lm_head ran: logits were computed")

    def engine_for(arch, tied, tp, when, stage=0, seed=0):
        model = make_model(arch, tied, seed)
        if when == "before":
            apply_vocab_parallel_loss(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        config = _ds_config(tp, stage)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if when == "after":
            apply_vocab_parallel_loss(engine.module)
        head, lm_head = current_head(engine.module), engine.module.lm_head
        assert head.weight is lm_head.weight, "the head must share the layer's parameter"
        hook = lm_head.register_forward_hook(no_logits)
        bounds = (head.vocab_start_index, head.vocab_end_index)
        return engine, hook, dict(layer=type(lm_head).__name__, bounds=bounds)

    out = {}
    # Data parallel over both ranks (the same data on each), the nn.Linear head: TP 1.
    engine, _, info = engine_for("llama", True, 1, "before")
    out["dp/llama/tied"] = info | _ds_train(engine, range(STEPS))
    # AutoTP TP 2, vocab_parallel_lm_head: DeepSpeed's VocabParallelLinear.
    for arch, tied, when, stage in (
        ("llama", False, "before", 0),
        ("llama", True, "after", 0),
        ("qwen2", False, "after", 0),
        ("qwen2", True, "before", 1),
    ):
        engine, hook, info = engine_for(arch, tied, 2, when, stage)
        key = f"tp2/{arch}/{'tied' if tied else 'untied'}"
        out[key] = info | _ds_train(engine, range(STEPS))

    # Removed: the original forward, rank-local logits, DeepSpeed's VocabParallelCausalLMLoss.
    # Eval mode first: the loss and the logits of the whole vocabulary, gathered over TP.
    hook.remove()
    model = engine.module
    (ids, labels), _ = micro_batches(0)
    start, end = current_head(model).vocab_start_index, current_head(model).vocab_end_index
    with torch.no_grad():
        ours = model(ids, labels=labels)
        evaluated = model.eval()(ids, labels=labels)
        model.train()
        remove_vocab_parallel_loss(model)
        theirs = model(ids, labels=labels)
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    out["removed"] = dict(
        ours=ours.loss.item(),
        theirs=theirs.loss.item(),
        logits=tuple(theirs.logits.shape),
        loss_function=type(model.loss_function).__name__,
        eval_logits=tuple(evaluated.logits.shape),
        eval_loss=evaluated.loss.item(),
        eval_ce=torch.nn.functional.cross_entropy(  # from the gathered logits, in float64
            evaluated.logits.double().flatten(0, 1), target.flatten()
        ).item(),
        eval_rows=_np(evaluated.logits[..., start:end]),  # DeepSpeed's own rank-local logits
        their_rows=_np(theirs.logits),
    )

    # Checkpoint: save after 1 step, 2 more; a new model (other weights) and engine load it
    # and train the same 2 steps. The head is rebuilt on the new engine's layer.
    engine, _, _ = engine_for("llama", False, 2, "before")
    _ds_train(engine, range(1))
    engine.save_checkpoint(ckpt_dir, tag="step1")
    uninterrupted = _ds_train(engine, range(1, 3))
    resumed_engine, _, _ = engine_for("llama", False, 2, "after", seed=1)
    path, _ = resumed_engine.load_checkpoint(ckpt_dir, tag="step1")
    assert path is not None, "load_checkpoint found no checkpoint"
    resumed = _ds_train(resumed_engine, range(1, 3))
    out["checkpoint"] = dict(uninterrupted=uninterrupted, resumed=resumed)
    return out


@pytest.mark.slow
def test_deepspeed_dp_and_autotp_equal_unpatched(tmp_path):
    """DeepSpeed on 2 gloo ranks, fp32, gradient clipping: data parallel with the plain
    head, and AutoTP TP 2 (uneven shards 129 + 128) for Llama and Qwen2, untied and tied,
    patched before or after deepspeed.initialize, ZeRO 0 and 1: every rank's losses and
    gradient norms equal the unpatched single-process model's, and lm_head never runs.
    In eval mode the logits are the whole vocabulary's on both ranks (this rank's columns:
    DeepSpeed's own rank-local logits; their cross entropy: the loss). Removing the patch
    gives DeepSpeed's own loss back; a checkpoint resumes exactly."""
    pytest.importorskip("deepspeed")
    refs = {(arch, tied): reference(arch, tied) for arch in ARCHS for tied in (False, True)}
    per_rank = run_ranks(_deepspeed_runs, 2, str(tmp_path / "ckpt"))
    for rank, result in enumerate(per_rank):
        ckpt, removed = result.pop("checkpoint"), result.pop("removed")
        assert len(result) == 5, result.keys()
        for key, r in result.items():
            where = f"rank {rank}, {key}"
            mode, arch, tied = key.split("/")
            ref = refs[(arch, tied == "tied")]
            if mode == "dp":
                assert r["layer"] == "Linear" and r["bounds"] == (0, V), (where, r)
            else:
                assert r["layer"] == "VocabParallelLinear", (where, r)
                assert r["bounds"] == [(0, 129), (129, V)][rank], (where, r)
            close(r["losses"], ref["losses"], f"{where}: losses")
            close(r["norms"], ref["norms"], f"{where}: gradient norms")
        close(ckpt["resumed"]["losses"], ckpt["uninterrupted"]["losses"], "resumed", 1e-7)
        close(ckpt["resumed"]["norms"], ckpt["uninterrupted"]["norms"], "resumed norms", 1e-7)
        assert removed["loss_function"] == "VocabParallelCausalLMLoss", removed
        assert removed["logits"] == (BATCH, SEQ, [129, 128][rank]), removed
        close(removed["theirs"], removed["ours"], f"rank {rank}: DeepSpeed's loss after remove")
        assert removed["eval_logits"] == (BATCH, SEQ, V), removed["eval_logits"]
        close(removed["eval_loss"], removed["eval_ce"], f"rank {rank}: eval loss vs its logits")
        close(removed["eval_rows"], removed["their_rows"], f"rank {rank}: gathered logits")


@pytest.mark.parametrize("tied", [False, True])
def test_token_stats_from_a_patched_model(tied):
    """``return_token_stats`` (RL): log-probs and entropy of the shifted labels, equal to
    those of the unpatched model's logits, with gradients; no logits, in eval mode too."""
    ref_model = make_model("llama", tied)
    model = make_model("llama", tied)
    apply_vocab_parallel_loss(model)
    ids, labels = micro_batches(0)[0]
    temp = 0.7
    model.eval()  # a reference model: no logits all the same
    out = model(ids, labels=labels, return_token_stats=dict(entropy=True, temperature=temp))
    assert out.logits is None and out.loss is None
    stats = out.token_stats
    logits = ref_model(ids).logits.double() / temp
    lp = torch.log_softmax(logits, dim=-1)
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    ignored = target == -100
    want_lp = lp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1).masked_fill(ignored, 0)
    want_h = -(lp.exp() * lp).sum(-1).masked_fill(ignored, 0)
    torch.testing.assert_close(stats.logprobs.double(), want_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(stats.entropy.double(), want_h, rtol=0, atol=2e-5)
    a, b = torch.randn(target.shape), torch.randn(target.shape)
    (a * stats.logprobs + b * stats.entropy).sum().backward()
    (a.double() * want_lp + b.double() * want_h).sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="^return_token_stats: needs labels"):
        model(ids, return_token_stats=True)
    with pytest.raises(TypeError, match="^return_token_stats:"):
        model(ids, labels=labels, return_token_stats="entropy")
