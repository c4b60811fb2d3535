"""The drafter's prefix, prefilled once without gradient, and the two cache views the continuation branches read.

BudgetDraft (Alg. 1, steps 2–4): the drafter prefills the prefix ``x[:P]`` once (chunked, no gradient); the
full-cache branch reads all P prefix tokens, the sparse branch reads the top ⌊B/s⌋ chunks of them. The chunks are
chosen by the very code the inference cache runs: the prefill uses the ``"sparsekv"`` attention, whose scoring
hand-over (:mod:`hf_sparsekv.caches.scoring_hook`) gives each layer its prefix queries, and the selection is a
:class:`~hf_sparsekv.caches.chunk_budget.ChunkBudgetLayer` fed the full prefix and those queries, exactly as after
an inference prefill (:func:`~hf_sparsekv.caches.chunk_selection.select_chunks` → ``select_tokens``).

Both views are read-only: a continuation forward returns ``[prefix; new]`` keys/values without storing the new
ones, so the prefix is never modified (this is Alg. 1's ``Clone(K_full)`` at no copy cost) and a forward replayed
by gradient checkpointing reads the same states. Prefix keys are stored after RoPE at their real positions 0..P-1;
the logical length of both views is P, so continuation tokens get positions P..T-1.

Memory: keys/values ``O(P)`` per layer, queries ``O(P)`` per layer (held only until the selection), attention
``O(prefill_chunk·P)`` during the prefill and ``O(512·P)`` during the scoring; never P×P.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .. import attention
from ..cache_keyword import cache_keyword
from ..caches import scoring_hook
from ..caches.base import CompressedCache, CompressedLayer, tensor_nbytes
from ..caches.chunk_budget import ChunkBudgetLayer
from ..caches.chunk_selection import ChunkSelection, as_selection


class _QueryRecordingLayer(DynamicLayer):
    """A plain full-cache layer that also keeps the queries the ``"sparsekv"`` attention hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[torch.Tensor] = []
        self.scaling: float | None = None

    def select(self, query: torch.Tensor, scaling: float) -> None:  # called by the "sparsekv" attention
        self.queries.append(query.detach())
        self.scaling = scaling


class _QueryRecordingCache(DynamicCache):
    """DynamicCache whose every update asks the attention function for that chunk's queries."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_class_to_replicate = _QueryRecordingLayer

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        scoring_hook.expect_scores(layer_idx, self.layers[layer_idx])
        return keys, values


class FrozenPrefixLayer(CompressedLayer):
    """Read-only layer: ``stored`` prefix keys/values (a subset of the ``seen`` prefix tokens, at their real
    positions). ``update(k, v)`` returns ``[prefix; k]``, ``[prefix; v]`` and stores nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, seen: int) -> None:
        super().__init__()
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError(f"keys/values must be [B, H, N, D] of one shape, got {tuple(keys.shape)}, {tuple(values.shape)}")
        if keys.shape[-2] > seen:
            raise ValueError(f"a view cannot store {keys.shape[-2]} tokens out of {seen} seen")
        self.keys, self.values, self.seen = keys, values, seen
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def stored_length(self) -> int:
        return self.keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys = torch.cat([self.keys.to(key_states.dtype), key_states], dim=-2)
        values = torch.cat([self.values.to(value_states.dtype), value_states], dim=-2)
        return keys, values

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a training view is read-only")

    def nbytes(self) -> int:
        return tensor_nbytes(self.keys, self.values)


class FrozenPrefixCache(CompressedCache):
    """The cache a continuation branch runs on: one :class:`FrozenPrefixLayer` per decoder layer."""

    def __init__(self, layers: list[FrozenPrefixLayer]) -> None:
        super().__init__(layers=layers)


@dataclass
class SparseView:
    """The sparse branch's cache and, per layer, the prefix positions it kept (``[1, 1 or Hkv, N]``, ascending)."""

    cache: FrozenPrefixCache
    kept_indices: list[torch.Tensor]
    budget: int


