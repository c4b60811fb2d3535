"""Retrieval drafting (prompt lookup): each row's drafts are the continuation of an earlier occurrence of its last
tokens, in the prompt or in what it has generated so far. No drafter model: the drafts cost a few comparisons over
the token buffer, on the device and without a host sync, so the step is captured like a model's draft step.

Per row, with the sequence ``seq[b, :n[b]]``: the longest suffix of ``k <= max_ngram`` tokens that occurred earlier
(ending at ``j <= n - 2``) selects the most recent such occurrence; the drafts are the ``γ`` tokens after it,
``seq[j + 1 ...]``, extended periodically where they would run past the sequence (``seq[j + 1 + (i mod p)]`` with
``p = n - 1 - j``: the repetition that the match implies). A row with no match drafts its last token repeated (the
``k = 0`` case, ``j = n - 2``) and says so: a round in which no row found a match runs one verifier step instead of
a verification of γ + 1 tokens (on a compute-bound device, a CPU, the wider step would cost more for nothing).
Drafts are proposals only: verification keeps exactly the tokens greedy (or sampled) decoding would produce,
whatever they are.

The engine computes the next round's drafts at the end of every step that moves the sequence (and after the
prefill), and leaves the match flags in the report the host already reads once per round: no extra sync. Beside a
drafter, a round in which some row found a match verifies the drafter's chain and the retrieved one together, as two
branches of one tree (:mod:`.draft_tree`), and keeps the longer accepted one.

Sampling reads the drafts as drawn from a one-hot ``q`` (they are a function of the sequence), which speculative
sampling accepts with probability ``p(x)`` and otherwise resamples from ``p`` without ``x``: exact."""

from __future__ import annotations

import torch


def retrieval_drafts(seq: torch.Tensor, n: torch.Tensor, gamma: int, max_ngram: int) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """``seq [B, C]`` token buffers (positions ``>= n[b]`` hold stale values and are never matched), ``n [B]`` each
    row's length (``>= 2``) -> ``(drafts [B, γ] int64, found [B] bool)`` (see the module docstring)."""
    rows, capacity = seq.shape
    positions = torch.arange(capacity, device=seq.device)[None, :]  # [1, C]: j, where a match would end
    last = (n - 1)[:, None]  # [B, 1]
    best = torch.full((rows,), -1, dtype=torch.long, device=seq.device)  # k * C + j of the best match
    match = torch.ones(rows, capacity, dtype=torch.bool, device=seq.device)
    for k in range(1, max_ngram + 1):
        # the k-th token from the end: seq[j - k + 1] against seq[n - k] (shifted right by k - 1, stale left edge)
        suffix_token = seq.gather(1, (last - (k - 1)).clamp_min(0))  # [B, 1]
        shifted = torch.roll(seq, k - 1, dims=1)
        match = match & (shifted == suffix_token)
        valid = (positions >= k - 1) & (positions <= last - 1) & (last - (k - 1) >= 0)
        score = torch.where(match & valid, k * capacity + positions, -1).amax(1)
        best = torch.where(score >= 0, score, best)  # a longer suffix's match wins over any shorter one
    end = torch.where(best >= 0, best % capacity, n - 2)  # [B]: no match -> the last token repeated
    period = (n - 1 - end)[:, None]  # >= 1
    offsets = torch.arange(gamma, device=seq.device)[None, :]
    return seq.gather(1, end[:, None] + 1 + offsets % period), best >= 0


def retrieve(engine) -> None:
    """The next round's retrieved drafts from the engine's own token buffer, and the match flags in the report's
    last column. Alone (``spec.budget``: the longest suffix matched) they are the round's drafts, ``engine.drafts
    [B, γ]``, with, sampling, the one-hot ``engine.q [B, γ, V]`` they are drawn from; beside a drafter
    (``spec.retrieval``) the second branch of the round's tree, ``engine.retrieved [B, γ]``."""
    spec = engine.spec
    alone = spec.mode == "lookup"
    drafts, found = retrieval_drafts(engine.seq, engine.n, spec.gamma, spec.budget if alone else spec.retrieval)
    engine.report[:, -1].copy_(found.long())
    if not alone:
        engine.retrieved.copy_(drafts)
        return
    engine.drafts.copy_(drafts)
    if engine.warpers is not None:
        engine.q.zero_()
        engine.q.scatter_(2, drafts[..., None], 1.0)
