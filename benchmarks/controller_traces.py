"""Where a controller call gains or loses against our graph AR, round by round (bundled pair, one context, CUDA).

Each method of ``graph_engine.py`` named in ``--methods`` runs ``--repeats`` times on each of ``--docs`` held-out
documents, interleaved, after two warm-up calls each (capture and compilation there); before each timed call the
engines forget the sequence they hold (every call prefills its whole prompt). Per call it records the seconds, the
prefill's and the rounds' seconds (the rest is the front end and the output's assembly), the rounds of each width,
and the controller's trace: each choice (width, plain rounds since the last draft, prompt tokens of a pending
drafter prefill, the plain run at which the next exploration falls due) and each observation (width, steps, the
round's microseconds, positions caught up, prompt tokens prefilled, the first row's accepted drafts). ``--gaps``
runs each named method once more under ``torch.profiler`` on the last document: the device's busy and idle time over
the call and its longest idle gaps.

The steps are traced light by default (``HF_SPARSEKV_COMPILE=light``, a few seconds a configuration; ``--compile 1``
compiles them fully, minutes). ``results.json`` has ``graph_engine.py``'s layout (``records``: context, doc, rep,
method, seconds, tau), which ``tables.py``'s ``per_document`` kind reads, with the trace fields beside.

    python benchmarks/controller_traces.py --out runs/controller-traces --context 16384 --docs 2 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

METHODS = "hf-static-ar,graph-ar,static-engine,useless-gA,full-gA,assisted,selfchunk-512-gA,chunk-512-gA,window-gA"


def traced(controller_class, trace: list):
    """Wrap ``controller_class``'s ``choose`` and ``observe`` so that each call appends its record to ``trace``;
    returns a function that puts the originals back."""
    choose, observe = controller_class.choose, controller_class.observe

    def traced_observe(self, g, accepted, seconds, rounds=1, caught_up=0, prefilled=0, each=None):
        trace.append(("observe", g, rounds, None if seconds is None else round(seconds * 1e6, 1), caught_up, prefilled,
                      accepted[:1]))
        return observe(self, g, accepted, seconds, rounds, caught_up, prefilled, each)

    def traced_choose(self, allowed=None, remaining=None):
        width = choose(self, allowed, remaining)
        trace.append(("choose", width, self.plain_run, self.deferred,
                      self._plain_until[0] if self._plain_until else None))
        return width

    controller_class.choose, controller_class.observe = traced_choose, traced_observe

    def restore():
        controller_class.choose, controller_class.observe = choose, observe
    return restore


def record(context: int, method: str, doc: int, rep: int, seconds: float, stats, trace: list) -> dict:
    """One call's record: ``graph_engine.py``'s fields (τ from the rounds) and the trace's."""
    r = dict(context=context, doc=doc, rep=rep, method=method, seconds=seconds, tau=None, trace=list(trace))
    if stats is not None:
        stats = stats if isinstance(stats, dict) else vars(stats)
        widths = stats.get("width_rounds") or {}
        rounds = sum(widths.values())
        r.update(prefill_s=stats.get("prefill_seconds"), rounds_s=stats.get("rounds_seconds"),
                 widths={str(k): v for k, v in widths.items()}, drafter_prefill_tokens=stats.get("drafter_prefill_tokens"),
                 draft_s=stats.get("draft_seconds"), verify_s=stats.get("verify_seconds"),
                 tau=(stats.get("new_tokens", 0) - 1) / rounds if rounds and method != "graph-ar" else None)
        if r["prefill_s"] is not None and r["rounds_s"] is not None:
            r["outside_s"] = seconds - r["prefill_s"] - r["rounds_s"]
    return r


