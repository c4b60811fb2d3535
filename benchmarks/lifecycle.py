"""What a user pays over a loop of plain ``generate()`` calls on the bundled pair, every compilation included: a loop
of prompts of varying lengths (a dataset evaluation, a notebook) in one process, per call and in total, for HF
static-cache AR, our engine's AR (``static_engine=True``) and the routed ``assistant_model=`` call; then each method's
warm call at the longest length (median of repeats, interleaved). Prints a table, writes JSON and a PNG of the
cumulative time.

    python benchmarks/lifecycle.py --out runs/lifecycle [--lengths 3000,9000,...] [--methods hf-static-ar,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402

import hf_sparsekv  # noqa: E402
from hf_sparsekv.zoo import eval_documents, load_pair  # noqa: E402

LENGTHS = (3000, 9000, 5000, 15000, 12000, 2000, 16000, 7000)  # an evaluation loop of mixed lengths, in this order
METHODS = ("hf-static-ar", "static-engine", "routed")


def call(name: str, verifier, drafter, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    common = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    if name == "hf-static-ar":
        return verifier.generate(ids, cache_implementation="static", **common)
    if name == "hf-ar":
        hf_sparsekv.unregister()
        try:
            return verifier.generate(ids, **common)
        finally:
            hf_sparsekv.register()
    if name == "static-engine":
        return verifier.generate(ids, static_engine=True, **common)
    if name == "routed":
        return verifier.generate(ids, assistant_model=drafter, **common)
    raise ValueError(f"unknown method {name!r}")


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/lifecycle")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warm-reps", type=int, default=5)
    args = parser.parse_args(argv)
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    methods = args.methods.split(",")
    verifier, drafter, _ = load_pair(device="cuda")
    text = torch.cat(eval_documents())
    prompts = [text[i * 997 : i * 997 + n][None].cuda() for i, n in enumerate(lengths)]
    record = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=commit(),
                  models="bundled pair (bf16)", lengths=lengths, new_tokens=args.new_tokens, loop={}, warm={})
    for name in methods:  # each method's loop from its first call (compilations included), one after another
        times = [timed(lambda ids=ids: call(name, verifier, drafter, ids, args.new_tokens))
                 for ids in tqdm(prompts, desc=name)]
        record["loop"][name] = times
        print(f"{name}: loop {sum(times):.1f} s ({', '.join(f'{t:.2f}' for t in times)})", flush=True)
    longest = prompts[lengths.index(max(lengths))]
    warm = {name: [] for name in methods}
    for _ in range(args.warm_reps):  # interleaved
        for name in methods:
            warm[name].append(timed(lambda: call(name, verifier, drafter, longest, args.new_tokens)))
    record["warm"] = {name: statistics.median(t) for name, t in warm.items()}
    (out / "lifecycle.json").write_text(json.dumps(record, indent=1))
    print(table(record))
    plot(record, out / "lifecycle.png")
    return 0


def table(record: dict) -> str:
    lines = ["| method | first call (s) | loop total (s) | × HF static loop | warm call at the longest (s) |",
             "| --- | --- | --- | --- | --- |"]
    base = sum(record["loop"].get("hf-static-ar", [float("nan")]))
    for name, times in record["loop"].items():
        lines.append(f"| {name} | {times[0]:.1f} | {sum(times):.1f} | {base / sum(times):.2f} | "
                     f"{record['warm'][name]:.3f} |")
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, times in record["loop"].items():
        total, points = 0.0, [0.0]
        for t in times:
            total += t
            points.append(total)
        ax.plot(range(len(points)), points, marker="o", label=name)
    ax.set_xlabel("calls")
    ax.set_ylabel("seconds, cumulative (compilation included)")
    ax.set_title(f"A loop of {len(record['lengths'])} prompts ({min(record['lengths'])}-{max(record['lengths'])} tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
