"""A compile pass over a step's graph: the linear layers that read the same input become one
``hf_sparsekv::grouped_linear`` call (a layer's q/k/v projections, an MLP's gate/up).

Why: a decode step's linear layers are reads of their weights. cuBLAS runs each small one as a split-K GEMV with a
separate reduce kernel; the grouped kernel (:mod:`hf_sparsekv.kernels.grouped_linear`) reads the weights of a group
in one launch, without the reduce. The model's modules and parameters are not touched (nothing is concatenated):
the pass rewrites the graph dynamo traced from the step, before Inductor compiles it, so it applies exactly where
the engine compiles a step and nowhere else. A lone layer becomes a call only where the kernel beats cuBLAS on it
(:func:`~hf_sparsekv.kernels.grouped_linear.worth_it`).

A ``linear`` call joins a group when its weight (and bias, if any) are graph inputs of a dtype the kernel takes,
contiguous (or, under tensor parallelism, a graph input's ``to_local()`` shard: transformers' sharded layers compute
on their local shard, so the kernel reads that), on a device where :func:`hf_sparsekv.kernels.runtime.enabled`,
and its input has at most :data:`~hf_sparsekv.kernels.grouped_linear.MAX_ROWS` rows (decode and verify steps;
larger batches keep cuBLAS).
Groups keep the order in which the layers were called; a group holds at most three layers, all with a bias or all
without.

:func:`gate_projections` then turns a gated MLP's grouped gate/up call whose outputs only feed ``silu(gate) * up``
into one ``hf_sparsekv::gated_linear`` call (:mod:`hf_sparsekv.kernels.gated_linear`): the activation and the
product are computed where the projections are, one kernel fewer a layer. And :func:`norm_projections` folds the
RMSNorm that feeds a grouped or gated call (and the residual add before it) into one
``hf_sparsekv::normed_linear`` call (:mod:`hf_sparsekv.kernels.normed_linear`): two kernels fewer a layer.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..kernels import gated_linear
from ..kernels import grouped_linear as kernel
from ..kernels import normed_linear
from ..kernels import runtime

_LINEARS = (torch._C._nn.linear, F.linear)


def _value(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _plain_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and type(t).__name__ != "DTensor" and not getattr(t, "_is_view_of_dtensor", 0)


def _local_shard(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``x.to_local()`` of a graph input ``x`` (a DTensor parameter of a model loaded with
    ``tp_plan``). dynamo writes it as a ``to_local`` method call, or (torch 2.11) as a call of a function it wraps the
    method in, named ``..._to_local_...``; its only node argument is the input."""
    if node.op == "call_method":
        named = node.target == "to_local"
    else:
        named = node.op == "call_function" and "to_local" in getattr(node.target, "__name__", "")
    return (named and len(node.args) > 0 and node.all_input_nodes == [node.args[0]]
            and node.args[0].op == "placeholder")


def _parameter(node) -> bool:
    """Whether ``node`` is a graph input holding a plain tensor, or the local shard of a graph input holding a
    DTensor (:func:`_local_shard`)."""
    if not isinstance(node, torch.fx.Node) or not _plain_tensor(_value(node)):
        return False
    return node.op == "placeholder" or _local_shard(node)


def _linear_parts(node: torch.fx.Node):
    """``(input, weight, bias)`` nodes of a ``linear`` call the kernel can take, else None."""
    if node.op != "call_function" or node.target not in _LINEARS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    w, xv = _value(weight), _value(x)
    if not (_parameter(weight) and _plain_tensor(xv)) or (bias is not None and not _parameter(bias)):
        return None
    biases = [_value(bias)] if bias is not None else []
    if not (runtime.enabled(w.device) and w.device == xv.device and kernel.kernel_takes(xv, [w], biases)):
        return None
    return x, weight, bias


