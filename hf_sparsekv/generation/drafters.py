"""Draft sources of the speculative loop: a separate model on its own cache, or the verifier's INT4 view."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..caches import HierarchicalQuantCache


def forward(model, tokens: torch.Tensor, cache: Cache, start: int, logits_to_keep: int) -> torch.Tensor:
    """Run ``model`` on ``tokens [1, n]`` at real positions ``start..start+n-1``; float32 logits ``[1, k, V]``
    (float32 like stock generate(), so that argmax ties break the same way)."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)
    out = model(
        input_ids=tokens, past_key_values=cache, position_ids=positions, use_cache=True, logits_to_keep=logits_to_keep
    )
    return out.logits.float()


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

    def prefill(self, prompt: torch.Tensor) -> None:
        forward(self.model, self._inputs(prompt), self.cache, 0, 1)
        self.fed = prompt.shape[1]

    def propose(self, sequence: torch.Tensor, n: int) -> list[int]:
        """Greedy drafts continuing ``sequence [1, N]``; the cache ends up holding N + n - 1 tokens."""
        drafts: list[int] = []
        tokens = self._inputs(sequence[:, self.fed :])
        for _ in range(n):
            logits = forward(self.model, tokens, self.cache, self.fed, 1)
            self.fed += tokens.shape[1]
            token = int(logits[0, -1, : self.shared_vocab].argmax())
            drafts.append(token)
            tokens = sequence.new_tensor([[token]])
        return drafts

    def rollback(self, valid: int) -> None:
        """Keep only the first ``valid`` tokens of the current sequence."""
        if self.fed > valid:
            self.cache.crop(valid - self.fed)
            self.fed = valid


class SelfDrafter:
    """QuantSpec self-speculation: the verifier drafts on the INT4 view of its own hierarchical store.

    The draft tokens are removed from the store before verification (the verifier recomputes them in the INT8
    view), so between rounds the store holds exactly the verified sequence minus its last token.
    """

    def __init__(self, model, cache: HierarchicalQuantCache):
        self.model, self.cache = model, cache

    def prefill(self, prompt: torch.Tensor) -> None:  # the verifier's prefill fills the shared store
        pass

    def propose(self, sequence: torch.Tensor, n: int) -> list[int]:
        start = sequence.shape[1] - 1
        drafts: list[int] = []
        token = sequence[:, -1:]
        self.cache.set_view("int4")
        try:
            for i in range(n):
                logits = forward(self.model, token, self.cache, start + i, 1)
                drafts.append(int(logits[0, -1].argmax()))
                token = sequence.new_tensor([[drafts[-1]]])
        finally:
            self.cache.crop(-len(drafts))
            self.cache.set_view("int8")
        return drafts

    def rollback(self, valid: int) -> None:
        pass
