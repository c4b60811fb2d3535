"""The compile pass that turns a float32 matmul over a contraction of length one into a broadcast product: what it
rewrites, what it leaves alone, and that the rewritten graph gives bitwise the same result (traced functions and
the tiny Llama / Qwen2 / Mistral models, whose rotary embedding is such a matmul on transformers 5.17)."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

from hf_sparsekv.generation.outer_products import _MATMULS, outer_products

from .conftest import prompt, tiny_model


def _traced(fn, *args):
    """dynamo's graph of ``fn(*args)`` with its example inputs."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=record, dynamic=False)(*args)
    assert len(graphs) == 1
    return graphs[0]


def _matmuls(gm) -> int:
    return sum(node.op == "call_function" and node.target in _MATMULS for node in gm.graph.nodes)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("op", ["matmul", "bmm"])
def test_an_outer_product_becomes_a_product_with_the_same_bits(op):
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(2, 32, 1, generator=gen) * 1e-2  # inv_freq-like
    b = torch.arange(40, 47, dtype=torch.float32).expand(2, 1, 7).contiguous()  # positions
    fn = (lambda a, b: torch.cat([(a @ b).cos(), (a @ b).sin()], -1)) if op == "matmul" else (
        lambda a, b: torch.bmm(a, b).transpose(1, 2).cos())
    gm, inputs = _traced(fn, a, b)
    before = _first(gm(*inputs))
    assert _matmuls(gm) == (2 if op == "matmul" else 1)
    assert outer_products(gm) == (2 if op == "matmul" else 1)
    assert _matmuls(gm) == 0
    assert any(node.target is operator.mul for node in gm.graph.nodes)
    after = _first(gm(*inputs))
    assert torch.equal(after, before)
    assert torch.equal(after, fn(a, b))


@pytest.mark.parametrize("shapes,dtype", [
    (((2, 32, 2), (2, 2, 7)), torch.float32),  # a real contraction
    (((2, 32, 1), (2, 1, 7)), torch.bfloat16),  # not float32: the product's rounding is the GEMM's business
    (((32,), (32,)), torch.float32),  # a dot product
])
def test_other_matmuls_are_left_alone(shapes, dtype):
    a, b = (torch.rand(*s).to(dtype) for s in shapes)
    gm, _ = _traced(lambda a, b: a @ b, a, b)
    assert outer_products(gm) == 0
    assert _matmuls(gm) == 1


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_model_traced_with_the_pass_gives_the_same_logits(arch):
    model = copy.deepcopy(tiny_model(arch))
    ids = prompt(5, seed=4)
    gm, inputs = _traced(lambda ids: model(input_ids=ids).logits, ids)
    outer = sum(1 for node in gm.graph.nodes if node.op == "call_function" and node.target in _MATMULS)
    with torch.no_grad():
        before = _first(gm(*inputs))
        replaced = outer_products(gm)
        after = _first(gm(*inputs))
        eager = model(input_ids=ids).logits
    assert replaced == outer  # the rotary embedding's matmul where the release writes one (5.17), else nothing
    assert _matmuls(gm) == 0
    assert torch.equal(after, before)
    assert torch.equal(after, eager)
