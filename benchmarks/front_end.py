"""Where a call's time outside its prefill and rounds goes (issue 52): the front end of ``generate()`` by phase.

The bundled pair, one held-out document cut to ``--context`` tokens, a few new tokens a call, greedy. Each method
runs ``--calls`` times after ``--warmup`` calls; for each, the median over the calls of:

- ``outside_ms``: the call's wall-clock time less its ``prefill_seconds`` and ``rounds_seconds`` (``spec_stats``);
- ``decode_rows_outside_ms``: the part of that inside the decode loop's own function (before the prefill, after the
  last round);
- one column per front-end function of :mod:`hf_sparsekv.generation.front` (each wrapped by a timer here):
  ``_prepare_config`` (stock's merged ``GenerationConfig``), ``engine_for`` (the kept engine and its weight key),
  ``_row_rules``, ...

Methods: ``ar`` (``graph_greedy_generate``, no ``generate()``), ``ar_generate`` (``static_engine=True``),
``chunk`` (the drafter on a chunk budget of 512, the controller), ``selfchunk`` (self-drafting, chunk 512). On CPU it
runs too (the same host code, eager steps). Before each call the kept engines forget the sequence they hold, so that
every call prefills its whole prompt. Prints a table, writes JSON. ``HF_SPARSEKV_COMPILE=0`` skips compilation
(the front end does not depend on it).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

import hf_sparsekv
from hf_sparsekv.generation import front, rounds
from hf_sparsekv.generation.engine import forget_sequences
from hf_sparsekv.zoo import eval_documents, load_pair

PHASES = ("_prepare_config", "infer_attention_mask", "_draft_length", "_check_models", "_row_rules", "_engine_rules",
          "captures", "engine_for")


def _timed(record: dict, name: str, function):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            record.setdefault(name, []).append(time.perf_counter() - start)
    return timed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="runs/front-end")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    verifier, drafter, _ = load_pair(device=device)
    ids = eval_documents()[0][None, : args.context].to(device)
    record, stats = {}, []
    for name in PHASES:
        setattr(front, name, _timed(record, name, getattr(front, name)))
    decode_rows = rounds.static_decode_rows

    def recorded(*a, **k):
        start = time.perf_counter()
        results = decode_rows(*a, **k)
        stats.append((time.perf_counter() - start, results[0].stats))
        return results
    rounds.static_decode_rows = front.static_decode_rows = recorded
    common = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    methods = {
        "ar": lambda: hf_sparsekv.graph_greedy_generate(verifier, ids, args.new_tokens, eos_token_id=[]),
        "ar_generate": lambda: verifier.generate(ids, static_engine=True, **common),
        "chunk": lambda: verifier.generate(ids, assistant_model=drafter, kv_budget=512, **common),
        "selfchunk": lambda: verifier.generate(ids, assistant_model=verifier, kv_budget=512, **common),
    }
    rows = {}
    for name, call in methods.items():
        for _ in range(args.warmup):
            forget_sequences(verifier)  # every call prefills its whole prompt, as a call on a new prompt does
            call()
        record.clear()
        outside, inner = [], []
        for _ in range(args.calls):
            forget_sequences(verifier)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            seconds = time.perf_counter() - start
            loop, s = stats[-1]
            outside.append(seconds - s.prefill_seconds - s.rounds_seconds)
            inner.append(loop - s.prefill_seconds - s.rounds_seconds)
        rows[name] = dict(outside_ms=1e3 * statistics.median(outside),
                          decode_rows_outside_ms=1e3 * statistics.median(inner),
                          **{k: 1e3 * statistics.median(v) for k, v in record.items()})
    columns = ["outside_ms", "decode_rows_outside_ms", *PHASES]
    print(f"front end of a call, ms (median of {args.calls}), {device}, context {args.context}")
    print("| method | " + " | ".join(columns) + " |\n|" + " --- |" * (len(columns) + 1))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3f}" if c in row else "-" for c in columns) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu", date=time.strftime("%Y-%m-%d"),
        settings=vars(args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
