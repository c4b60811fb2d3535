"""What a user pays over a loop of plain ``generate()`` calls on the bundled pair, every compilation included: a loop
of prompts of varying lengths (a dataset evaluation, a notebook) in one process, per call and in total, for HF
static-cache AR, our engine's AR (``static_engine=True``) and the routed ``assistant_model=`` call; then each method's
warm call at the longest length (median of repeats, interleaved); a second loop of 64 prompts of 1K-16K tokens, each
method's in a fresh process (its first call and compilations included, as a user's script pays them); a chat whose
turns extend the previous output; configurations alternated on one model. Prints a table, writes JSON and a PNG of
the cumulative time.

    python benchmarks/lifecycle.py --out runs/lifecycle [--lengths 3000,9000,...] [--methods hf-static-ar,...]
"""

from __future__ import annotations

import argparse
import json
import os
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
METHODS = ("hf-static-ar", "hf-ar", "static-engine", "routed")
ALTERNATED = ("static-engine", "routed", "lookup", "chunk")  # configurations alternated on one model


def call(name: str, verifier, drafter, ids: torch.Tensor, new_tokens: int, **more):
    common = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **more)
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
    if name == "lookup":
        return verifier.generate(ids, prompt_lookup_num_tokens=5, **common)
    if name == "chunk":
        return verifier.generate(ids, assistant_model=drafter, kv_budget=512, **common)
    raise ValueError(f"unknown method {name!r}")


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def loop(name: str, prompts: list, verifier, drafter, new_tokens: int) -> list[float]:
    """One method's loop over ``prompts`` from its first call (compilations included): each call's seconds."""
    from tqdm import tqdm

    times = [timed(lambda ids=ids: call(name, verifier, drafter, ids, new_tokens)) for ids in tqdm(prompts, desc=name)]
    print(f"{name}: loop {sum(times):.1f} s ({', '.join(f'{t:.2f}' for t in times)})", flush=True)
    return times


def chat(name: str, text: torch.Tensor, verifier, drafter, turns: int, start: int, added: int,
         new_tokens: int) -> list[dict]:
    """A chat of ``turns`` turns: the first prompt is ``start`` tokens of ``text``; each later one is the previous
    output and the next ``added`` tokens. Per turn: its seconds, the prompt tokens the engine's verifier and drafter
    prefilled (None for stock); then, after the chat, two warm calls of the same length with no held prefix: on an
    unrelated prompt (``single_s``) and on the turn's own prompt once the engine forgot it (``same_s``: the same
    tokens to draft, so only what the held prefix saves or costs differs)."""
    from hf_sparsekv.generation.engine import current_engine, forget_sequences

    turns_out, prompts, ids, at = [], [], text[None, :start].cuda(), start
    for _ in range(turns):
        holder = {}

        def one(ids=ids):
            holder["out"] = call(name, verifier, drafter, ids, new_tokens)

        seconds = timed(one)
        engine = current_engine(verifier) if name != "hf-static-ar" else None
        turns_out.append(dict(length=ids.shape[1], s=seconds,
                              prefill_tokens=None if engine is None else ids.shape[1] - engine.reused,
                              drafter_prefill_tokens=None if engine is None else engine.drafter_prefill_tokens))
        prompts.append(ids)
        ids = torch.cat([holder["out"], text[None, at : at + added].cuda()], 1)
        at += added
    for turn, own in zip(turns_out, prompts):
        other = text[None, -turn["length"]:].cuda()  # the same length from the other end of the text
        turn["single_s"] = timed(lambda: call(name, verifier, drafter, other, new_tokens))
        forget_sequences(verifier)
        turn["same_s"] = timed(lambda: call(name, verifier, drafter, own, new_tokens))
    print(f"{name}: chat (turn/unrelated/same prompt) "
          + ", ".join(f"{t['s']:.3f}/{t['single_s']:.3f}/{t['same_s']:.3f}" for t in turns_out), flush=True)
    return turns_out


