"""The BudgetDraft objective's pieces (Alg. 1 steps 1, 3–4): teacher targets and continuation losses.

Layout of one sequence ``x [1, T]``: prefix ``x[:, :P]``, continuation ``x[:, P:]`` (C = T − P tokens at real
positions P..T−1). Position i of the continuation forward predicts the token after ``x[P + i]``; its teacher target is
the verifier's greedy token there under the full cache (Eq. 5), so every one of the C positions is supervised and the
targets are exactly the tokens greedy verification would accept.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from ..cache_keyword import cache_keyword
from .views import chunked_prefill


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on ``device`` when ``enabled`` (a no-op context otherwise)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16) if enabled else nullcontext()


def positions(prefix_len: int, length: int, device) -> torch.Tensor:
    """Real position ids ``[1, length]``: P, P+1, ..., P+length−1 (Alg. 1 step 4, line 13)."""
    return torch.arange(prefix_len, prefix_len + length, device=device).unsqueeze(0)


@torch.no_grad()
def teacher_targets(verifier, sequence: torch.Tensor, prefix_len: int, prefill_chunk: int) -> torch.Tensor:
    """Alg. 1 step 1: greedy targets ``[C]`` (int64) of the frozen verifier on its full cache.

    The prefix is prefilled ``prefill_chunk`` tokens at a time; the continuation is one forward at positions P..T−1.
    """
    if not 0 < prefix_len < sequence.shape[1]:
        raise ValueError(f"prefix_len must be in [1, {sequence.shape[1] - 1}], got {prefix_len}")
    cache = DynamicCache()
    chunked_prefill(verifier, sequence[:, :prefix_len], prefill_chunk, cache)
    continuation = sequence[:, prefix_len:]
    logits = verifier(
        input_ids=continuation,
        **{cache_keyword(verifier): cache},
        position_ids=positions(prefix_len, continuation.shape[1], sequence.device),
        use_cache=True,
    ).logits
    return logits[0].float().argmax(-1)


def continuation_logits(drafter, continuation: torch.Tensor, cache, prefix_len: int) -> torch.Tensor:
    """The drafter's logits ``[C, V]`` (float32) for ``continuation [1, C]`` read against a prefix view ``cache``
    whose logical length is ``prefix_len``, at real positions P..T−1."""
    if cache.get_seq_length() != prefix_len:
        raise ValueError(f"the prefix view has seen {cache.get_seq_length()} tokens, expected {prefix_len}")
    out = drafter(
        input_ids=continuation,
        **{cache_keyword(drafter): cache},
        position_ids=positions(prefix_len, continuation.shape[1], continuation.device),
        use_cache=True,
    )
    return out.logits[0].float()


def top1_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Top-1 cross-entropy (Eq. 6/7, averaged over the C positions) and the fraction of positions where the
    drafter's argmax already equals the target (the per-position acceptance under teacher forcing)."""
    loss = F.cross_entropy(logits, targets)
    agreement = float((logits.detach().argmax(-1) == targets).float().mean())
    return loss, agreement
