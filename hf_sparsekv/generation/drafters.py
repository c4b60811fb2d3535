"""Draft sources of the speculative loop: a separate model on its own cache, the verifier on a compressed cache
built from its own prefill, or the verifier's INT4 view.

Every drafter has ``sharing_prefill(verifier, verifier_cache)`` (a context around the verifier's prefill),
``prefill(prompt)`` (after it), ``propose(sequence, n, sample)`` (greedy with ``sample`` None or a greedy rule over
processed scores, speculative sampling with a sampler: :mod:`.sampling`) and ``rollback(valid)``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.cache_utils import Cache

from ..cache_keyword import cache_keyword
from ..query_attention import queries_from_attention
from ..caches import HierarchicalQuantCache, query_hooks


def forward(model, tokens: torch.Tensor, cache: Cache, start: int, logits_to_keep: int) -> torch.Tensor:
    """Run ``model`` on ``tokens [1, n]`` at real positions ``start..start+n-1``; float32 logits ``[1, k, V]``
    (float32 like stock generate(), so that argmax ties break the same way)."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)
    out = model(
        input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=logits_to_keep,
        **{cache_keyword(model): cache},
    )
    return out.logits.float()


def _next_draft(sample, sequence: torch.Tensor, drafts: list[int], logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """The draft after ``sequence [1, N]`` + ``drafts`` from ``logits [1, V']``: the argmax (``sample`` None), or
    ``sample(prefix, logits) -> (token, probabilities [V] or None)``."""
    if sample is None:
        return int(logits[0].argmax()), None
    return sample(torch.cat([sequence, sequence.new_tensor([drafts])], dim=1), logits)


class ModelDrafter:
    """A small model drafting on its own (possibly compressed) cache. Its cache lags the sequence; each round feeds
    it what it has not seen, and rollback keeps only tokens that are still part of the sequence."""

    def __init__(self, model, cache: Cache):
        self.model, self.cache = model, cache
        self.fed = 0  # tokens of the sequence the cache holds
        self.shared_vocab: int | None = None  # drafts come from ids [0, shared_vocab) (see limit_vocabulary)
        self.own_vocab: int | None = None

    def limit_vocabulary(self, shared_vocab: int, own_vocab: int) -> None:
        """Draft only ids the verifier has (``[0, shared_vocab)``, argmax over that range of the drafter's logits)
        when the two embeddings differ by padding. A sequence id the drafter lacks (``>= own_vocab``, possible only
        if the verifier itself picks one of its padding rows) reaches the drafter as id 0: that changes the drafts,
        never the output, which is the verifier's greedy choice either way."""
        self.shared_vocab, self.own_vocab = shared_vocab, own_vocab

    def _inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.own_vocab is None:
            return tokens
        return torch.where(tokens < self.own_vocab, tokens, torch.zeros_like(tokens))

    def sharing_prefill(self, verifier, verifier_cache: Cache) -> contextlib.AbstractContextManager:
        """Nothing to take from the verifier's prefill: this drafter prefills on its own."""
        return contextlib.nullcontext()

    def prefill(self, prompt: torch.Tensor) -> None:
        """Run the drafter on the whole prompt. A cache that selects from the prompt's queries gets them from the
        drafter's attention call itself (:func:`hf_sparsekv.query_attention.queries_from_attention`, any
        architecture); only under an attention implementation that cannot be wrapped (flash-attn, flex, custom) are
        they recomputed by hooks (:mod:`hf_sparsekv.caches.query_hooks`)."""
        with contextlib.ExitStack() as stack:
            if query_hooks.needs_prompt_queries(self.cache):
                if not stack.enter_context(queries_from_attention(self.model)):
                    stack.enter_context(query_hooks.prompt_queries(self.model))
            forward(self.model, self._inputs(prompt), self.cache, 0, 1)
        self.fed = prompt.shape[1]

    def propose(self, sequence: torch.Tensor, n: int, sample=None) -> tuple[list[int], list[torch.Tensor]]:
        """Drafts continuing ``sequence [1, N]`` chosen by ``sample(prefix [1, N + i], logits [1, V']) -> (token,
        probabilities [V] or None)`` (None: the argmax); returns the drafts and the probabilities ``sample`` gave.
        The cache ends up holding N + n - 1 tokens."""
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        tokens = self._inputs(sequence[:, self.fed :])
        for _ in range(n):
            logits = forward(self.model, tokens, self.cache, self.fed, 1)
            self.fed += tokens.shape[1]
            token, q = _next_draft(sample, sequence, drafts, logits[0, -1:, : self.shared_vocab])
            drafts.append(token)
            if q is not None:
                probs.append(q)
            tokens = self._inputs(sequence.new_tensor([[token]]))
        return drafts, probs

    def rollback(self, valid: int) -> None:
        """Keep only the first ``valid`` tokens of the current sequence."""
        if self.fed > valid:
            self.cache.crop(valid - self.fed)
            self.fed = valid


class SharedPrefillDrafter(ModelDrafter):
    """Self-speculation on a compressed view (TriForce/MagicDec-style): the verifier drafts on a chunk-budget or
    sink+window cache built from its own prefill, with no second prefill of the prompt.

    During the verifier's prefill, after each attention module has run, that layer's keys/values in the verifier's
    cache (the whole prompt, ``[1, Hkv, P, D]``, after RoPE) go through the compressed cache's ``update``, exactly
    as if the model had prefilled it; a layer that selects from the prompt's queries gets the queries ``[1, Hq, P,
    D]`` the verifier's attention call received (:func:`hf_sparsekv.query_attention.queries_from_attention`, any
    architecture), or, under an attention implementation that cannot be wrapped, recomputed from the module's input
    (:func:`hf_sparsekv.caches.query_hooks.recompute_queries`). Tensors are shared, never modified in place (both
    caches only concatenate, slice or gather). Afterwards it drafts like :class:`ModelDrafter`.

    Invariant after the prefill: the compressed cache has seen exactly the P prompt tokens. A chunk-budget cache
    needs the queries of all P tokens, so the verifier's cache must not hold a prefix (prompt caching) then.
    """

    @contextlib.contextmanager
    def sharing_prefill(self, verifier, verifier_cache: Cache):
        self._queries: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self._implementation = verifier.config._attn_implementation
        with contextlib.ExitStack() as stack:
            wants_queries = query_hooks.needs_prompt_queries(self.cache)
            self._from_attention = wants_queries and stack.enter_context(
                queries_from_attention(verifier, self._keep_query))
            stack.enter_context(query_hooks.after_attention(verifier, functools.partial(self._take_layer, verifier_cache)))
            try:
                yield
            finally:
                self._queries = {}

    def _keep_query(self, module, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """The query ``[1, Hq, n, D]`` of the verifier's attention call for ``module.layer_idx`` (with the key it
        attended to), until the layer's hook below takes it."""
        self._queries[module.layer_idx] = (query, key, scaling)

    def _prompt_queries(self, module, hidden_states, position_embeddings, keys: torch.Tensor):
        """``(queries [1, Hq, P, D], scaling)`` of the verifier's prefill for ``module``'s layer."""
        if self._from_attention:
            query, key, scaling = self._queries.pop(module.layer_idx, (None, None, None))
            if query is None or key is not keys:
                raise RuntimeError(
                    f"the verifier's attention for layer {module.layer_idx} did not hand over its prompt queries"
                )
            return query, scaling
        try:
            return query_hooks.recompute_queries(module, hidden_states, position_embeddings, keys), module.scaling
        except query_hooks.QueriesNotRecomputable as err:  # under flash-attn etc.: the hooks were the only way
            raise NotImplementedError(
                f"{err.reason}. Under attn_implementation={self._implementation!r} self-drafting on "
                "a chunk-budget cache recomputes them: load the model with attn_implementation='sdpa' or 'eager', "
                "pass a separate assistant_model, or use draft_cache='window'"
            ) from None

    def _take_layer(self, verifier_cache, module, hidden_states, position_embeddings, cache) -> None:
        if cache is not verifier_cache:
            return
        idx = module.layer_idx
        keys, values = verifier_cache.layers[idx].keys, verifier_cache.layers[idx].values
        self.cache.update(keys, values, idx)
        layer = self.cache.layers[idx]
        if getattr(layer, "awaiting_scores", False):
            if hidden_states.shape[-2] != keys.shape[-2]:
                raise NotImplementedError(
                    "past_key_values holding a prefix cannot seed a self-drafting chunk-budget cache: the chunk "
                    "selection needs the queries of the whole prompt (pass a separate assistant_model, or "
                    "draft_cache='window')"
                )
            query, scaling = self._prompt_queries(module, hidden_states, position_embeddings, keys)
            layer.select(query, scaling)

    def prefill(self, prompt: torch.Tensor) -> None:
        if self.cache.get_seq_length() != prompt.shape[1]:
            raise RuntimeError(
                f"the self-drafter's cache saw {self.cache.get_seq_length()} tokens of the verifier's prefill of "
                f"{prompt.shape[1]}"
            )
        self.fed = prompt.shape[1]


class SelfDrafter:
    """QuantSpec self-speculation: the verifier drafts on the INT4 view of its own hierarchical store.

    The draft tokens are removed from the store before verification (the verifier recomputes them in the INT8
    view), so between rounds the store holds exactly the verified sequence minus its last token.
    """

    def __init__(self, model, cache: HierarchicalQuantCache):
        self.model, self.cache = model, cache

    def sharing_prefill(self, verifier, verifier_cache: Cache) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the verifier's prefill fills the shared store itself

    def prefill(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, sequence: torch.Tensor, n: int, sample=None) -> tuple[list[int], list[torch.Tensor]]:
        """As :meth:`ModelDrafter.propose`, on the INT4 view."""
        start = sequence.shape[1] - 1
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        token = sequence[:, -1:]
        self.cache.set_view("int4")
        try:
            for i in range(n):
                logits = forward(self.model, token, self.cache, start + i, 1)
                token_id, q = _next_draft(sample, sequence, drafts, logits[0, -1:])
                drafts.append(token_id)
                if q is not None:
                    probs.append(q)
                token = sequence.new_tensor([[drafts[-1]]])
        finally:
            self.cache.crop(-len(drafts))
            self.cache.set_view("int8")
        return drafts, probs

    def rollback(self, valid: int) -> None:
        pass