def group_projections(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (see the module docstring); the number of ``grouped_linear`` calls inserted."""
    by_input: dict[torch.fx.Node, list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]]] = {}
    for node in gm.graph.nodes:
        parts = _linear_parts(node)
        if parts is not None:
            by_input.setdefault(parts[0], []).append((node, parts[1], parts[2]))
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    inserted = 0
    for x, calls in by_input.items():
        for with_bias in (False, True):
            same = [c for c in calls if (c[2] is not None) == with_bias]
            rows = _value(x).numel() // _value(x).shape[-1] if same else 0
            for i in range(0, len(same), kernel.MAX_WEIGHTS):
                group = same[i : i + kernel.MAX_WEIGHTS]
                if kernel.worth_it(rows, [tuple(_value(c[1]).shape) for c in group]):
                    _replace(gm.graph, x, group, position)
                    inserted += 1
    return _recompiled(gm, inserted)


def _recompiled(gm: torch.fx.GraphModule, changes: int) -> int:
    """``changes``, after checking and recompiling ``gm`` where there were any."""
    if changes:
        gm.graph.lint()
        gm.recompile()
    return changes


def _replace(graph: torch.fx.Graph, x: torch.fx.Node, calls, position: dict) -> None:
    first = min((c[0] for c in calls), key=position.__getitem__)
    weights = [c[1] for c in calls]
    biases = [c[2] for c in calls if c[2] is not None]
    for shard in weights + biases:  # a later layer's to_local() (it reads only a graph input) moves before the call
        if shard.op != "placeholder" and position[shard] > position[first]:
            first.prepend(shard)
            position[shard] = position[first] - 0.5  # (where it is now, for a later group that reads it too)
    with graph.inserting_before(first):
        grouped = graph.call_function(torch.ops.hf_sparsekv.grouped_linear.default, (x, weights, biases))
        grouped.meta["example_value"] = [_value(c[0]) for c in calls]
        for i, (node, _, _) in enumerate(calls):
            item = graph.call_function(operator.getitem, (grouped, i))
            item.meta.update(node.meta)
            node.replace_all_uses_with(item)
    for node, _, _ in calls:
        graph.erase_node(node)



_SILU = (F.silu,)
_MUL = (operator.mul, torch.mul)


def _call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _method(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _gated_parts(node: torch.fx.Node):
    """``(product, [nodes it replaces])`` where ``node`` is a grouped call of two weights without biases whose
    outputs feed only ``silu(out[0]) * out[1]`` and the gated kernel takes it; else None."""
    if not _call(node, torch.ops.hf_sparsekv.grouped_linear.default):
        return None
    x, weights, biases = node.args
    if len(weights) != 2 or biases or len(node.users) != 2:
        return None
    items = {}
    for user in node.users:
        if not _call(user, operator.getitem) or len(user.users) != 1:
            return None
        items[user.args[1]] = user
    gate, up = items.get(0), items.get(1)
    silu = _only_user(gate) if gate is not None and up is not None else None
    if not _call(silu, *_SILU) or silu.kwargs.get("inplace"):
        return None
    product = _only_user(silu)
    if not _call(product, *_MUL) or product.kwargs or set(product.args) != {silu, up} or _only_user(up) is not product:
        return None
    if not gated_linear.kernel_takes(_value(x), _value(weights[0]), _value(weights[1])):
        return None
    return product, [silu, gate, up, node]


def gate_projections(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm`` in place: each grouped gate/up call whose outputs only feed ``silu(gate) * up`` becomes one
    ``gated_linear`` call (see the module docstring); the number rewritten. Run after :func:`group_projections`."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        parts = _gated_parts(node)
        if parts is None:
            continue
        product, replaced = parts
        x, (w_gate, w_up), _ = node.args
        with gm.graph.inserting_before(product):
            gated = gm.graph.call_function(torch.ops.hf_sparsekv.gated_linear.default, (x, w_gate, w_up))
        gated.meta.update(product.meta)
        product.replace_all_uses_with(gated)
        for dead in [product, *replaced]:
            gm.graph.erase_node(dead)
        rewritten += 1
    return _recompiled(gm, rewritten)


def _cast_to(node, dtype) -> bool:
    """Whether ``node`` is ``t.to(dtype)``."""
    if not _method(node, "to"):
        return False
    cast = node.kwargs.get("dtype", node.args[1] if len(node.args) == 2 else None)
    return cast == dtype and len(node.args) <= 2 and set(node.kwargs) <= {"dtype"}


def _other(node: torch.fx.Node, known: torch.fx.Node):
    """The argument of a two-argument call that is not ``known`` (None if ``known`` is not one of them)."""
    a, b = node.args
    return b if a is known else a if b is known else None


def _rms_norm(x: torch.fx.Node):
    """``(h, norm weight node, eps, chain nodes)`` where ``x`` is transformers' RMSNorm of ``h`` (Llama, Qwen2,
    Mistral: ``w * (h.to(float32) * rsqrt(h.to(float32).pow(2).mean(-1, keepdim=True) + eps)).to(dtype)``) and no
    node of it but ``x`` is read elsewhere; else None."""
    if not _call(x, operator.mul) or len(x.args) != 2 or x.kwargs:
        return None
    cast = next((a for a in x.args if _method(a, "to")), None)
    weight = _other(x, cast) if cast is not None else None
    wv, xv = _value(weight), _value(x)
    if weight is None or not _parameter(weight) or wv.dim() != 1 or xv is None or not _cast_to(cast, xv.dtype):
        return None
    scaled = cast.args[0]
    if not _call(scaled, operator.mul) or len(scaled.users) != 1 or len(cast.users) != 1:
        return None
    rsqrt = next((a for a in scaled.args if _call(a, torch.rsqrt)), None)
    h32 = _other(scaled, rsqrt) if rsqrt is not None else None
    if h32 is None or not _cast_to(h32, torch.float32) or len(rsqrt.users) != 1:
        return None
    add = rsqrt.args[0]
    if not _call(add, operator.add) or len(add.users) != 1 or not isinstance(add.args[1], float):
        return None
    mean = add.args[0]
    if not _method(mean, "mean") or len(mean.users) != 1 or mean.kwargs.get("keepdim") is not True or \
            tuple(mean.args[1:]) + tuple(v for k, v in mean.kwargs.items() if k == "dim") not in ((-1,), ([-1],)):
        return None
    square = mean.args[0]
    if not _method(square, "pow") or tuple(square.args) != (h32, 2) or len(square.users) != 1:
        return None
    if set(h32.users) != {square, scaled}:
        return None
    return h32.args[0], weight, add.args[1], [x, cast, scaled, rsqrt, add, mean, square, h32]


def _residual(h: torch.fx.Node, before: torch.fx.Node, position: dict):
    """``(a, b)`` where ``h = a + b`` of two tensors of h's shape and dtype whose other readers all come after
    ``before`` (they then read the fused call's sum); else None."""
    if not _call(h, operator.add) or len(h.args) != 2 or h.kwargs:
        return None
    hv = _value(h)
    parts = [_value(a) for a in h.args]
    if not all(_plain_tensor(p) and p.shape == hv.shape and p.dtype == hv.dtype for p in parts):
        return None
    later = [u for u in h.users if not _cast_to(u, torch.float32)]
    if any(u not in position or position[u] < position[before] for u in later):
        return None
    return h.args


def norm_projections(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm`` in place: each grouped or gated call whose input is an RMSNorm read by nothing else becomes one
    ``normed_linear`` call, which also computes the residual add before the norm where there is one (its sum then
    read from the call; see the module docstring); the number rewritten. Run after :func:`gate_projections`."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    rewritten = 0
    for node in list(gm.graph.nodes):
        gated = _call(node, torch.ops.hf_sparsekv.gated_linear.default)
        if not (gated or _call(node, torch.ops.hf_sparsekv.grouped_linear.default)):
            continue
        x = node.args[0]
        norm = _rms_norm(x) if isinstance(x, torch.fx.Node) and len(x.users) == 1 else None
        if norm is None:
            continue
        h, weight, eps, chain = norm
        if not _plain_tensor(_value(h)):
            continue
        weights, biases = (list(node.args[1:]), []) if gated else (node.args[1], node.args[2])
        residual = _residual(h, node, position)
        inputs = residual if residual is not None else (h, None)
        values = [_value(w) for w in weights]
        if not normed_linear.kernel_takes(_value(inputs[0]), _value(inputs[1]) if residual else None, _value(weight),
                                          values, [_value(b) for b in biases], gated):
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.hf_sparsekv.normed_linear.default,
                                           (*inputs, weight, eps, weights, biases, gated))
            outs = ([_value(h)] if residual else []) + ([_value(node)] if gated else list(_value(node)))
            fused.meta["example_value"] = outs
            items = [gm.graph.call_function(operator.getitem, (fused, i)) for i in range(len(outs))]
        for item, value in zip(items, outs):
            item.meta["example_value"] = value
        first = 1 if residual else 0
        if gated:
            items[first].meta.update(node.meta)
            node.replace_all_uses_with(items[first])
        else:
            for user in list(node.users):
                user.replace_all_uses_with(items[first + user.args[1]])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        for dead in chain:
            gm.graph.erase_node(dead)
        if residual:
            items[0].meta.update(h.meta)
            h.replace_all_uses_with(items[0])
            gm.graph.erase_node(h)
        for item in items:
            if not item.users:
                gm.graph.erase_node(item)
        rewritten += 1
    return _recompiled(gm, rewritten)
