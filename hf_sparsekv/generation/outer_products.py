"""A compile pass over a step's graph: a float32 matmul whose contraction has length one (an outer product, such as
the rotary embedding's ``inv_freq [B, F, 1] @ positions [B, 1, L]`` in transformers 5.17) becomes the broadcast
product it equals.

Why: Inductor keeps every matmul a cuBLAS call, so a decode step of such a model starts with a one-off fp32 GEMM
kernel (3.2-3.5 µs on an H200, a fifteenth of the bundled drafter's step); as a product it joins the cos/sin kernel
that reads it. The result is bitwise the same: each output is one product of two float32 numbers, rounded once,
whichever way it is computed (no sum). Later transformers releases write the product themselves (the pass then
finds nothing).
"""

from __future__ import annotations

import operator

import torch

_MATMULS = (operator.matmul, torch.matmul, torch.bmm)


def _outer_operands(node: torch.fx.Node):
    """``(a, b)`` of a float32 ``a [..., M, 1] @ b [..., 1, N]`` call, else None."""
    if node.op != "call_function" or node.target not in _MATMULS or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    va, vb = (x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None for x in (a, b))
    if not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.dim() >= 2 for v in (va, vb)):
        return None
    if va.shape[-1] != 1 or vb.shape[-2] != 1 or (node.target is torch.bmm and va.shape[0] != vb.shape[0]):
        return None
    return a, b


def outer_products(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (see the module docstring); the number of matmuls replaced."""
    replaced = 0
    for node in list(gm.graph.nodes):
        operands = _outer_operands(node)
        if operands is None:
            continue
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(operator.mul, operands)
        product.meta.update(node.meta)
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced
