"""Tensor parallelism's speed (issue 56): the verifier sharded over the GPUs of one host with transformers'
``tp_plan="auto"`` (one process per GPU under torchrun) against the same verifier on one GPU, in one run, random
bf16 weights of a real shape (``--layers`` keeps the first N decoder layers: a step's cost is per layer, so a 70B
shape that does not fit one host's disk or one GPU is timed on fewer layers and says so).

Per context L, batch 1, milliseconds per captured step (compiled with ``--compile``, as ``generate()`` does):

* ``ar``: the verifier on one token; ``verify``: on γ + 1 tokens (full static cache);
* ``draft-chunk-B``: one draft round of the drafter (Llama-3.2-1B shape, replicated on every rank, its cache a chunk
  budget B) divided by γ: tensor parallelism does not split it, so it shows what the replicated drafter costs;
* for the sharded verifier, the all-reduces' share of the AR step's GPU time (``torch.profiler``, kernels whose name
  holds ``nccl``), on rank 0; the AR step's costliest kernels, one GPU and TP rank 0, go to ``profile-ar-*.txt``.

The one-GPU steps run first, in this process on ``cuda:0``; then ``--gpus`` processes under torchrun load the same
checkpoint with ``tp_plan="auto"`` and run the same steps in lockstep (each step's all-reduces join every rank), rank
0 timing them. The checkpoint (random weights, seed 0) is written once under ``--work``. Writes ``results.json``,
``table.md`` and ``tp_speedup.png`` under ``--out``.

    python benchmarks/tensor_parallel.py --verifier llama-3.1-8b --contexts 16384 32768 65536 --out runs/tp-8b
    python benchmarks/tensor_parallel.py --verifier llama-3.1-70b --layers 20 --skip-single --contexts 32768 65536
    python benchmarks/tensor_parallel.py --tiny --device cpu --out /tmp/tp     # CPU smoke test (gloo, uncaptured)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import hf_sparsekv  # noqa: F401  (registers the attention implementations the models are built with)
from provenance import commit
from real_cost import SHAPES, build, engine_step_seconds, time_graph_step

DRAFTER = "llama-3.2-1b"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="llama-3.1-8b", choices=[k for k in SHAPES if k.startswith("llama")])
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--budget", type=int, default=1024, help="the drafter's chunk budget")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="compile the steps before capture (generate()'s default)")
    p.add_argument("--ar-only", action="store_true", help="time the AR step only (no verify or draft steps)")
    p.add_argument("--skip-single", action="store_true", help="no one-GPU baseline (a shape that does not fit one)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and contexts: the same code path as a smoke test")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo, uncaptured (with --tiny)")
    p.add_argument("--work", default=None, help="where the checkpoint goes (default: OUT/checkpoint)")
    p.add_argument("--out", default="runs/tensor-parallel")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny")
    if args.tiny:
        args.contexts = [c for c in args.contexts if c <= 256] or [64, 128]
        args.budget, args.repeats, args.warmup = 16, 3, 1
    return args


def _model(name: str, device: torch.device, tiny: bool, layers: int | None):
    """Random weights of ``name``'s shape (seed 0), its first ``layers`` decoder layers; tiny: 4 key/value heads, so
    that up to 4 ranks each hold whole heads."""
    overrides = {} if layers is None else dict(num_hidden_layers=layers)
    if tiny:
        overrides["num_key_value_heads"] = 4
    return build(name, device, torch.float32 if tiny else torch.bfloat16, tiny, **overrides)


def checkpoint(args) -> Path:
    """The verifier's random weights saved once under ``--work`` (what every rank loads with ``tp_plan``)."""
    path = Path(args.work or Path(args.out) / "checkpoint") / f"{args.verifier}-{args.layers or 'all'}-{args.tiny}"
    if not (path / "config.json").exists():
        model = _model(args.verifier, torch.device(args.device), args.tiny, args.layers)
        model.config._attn_implementation = "sdpa"
        model.save_pretrained(path)
        del model
    return path


def step_times(verifier, drafter, args, device) -> dict[int, dict[str, float]]:
    """Seconds per step (``ar``, ``verify``, ``draft-chunk-B``) at each context, on the engine ``generate()`` uses."""
    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.generation.graph_steps import static_attention_for

    vocab = verifier.config.vocab_size
    out = {}
    for L in args.contexts:
        torch.manual_seed(L)
        prompts = [torch.randint(0, vocab, (1, L), device=device)]
        steps = {}

        def timed(mode, budget, draft_model, *names):
            return engine_step_seconds(verifier, draft_model, mode, budget, args.gamma, prompts, device,
                                       args.repeats, args.warmup, *names)

        with torch.no_grad(), static_attention_for(verifier, drafter):
            (steps["ar"],) = timed("ar", None, None, "ar_step")
            if not args.ar_only:
                draft_round, steps["verify"] = timed("chunk", args.budget, drafter, "draft", "verify")
                steps[f"draft-chunk-{args.budget}"] = draft_round / args.gamma
        out[L] = steps
        print(f"[L={L}] " + " ".join(f"{k}={v * 1e3:.3f}ms" for k, v in steps.items()), flush=True)
    static_engine.release_engines()
    return out


def profile_ar(verifier, args, device) -> dict[int, tuple[float | None, str]]:
    """Per context: the share of the AR step's kernel time spent in NCCL kernels, and the profile's table of its
    costliest kernels (10 replays; GPU kernels on CUDA, host operators on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.generation.graph_steps import static_attention_for

    cuda = device.type == "cuda"
    out = {}
    for L in args.contexts:
        torch.manual_seed(L)
        prompt = torch.randint(0, verifier.config.vocab_size, (1, L), device=device)
        static_engine.release_engines()
        with torch.no_grad(), static_attention_for(verifier):
            engine = static_engine.engine_for(verifier, None, "ar", None, 1, L + 64, 64, cuda)
            engine.prefill([prompt])
            time_graph_step(engine, "ar_step", device, 1, args.warmup)
            n0, seq0 = engine.n.clone(), engine.seq.clone()
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    engine.run_step("ar_step")
                    engine.n.copy_(n0)
                    engine.seq.copy_(seq0)
                if cuda:
                    torch.cuda.synchronize(device)
        events, share = prof.key_averages(), None
        if cuda:
            kernels = [e for e in events if e.device_type.name == "CUDA"]
            total = sum(e.self_device_time_total for e in kernels)
            share = sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / total if total else None
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        out[L] = (share, events.table(sort_by=sort, row_limit=30, max_name_column_width=90))
    static_engine.release_engines()
    return out


def rank_worker(args) -> int:
    """One rank of the sharded run (under torchrun): load the checkpoint with ``tp_plan="auto"``, time the steps in
    lockstep with the other ranks, and on rank 0 write ``tp.json``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    verifier = AutoModelForCausalLM.from_pretrained(checkpoint(args), tp_plan="auto",
                                                    dtype=torch.float32 if args.tiny else torch.bfloat16).eval()
    device = verifier.device
    drafter = _model(DRAFTER, device, args.tiny, None)  # seed 0 on every rank: the same replicated weights
    seconds = step_times(verifier, drafter, args, device)
    profiles = profile_ar(verifier, args, device)
    from hf_sparsekv.generation import engine as static_engine

    static_engine.release_engines()  # before the group goes: a live graph holding NCCL calls makes the destroy hang
    if rank == 0:
        for L, (_, table) in profiles.items():
            (Path(args.out) / f"profile-ar-tp-{L}.txt").write_text(table)
        (Path(args.out) / "tp.json").write_text(json.dumps(dict(
            tp_size=verifier._tp_size, seconds={str(k): v for k, v in seconds.items()},
            allreduce_share={str(k): share for k, (share, _) in profiles.items()})))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def sharded(args) -> dict:
    """Run :func:`rank_worker` in ``--gpus`` processes; rank 0's results."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.gpus),
           __file__, "--rank-worker", *_forwarded(args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.device == "cpu":  # transformers shards on the CPU when no GPU is visible
        env["CUDA_VISIBLE_DEVICES"] = ""
    subprocess.run(cmd, check=True, env=env)
    return json.loads((Path(args.out) / "tp.json").read_text())


def _forwarded(args) -> list[str]:
    out = ["--verifier", args.verifier, "--contexts", *map(str, args.contexts), "--gpus", str(args.gpus),
           "--gamma", str(args.gamma), "--budget", str(args.budget), "--repeats", str(args.repeats),
           "--warmup", str(args.warmup), "--device", args.device, "--out", args.out]
    out += ["--layers", str(args.layers)] if args.layers is not None else []
    out += ["--work", args.work] if args.work else []
    out += ["--compile"] if args.compile else []
    out += ["--ar-only"] if args.ar_only else []
    out += ["--tiny"] if args.tiny else []
    return out


def rows_of(single: dict | None, tp: dict, contexts: list[int]) -> list[dict]:
    rows = []
    for L in contexts:
        for step, t in tp["seconds"][str(L)].items():
            one = None if single is None else single[L][step]
            rows.append(dict(context=L, step=step, one_gpu_ms=None if one is None else 1e3 * one, tp_ms=1e3 * t,
                             speedup=None if one is None else one / t,
                             allreduce_share=tp["allreduce_share"][str(L)] if step == "ar" else None))
    return rows


def markdown(rows: list[dict], args, tp_size: int) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    shape = args.verifier + (f", first {args.layers} layers" if args.layers else "") + (" (tiny)" if args.tiny else "")
    lines = [f"{shape}, γ = {args.gamma}, drafter {DRAFTER} on a chunk budget of {args.budget}, tensor parallel over "
             f"{tp_size} ({'compiled' if args.compile else 'uncompiled'} captured steps)", "",
             "| context | step | one GPU ms | TP ms | one / TP | all-reduce share of the step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['step']} | {f(r['one_gpu_ms'], '.3f')} | {r['tp_ms']:.3f} | "
                     f"{f(r['speedup'], '.2f')} | {f(r['allreduce_share'], '.1%')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for step in dict.fromkeys(r["step"] for r in rows):
        pts = [(r["context"], r["speedup"]) for r in rows if r["step"] == step and r["speedup"] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=step)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("one-GPU step time / tensor-parallel step time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rank_worker:
        return rank_worker(args)
    os.environ["HF_SPARSEKV_COMPILE"] = "1" if args.compile else "0"  # this process's steps and the ranks' alike
    checkpoint(args)
    single = None
    if not args.skip_single:
        device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
        verifier = _model(args.verifier, device, args.tiny, args.layers)
        drafter = _model(DRAFTER, device, args.tiny, None)
        single = step_times(verifier, drafter, args, device)
        for L, (_, table) in profile_ar(verifier, args, device).items():
            (out / f"profile-ar-one-gpu-{L}.txt").write_text(table)
        del verifier, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tp = sharded(args)
    rows = rows_of(single, tp, args.contexts)
    table = markdown(rows, args, tp["tp_size"])
    payload = dict(gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   gpus=args.gpus, date=datetime.date.today().isoformat(), commit=commit(), torch=torch.__version__,
                   settings={k: v for k, v in vars(args).items() if k != "rank_worker"}, rows=rows)
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    (out / "table.md").write_text(table)
    plot(rows, out / "tp_speedup.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
