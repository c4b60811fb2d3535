"""Where a loop's fixed costs go: per call of the 64-prompt loop, Triton compilations, captures, engine builds,
dynamo graphs, and a cProfile summary of slow calls.  python .gpu/diag.py METHOD [N]"""
import cProfile, io, os, pstats, sys, time, collections
sys.path.insert(0, "benchmarks")
import torch, triton
from triton.runtime import jit as tjit
import hf_sparsekv
from hf_sparsekv.generation import engine as eng, graph_steps as gs
import lifecycle as lc
os.environ["HF_SPARSEKV_COMPILE"] = os.environ.get("DIAG_COMPILE", "auto")  # (provenance set 1)

events = collections.defaultdict(list)
def wrap(owner, name, tag, label=lambda a: ""):
    orig = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            events[tag].append((label(a), time.perf_counter() - t))
    setattr(owner, name, w)
if hasattr(tjit.JITFunction, "_do_compile"):
    wrap(tjit.JITFunction, "_do_compile", "triton", lambda a: getattr(a[0], "__name__", "?"))
else:
    print("no _do_compile; triton", triton.__version__)
wrap(gs.CapturedStep, "_capture", "capture")
wrap(eng.StaticEngine, "__init__", "engine")

method = sys.argv[1]
count = int(sys.argv[2]) if len(sys.argv) > 2 else 64
verifier, drafter, _ = lc.load_pair(device="cuda")
text = torch.cat(lc.eval_documents())
lengths = lc.long_lengths(count)
prompts = [text[(7 * i) % 1000 : (7 * i) % 1000 + n][None].cuda() for i, n in enumerate(lengths)]
from torch._dynamo.utils import counters
total = 0.0
for i, ids in enumerate(prompts):
    events.clear()
    graphs0 = counters["stats"]["unique_graphs"]
    if i == 40:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = lc.timed(lambda: lc.call(method, verifier, drafter, ids, 128))
        ka = prof.key_averages()
        print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
        gpu = sum(e.self_device_time_total for e in ka) / 1e3
        print(f"call 40 GPU busy {gpu:.1f} ms of {t*1e3:.1f} ms", flush=True)
    else:
        t = lc.timed(lambda: lc.call(method, verifier, drafter, ids, 128))
    total += t
    tri = events["triton"]
    names = collections.Counter(n for n, _ in tri)
    line = (f"{method} call {i:2d} len {ids.shape[1]:5d} {t:6.2f}s | triton {len(tri)} {sum(s for _, s in tri):.2f}s "
            f"{dict(names) if tri else ''} | captures {len(events['capture'])} {sum(s for _, s in events['capture']):.2f}s"
            f" | engines {len(events['engine'])} {sum(s for _, s in events['engine']):.2f}s"
            f" | dynamo graphs +{counters['stats']['unique_graphs'] - graphs0}")
    print(line, flush=True)
print(f"{method} total {total:.1f}s")
