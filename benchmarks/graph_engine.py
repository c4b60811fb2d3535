"""End-to-end speed of the CUDA-graph path on the bundled pair, against every AR baseline a user has, in one run.

Methods, interleaved within each repeat (so that the noisy host affects them alike):

  hf-eager-ar      verifier.generate(ids, do_sample=False)                         stock eager AR
  hf-static-ar     verifier.generate(ids, cache_implementation="static")           transformers' compiled static AR
  graph-ar         hf_sparsekv.graph_greedy_generate(verifier, ids)                our AR on the captured static engine
  hf-assisted      verifier.generate(ids, assistant_model=drafter), unregistered    stock assisted generation (eager)
  assisted         the same call with the import: routed to our engine               (full drafter cache, controller's γ)
  static-engine    verifier.generate(ids, static_engine=True)                      our AR through stock generate()
  chunk-B-gG       generate(..., kv_budget=B, num_assistant_tokens=G)              ours, graph path
  window-gG        generate(..., draft_cache="window", kv_budget=1024)             ours, graph path
  int4-self-gG     generate(..., assistant_model=verifier, draft_cache="int4")     ours, graph path (QuantSpec self-spec)
  int4-self-full-gG  the same with draft_weights="full" (no 4-bit draft weights)
  full-gG          generate(..., draft_cache="full")                               ours, the drafter on a full cache
  selfchunk-B-gG   generate(..., assistant_model=verifier, kv_budget=B)            ours, self-drafting on a chunk cache
  useless-gG       full-gG with a drafter that never agrees (its output ids rolled by one)
  lookup-gG        generate(ids, prompt_lookup_num_tokens=G)                      stock's call, on our graph path (retrieval)
  hf-lookup-gG     the same call with hf_sparsekv.unregister()d                    stock's own prompt lookup (eager)
  NAME-nocompile   NAME with HF_SPARSEKV_COMPILE=0: captured steps without torch.compile (ablation)
  NAME-eagerprefill  NAME with HF_SPARSEKV_PREFILL_COMPILE=0: compiled steps, the prefill eager (ablation)
  NAME-lookup      chunk/window NAME with prompt_lookup_num_tokens=G too: retrieval beside the drafter
  NAME-tN          chunk/window NAME (or NAME-lookup) with draft_tree_size=N: trees of N draft nodes a round

Our graph AR's round loop is read too (a round a token), so that its prefill, step and host times sit beside the
speculative methods'. The host's time is split: between the rounds' steps (per round), and outside the prefill and
the rounds (per call: ``generate()``'s front end, the engine's lookup, the output's assembly).

``gG`` fixes γ = G (``num_assistant_tokens=G``, the constant schedule); ``gA`` leaves it to the draft-length controller
(at most 8 drafts a round; lookup-gA: prompt_lookup_num_tokens=8).

``--profile NAME,...`` runs each named method once more under torch.profiler (CUDA time by kernel; the host's and
the device's timeline as a gzipped Chrome trace beside it, to find where a call's wall time goes between steps).
``--busy N``: the timed repeats run beside N processes that each spin on one of the host's cores (the warm-ups on an
idle host), as on a host shared with other jobs.
``--temperature T``: every method samples (``do_sample=True, temperature=T``, the pair's other generation defaults;
speculative sampling on the graph path), graph-ar is left out (it is greedy only) and there is no identity check.

Every method is called as a user calls it, ``generate(ids, ...)`` returning sequences (no returned cache, as the
baselines); the speculative stats are read from the engine's round loop. Before each timed call the kept engines forget
the sequence they hold (``forget_sequences``): a repeat, or a method sharing another's engine, prefills its whole
prompt, as HF's static cache does. End to end (prefill + decode) tokens/s, median of ``--repeats`` after one warm-up run per method and context
(torch.compile and graph capture happen there; its duration is reported as ``first_call_s``; a second warm-up
pass catches the recompiles one method's model change causes in another's steps), acceptance α and τ, peak memory, token identity against greedy AR (stock's; our graph AR's where stock's eager AR
is not in the run; a call apart from it is checked once per document for a tie of the verifier's dtype at its first
token apart, ``speculative.tie_check``, and the table counts those).
The slow stock baselines run ``--slow-repeats`` times. ``--steps`` also times one captured draft step and one
captured verify step against the same steps run eagerly. Prints a table, writes ``results.json`` and a PNG plot.

    python benchmarks/graph_engine.py --contexts 4096,16384 --docs 3 --new-tokens 256 --out runs/graph-engine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import hf_sparsekv
from hf_sparsekv.generation import compile_policy, engine as static_engine, graph_steps, rounds
from hf_sparsekv.generation.controller import CATCH_UP, PREFILL, ControllerMemory
from hf_sparsekv.zoo import eval_documents, load_pair
from provenance import commit
from spec_methods import _first_mismatch
from speculative import tie_check

ABLATIONS = {"-nocompile": compile_policy.COMPILE_ENV, "-eagerprefill": graph_steps.PREFILL_COMPILE_ENV,
             "-noqueue": rounds.QUEUE_DRAFTS_ENV}  # set to "0"
SLOW = ("hf-eager-ar", "hf-assisted") + tuple(f"hf-lookup-g{g}" for g in range(1, 33))


def methods(budgets, gammas, sampling: bool = False) -> list[str]:
    names = ["hf-eager-ar", "hf-static-ar"] + ([] if sampling else ["graph-ar"]) + ["hf-assisted"]
    names += [f"chunk-{b}-g{g}" for b in budgets for g in gammas]
    names += [f"window-g{g}" for g in gammas] + [f"int4-self-g{g}" for g in gammas]
    names += [f"lookup-g{g}" for g in gammas] + [f"hf-lookup-g{g}" for g in gammas]
    return names


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """Environment variable ``name`` set to ``value`` inside the block (None: left as it is)."""
    previous = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            os.environ.pop(name) if previous is None else os.environ.update({name: previous})


# an ablation's own controller memory, per method and engine: a method and its ablation share an engine (the same
# configuration), and each learns from its own calls, as a user running only one of them would
_ABLATION_MEMORY: dict = {}


@contextlib.contextmanager
def _recorded_stats(own_memory: dict | None = None):
    """A list that receives the ``SpecStats`` of each call's first row on our engine inside the block, read from the
    engine's round loop (``rounds.static_decode_rows``, which our graph AR and the one-row speculative calls run):
    the timed call stays ``generate(ids, ...)`` returning sequences, the call shape of the baselines
    (``return_dict_in_generate=True`` would add the copy of the whole KV cache into the returned cache, which stock's
    static AR hands back without a copy). ``own_memory`` (engine id -> ``ControllerMemory``): the call's controller
    learns from and into its own memory instead of the engine's."""
    calls = []
    original = rounds.static_decode_rows

    def recorded(engine, *args, **kwargs):
        shared = engine.controller_memory
        if own_memory is not None:
            engine.controller_memory = own_memory.setdefault(id(engine), ControllerMemory(shared.gamma))
        try:
            results = original(engine, *args, **kwargs)
            memory = engine.controller_memory  # what the controller knows after the call (why it chose what it did)
        finally:
            engine.controller_memory = shared
        calls.append(results[0].stats)
        calls[-1].controller = dict(
            round_ms={w: round(1e3 * statistics.median(v), 4) for w, v in memory.samples.items() if w >= 0},
            prefill_us_per_token=round(1e6 * statistics.median(memory.samples[PREFILL]), 4) if PREFILL in memory.samples else None,
            catch_up_us_per_step=(round(1e6 * statistics.median(memory.samples[CATCH_UP]), 3) if CATCH_UP in memory.samples
                                  else None),
            acceptance=[round(h / t, 3) if t else None for h, t in zip(memory.hits, memory.trials)],
            plain_run=memory.plain_run)
        return results
    rounds.static_decode_rows = recorded
    try:
        yield calls
    finally:
        rounds.static_decode_rows = original


