"""Speculative generation against greedy AR on one prompt: the figures ``hf-sparsekv generate`` and ``make demo``
print (token identity, acceptance α, τ, and on a GPU the speedup)."""

from __future__ import annotations

import torch

from .cache_keyword import cache_keyword
from .caches import HierarchicalQuantCache
from .generation.stats import SyncedTimer


def timed_generate(model, ids, **kwargs):
    """``(output of model.generate(ids, do_sample=False, **kwargs), wall-clock seconds)``."""
    with SyncedTimer(ids.device) as clock:
        out = model.generate(ids, do_sample=False, **kwargs)
    return out, clock.seconds


def greedy_reference(verifier, ids, max_new_tokens: int, mode="full", static_engine: bool = False):
    """``(sequences, seconds)`` of plain greedy AR; for ``mode == "int4"`` on the INT8 view the self-speculation
    verifies; with ``static_engine`` on hf_sparsekv's engine (``generate(static_engine=True)``), else stock's."""
    cache = {cache_keyword(verifier): HierarchicalQuantCache()} if mode == "int4" else {}
    engine = {"static_engine": True} if static_engine else {}
    return timed_generate(verifier, ids, max_new_tokens=max_new_tokens, **cache, **engine)


def compare(verifier, drafter, ids, mode, budget: int | None, gamma: int, max_new_tokens: int, reference=None,
            lookup: int | None = None, static_engine: bool = False) -> dict:
    """Run speculative generation on ``ids [1, P]`` and check it against greedy AR; return the figures: the
    ``spec_stats`` fields plus ``identical_to_ar``, ``sequences``, ``ar_seconds``, ``spec_seconds``, ``speedup`` and
    ``summary`` (:meth:`~hf_sparsekv.generation.stats.SpecStats.summary`).

    ``mode`` is a ``draft_cache`` value of ``generate()``: "chunk", "window", "full", "int4" (self-speculative) or a
    cache instance for the drafter, or "lookup" (prompt lookup alone, ``lookup`` tokens a round, no drafter);
    ``budget`` is passed as ``kv_budget`` for "chunk"/"window" only; ``lookup`` beside a drafter adds prompt lookup
    as a second branch. ``reference`` is a :func:`greedy_reference` result to reuse (same ids, length);
    ``static_engine`` decodes the reference on hf_sparsekv's engine.
    """
    spec_args = {"assistant_model": drafter, "num_assistant_tokens": gamma}
    if lookup is not None:
        spec_args["prompt_lookup_num_tokens"] = lookup
    if mode == "lookup":  # N drafts every round, as the other modes draft γ (no draft-length controller)
        spec_args = {"prompt_lookup_num_tokens": lookup or gamma, "num_assistant_tokens_schedule": "constant"}
    elif mode == "int4":
        spec_args.update(assistant_model=verifier, draft_cache="int4")
    elif mode in ("chunk", "window"):
        spec_args.update(draft_cache=mode, kv_budget=budget)
    else:
        spec_args.update(draft_cache=mode)
    sequences, ar_seconds = reference or greedy_reference(verifier, ids, max_new_tokens, mode, static_engine)
    out, spec_seconds = timed_generate(
        verifier, ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **spec_args
    )
    return {
        "identical_to_ar": bool(torch.equal(out.sequences, sequences)),
        "sequences": out.sequences,
        "ar_seconds": ar_seconds,
        "spec_seconds": spec_seconds,
        "speedup": ar_seconds / spec_seconds,
        "summary": out.spec_stats.summary(),
        **out.spec_stats.to_dict(),
    }


def report(name: str, result: dict, tokenizer=None, prompt_length: int = 0, show_speed: bool = True) -> None:
    """Print a :func:`compare` result; ``show_speed=False`` (on CPU) prints acceptance and τ without timings."""
    print(f"== {name}")
    if tokenizer is not None:
        print(tokenizer.decode(result["sequences"][0, prompt_length:]))
    line = (
        f"identical to greedy AR: {result['identical_to_ar']} | {result['summary']}"
    )
    if show_speed:
        line += (
            f" | AR {result['ar_seconds']:.2f}s, speculative {result['spec_seconds']:.2f}s, "
            f"speedup {result['speedup']:.2f}x"
        )
    print(line)


SPEED_ON_CPU = (
    "(no speedup printed on CPU: timings of these small models there swing between identical runs and do not show "
    "what speculation gains; speed is measured on the GPU, see BENCHMARKS.md)"
)
