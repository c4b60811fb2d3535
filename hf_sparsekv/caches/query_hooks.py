"""The prompt's queries for caches that score their prefix, under any attention implementation (eager, SDPA,
flash-attn, ...).

A cache's ``update`` sees keys and values, never queries; :class:`~.chunk_budget.ChunkBudgetCache` needs the
prompt's queries to pick its chunks. As in NVIDIA's kvpress, forward hooks on the model's attention modules supply
them: after an attention module has run on the prompt, the hook recomputes that layer's queries from the module's
own input (``hidden_states [B, n, hidden]`` and ``position_embeddings = (cos, sin)``) with the module's own parts:
``q_proj``, ``q_norm`` if it has one, the ``apply_rotary_pos_emb`` of its modeling file, and ``module.scaling``.

Guard (no silent wrong selection): the same recipe applied to ``k_proj``/``k_norm`` must reproduce the keys the
cache received from the module. A module whose projection path differs (fused ``qkv_proj``, another RoPE, extra
scaling) fails that check or lacks a part, and the hook raises ``NotImplementedError``.

Hooks exist only inside :func:`prompt_queries` (``generate()`` opens it when ``past_key_values`` is such a cache,
and the speculative loop for the drafter's prefill); the ``"sparsekv"`` attention hands the queries over directly
(:mod:`.scoring_hook`), and then the hook finds nothing left to do.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch


class QueriesNotRecomputable(NotImplementedError):
    """An attention module's prompt queries cannot be recomputed from its input. ``reason`` says why; the message
    adds the way out of the hook path (the ``"sparsekv"`` attention hands the queries over directly). Self-drafting,
    which recomputes them under every attention implementation, names its own ways out instead."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}; run the model with attn_implementation='sparsekv'")
        self.reason = reason


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's attention modules: submodules whose class name ends in ``Attention`` and that carry an integer
    ``layer_idx`` (the transformers convention)."""
    return [
        m for m in model.modules() if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
    ]


def _projected(module, proj: str, norm: str, hidden_states: torch.Tensor) -> torch.Tensor:
    """``proj`` (then ``norm`` over head_dim if the module has one) of ``hidden_states [B, n, hidden]`` -> ``[B, H, n, D]``."""
    linear = getattr(module, proj, None)
    head_dim = getattr(module, "head_dim", None)
    if linear is None or not isinstance(head_dim, int):
        raise QueriesNotRecomputable(
            f"{type(module).__name__} has no {proj}/head_dim: the prompt's queries cannot be recomputed for this "
            "architecture under its attention implementation"
        )
    states = linear(hidden_states).view(*hidden_states.shape[:-1], -1, head_dim)
    if getattr(module, norm, None) is not None:
        states = getattr(module, norm)(states)
    return states.transpose(1, 2)


def _rope(module) -> Callable:
    rope = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    if rope is None:
        raise QueriesNotRecomputable(
            f"{type(module).__name__}: its modeling file has no apply_rotary_pos_emb, so the prompt's queries cannot "
            "be recomputed"
        )
    return rope


def _rotate(rope: Callable, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``rope`` applied to ``query [B, Hq, n, D]`` and ``key [B, Hkv, n, D]`` with ``cos``/``sin`` ``[B, n, R]``.
    Partial rotary (R < D, e.g. StableLM, GPT-NeoX, Phi): the first R dimensions of each head are rotated and the
    other D - R pass through, as those modeling files do."""
    rotary = cos.shape[-1]
    if rotary >= query.shape[-1]:
        return rope(query, key, cos, sin)
    q_rot, k_rot = rope(query[..., :rotary], key[..., :rotary], cos, sin)
    return torch.cat([q_rot, query[..., rotary:]], dim=-1), torch.cat([k_rot, key[..., rotary:]], dim=-1)


