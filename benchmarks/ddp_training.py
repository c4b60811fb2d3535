"""Drafter training throughput under DDP: ``accelerate launch --num_processes N -m hf_sparsekv.cli train-drafter`` on
N = 1 and 2 GPUs (NCCL), the bundled pair, one run each; tokens per second per GPU and the scaling from 1 to N.

A step is one sequence of ``--seq-len`` tokens per process (the verifier's teacher pass, the drafter's full and
sparse views, backward, the gradient all-reduce); the time per step is the median gap between consecutive steps of
``metrics.jsonl`` after ``--skip`` warm-up steps. Writes ``ddp_training.json`` and ``ddp_training.md``.

    python benchmarks/ddp_training.py --processes 1 2 --out runs/ddp
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from provenance import commit

PAIR = Path(__file__).resolve().parents[1] / "hf_sparsekv" / "zoo" / "pair"


def run(n: int, args, out: Path) -> dict:
    folder = out / f"processes-{n}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", *(["--multi_gpu"] if n > 1 else []),
           "-m", "hf_sparsekv.cli", "train-drafter", "--verifier", str(PAIR / "verifier"),
           "--drafter", str(PAIR / "drafter"), "--tokenizer", str(PAIR / "tokenizer"), "--data", "python-source",
           "--output", str(folder), "--seq-len", str(args.seq_len), "--continuation-len", "256",
           "--max-steps", str(args.steps), "--no-eval", "--save-every", "0", "--no-progress"]
    subprocess.run(cmd, check=True)
    times = [json.loads(line)["time"] for line in (folder / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("event") == "step"]
    gaps = [b - a for a, b in zip(times[args.skip :], times[args.skip + 1 :])]
    step = statistics.median(gaps)
    return dict(processes=n, seconds_per_step=step, tokens_per_s_per_gpu=args.seq_len / step,
                tokens_per_s=n * args.seq_len / step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the timing")
    p.add_argument("--out", default="runs/ddp-training")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run(n, args, out) for n in args.processes]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    base = rows[0]["tokens_per_s"] / rows[0]["processes"]
    lines = [f"bundled pair, seq_len {args.seq_len}, {device}", "",
             "| GPUs | s/step | tokens/s per GPU | tokens/s | scaling efficiency |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['processes']} | {r['seconds_per_step']:.3f} | {r['tokens_per_s_per_gpu']:.0f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / (r['processes'] * base):.2f} |")
    table = "\n".join(lines) + "\n"
    (out / "ddp_training.md").write_text(table)
    (out / "ddp_training.json").write_text(json.dumps(dict(
        settings=dict(vars(args), device=device, date=datetime.date.today().isoformat(),
                      commit=commit()), rows=rows), indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
