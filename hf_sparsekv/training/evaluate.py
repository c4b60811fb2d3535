"""Held-out acceptance of a drafter per context length × KV budget, measured with the real speculative loop."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..generation import speculative_generate


def _as_prompt(sequence: torch.Tensor, device) -> torch.Tensor:
    if sequence.dim() == 1:
        sequence = sequence.unsqueeze(0)
    if sequence.dim() != 2 or sequence.shape[0] != 1:
        raise ValueError(f"each prompt must be [L] or [1, L] token ids, got shape {tuple(sequence.shape)}")
    return sequence.to(device)


def measure_acceptance(
    verifier,
    drafter,
    prompts: Iterable[torch.Tensor],
    contexts: Iterable[int],
    budgets: Iterable[int | None],
    gamma: int = 5,
    max_new_tokens: int = 64,
) -> dict:
    """Greedy sparse/full speculative decoding (``draft_cache="chunk"``, ``kv_budget=B``; ``None`` = full drafter
    cache) from the first ``context`` tokens of each prompt, ``max_new_tokens`` tokens each (EOS ignored).

    Returns ``{context: {budget: cell}}`` (budget ``"full"`` for ``None``), each cell with ``acceptance_rate`` =
    accepted / drafted pooled over prompts (as in ``spec_stats``), ``accepted``, ``drafted``, ``rounds``,
    ``new_tokens`` and ``mean_accepted_length``. Every prompt must have at least ``max(contexts)`` tokens.
    """
    prompts = [_as_prompt(p, verifier.device) for p in prompts]
    contexts, budgets = [int(c) for c in contexts], list(budgets)
    if not prompts or not contexts or not budgets:
        raise ValueError("measure_acceptance needs at least one prompt, one context and one budget")
    shortest = min(p.shape[1] for p in prompts)
    if max(contexts) > shortest:
        raise ValueError(f"context {max(contexts)} is longer than the shortest prompt ({shortest} tokens)")
    was_training = drafter.training
    drafter.eval()
    results: dict = {}
    try:
        for context in contexts:
            row = results.setdefault(context, {})
            for budget in budgets:
                totals = dict(accepted=0, drafted=0, rounds=0, new_tokens=0)
                for prompt in prompts:
                    spec = dict(draft_cache="full") if budget is None else dict(draft_cache="chunk", kv_budget=int(budget))
                    out = speculative_generate(
                        verifier,
                        prompt[:, :context],
                        assistant_model=drafter,
                        num_assistant_tokens=gamma,
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        eos_token_id=None,
                        return_dict_in_generate=True,
                        **spec,
                    )
                    for key in totals:
                        totals[key] += out.spec_stats[key]
                drafted, rounds = totals["drafted"], totals["rounds"]
                row["full" if budget is None else int(budget)] = dict(
                    totals,
                    acceptance_rate=totals["accepted"] / drafted if drafted else 0.0,
                    mean_accepted_length=(totals["new_tokens"] - len(prompts)) / rounds if rounds else 0.0,
                )
    finally:
        drafter.train(was_training)
    return results


def acceptance_table(results: dict) -> dict:
    """``{context: {budget: acceptance_rate}}`` from :func:`measure_acceptance`'s result."""
    return {c: {b: cell["acceptance_rate"] for b, cell in row.items()} for c, row in results.items()}
