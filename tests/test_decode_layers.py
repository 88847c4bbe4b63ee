"""Decode layers: same outputs as the stock layers, switched in place only for modules the runtime owns, and only
for the runtime's own passes on a model a user hands over."""

from __future__ import annotations

import pytest
import torch

from heads.common import FrozenProjection
from runtime.target.decode_layers import (DecodeFrozenProjection, DecodeLayers, DecodeLinear, PackedWeights,
                                          decode_linear, use_decode_layers)
from runtime.target.kernels import bf16_packed_linear, pack_bf16_weight
from runtime.target.model import Target
from tests.conftest import tiny_model


@pytest.mark.parametrize("shape", [(32,), (1, 32), (2, 3, 32), (1, 16, 32), (1, 17, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_linear_equals_linear(shape, with_bias):
    weight, bias = torch.randn(48, 32), (torch.randn(48) if with_bias else None)
    hidden = torch.randn(*shape[:-1], 64)[..., ::2]  # a strided view, as attention outputs can be
    with torch.inference_mode():
        fast = decode_linear(hidden, weight, bias)
    torch.testing.assert_close(fast, torch.nn.functional.linear(hidden, weight, bias), rtol=1e-5, atol=1e-5)
    # A strided result would push the attention that follows off SDPA's fused CPU kernel.
    assert fast.is_contiguous()


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16, 17])
def test_bf16_decode_linear_equals_linear_with_and_without_bf16_matrix_instructions(monkeypatch, dot, native, rows):
    # Which product runs depends on the CPU's bf16 instructions; every choice runs here whatever this CPU has (the
    # AVX512-BF16 dot kernel, where the CPU has it, comes first, so it is switched off for the others)
    import runtime.target.decode_layers as decode_layers

    monkeypatch.setattr(decode_layers, "native_bf16_matmul", lambda: native)
    if not dot:
        monkeypatch.setattr(decode_layers, "bf16_dot_linear", lambda: None)
    weight, bias = torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()
    hidden = torch.randn(rows, 64).bfloat16()
    with torch.inference_mode():
        fast = decode_linear(hidden, weight, bias)
    reference = torch.nn.functional.linear(hidden.float(), weight.float(), bias.float())
    torch.testing.assert_close(fast.float(), reference, rtol=2e-2, atol=2e-2)
    assert fast.dtype == torch.bfloat16 and fast.shape == (rows, 48)


@pytest.mark.parametrize("shape", [(32,), (1, 32), (3, 32), (2, 3, 32), (1, 9, 32)])
def test_decode_frozen_projection_equals_the_stock_one(shape):
    projection = FrozenProjection()
    projection.weight = torch.randn(64, 32)
    hidden = torch.randn(*shape)
    with torch.inference_mode():
        stock = projection(hidden)
        use_decode_layers(projection)
        assert isinstance(projection, DecodeFrozenProjection)
        fast = projection(hidden)
    torch.testing.assert_close(fast, stock, rtol=1e-5, atol=1e-5)


def test_use_decode_layers_switches_plain_linears_only_and_keeps_outputs():
    class Adapter(torch.nn.Linear):
        pass

    model = tiny_model("llama")
    model.extra = Adapter(4, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.inference_mode():
        before = model(ids).logits
        use_decode_layers(model)
        after = model(ids).logits
    layer = model.get_decoder().layers[0]
    assert isinstance(layer.self_attn.q_proj, DecodeLinear) and isinstance(layer.mlp.down_proj, DecodeLinear)
    assert type(model.extra) is Adapter
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, switched", [("llama", True), ("qwen2", True), ("gemma", False)])
def test_decode_norms_switch_llama_formula_norms_only_and_keep_outputs(arch, switched):
    model = tiny_model(arch).bfloat16()
    norm_class = type(model.get_decoder().norm)
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.inference_mode():
        before = model(ids).logits.float()
        use_decode_layers(model)
        after = model(ids).logits.float()
    now = type(model.get_decoder().norm)
    assert (now is not norm_class and issubclass(now, norm_class)) == switched
    torch.testing.assert_close(after, before, rtol=0.02, atol=0.02)  # bf16: the sum of squares in another order


def test_decode_layers_are_active_only_inside_the_context():
    model = tiny_model("llama")
    layers = DecodeLayers(model)
    q_proj = model.get_decoder().layers[0].self_attn.q_proj
    with layers.active():
        assert isinstance(q_proj, DecodeLinear)
    assert type(q_proj) is torch.nn.Linear
    with pytest.raises(KeyError), layers.active():  # an error inside a pass still restores the stock classes
        raise KeyError("boom")
    assert type(q_proj) is torch.nn.Linear


def test_packed_weights_follow_a_weight_that_changes():
    store = PackedWeights()
    weight = torch.randn(40, 8).bfloat16()
    first = store.of(weight)
    assert store.of(weight) is first and torch.equal(first, pack_bf16_weight(weight))
    with torch.no_grad():
        weight.mul_(2)  # in place: the version counter moves
    second = store.of(weight)
    assert second is not first and torch.equal(second, pack_bf16_weight(weight))
    other = weight.clone()  # another tensor (a layer given new weights) gets its own copy
    assert torch.equal(store.of(other), second) and store.of(other) is not second
    assert len(store) == 2


def test_bf16_decode_layers_pack_the_linears_and_keep_outputs():
    """In bf16 on a CPU with the packed kernel every plain linear layer runs over a packed copy of its weight; the
    logits stay those of the stock layers up to bf16 summation order, and the parameters are untouched."""
    model = tiny_model("llama").bfloat16()
    weights = {name: p.clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    layers = DecodeLayers(model)
    with torch.inference_mode():
        before = model(ids).logits.float()
        with layers.active():
            after = model(ids).logits.float()
    torch.testing.assert_close(after, before, rtol=0.03, atol=0.03)
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    if bf16_packed_linear() is None:
        assert layers.packed is None
    else:
        assert len(layers.packed) == linears  # packed when the layers were built, once each
    assert DecodeLayers(tiny_model("llama")).packed is None  # fp32 weights: nothing to pack


def layer_classes(model) -> list[type]:
    return [type(module) for module in model.modules()]


def test_target_leaves_a_users_model_unchanged_and_runs_decode_layers_in_its_passes():
    """The runtime may not switch a caller's model behind their back: after wrapping it and decoding with it, the
    model has its own classes, attention implementation, grad flags and outputs; inside the runtime's pass it ran
    the decode layers and the tree attention."""
    from runtime.engine.decoder import SpeculativeDecoder
    from runtime.proposers import NgramProposer

    model = tiny_model("llama")
    classes, attention = layer_classes(model), model.config._attn_implementation
    grads = [p.requires_grad for p in model.parameters()]
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    with torch.no_grad():
        before = model(ids).logits
    seen = []
    q_proj = model.get_decoder().layers[0].self_attn.q_proj
    handle = q_proj.register_forward_pre_hook(
        lambda module, args: seen.append((type(module), model.config._attn_implementation)))
    target = Target(model, None, "tiny")
    SpeculativeDecoder(target, NgramProposer(), tree_size=4).generate(ids[0], 6)
    handle.remove()
    assert seen and all(issubclass(kind, DecodeLinear) and impl == "headstart_tree" for kind, impl in seen)
    assert layer_classes(model) == classes and model.config._attn_implementation == attention
    assert [p.requires_grad for p in model.parameters()] == grads
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_target_refuses_a_model_in_training_mode():
    with pytest.raises(ValueError, match=r"training mode .* call model.eval\(\)"):
        Target(tiny_model("llama").train(), None, "tiny")
