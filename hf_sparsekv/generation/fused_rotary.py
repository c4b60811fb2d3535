"""A compile pass over a step's graph: a layer's rotary embedding, its cache write and its decode attention become
one ``hf_sparsekv::static_rope_decode`` call (:mod:`hf_sparsekv.kernels.rope_attention`), one kernel fewer a layer.

What it rewrites, in the graph dynamo traced from the step (the model's own code, unchanged: Llama, Qwen2, Mistral
and every model whose attention calls transformers' ``apply_rotary_pos_emb``)::

    q_embed = q * cos + cat((-q[..., D/2:], q[..., :D/2]), -1) * sin      # and k_embed from k, same cos/sin
    keys[rows, :, slots] = k_embed.transpose(1, 2)                      # the static cache's write
    values[rows, :, slots] = v.transpose(1, 2)
    out = hf_sparsekv.static_decode(q_embed, keys, values, length, scaling, tree, tickets)

into ``out = hf_sparsekv.static_rope_decode(q, k, v, cos, sin, keys, values, rows, slots, length, scaling, tree,
tickets)``, which writes the buffers itself; a sink+window ring's ``static_window_decode`` (no tree) likewise into
``static_rope_window_decode``. It applies only where each of these values is read by the next alone
and the buffers by the write and the attention alone (a self-drafting step, which also writes its companion cache,
stays as it is), with the rotary embedding over the whole head (no partial rotary, no interleaved pairs).
"""

from __future__ import annotations

import operator

import torch

from .projection_groups import _call, _method, _recompiled, _value

_DECODE = torch.ops.hf_sparsekv.static_decode.default
_WINDOW_DECODE = torch.ops.hf_sparsekv.static_window_decode.default


def _arg(node: torch.fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _half_slice(node, source, half: int, upper: bool) -> bool:
    """Whether ``node`` is ``source[..., half:]`` (upper) or ``source[..., :half]``."""
    if not (_call(node, operator.getitem) and node.args[0] is source and len(node.users) == 1):
        return False
    index = node.args[1]
    want = slice(half, None, None) if upper else slice(None, half, None)
    return isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and index[1] == want


def _product(node, factor_of):
    """``(x, factor)`` where ``node = x * factor`` (either order) and ``factor_of(x)`` holds; else None."""
    if not (_call(node, operator.mul) and len(node.args) == 2 and len(node.users) == 1):
        return None
    for x, factor in (node.args, node.args[::-1]):
        if isinstance(x, torch.fx.Node) and isinstance(factor, torch.fx.Node) and factor_of(x):
            return x, factor
    return None


def _rotary(node):
    """``(x, cos, sin, nodes)`` where ``node`` is transformers' rotary embedding of ``x [B, H, L, D]`` read by one
    node (``nodes``: those it is made of, each read only within it); else None."""
    if not (_call(node, operator.add) and len(node.args) == 2 and len(node.users) == 1):
        return None
    for first, second in (node.args, node.args[::-1]):
        turned = _product(second, lambda n: _call(n, torch.cat))
        if turned is None:
            continue
        cat, sin = turned
        pieces, dim = _arg(cat, 0, "tensors"), _arg(cat, 1, "dim", 0)
        if not (isinstance(pieces, (tuple, list)) and len(pieces) == 2 and len(cat.users) == 1):
            continue
        neg, lower = pieces
        if not (_call(neg, operator.neg) and len(neg.users) == 1):
            continue
        x = neg.args[0].args[0] if _call(neg.args[0], operator.getitem) else None
        xv = _value(x)
        if not isinstance(xv, torch.Tensor) or xv.dim() != 4 or dim not in (-1, 3):
            continue
        half = xv.shape[-1] // 2
        if not (_half_slice(neg.args[0], x, half, True) and _half_slice(lower, x, half, False)):
            continue
        plain = _product(first, lambda n: n is x)
        if plain is None:
            continue
        return x, plain[1], sin, [node, first, second, cat, neg, neg.args[0], lower]
    return None


def _write(buffer: torch.fx.Node, decode: torch.fx.Node):
    """``(setitem, rows, slots, source)`` of the one ``buffer[rows, :, slots] = source.transpose(1, 2)`` before
    ``decode``, where those two are all that read ``buffer``; else None."""
    if buffer.op != "placeholder" or len(buffer.users) != 2 or decode not in buffer.users:
        return None
    (write,) = [u for u in buffer.users if u is not decode]
    if not (_call(write, operator.setitem) and write.args[0] is buffer and not write.users):
        return None
    index, moved = write.args[1], write.args[2]
    if not (isinstance(index, tuple) and len(index) == 3 and index[1] == slice(None, None, None)):
        return None
    if not (_method(moved, "transpose") and tuple(moved.args[1:]) == (1, 2) and len(moved.users) == 1):
        return None
    return write, index[0], index[2], moved


def fuse_rotary_writes(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (see the module docstring); the number of attention calls rewritten."""
    rewritten = 0
    for decode in list(gm.graph.nodes):
        ring = _call(decode, _WINDOW_DECODE)
        if not (ring or _call(decode, _DECODE)) or decode.kwargs or (ring and _arg(decode, 9, "tree") is not None):
            continue
        query, keys, values = decode.args[:3]
        rotated_query = _rotary(query)
        key_write, value_write = _write(keys, decode), _write(values, decode)
        if rotated_query is None or key_write is None or value_write is None:
            continue
        rotated_key = _rotary(key_write[3].args[0])
        if rotated_key is None or key_write[1:3] != value_write[1:3]:
            continue
        q, cos, sin, query_nodes = rotated_query
        k, key_cos, key_sin, key_nodes = rotated_key
        if (key_cos, key_sin) != (cos, sin):
            continue
        rows, slots = key_write[1:3]
        value_source = value_write[3].args[0]
        inputs = (q, k, value_source, cos, sin, keys, values, rows, slots)
        if ring:  # (length, slot_positions, query_positions, sink, window, scaling), tickets, chunk
            call = (torch.ops.hf_sparsekv.static_rope_window_decode.default,
                    inputs + tuple(decode.args[3:9]) + (_arg(decode, 10, "tickets"), _arg(decode, 11, "chunk", 0)))
        else:  # (length, scaling), tree, tickets
            call = (torch.ops.hf_sparsekv.static_rope_decode.default,
                    inputs + tuple(decode.args[3:5]) + (_arg(decode, 5, "tree"), _arg(decode, 6, "tickets")))
        with gm.graph.inserting_before(decode):
            fused = gm.graph.call_function(*call)
        fused.meta.update(decode.meta)
        decode.replace_all_uses_with(fused)
        for dead in [decode, key_write[0], value_write[0], key_write[3], value_write[3], *query_nodes, *key_nodes]:
            gm.graph.erase_node(dead)
        rewritten += 1
    return _recompiled(gm, rewritten)