def recompute_queries(module, hidden_states: torch.Tensor, position_embeddings, keys: torch.Tensor) -> torch.Tensor:
    """Queries ``[B, Hq, n, D]`` (after RoPE) of the ``n`` tokens whose attention input was ``hidden_states [B, n, hidden]``.

    ``keys [B, Hkv, n, D]``: the post-RoPE keys the module produced for the same tokens; the same recipe must
    reproduce them (within a few units of the dtype's rounding) or NotImplementedError is raised.
    """
    if position_embeddings is None or hidden_states is None:
        raise QueriesNotRecomputable(
            f"{type(module).__name__} was not called with hidden_states and position_embeddings: the prompt's "
            "queries cannot be recomputed"
        )
    rope = _rope(module)
    query = _projected(module, "q_proj", "q_norm", hidden_states)
    key = _projected(module, "k_proj", "k_norm", hidden_states)
    try:
        cos, sin = position_embeddings
        query, key = _rotate(rope, query, key, cos, sin)
    except (TypeError, ValueError, RuntimeError) as err:  # another rotary recipe (e.g. GPT-J's sincos form)
        raise QueriesNotRecomputable(
            f"{type(module).__name__}: its rotary embedding is not the (query, key, cos, sin) recipe ({err}), so the "
            "prompt's queries cannot be recomputed"
        ) from None
    eps = torch.finfo(keys.dtype).eps if keys.dtype.is_floating_point else 0.0
    if key.shape != keys.shape or not torch.allclose(key, keys, rtol=16 * eps, atol=16 * eps):
        raise QueriesNotRecomputable(
            f"{type(module).__name__}: keys recomputed from the module's input differ from those it stored, so its "
            "queries cannot be recomputed faithfully"
        )
    return query


def _module_inputs(args: tuple, kwargs: dict):
    """(hidden_states, position_embeddings, cache) of an attention module call. The cache keyword is ``cache`` from
    transformers 5.24 on, ``past_key_values`` (``past_key_value`` in older files) before, ``layer_past`` in
    GPT-NeoX/Falcon-style files."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    position_embeddings = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value", "layer_past")
                  if kwargs.get(k) is not None), None)
    return hidden, position_embeddings, cache


@contextlib.contextmanager
def after_attention(model: torch.nn.Module, fn: Callable) -> Iterator[None]:
    """Within the block, ``fn(module, hidden_states, position_embeddings, past_key_values)`` runs after every call of
    one of ``model``'s attention modules. Raises NotImplementedError if the model has none."""
    modules = attention_modules(model)
    if not modules:
        raise NotImplementedError(
            f"{type(model).__name__} has no attention modules (…Attention with a layer_idx) to take the prompt's "
            "queries from; run the model with attn_implementation='sparsekv'"
        )

    def hook(module, args, kwargs, output):
        fn(module, *_module_inputs(args, kwargs))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _score_pending_layer(module, hidden_states, position_embeddings, cache) -> None:
    """If the layer ``module.layer_idx`` of ``cache`` waits for its prompt's queries, recompute and hand them over."""
    layers = getattr(cache, "layers", None)
    if layers is None or module.layer_idx >= len(layers):
        return
    layer = layers[module.layer_idx]
    if not getattr(layer, "awaiting_scores", False):
        return
    query = recompute_queries(module, hidden_states, position_embeddings, layer.keys)
    layer.select(query, module.scaling)


def prompt_queries(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Context manager: forward calls of ``model`` inside it hand the prompt's queries to any cache layer waiting for
    them (e.g. ``ChunkBudgetCache``), whatever the attention implementation::

        with hf_sparsekv.prompt_queries(model):
            model(input_ids=prompt, past_key_values=cache)

    ``generate()`` does this by itself when ``past_key_values`` is such a cache."""
    return after_attention(model, _score_pending_layer)


def needs_prompt_queries(cache) -> bool:
    """Whether ``cache`` picks what it keeps from the prompt's queries (so its prefill must run under hooks)."""
    return bool(getattr(cache, "needs_prompt_queries", False))
