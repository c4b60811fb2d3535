"""What filling a self-drafter's chunk cache from the verifier's costs (issue 52): the deferred drafter prefill of a
self-drafting call, its chunks selected from the prompt's kept queries, layers selected as one batch against one at
a time.

The bundled verifier drafting for itself on a chunk budget of 512, one held-out document cut to each ``--contexts``
length. Each repeat runs the verifier's prefill with the drafter's deferred (untimed), then times
``StaticEngine.prefill_drafter`` (synchronised before and after), once batched (``layers_a_batch``'s choice) and once
a layer at a time, interleaved. Reports the median ms of each, and whether the two fills left the same keys and
values (bitwise). Prints a table, writes JSON.

    python benchmarks/self_drafter_fill.py --contexts 2048,16384 --repeats 20 --out runs/self-drafter-fill
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_sparsekv.caches import static as static_caches
from hf_sparsekv.generation import engine as static_engine, graph_steps
from hf_sparsekv.zoo import eval_documents, load_pair

from provenance import commit


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _fill(engine, ids, device: str, batched: bool) -> tuple[float, list[torch.Tensor]]:
    """One deferred prefill, then the drafter's fill timed; returns its seconds and the drafter's buffers."""
    with torch.no_grad(), graph_steps.static_attention_for(engine.verifier):
        engine.prefill([ids], defer_drafter=True)
        if not engine.drafter_deferred:
            raise RuntimeError("the drafter's prefill was not deferred (prompt queries over the engine's limit?)")
        real = static_caches.layers_a_batch
        if not batched:
            static_caches.layers_a_batch = lambda device, logits: 1
        try:
            _sync(device)
            start = time.perf_counter()
            engine.prefill_drafter([ids])
            _sync(device)
            seconds = time.perf_counter() - start
        finally:
            static_caches.layers_a_batch = real
    return seconds, [t.clone() for layer in engine.drafter_cache.layers for t in (layer.keys, layer.values)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048,16384")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="runs/self-drafter-fill")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    verifier, _, _ = load_pair(device=device)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids = eval_documents()[0][None, :context].to(device)
        verifier.generate(ids, assistant_model=verifier, kv_budget=512, max_new_tokens=4, do_sample=False)
        engine = static_engine.current_engine(verifier)
        times = {True: [], False: []}
        same = True
        for _ in range(args.repeats + 1):  # the first of each is a warm-up
            buffers = {}
            for batched in (True, False):
                seconds, buffers[batched] = _fill(engine, ids, device, batched)
                times[batched].append(seconds)
            same &= all(torch.equal(a, b) for a, b in zip(buffers[True], buffers[False]))
        row = dict(context=context, batched_ms=1e3 * statistics.median(times[True][1:]),
                   one_layer_at_a_time_ms=1e3 * statistics.median(times[False][1:]), identical=same)
        rows.append(row)
        print(f"{context}: batched {row['batched_ms']:.2f} ms, a layer at a time {row['one_layer_at_a_time_ms']:.2f} "
              f"ms, identical {same}", flush=True)
    print(f"\nself-drafter fill, bundled verifier, chunk 512, {device}, median of {args.repeats}")
    print("| context | batched ms | a layer at a time ms | × | identical |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['context']} | {r['batched_ms']:.2f} | {r['one_layer_at_a_time_ms']:.2f} | "
              f"{r['one_layer_at_a_time_ms'] / r['batched_ms']:.2f} | {r['identical']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu", date=time.strftime("%Y-%m-%d"),
        commit=commit(), settings=vars(args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
