"""Why the useless drafter's prefill (through generate()) takes longer than our AR's (direct call) at 16K."""
import gc, json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
import graph_engine as ge
from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.zoo import eval_documents, load_pair

out = Path(os.environ.get("OUT", "runs/prefill")); out.mkdir(parents=True, exist_ok=True)
static_engine.MAX_ENGINES_PER_MODEL = 256
verifier, drafter, _ = load_pair(device="cuda")
docs = eval_documents()
ctx = int(os.environ.get("CTX", "16384"))
prompts = [d[None, :ctx].cuda() for d in docs if d.numel() >= ctx][:2]
names = os.environ.get("METHODS", "graph-ar,useless-gA").split(",")

log = []
orig_prefill = static_engine.StaticEngine.prefill
def prefill(self, *a, **k):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter(); e0.record()
    r = orig_prefill(self, *a, **k)
    e1.record(); host = time.perf_counter() - t
    torch.cuda.synchronize()
    log.append(dict(host_ms=1e3 * host, gpu_ms=e0.elapsed_time(e1), deferred=self.drafter_deferred))
    return r
static_engine.StaticEngine.prefill = prefill

gcs, start = [], [None]
def cb(phase, info):
    if phase == "start": start[0] = time.perf_counter()
    else: gcs.append((info["generation"], 1e3 * (time.perf_counter() - start[0])))
gc.callbacks.append(cb)

for n in names:
    for _ in range(2):
        ge.timed(ge.runner(n, verifier, drafter, prompts[0], 128))
print("warm", flush=True)
rows = []
for phase in ("plain", "gc-frozen", "gc-off"):
    if phase == "gc-frozen": gc.collect(); gc.freeze()
    if phase == "gc-off": gc.disable()
    for rep in range(4):
        for i, ids in enumerate(prompts):
            for n in names:
                log.clear(); gcs.clear()
                s, seq, stats, _ = ge.timed(ge.runner(n, verifier, drafter, ids, 128))
                p = log[-1] if log else {}
                rows.append(dict(phase=phase, method=n, doc=i, rep=rep, ms=1e3 * s,
                                 prefill_ms=1e3 * stats["prefill_seconds"], **p,
                                 gc=[g for g in gcs], gc_ms=sum(d for _, d in gcs)))
    gc.enable()
    print(phase, flush=True)
(out / "prefill_diag.json").write_text(json.dumps(rows, indent=1))
for phase in ("plain", "gc-frozen", "gc-off"):
    for n in names:
        r = [x for x in rows if x["phase"] == phase and x["method"] == n]
        md = lambda k: statistics.median(x[k] for x in r)
        print(f"{phase:10s} {n:12s} call {md('ms'):6.2f} prefill {md('prefill_ms'):6.2f} host {md('host_ms'):6.2f} "
              f"gpu {md('gpu_ms'):6.2f} gc_ms {md('gc_ms'):5.2f} prefills {[round(x['prefill_ms'],1) for x in r]} "
              f"gcs {[len(x['gc']) for x in r]}")
for n in names:
    (out / f"profile-{n}.txt").write_text(ge.profile_method(ge.runner(n, verifier, drafter, prompts[0], 128), n,
                                                             out / f"trace-{n}.json.gz"))
print("done", flush=True)