def gaps(fn, timed, verifier) -> dict:
    """The device's timeline of one call of ``fn`` under torch.profiler: kernels, span, busy and idle ms, the idle
    gaps over 20 us and the ten longest (us)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed(fn, verifier)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, idle, start, end = 0.0, [], *spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, idle, start, end = busy + end - start, idle + [s - end], s, e
        else:
            end = max(end, e)
    busy += end - start
    span = spans[-1][1] - spans[0][0]
    return dict(kernels=len(spans), span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3,
                gaps_over_20us=sum(g > 20 for g in idle), longest_gaps_us=[round(g, 1) for g in sorted(idle)[-10:][::-1]])


def timeline(fn, timed, verifier, out: Path, name: str) -> None:
    """One call of ``fn`` under torch.profiler: ``timeline-NAME.txt``, the host's launches and syncs and the device's
    kernels (start and duration, us) over 2.5 ms from 60 % into the call (a few rounds: where the device waits for the
    host between them), and ``kernels-NAME.txt``, the device's time by kernel over the call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed(fn, verifier)
    events = sorted((e.time_range.start, e.time_range.end, e.device_type == torch.autograd.DeviceType.CUDA, e.name[:70])
                    for e in prof.events())
    device = [e for e in events if e[2]]
    start = device[0][0] + 0.6 * (device[-1][1] - device[0][0])
    host = ("cudaGraphLaunch", "cudaStreamSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "cudaEventRecord", "aten::")
    lines = [f"{s - start:9.1f} {e - s:8.1f} {'G' if cuda else 'C'} {label}" for s, e, cuda, label in events
             if start <= s <= start + 2500 and (cuda or label.startswith(host))]
    (out / f"timeline-{name}.txt").write_text("start_us dur_us G(device)/C(host) name\n" + "\n".join(lines) + "\n")
    totals: dict = {}
    for s, e, _, label in device:
        totals[label] = totals.get(label, 0.0) + e - s
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:25]
    (out / f"kernels-{name}.txt").write_text("\n".join(f"{v / 1e3:8.3f} ms {k}" for k, v in top) + "\n")


def table(records: list[dict]) -> str:
    lines = ["| method | doc | median ms | × graph AR | prefill ms | rounds ms | outside ms | rounds by width (last) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    calls: dict = {}
    for r in records:
        calls.setdefault((r["method"], r["doc"]), []).append(r)
    for (method, doc), rs in calls.items():
        med = lambda key: statistics.median(r[key] for r in rs) if rs[0].get(key) is not None else float("nan")  # noqa: E731
        base = calls.get(("graph-ar", doc))
        ratio = statistics.median(r["seconds"] for r in base) / med("seconds") if base else float("nan")
        lines.append(f"| {method} | {doc} | {1e3 * med('seconds'):.2f} | {ratio:.2f} | {1e3 * med('prefill_s'):.2f} | "
                     f"{1e3 * med('rounds_s'):.2f} | {1e3 * med('outside_s'):.2f} | {rs[-1].get('widths')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--docs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--gaps", default="graph-ar,selfchunk-512-gA,useless-gA")
    p.add_argument("--timeline", default="", help="methods whose call's device timeline is written (window-g1, say)")
    p.add_argument("--compile", default="light", help="HF_SPARSEKV_COMPILE for the run (light, 1, 0)")
    p.add_argument("--out", default="runs/controller-traces")
    args = p.parse_args(argv)
    os.environ["HF_SPARSEKV_COMPILE"] = args.compile
    import torch

    import graph_engine as ge
    from hf_sparsekv.generation import controller, engine as static_engine
    from hf_sparsekv.zoo import eval_documents, load_pair
    from provenance import commit

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    static_engine.MAX_ENGINES_PER_MODEL = 256
    verifier, drafter, _ = load_pair(device="cuda")
    docs = [d[None, : args.context].cuda() for d in eval_documents() if d.numel() >= args.context][: args.docs]
    names = args.methods.split(",")
    runs = {(n, i): ge.runner(n, verifier, drafter, ids, args.new_tokens) for n in names for i, ids in enumerate(docs)}
    trace: list = []
    restore = traced(controller.DraftController, trace)
    try:
        for fn in runs.values():
            for _ in range(2):
                ge.timed(fn, verifier)
        records = []
        for rep in range(args.repeats):
            for (name, doc), fn in runs.items():
                trace.clear()
                seconds, _, stats, _ = ge.timed(fn, verifier)
                records.append(record(args.context, name, doc, rep, seconds, stats, trace))
    finally:
        restore()
    profiled = {n: gaps(runs[(n, len(docs) - 1)], ge.timed, verifier) for n in args.gaps.split(",") if n in names}
    for name in (n for n in args.timeline.split(",") if n in names):
        timeline(runs[(name, 0)], ge.timed, verifier, out, name)
    payload = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=commit(),
                   torch=torch.__version__, settings=dict(vars(args), contexts=args.context, script="controller_traces.py"), records=records,
                   gaps=profiled)
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    print(table(records))
    for name, g in profiled.items():
        print(name, json.dumps(g))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
