"""What the draft-length controller would choose at Llama-3.1-8B shape, per context and mode: a **projection**.

No GPU is needed: it reads step costs measured on a GPU at 8B shape (random weights; ``make bench-scale`` JSON:
``ar``, ``verify-4``/``verify-6`` or ``int4-verify``, one draft forward) and takes each mode's acceptance from the
real pair's τ at γ = 5 (CPU, ``make bench-real``), as the projections of BENCHMARKS.md do. Per mode and context:

* ``p``: the per-draft acceptance of a geometric model fitted to τ at γ = 5, τ = (1 - p^6) / (1 - p);
* ``t(g) = g · t_draft + t_verify(g)``: verification of ``g`` drafts interpolated through the measured widths (AR
  for g = 0, then 3 and 5 drafts) as the controller interpolates its round times
  (:func:`hf_sparsekv.generation.controller.interpolated`; beyond the widest, the slope from the narrowest);
* the controller's choice among its ladder ({0} ∪ {1, 2, 3, 4, 6, 8}, :mod:`hf_sparsekv.generation.controller`) by
  the controller's own rate ``E[tokens | g] / t(g)``, against the best constant γ in 1..8 chosen in hindsight and the
  published γ = 5.

Speeds are relative to our graph AR (``ar``). Exploration rounds and host time are left out (the controller's
measured overheads are in BENCHMARKS.md's end-to-end runs).

    python benchmarks/controller_projection.py --out runs/controller-projection
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_sparsekv.generation.controller import interpolated, widths

RESULTS = Path(__file__).resolve().parent / "results"
# the real pair's τ at γ = 5 on its 8K prompts (BENCHMARKS.md, "Real-pair acceptance"); int4: every context
DEFAULT_TAU = {"chunk-1024": 3.00, "window-1024": 2.86, "full": 3.00, "int4": 5.73}
STEPS = RESULTS / "scale-h100-2026-11-26" / "steps.json"  # ar, verify-4, verify-6, the 1B drafter's forwards
INT4_STEPS = RESULTS / "quant-8b-h100-2026-11-27b" / "scale-8b-b1.json"  # ar, int4-verify, int4-w4-draft
GAMMA_MAX = 8


def fitted_acceptance(tau: float, gamma: int = 5) -> float:
    """p with (1 - p^(γ+1)) / (1 - p) = τ (bisection; τ in [1, γ + 1])."""
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        if sum(p**k for k in range(gamma + 1)) < tau:
            low = p
        else:
            high = p
    return (low + high) / 2


def expected_tokens(p: float, g: int) -> float:
    return sum(p**k for k in range(g + 1))


def project(seconds: dict, mode: str, tau: float) -> dict:
    """The controller's choice and the speeds (× our graph AR) for one context's measured ``seconds``."""
    ar = seconds["ar"]
    if mode == "int4":
        points, draft = {0: ar, 5: seconds["int4-verify"]}, seconds["int4-w4-draft"]
    else:
        points, draft = {0: ar, 3: seconds["verify-4"], 5: seconds["verify-6"]}, seconds[f"draft-{mode}"]
    p = fitted_acceptance(tau)

    def speed(g: int) -> float:
        return expected_tokens(p, g) * ar / (g * draft + interpolated(points, g))

    ladder = (0,) + widths(GAMMA_MAX)
    chosen = max(ladder, key=speed)
    best = max(range(1, GAMMA_MAX + 1), key=speed)
    return dict(p=p, chosen=chosen, chosen_speed=speed(chosen), best_fixed=best, best_fixed_speed=speed(best),
                gamma5_speed=speed(5), vs_best=speed(chosen) / speed(best))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=Path, default=STEPS)
    parser.add_argument("--int4-steps", type=Path, default=INT4_STEPS)
    for mode, tau in DEFAULT_TAU.items():
        parser.add_argument(f"--tau-{mode}", type=float, default=tau, help=f"τ at γ = 5 of {mode}")
    parser.add_argument("--out", type=Path, default=Path("runs/controller-projection"))
    args = parser.parse_args(argv)
    rows = []
    for path, modes in ((args.steps, ("chunk-1024", "window-1024", "full")), (args.int4_steps, ("int4",))):
        for row in json.loads(path.read_text())["rows"]:
            if row.get("batch", 1) != 1:
                continue
            for mode in modes:
                tau = getattr(args, f"tau_{mode.replace('-', '_')}")
                rows.append(dict(mode=mode, context=row["context"], tau=tau, **project(row["seconds"], mode, tau)))
    lines = ["| mode | context | τ (γ=5) | p | controller's γ | × AR | best fixed γ | × AR | γ = 5 × AR | controller / best |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['context'] // 1024}K | {r['tau']:.2f} | {r['p']:.3f} | {r['chosen']} | "
                     f"{r['chosen_speed']:.2f} | {r['best_fixed']} | {r['best_fixed_speed']:.2f} | "
                     f"{r['gamma5_speed']:.2f} | {r['vs_best']:.3f} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    named = {name: str(path.resolve().relative_to(RESULTS.parent.parent)) if path.resolve().is_relative_to(
        RESULTS.parent.parent) else str(path) for name, path in (("steps", args.steps), ("int4_steps", args.int4_steps))}
    (args.out / "results.json").write_text(json.dumps(dict(projection=True, **named, rows=rows), indent=1))
    (args.out / "table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
