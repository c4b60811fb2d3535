"""Speed of the speculative path on CPU (the engine's steps run uncaptured) on the bundled pair.

Greedy speculative generation (chunk budget 256, γ = 3) and plain greedy ``generate()`` from held-out documents cut
to ``--context`` tokens, median of ``--repeats`` after one warm-up, float32, the threads torch picks. Prints a table
and writes ``cpu_path.json``. To compare two checkouts on one machine, run this script under each one's
``PYTHONPATH`` in turn (interleaved), as the one-engine refactor's check did (benchmarks/results/HISTORY.md).
Before each call the kept engine forgets the sequence it holds, so that a repeat prefills its whole prompt.

    python benchmarks/cpu_path.py --context 3072 --new-tokens 64 --out runs/cpu-path
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_sparsekv
from hf_sparsekv.generation.engine import forget_sequences
from hf_sparsekv.zoo import eval_documents, load_pair


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=3072)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/cpu-path")
    args = p.parse_args()
    verifier, drafter, _ = load_pair(device="cpu")
    ids = eval_documents()[0][None, : args.context]
    greedy = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    methods = {
        "greedy-ar": lambda: verifier.generate(ids, **greedy),
        "chunk-256-g3": lambda: verifier.generate(ids, assistant_model=drafter, kv_budget=256, num_assistant_tokens=3,
                                                  **greedy),
    }
    seconds = {name: [] for name in methods}
    outputs = {}
    with torch.no_grad():
        for repeat in range(args.repeats + 1):  # the first round is the warm-up
            for name, run in methods.items():
                forget_sequences(verifier)  # a repeat prefills its whole prompt, as plain generate() does
                start = time.perf_counter()
                outputs[name] = run()
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
    rows = [{"method": name, "seconds": statistics.median(s), "tokens_per_s": args.new_tokens / statistics.median(s)}
            for name, s in seconds.items()]
    print(f"| method | s (prefill {args.context} + {args.new_tokens} new) | new tokens/s |\n| --- | --- | --- |")
    for row in rows:
        print(f"| {row['method']} | {row['seconds']:.2f} | {row['tokens_per_s']:.1f} |")
    identical = torch.equal(outputs["greedy-ar"], outputs["chunk-256-g3"])
    print(f"speculative output identical to greedy: {identical}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"settings": vars(args), "threads": torch.get_num_threads(), "package": hf_sparsekv.__file__,
              "rows": rows, "identical": identical}
    (out / "cpu_path.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
