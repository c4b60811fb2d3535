"""QuantSpec's 4-bit draft weights: the quantizer against a float64 computation of its own rule, int4 self-speculation
with ``draft_weights="int4"`` still token-identical to greedy AR on the INT8 view (CPU runs the dequantized reference
path), the draft steps and only they reading the 4-bit copy, the copy's life cycle; tinygemm on CUDA against the
dequantized reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hf_sparsekv
from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.generation import draft_weights, engine as static_engine
from hf_sparsekv.kernels.w4_linear import dequantize_w4, quantize_w4, w4_linear, w4_shape_ok

from .conftest import ARCHS, prompt, tiny_model


@pytest.mark.parametrize("shape,group", [((8, 128), 128), ((16, 192), 64), ((24, 96), 32)])
def test_quantize_w4_follows_its_rule_in_float64(shape, group):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w4 = quantize_w4(weight, pack=False)
    assert w4.group == group and w4.codes.dtype == torch.uint8 and int(w4.codes.max()) <= 15
    w = weight.double().reshape(shape[0], -1, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = (high - low) / 15
    assert torch.allclose(w4.scales.double(), scale, rtol=1e-6)
    codes = ((w - low[..., None]) / w4.scales.double()[..., None]).round().clamp(0, 15)
    assert torch.equal(w4.codes.reshape_as(codes).double(), codes)
    error = (dequantize_w4(w4, torch.float64).reshape_as(w) - w).abs()
    assert bool((error <= scale[..., None] / 2 * (1 + 1e-5) + 1e-7).all())  # at most half a step off
    x = torch.randn(3, shape[1], dtype=torch.float64)
    reference = x @ dequantize_w4(w4, torch.float64).T
    assert torch.allclose(w4_linear(x, w4), reference)


def test_a_weight_on_the_grid_comes_back_exactly():
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1)).double()
    codes[:, 0], codes[:, 1] = 0, 15  # every group spans the whole code range
    weight = (codes - 3) * 0.25  # low -0.75, step 0.25
    w4 = quantize_w4(weight.float(), pack=False)
    assert torch.equal(dequantize_w4(w4, torch.float64), weight)


def _int8_view_greedy(verifier, ids, new_tokens):
    return verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), max_new_tokens=new_tokens,
                             do_sample=False)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gamma", [1, 4])
def test_int4_self_speculation_on_4bit_weights_is_greedy_on_the_int8_view(arch, gamma, monkeypatch):
    verifier = copy.deepcopy(tiny_model(arch))
    states = []  # draft_weights._active at every 4-bit matmul, and in every verify step
    real = draft_weights.w4_linear
    monkeypatch.setattr(draft_weights, "w4_linear", lambda *a: (states.append(draft_weights._active), real(*a))[1])
    verify = static_engine.StaticEngine._verify
    monkeypatch.setattr(static_engine.StaticEngine, "_verify",
                        lambda self: (states.append(("verify", draft_weights._active)), verify(self))[1])
    for seed, length in enumerate((9, 100, 190)):
        ids = prompt(length, seed)
        out = verifier.generate(ids, assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32),
                                draft_weights="int4", num_assistant_tokens=gamma, max_new_tokens=30,
                                do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, _int8_view_greedy(verifier, ids, 30))
    assert static_engine.current_engine(verifier).spec.draft_weights == "int4"
    assert True in states and ("verify", False) in states and ("verify", True) not in states
    assert draft_weights.nbytes(verifier) > 0
    static_engine.release_engines()


def test_the_copy_follows_the_weights_and_is_freed():
    verifier = copy.deepcopy(tiny_model("qwen2"))
    layers = [m for m in verifier.modules() if type(m) is nn.Linear and w4_shape_ok(*m.weight.shape)]
    assert layers and draft_weights.default_choice(verifier) == "full"  # on CPU the default is the full weights
    ids = prompt(60, 3)
    spec = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32), draft_weights="int4",
                max_new_tokens=12, do_sample=False)
    verifier.generate(ids, **spec)
    first = layers[0]._hf_sparsekv_w4.codes.clone()
    with torch.no_grad():
        layers[0].weight.mul_(-1.0)  # in place: the copy is remade on the next call
    out = verifier.generate(ids, **spec)
    assert not torch.equal(layers[0]._hf_sparsekv_w4.codes, first)
    assert torch.equal(out, _int8_view_greedy(verifier, ids, 12))
    twin = copy.deepcopy(verifier)  # a copy's converted layers compute with the copy's own weights
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)
    x = torch.randn(1, 3, verifier.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(twin.lm_head(x), x @ twin.lm_head.weight.T)
    torch.testing.assert_close(verifier.lm_head(x), x @ verifier.lm_head.weight.T)
    hf_sparsekv.release_engines()
    assert draft_weights.nbytes(verifier) == 0
    assert all("forward" not in m.__dict__ and not hasattr(m, "_hf_sparsekv_w4") for m in layers)


def test_what_draft_weights_refuses():
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(20, 1)
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        verifier.generate(ids, assistant_model=verifier, draft_cache="int4", draft_weights="int8", max_new_tokens=3)
    with pytest.raises(ValueError, match="draft_weights applies to draft_cache='int4'"):
        verifier.generate(ids, assistant_model=drafter, kv_budget=16, draft_weights="int4", max_new_tokens=3)
    sharded = copy.deepcopy(verifier)
    sharded._tp_size = 2  # as transformers marks a model loaded with tp_plan
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        sharded.generate(ids, assistant_model=sharded, draft_cache="int4", draft_weights="int4", max_new_tokens=3)
    assert draft_weights.default_choice(sharded) == "full"


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 6, 16])
def test_tinygemm_matches_the_dequantized_reference(rows):
    torch.manual_seed(0)
    weight = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16()
    plain, packed = quantize_w4(weight, pack=False), quantize_w4(weight, pack=True)
    x = torch.randn(rows, 4096, device="cuda").bfloat16()
    reference = x.float() @ dequantize_w4(plain, torch.float32).T
    out = w4_linear(x, packed)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 4096)
    assert torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2), float((out.float() - reference).abs().max())
