"""The kernels of each captured step of the bundled pair, one replay at a time: what a step's time is made of.

For each step of ``--steps`` (``ar_step``; ``verify:G`` / ``draft:G``: a chunk-budget engine's verification of G
drafts and its G draft steps; with ``--mode int4`` every step is int4 self-speculation's, on the verifier's quantized
store: its plain step, its INT8-view verification and its INT4-view drafts with ``--draft-weights``), on the engine
``generate()`` builds (compiled and captured unless ``HF_SPARSEKV_COMPILE=0``), after a prefill of a held-out
document cut at ``--context`` tokens:

* the step's time: the median over ``--repeats`` replays of CUDA events around one replay (the sequence length put
  back after each, so every replay starts at the prompt's end);
* one replay under torch.profiler: its kernels in launch order with each one's duration and the idle gap before it,
  their count, the sum of their durations and of the gaps.

Prints a table per step and writes ``step_kernels.json`` (every kernel of each step's replay) under ``--out``.

    python benchmarks/step_kernels.py --context 16384 --steps ar_step verify:3 draft:3 --out runs/step-kernels
    python benchmarks/step_kernels.py --mode int4 --steps ar_step verify:6 draft:6 --label int4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch._inductor.config

from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.generation.graph_steps import static_attention_for
from hf_sparsekv.zoo import eval_documents, load_pair

from provenance import commit


@contextlib.contextmanager
def rewound(engine):
    """Run a step inside the block, then put the sequence back, so that every replay starts at the prompt's end."""
    n0, seq0 = engine.n.clone(), engine.seq.clone()
    try:
        yield
    finally:
        engine.n.copy_(n0)
        engine.seq.copy_(seq0)


def replay_seconds(engine, name: str, width: int | None, repeats: int) -> float:
    """Median seconds of one replay of the engine's step ``name`` (CUDA events; on CPU the wall clock)."""
    cuda = engine.n.device.type == "cuda"
    times = []
    for i in range(repeats + 2):
        with rewound(engine):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                engine.run_step(name, width)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                engine.run_step(name, width)
                seconds = time.perf_counter() - t0
        if i >= 2:  # the first replays upload the graph
            times.append(seconds)
    return statistics.median(times)


def replay_kernels(engine, name: str, width: int | None) -> list[dict]:
    """The kernels of one replay in launch order (on CPU: the operators): name, start and duration (µs), idle time
    before it (µs)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.n.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with rewound(engine), profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        engine.run_step(name, width)
        if cuda:
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if not cuda or (e.device_type.name == "CUDA" and e.device_time > 0)),
                     key=lambda e: e.time_range.start)
    out, last_end = [], None
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        out.append(dict(name=e.name, start_us=start, us=end - start,
                        gap_us=0.0 if last_end is None else max(0.0, start - last_end)))
        last_end = end if last_end is None else max(last_end, end)
    return out


def summary(kernels: list[dict]) -> dict:
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        by_name.setdefault(k["name"], []).append(k["us"])
    span = kernels[-1]["start_us"] + kernels[-1]["us"] - kernels[0]["start_us"] if kernels else 0.0
    return dict(kernels=len(kernels), kernel_us=sum(k["us"] for k in kernels),
                gap_us=sum(k["gap_us"] for k in kernels), span_us=span,
                by_name=sorted(((n, len(v), sum(v)) for n, v in by_name.items()), key=lambda t: -t[2]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--budget", type=int, default=512, help="the chunk-budget engine's budget (verify/draft steps)")
    p.add_argument("--steps", nargs="+", default=["ar_step", "verify:3", "draft:3"])
    p.add_argument("--mode", choices=["chunk", "int4"], default="chunk",
                   help="int4: every step on the quantized store of int4 self-speculation (group size 128)")
    p.add_argument("--draft-weights", choices=["int4", "full"], default="int4", help="int4 mode's draft weights")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--inductor", nargs="*", default=[], metavar="OPTION=VALUE",
                   help="torch._inductor.config options set before anything compiles (e.g. combo_kernels=True)")
    p.add_argument("--label", default="", help="a name for this run's settings (e.g. an Inductor option)")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (eager steps)")
    p.add_argument("--out", default="runs/step-kernels")
    args = p.parse_args(argv)
    for option in args.inductor:
        key, _, value = option.partition("=")
        setattr(torch._inductor.config, key, json.loads(value.lower() if value.lower() in ("true", "false") else value))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    verifier, drafter, _ = load_pair(device=args.device)
    ids = eval_documents()[0][None, : args.context].to(args.device)
    engine, engine_key = None, None  # one engine at a time: the steps of one key share it
    results = []
    with torch.no_grad():
        for spec in args.steps:
            name, _, width = spec.partition(":")
            width = int(width) if width else None
            chunk = width is not None and args.mode == "chunk"
            with static_attention_for(*([verifier, drafter] if chunk else [verifier])):
                if engine_key != (chunk, width):
                    static_engine.release_engines()
                    if args.mode == "int4":
                        engine = static_engine.engine_for(
                            verifier, verifier, "int4", 128, width or 1, args.context + 64, 64, args.device == "cuda",
                            draft_weights=args.draft_weights)
                    else:
                        engine = static_engine.engine_for(
                            verifier, drafter if chunk else None, "chunk" if chunk else "full",
                            args.budget if chunk else None, width or 1, args.context + 64, 64, args.device == "cuda")
                    engine.prefill([ids])
                    engine_key = (chunk, width)
                seconds = replay_seconds(engine, name, width, args.repeats)
                kernels = replay_kernels(engine, name, width)
            s = summary(kernels)
            results.append(dict(step=spec, seconds=seconds, **s, sequence=kernels))
            print(f"\n{spec}: {seconds * 1e3:.3f} ms a replay (median of {args.repeats}); one replay under the "
                  f"profiler: {s['kernels']} kernels, {s['kernel_us']:.1f} us in kernels, {s['gap_us']:.1f} us idle "
                  f"between them, span {s['span_us']:.1f} us")
            for n, count, us in s["by_name"][:25]:
                print(f"  {count:4d} x {us / count:6.2f} us = {us:7.1f} us  {n[:110]}")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    (out / f"step_kernels{('-' + args.label) if args.label else ''}.json").write_text(json.dumps(
        dict(gpu=gpu, commit=commit(), torch=torch.__version__, settings=vars(args), steps=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
