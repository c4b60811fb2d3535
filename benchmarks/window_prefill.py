"""A sink + window drafter's prefill: the whole prompt against the positions its cache keeps.

A drafter on a sink + window cache (``draft_cache="window", kv_budget=1024``: 4 sinks and a window of 1020) attends
to nothing but its sinks and its window, so its prefill of a long prompt need only feed those positions (the
engine's way: ``StaticSinkWindowCache.kept_prompt_positions``); the keys it keeps are then computed from them alone.
This compares it with the prefill of the whole prompt (the engine's way before; here by turning the kept positions
off for the call) on the bundled pair, held-out documents, greedy, a constant γ:

* the drafts' acceptance α and τ per document, pooled over documents, and whether every output equals plain greedy
  ``generate()``;
* the tokens the drafter's prefill read, and its time alone (the drafter's prefill through
  :func:`~hf_sparsekv.generation.graph_steps.static_prefill`, eager, median of ``--timing-repeats``; CUDA-synchronized
  on a GPU).

Prints a table (``tables.py``'s ``window_prefill`` kind, as BENCHMARKS.md shows it) and writes ``results.json``
under ``--out``.

    python benchmarks/window_prefill.py --contexts 4096,8192,16320 --docs 4 --out runs/window-prefill
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import hf_sparsekv  # noqa: F401  (the import registers the engine)
from hf_sparsekv.caches.static import StaticSinkWindowCache
from hf_sparsekv.generation import graph_steps
from hf_sparsekv.generation.drafting import _attention_shape
from hf_sparsekv.zoo import eval_documents, load_pair

from provenance import commit
from tables import window_prefill_lines

SINK, WINDOW = 4, 1020  # what draft_cache="window", kv_budget=1024 configures
METHODS = ("window-whole-prefill", "window-kept-prefill")


@contextlib.contextmanager
def prefill(method: str):
    """Within the block, a sink + window drafter's prefill feeds the whole prompt (``window-whole-prefill``) or the
    positions its cache keeps (``window-kept-prefill``, the engine's own)."""
    if method == "window-kept-prefill":
        yield
        return
    kept = StaticSinkWindowCache.kept_prompt_positions
    StaticSinkWindowCache.kept_prompt_positions = lambda self, length: None
    try:
        yield
    finally:
        StaticSinkWindowCache.kept_prompt_positions = kept


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drafter_prefill_ms(drafter, ids: torch.Tensor, method: str, repeats: int, gamma: int) -> float:
    """Median milliseconds of the drafter's prefill of ``ids [1, P]`` into a fresh sink + window cache."""
    times = []
    for _ in range(repeats + 1):  # (the first: warm-up)
        cache = StaticSinkWindowCache(SINK, WINDOW, gamma + 1, *_attention_shape(drafter), drafter.dtype, ids.device)
        sync(ids.device)
        start = time.perf_counter()
        with torch.no_grad(), graph_steps.static_attention_for(drafter):
            graph_steps.static_prefill(drafter, ids, cache, kept_only=method == "window-kept-prefill")
        sync(ids.device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def run_cell(verifier, drafter, ids, method: str, args, reference: torch.Tensor) -> dict:
    with prefill(method):
        out = verifier.generate(ids, assistant_model=drafter, draft_cache="window", kv_budget=SINK + WINDOW,
                                num_assistant_tokens=args.gamma, num_assistant_tokens_schedule="constant",
                                max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                return_dict_in_generate=True)
    s = out.spec_stats
    return dict(method=method, context=ids.shape[1], gamma=args.gamma, alpha=s.acceptance_rate,
                tau=s.mean_accepted_length, rounds=s.rounds, drafted=s.drafted, accepted=s.accepted,
                new_tokens=s.new_tokens, drafter_prefill_tokens=s.drafter_prefill_tokens,
                drafter_prefill_ms=drafter_prefill_ms(drafter, ids, method, args.timing_repeats, args.gamma),
                identical=bool(torch.equal(out.sequences, reference)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,8192,16320", help="prompt lengths (the documents hold 16,384 tokens)")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--timing-repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="runs/window-prefill")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    verifier, drafter, _ = load_pair(device=args.device)
    docs = eval_documents()[: args.docs]
    contexts = [int(c) for c in args.contexts.split(",")]
    if max(contexts) + args.new_tokens > verifier.config.max_position_embeddings:
        p.error(f"a context of {max(contexts)} and {args.new_tokens} new tokens pass the verifier's "
                f"{verifier.config.max_position_embeddings} positions")
    device = torch.device(args.device)
    settings = dict(vars(args), script="window_prefill.py", dtype=str(verifier.dtype).removeprefix("torch."),
                    commit=commit(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                    device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    cpu=platform.machine(), cpus=os.cpu_count(), torch_threads=torch.get_num_threads())
    cells = []
    work = [(context, d) for context in contexts for d in range(len(docs))]
    for context, d in tqdm(work, desc="prompts"):
        ids = docs[d][None, :context].to(device)
        reference = verifier.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        for method in METHODS:
            cells.append(dict(run_cell(verifier, drafter, ids, method, args, reference), doc=d))
        (out / "results.json").write_text(json.dumps(dict(settings=settings, cells=cells), indent=1))
    print("\n".join(window_prefill_lines(cells)))
    return 0 if all(c["identical"] for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