def unrelated(text: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    """``count`` prompts of ``length`` tokens of ``text``, each from another offset: a call on one of them finds none of
    its prefix held by an engine that ran another (a repeated prompt would prefill only its last token)."""
    return [text[None, 131 * i : 131 * i + length].cuda() for i in range(count)]


def alternate(names: list[str], prompts: list[torch.Tensor], verifier, drafter, rounds: int, new_tokens: int,
              setting: str) -> dict:
    """``names`` called in turn on one model for ``rounds`` rounds, round r on ``prompts[r]`` (no call repeats the
    previous one's prompt), then each round's call again 3 times with nothing held (its warm time, the median), with
    ``HF_SPARSEKV_COMPILE`` set to ``setting`` (``light``: every configuration's steps traced in its first round, so
    that the later rounds and the warm calls run the same steps; under ``auto`` a configuration's trace lands in
    whichever call crosses its threshold): every call's seconds."""
    previous, os.environ["HF_SPARSEKV_COMPILE"] = os.environ.get("HF_SPARSEKV_COMPILE"), setting
    try:
        return _alternate(names, prompts, verifier, drafter, rounds, new_tokens)
    finally:
        os.environ["HF_SPARSEKV_COMPILE"] = previous or "auto"


def _alternate(names: list[str], prompts: list[torch.Tensor], verifier, drafter, rounds: int, new_tokens: int) -> dict:
    from hf_sparsekv.generation.engine import forget_sequences

    def timed_call(name: str, ids: torch.Tensor) -> tuple[float, dict]:
        """The call's seconds, and where they went (``spec_stats``' widths chosen, prefill and rounds seconds; {}
        without stats)."""
        holder = {}
        seconds = timed(lambda: holder.setdefault("out", call(name, verifier, drafter, ids, new_tokens,
                                                                return_dict_in_generate=True)))
        stats = getattr(holder["out"], "spec_stats", None)
        return seconds, {} if stats is None else dict(
            widths=dict(stats.width_rounds), prefill_s=stats.prefill_seconds, rounds_s=stats.rounds_seconds)

    times, phases = {name: [] for name in names}, {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            seconds, where = timed_call(name, prompts[r])
            times[name].append(seconds)
            phases[name].append(where)
    same = {name: [[] for _ in range(rounds)] for name in names}  # each round's call again, warm, 3 times
    same_phases = {name: [] for name in names}  # the last repeat's phases, per round
    for repeat in range(3):
        for r in range(rounds):
            for name in names:
                forget_sequences(verifier)  # (as in its round: nothing of the prompt held)
                seconds, where = timed_call(name, prompts[r])
                same[name][r].append(seconds)
                if repeat == 2:
                    same_phases[name].append(where)
    result = {name: dict(rounds=times[name], warm_same=[statistics.median(t) for t in same[name]],
                         warm=statistics.median(t for ts in same[name] for t in ts), round_phases=phases[name],
                         warm_phases=same_phases[name]) for name in names}
    print("alternation (round/warm on its prompt): " + ", ".join(
        f"{n} " + " ".join(f"{t:.3f}/{w:.3f}" for t, w in zip(r["rounds"], r["warm_same"])) for n, r in result.items()),
        flush=True)
    return result


def long_lengths(count: int) -> list[int]:
    """The second loop's prompt lengths: drawn uniformly from 1K-16K, seeded."""
    return torch.randint(1000, 16001, (count,), generator=torch.Generator().manual_seed(0)).tolist()


def in_fresh_process(part: str, name: str, args, compile_setting: str):
    """``name``'s ``part`` (``"long-loop"``: its loop over :func:`long_lengths`; ``"growth"``: :func:`only_growth`)
    in a new Python process (``--only-<part>``) under ``HF_SPARSEKV_COMPILE=<compile_setting>``: what it wrote."""
    import subprocess

    subprocess.run([sys.executable, __file__, f"--only-{part}", name, "--long-loop", str(args.long_loop),
                    "--new-tokens", str(args.new_tokens), "--compile", compile_setting, "--out", args.out], check=True)
    return json.loads((Path(args.out) / f"{part}-{name}.json").read_text())


def only_long_loop(name: str, args) -> int:
    verifier, drafter, _ = load_pair(device="cuda")
    text = torch.cat(eval_documents())
    lengths = long_lengths(args.long_loop)
    prompts = [text[(7 * i) % 1000 : (7 * i) % 1000 + n][None].cuda() for i, n in enumerate(lengths)]
    times = loop(name, prompts, verifier, drafter, args.new_tokens)
    (Path(args.out) / f"long-loop-{name}.json").write_text(json.dumps(times))
    return 0


GROWTH_LENGTHS = (3000, 12000)  # a first engine of 8,192 positions, then a prompt that outgrows it


def only_growth(name: str, args) -> int:
    """(In a process of its own, with the steps traced light from the first call, so that a recompilation would show)
    three calls at the first of :data:`GROWTH_LENGTHS`, one at the second (the engine grows), three warm calls at the
    second on other prompts: the growth call's seconds, the warm calls', the engine's positions before and after, and
    what the growth call compiled (dynamo graphs, Triton kernels)."""
    from triton.runtime import jit
    from torch._dynamo.utils import counters

    from hf_sparsekv.generation.engine import current_engine

    triton_compiles = []
    if hasattr(jit.JITFunction, "_do_compile"):  # (Triton's private hook: the count is left empty where it is gone)
        do_compile = jit.JITFunction._do_compile

        def counted(self, *a, **k):
            triton_compiles.append(self.__name__)
            return do_compile(self, *a, **k)

        jit.JITFunction._do_compile = counted
    verifier, drafter, _ = load_pair(device="cuda")
    text = torch.cat(eval_documents())
    small, large = GROWTH_LENGTHS
    first = [timed(lambda ids=ids: call(name, verifier, drafter, ids, args.new_tokens))
             for ids in unrelated(text, small, 3)]
    before = current_engine(verifier).max_tokens
    graphs, kernels = counters["stats"]["unique_graphs"], len(triton_compiles)
    grown = unrelated(text, large, 4)
    growth_s = timed(lambda: call(name, verifier, drafter, grown[0], args.new_tokens))
    record = dict(first=first, growth_s=growth_s, positions=[before, current_engine(verifier).max_tokens],
                  dynamo_graphs=counters["stats"]["unique_graphs"] - graphs,
                  triton_kernels=triton_compiles[kernels:])
    record["warm"] = [timed(lambda ids=ids: call(name, verifier, drafter, ids, args.new_tokens)) for ids in grown[1:]]
    print(f"{name}: growth {record}", flush=True)
    (Path(args.out) / f"growth-{name}.json").write_text(json.dumps(record))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/lifecycle")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warm-reps", type=int, default=5)
    parser.add_argument("--long-loop", type=int, default=64,
                        help="prompts of the second loop, each method's in a fresh process (0: none)")
    parser.add_argument("--chat-turns", type=int, default=10, help="turns of the chat (0: none)")
    parser.add_argument("--alternate", default=",".join(ALTERNATED), help="configurations alternated ('': none)")
    parser.add_argument("--alternate-compile", default="light", choices=("auto", "1", "light", "0"),
                        help="HF_SPARSEKV_COMPILE while alternating (light: steps traced in each one's first round)")
    parser.add_argument("--compile", default="auto", choices=("auto", "1", "light", "0"),
                        help="HF_SPARSEKV_COMPILE for our calls (auto: the library's default)")
    parser.add_argument("--growth", action="store_true",
                        help="time a prompt that outgrows the engine (fresh processes)")
    parser.add_argument("--only-long-loop", metavar="METHOD", help=argparse.SUPPRESS)  # (a fresh process's part)
    parser.add_argument("--only-growth", metavar="METHOD", help=argparse.SUPPRESS)  # (a fresh process's part)
    args = parser.parse_args(argv)
    os.environ["HF_SPARSEKV_COMPILE"] = args.compile  # (provenance sets 1 for the other benchmarks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only_long_loop:
        return only_long_loop(args.only_long_loop, args)
    if args.only_growth:
        return only_growth(args.only_growth, args)
    lengths = [int(n) for n in args.lengths.split(",")]
    methods = args.methods.split(",")
    verifier, drafter, _ = load_pair(device="cuda")
    text = torch.cat(eval_documents())
    prompts = [text[i * 997 : i * 997 + n][None].cuda() for i, n in enumerate(lengths)]
    record = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=commit(),
                  models="bundled pair (bf16)", compile=args.compile, lengths=lengths, new_tokens=args.new_tokens,
                  loop={name: loop(name, prompts, verifier, drafter, args.new_tokens) for name in methods})
    longest = unrelated(text, max(lengths), args.warm_reps)
    warm = {name: [] for name in methods}
    for ids in longest:  # interleaved; each repeat on another prompt (no held prefix)
        for name in methods:
            warm[name].append(timed(lambda n=name, ids=ids: call(n, verifier, drafter, ids, args.new_tokens)))
    record["warm"] = {name: statistics.median(t) for name, t in warm.items()}
    save = lambda: (out / "lifecycle.json").write_text(json.dumps(record, indent=1))  # noqa: E731 (after each phase)
    save()
    if args.long_loop:  # each method's in a process of its own: its first call and compilations included
        record["long_loop_lengths"] = long_lengths(args.long_loop)
        record["long_loop"] = {name: in_fresh_process("long-loop", name, args, args.compile)
                               for name in methods if name != "hf-ar"}
        save()
    if args.chat_turns:
        record["chat"] = {name: chat(name, text, verifier, drafter, args.chat_turns, 1024, 512, args.new_tokens)
                          for name in methods if name in ("static-engine", "routed", "hf-static-ar")}
        save()
    if args.growth:
        record["growth"] = {name: in_fresh_process("growth", name, args, "light")
                            for name in methods if name in ("static-engine", "routed")}
        save()
    if args.alternate:
        record["alternation_compile"] = args.alternate_compile
        record["alternation"] = alternate(args.alternate.split(","), unrelated(text, lengths[1], 6), verifier,
                                          drafter, 3, args.new_tokens, args.alternate_compile)
    save()
    print(table(record))
    plot(record, out / "lifecycle.png")
    return 0


def table(record: dict) -> str:
    """The loops (first call, total, × HF static), the warm call; the chat's turns and the alternation's rounds
    against warm calls."""
    lines = ["| method | first call (s) | loop total (s) | × HF static loop | warm call at the longest (s) | "
             f"{len(record.get('long_loop_lengths', []))}-prompt loop (s) | × HF static |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = sum(record["loop"].get("hf-static-ar", [float("nan")]))
    long = record.get("long_loop", {})
    long_base = sum(long.get("hf-static-ar", [float("nan")]))
    for name, times in record["loop"].items():
        more = f"{sum(long[name]):.1f} | {long_base / sum(long[name]):.2f}" if name in long else "- | -"
        lines.append(f"| {name} | {times[0]:.1f} | {sum(times):.1f} | {base / sum(times):.2f} | "
                     f"{record['warm'][name]:.3f} | {more} |")
    for name, turns in record.get("chat", {}).items():
        later = turns[1:]
        worst = max(t["s"] / t["single_s"] for t in later) if later else float("nan")
        same = max(t["s"] / t["same_s"] for t in later) if later else float("nan")
        prefilled = [(t["prefill_tokens"], t.get("drafter_prefill_tokens")) for t in turns]
        lines.append(f"\nchat, {name}: {len(turns)} turns, {turns[0]['length']}-{turns[-1]['length']} tokens; total "
                     f"{sum(t['s'] for t in turns):.2f} s; worst later turn / warm call on an unrelated prompt "
                     f"{worst:.2f}, on its own prompt {same:.2f}; prefill tokens per turn (verifier, drafter) "
                     f"{prefilled}")
    for name, result in record.get("growth", {}).items():
        warm = statistics.median(result["warm"])
        lines.append(f"\ngrowth, {name}: {result['positions'][0]} -> {result['positions'][1]} positions; the call "
                     f"{result['growth_s']:.3f} s, warm {warm:.3f} s (+{result['growth_s'] - warm:.3f} s); compiled "
                     f"{result['dynamo_graphs']} dynamo graphs, Triton kernels {result['triton_kernels']}")
    for name, result in record.get("alternation", {}).items():
        later = result["rounds"][1:]
        warm = result.get("warm_same", [result["warm"]] * len(result["rounds"]))
        worst = max(t / w for t, w in zip(later, warm[1:]))
        lines.append(f"\nalternation, {name}: rounds {', '.join(f'{t:.3f}' for t in result['rounds'])} s; warm on "
                     f"the same prompts {', '.join(f'{w:.3f}' for w in warm)} s; worst later round / warm {worst:.2f}")
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