def runner(name: str, verifier, drafter, ids: torch.Tensor, new_tokens: int, temperature: float | None = None,
           own_memory: dict | None = None):
    """A function running method ``name`` once -> (sequences, spec_stats or None); greedy, or sampled at
    ``temperature``; an ablation (``NAME-noqueue``, ...) with its own controller memory (:func:`_recorded_stats`)."""
    for suffix, variable in ABLATIONS.items():
        if name.endswith(suffix):
            inner = runner(name.removesuffix(suffix), verifier, drafter, ids, new_tokens, temperature,
                           _ABLATION_MEMORY.setdefault(name, {}) if own_memory is None else own_memory)

            def ablated(inner=inner, variable=variable):
                with _env(variable, "0"):
                    return inner()
            return ablated
    common = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    if temperature is not None:
        common.update(do_sample=True, temperature=temperature)
    if name == "hf-eager-ar":
        return lambda: (verifier.generate(ids, **common), None)
    if name == "hf-static-ar":
        return lambda: (verifier.generate(ids, cache_implementation="static", **common), None)
    if name == "graph-ar":

        def ar():
            with _recorded_stats(own_memory) as calls:
                sequences = hf_sparsekv.graph_greedy_generate(verifier, ids, new_tokens, eos_token_id=[])
            return sequences, calls[-1] if calls else None
        return ar
    if name == "static-engine":
        return lambda: (verifier.generate(ids, static_engine=True, **common), None)
    if name == "assisted":

        def routed():
            with _recorded_stats(own_memory) as calls:
                sequences = verifier.generate(ids, assistant_model=drafter, **common)
            return sequences, calls[-1] if calls else None
        return routed
    if name == "hf-assisted" or name.startswith("hf-lookup-g"):
        call = (dict(assistant_model=drafter) if name == "hf-assisted"
                else dict(prompt_lookup_num_tokens=int(name[len("hf-lookup-g"):])))

        def stock():
            hf_sparsekv.unregister()
            try:
                return verifier.generate(ids, **call, **common), None
            finally:
                hf_sparsekv.register()
        return stock
    if name.startswith("lookup-g"):
        g = name[len("lookup-g"):]
        length = dict(prompt_lookup_num_tokens=8) if g == "A" else dict(prompt_lookup_num_tokens=int(g),
                                                                       num_assistant_tokens_schedule="constant")

        def lookup():
            with _recorded_stats(own_memory) as calls:
                sequences = verifier.generate(ids, **length, **common)
            return sequences, calls[-1] if calls else None
        return lookup
    extra = {}
    base, _, size = name.rpartition("-t")
    if base and size.isdigit():  # NAME-tN: trees of N draft nodes
        name, extra["draft_tree_size"] = base, int(size)
    if name.endswith("-lookup"):  # retrieval beside the drafter: a round with a match verifies the retrieved chain
        name = name.removesuffix("-lookup")
        extra["prompt_lookup_num_tokens"] = int(name.split("-")[-1][1:])
    kind, *rest = name.split("-")
    length = {} if rest[-1] == "gA" else dict(num_assistant_tokens=int(rest[-1][1:]))
    if kind == "chunk":
        spec = dict(assistant_model=drafter, kv_budget=int(rest[0]))
    elif kind == "window":
        spec = dict(assistant_model=drafter, draft_cache="window", kv_budget=1024)
    elif kind == "full":
        spec = dict(assistant_model=drafter, draft_cache="full")
    elif kind == "useless":
        spec = dict(assistant_model=_useless(drafter), draft_cache="full")
    elif kind == "selfchunk":
        spec = dict(assistant_model=verifier, draft_cache="chunk", kv_budget=int(rest[0]))
    else:  # int4-self-gG: the default draft weights (4-bit on CUDA); int4-self-full-gG: the model's own
        spec = dict(assistant_model=verifier, draft_cache="int4")
        if "full" in rest:
            spec["draft_weights"] = "full"

    def run():
        with _recorded_stats(own_memory) as calls:
            sequences = verifier.generate(ids, **length, **spec, **extra, **common)
        return sequences, calls[-1] if calls else None
    return run