@dataclass
class DrafterPrefix:
    """The drafter's prefix state after :func:`prefill_prefix`: per layer keys/values ``[1, Hkv, P, D]`` (after RoPE),
    prefix queries ``[1, Hq, P, D]`` and the attention scaling."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]
    scaling: list[float]

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]

    def full_view(self) -> FrozenPrefixCache:
        """All P prefix tokens (Alg. 1 step 3, the ``Clone(K_full)``)."""
        return FrozenPrefixCache([FrozenPrefixLayer(k, v, self.length) for k, v in zip(self.keys, self.values)])

    def sparse_view(
        self, budget: int, chunk_size: int = 8, per_kv_head: bool = False, score_window: int | None = None,
        selection: ChunkSelection | str = "observed",
    ) -> SparseView:
        """At most ⌊budget/chunk_size⌋ chunks per layer (Alg. 1 step 4, TopKChunks), selected by the inference cache's
        own layer class under ``selection`` (see :mod:`hf_sparsekv.caches.chunk_selection`; ``"cumulative"`` is the
        paper's score). With P ≤ budget nothing is dropped, as at inference."""
        selection = as_selection(selection, per_kv_head, score_window)
        p = self.length
        layers, kept = [], []
        with torch.no_grad():
            for k, v, q, scale in zip(self.keys, self.values, self.queries, self.scaling):
                selector = ChunkBudgetLayer(budget, chunk_size, selection)
                selector.update(k, v)
                if selector.awaiting_scores:
                    selector.select(q, scale)
                    indices = selector.kept_indices
                else:
                    indices = torch.arange(p, device=k.device).view(1, 1, p)
                layers.append(FrozenPrefixLayer(selector.keys, selector.values, p))
                kept.append(indices)
        return SparseView(FrozenPrefixCache(layers), kept, budget)


def _check_ids(input_ids: torch.Tensor, name: str) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty [1, n] tensor of token ids, got shape {tuple(input_ids.shape)}")


@torch.no_grad()
def chunked_prefill(model, input_ids: torch.Tensor, chunk: int, cache) -> torch.Tensor:
    """Run ``model`` over ``input_ids [1, P]`` ``chunk`` tokens at a time into ``cache`` (real positions 0..P-1;
    only the last position's logits are computed). Returns those logits, ``[1, V]``."""
    _check_ids(input_ids, "input_ids")
    if chunk <= 0:
        raise ValueError(f"prefill chunk must be positive, got {chunk}")
    for start in range(0, input_ids.shape[1], chunk):
        piece = input_ids[:, start : start + chunk]
        positions = torch.arange(start, start + piece.shape[1], device=input_ids.device).unsqueeze(0)
        out = model(
            input_ids=piece, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache}
        )
    return out.logits[:, -1]


def prefill_prefix(drafter, prefix_ids: torch.Tensor, chunk: int) -> DrafterPrefix:
    """Alg. 1 step 2: the drafter's chunked prefix prefill without gradient, recording each layer's queries.

    The drafter must use the ``"sparsekv"`` attention (the one inference scores with); it is run in eval mode for
    the prefill and put back in the mode it was in.
    """
    if drafter.config._attn_implementation != attention.NAME:
        raise ValueError(
            f"the drafter must run with attn_implementation='{attention.NAME}' (it uses "
            f"'{drafter.config._attn_implementation}'): call drafter.set_attn_implementation('{attention.NAME}')"
        )
    cache = _QueryRecordingCache()
    was_training = drafter.training
    drafter.eval()
    try:
        chunked_prefill(drafter, prefix_ids, chunk, cache)
    finally:
        drafter.train(was_training)
    layers = cache.layers
    n_chunks = -(-prefix_ids.shape[1] // chunk)
    for i, layer in enumerate(layers):
        if len(layer.queries) != n_chunks:
            raise RuntimeError(
                f"layer {i} received {len(layer.queries)} query hand-overs for {n_chunks} prefill chunks: the "
                "drafter's attention does not go through the 'sparsekv' implementation"
            )
    return DrafterPrefix(
        keys=[layer.keys for layer in layers],
        values=[layer.values for layer in layers],
        queries=[torch.cat(layer.queries, dim=-2) for layer in layers],
        scaling=[layer.scaling for layer in layers],
    )