_USELESS = {}


def _useless(drafter):
    """A copy of ``drafter`` whose output ids are rolled by one: it drafts the id after its own choice, which the
    verifier (nearly) never agrees with."""
    if id(drafter) not in _USELESS:
        import copy

        copy_ = copy.deepcopy(drafter)
        with torch.no_grad():
            head = copy_.get_output_embeddings().weight
            head.copy_(head.roll(1, 0))
        _USELESS[id(drafter)] = copy_
    return _USELESS[id(drafter)]


def near_tie(verifier, method: str, ids: torch.Tensor, seq: torch.Tensor, reference: torch.Tensor) -> bool | None:
    """Whether ``seq`` (``[1, P + n]``, a call's output for the prompt ``ids [1, P]``) first leaves ``reference`` (our
    AR's) at a tie of the verifier's dtype: the float64 logits of the two tokens there closer than the dtype's error
    on them (``speculative.tie_check``). None where that cannot tell: int4 verifies on the INT8 view (its reference is
    not our AR), or the two differ in length only."""
    mismatch = None if method.startswith("int4") else _first_mismatch(seq, reference, ids.shape[1])
    if mismatch is None or "got" not in mismatch:
        return None
    return tie_check(verifier, ids, reference, mismatch)["tie"]


@contextlib.contextmanager
def busy_host(processes: int):
    """``processes`` Python processes that spin (one core each) while the block runs, then are stopped."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(1.0 if spinners else 0.0)  # let them start
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def timed(fn, verifier) -> tuple[float, torch.Tensor, dict | None, int]:
    static_engine.forget_sequences(verifier)  # a repeat prefills its whole prompt, as HF static does
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    seq, stats = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, seq, stats, torch.cuda.max_memory_allocated()


def step_times(verifier, drafter, ids, new_tokens, reps=50) -> dict:
    """Median ms of one captured draft step / verify step against the same step function run eagerly."""
    verifier.generate(ids, assistant_model=drafter, kv_budget=512, num_assistant_tokens=3, max_new_tokens=new_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    engine = static_engine.current_engine(verifier)
    result = {}
    for name in ("draft", "verify"):
        step = engine.steps[name]
        n0 = engine.n.clone()
        for label, fn in (("graph", step), ("eager", step.eager_fn)):
            times = []
            with torch.no_grad(), graph_steps.static_attention_for(verifier, drafter):
                for _ in range(reps):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    torch.cuda.synchronize()
                    engine.n.copy_(n0)
                    times.append(a.elapsed_time(b))
            result[f"{name}_{label}_ms"] = statistics.median(times)
    result["gamma"] = 3
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,16384")
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slow-repeats", type=int, default=1)
    p.add_argument("--budgets", default="256,512,1024,2048")
    p.add_argument("--gammas", default="3,5")
    p.add_argument("--only", default="", help="comma-separated method names (default: all)")
    p.add_argument("--extra", default="", help="comma-separated methods added to the list (e.g. graph-ar-nocompile)")
    p.add_argument("--steps", action="store_true", help="also time captured vs eager draft/verify steps")
    p.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    p.add_argument("--profile", default="", help="comma-separated methods to run once more under torch.profiler "
                   "(first context): CUDA time by kernel, written to profile-NAME.txt")
    p.add_argument("--busy", type=int, default=0, help="time the repeats beside this many processes that spin on the "
                   "host's cores (the warm-ups run on an idle host): a busy shared host")
    p.add_argument("--out", default="runs/graph-engine")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    static_engine.MAX_ENGINES_PER_MODEL = 256  # every configuration keeps its captured graphs across the interleaved runs
    verifier, drafter, _ = load_pair(device="cuda")
    docs = eval_documents()
    sampling = args.temperature is not None
    names = methods([int(b) for b in args.budgets.split(",")], [int(g) for g in args.gammas.split(",")], sampling)
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    names += [n for n in args.extra.split(",") if n]
    records, first_call = [], {}
    from tqdm import tqdm

    def save() -> dict:
        """results.json as it stands: written after every warm-up and every pass over the documents, so that a run
        cut by a time limit keeps what it measured."""
        payload = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=commit(),
                       torch=torch.__version__, settings=vars(args), summary=summarize(records),
                       first_call_s=first_call, records=records)
        (out / "results.json").write_text(json.dumps(payload, indent=1))
        return payload

    ties: dict = {}  # (context, document, method) -> near_tie's answer, checked once

    def measure(context: int, prompts: list) -> None:
        """The timed repeats at one context: every method on every document, interleaved."""
        references = {}
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                for name in tqdm(names, desc=f"{context} rep {rep} doc {i}", leave=False):
                    if name in SLOW and rep >= args.slow_repeats:
                        continue
                    torch.manual_seed(1000 * rep + i)
                    seconds, seq, stats, peak = timed(runner(name, verifier, drafter, ids, args.new_tokens,
                                                             args.temperature), verifier)
                    if not sampling and (name == "hf-eager-ar" or (name == "graph-ar" and "hf-eager-ar" not in names)):
                        references[i] = seq  # stock greedy; else our AR (itself tested identical to it)
                    ref = references.get(i)
                    identical = None if ref is None else bool(torch.equal(seq, ref))
                    if identical is False and (context, i, name) not in ties:
                        ties[context, i, name] = near_tie(verifier, name, ids, seq, ref)
                    records.append(dict(
                        context=context, doc=i, rep=rep, method=name, seconds=seconds,
                        tokens=int(seq.shape[1] - ids.shape[1]), peak_bytes=peak, identical=identical,
                        tie=None if identical is not False else ties[context, i, name],
                        acceptance=None if stats is None or name == "graph-ar" else stats["acceptance_rate"],
                        tau=None if stats is None or name == "graph-ar" else stats["mean_accepted_length"],
                        **({} if stats is None or not stats["rounds"] else dict(
                            rounds=stats["rounds"], prefill_ms=1e3 * stats["prefill_seconds"],
                            draft_ms_per_round=1e3 * stats["draft_seconds"] / stats["rounds"],
                            verify_ms_per_round=1e3 * stats["verify_seconds"] / stats["rounds"],
                            # the host's time between the rounds' steps, and the call's outside the prefill and the
                            # rounds (its front end, the output's assembly)
                            host_ms_per_round=1e3 * (stats["rounds_seconds"] - stats["draft_seconds"]
                                                     - stats["verify_seconds"]) / stats["rounds"],
                            outside_ms=1e3 * (seconds - stats["prefill_seconds"] - stats["rounds_seconds"]),
                            width_rounds=stats["width_rounds"], controller=stats.controller)),
                    ))
                save()

    for context in [int(c) for c in args.contexts.split(",")]:
        prompts = [d[None, :context].cuda() for d in docs if d.numel() >= context][: args.docs]
        for name in tqdm(names, desc=f"warm-up {context}"):
            first_call[f"{name}@{context}"] = timed(runner(name, verifier, drafter, prompts[0], args.new_tokens,
                                                           args.temperature), verifier)[0]
            save()
        # a second pass: int4 self-speculation swaps the verifier's linear layers for 4-bit-capable ones, so every
        # compiled step of that model that ran before it compiles once more (70 s mid-table on an H200 once)
        for name in tqdm(names, desc=f"warm-up again {context}"):
            timed(runner(name, verifier, drafter, prompts[0], args.new_tokens, args.temperature), verifier)
        with busy_host(args.busy):
            measure(context, prompts)
        payload = save()
        summary = payload["summary"]
        print(table([r for r in summary if r["context"] == context]), flush=True)
    for name in [n for n in args.profile.split(",") if n]:
        context = int(args.contexts.split(",")[0])
        path = out / f"profile-{name}.txt"
        path.write_text(profile_method(runner(name, verifier, drafter, docs[0][None, :context].cuda(),
                                              args.new_tokens, args.temperature), f"{name} at {context}",
                                       out / f"trace-{name}.json.gz", verifier))
        print(path.read_text()[:4000], flush=True)
    if args.steps:
        ids = docs[0][None, :16384].cuda()
        payload["steps_16k"] = step_times(verifier, drafter, ids, 64)
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    print("first call (compile + capture + run), s:", json.dumps({k: round(v, 1) for k, v in first_call.items()}))
    if args.steps:
        print("per-forward ms at 16K (γ=3):", json.dumps(payload["steps_16k"]))
    plot(summary, out / "tokens_per_second.png")
    return 0


def profile_method(fn, label: str, trace: Path, verifier) -> str:
    """torch.profiler table (CUDA time by kernel, with launch counts) of one more run of ``fn`` (compiled and captured
    already), headed by the run's rounds and its draft / verify milliseconds per round; the run's host and device
    timeline is written to ``trace`` (Chrome trace format, gzipped)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    static_engine.forget_sequences(verifier)  # the profiled run prefills its whole prompt too
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, stats = fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    head = f"{label}: one run under torch.profiler\n"
    if stats is not None and stats["rounds"]:
        head += (f"rounds {stats['rounds']}, τ {stats['mean_accepted_length']:.2f}, draft "
                 f"{1e3 * stats['draft_seconds'] / stats['rounds']:.3f} ms/round, verify "
                 f"{1e3 * stats['verify_seconds'] / stats['rounds']:.3f} ms/round, prefill "
                 f"{1e3 * stats['prefill_seconds']:.1f} ms\n")
    events = prof.key_averages()
    head += f"kernel launches: {sum(e.count for e in events if e.device_type.name == 'CUDA')}\n"
    return head + events.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=100) + "\n"


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for context in sorted({r["context"] for r in records}):
        cell = [r for r in records if r["context"] == context]
        tps = {}
        for name in dict.fromkeys(r["method"] for r in cell):
            rs = [r for r in cell if r["method"] == name]
            per_doc = [statistics.median([r["tokens"] / r["seconds"] for r in rs if r["doc"] == d])
                       for d in sorted({r["doc"] for r in rs})]
            tps[name] = statistics.mean(per_doc)
            acc = [r["acceptance"] for r in rs if r["acceptance"] is not None]
            tau = [r["tau"] for r in rs if r["tau"] is not None]
            ident = [r["identical"] for r in rs if r["identical"] is not None]
            tied = sum(1 for r in rs if r.get("tie"))
            per_round = {key: statistics.median([r[key] for r in rs])
                         for key in ("draft_ms_per_round", "verify_ms_per_round", "host_ms_per_round", "outside_ms",
                                     "prefill_ms") if all(key in r for r in rs)}
            rows.append(dict(context=context, method=name, tokens_per_s=tps[name], runs=len(rs), **per_round,
                             acceptance=statistics.mean(acc) if acc else None, tau=statistics.mean(tau) if tau else None,
                             peak_gib=max(r["peak_bytes"] for r in rs) / 2**30,
                             identical=(f"{sum(ident)}/{len(ident)}" + (f" ({tied} apart at a tie)" if tied else ""))
                             if ident else "-"))
        for row in rows:
            if row["context"] == context:
                row["vs_hf_static"] = row["tokens_per_s"] / tps["hf-static-ar"] if "hf-static-ar" in tps else None
                row["vs_graph_ar"] = row["tokens_per_s"] / tps["graph-ar"] if "graph-ar" in tps else None
    return rows


def table(rows: list[dict]) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = ["| context | method | tokens/s | × HF static | × graph AR | α | τ | draft / verify / host ms a round "
             "| ms outside the rounds | peak GiB | identical to AR | runs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['method']} | {r['tokens_per_s']:.0f} | {f(r['vs_hf_static'])} | "
                     f"{f(r['vs_graph_ar'])} | {f(r['acceptance'])} | {f(r['tau'])} | "
                     f"{f(r.get('draft_ms_per_round'), '.3f')} / {f(r.get('verify_ms_per_round'), '.3f')} / "
                     f"{f(r.get('host_ms_per_round'), '.3f')} | {f(r.get('outside_ms'))} | {r['peak_gib']:.2f} | "
                     f"{r['identical']} | {r['runs']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(7 * len(contexts), 5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        cell = [r for r in rows if r["context"] == context]
        ax.barh([r["method"] for r in cell], [r["tokens_per_s"] for r in cell])
        ax.set_title(f"bundled pair, bf16, {context} prompt")
        ax.set_xlabel("tokens/s (end to end)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
