"""benchmarks/speculative.py in a minimal CPU mode on the bundled pair: every method runs, outputs are checked
against greedy AR, a crashing method is recorded without stopping the grid, and the outputs (JSON, table, plots,
profile, the projection code path at a tiny shape) are written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _harness():
    spec = importlib.util.spec_from_file_location("bench_speculative", ROOT / "benchmarks" / "speculative.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_mismatch_reports_the_position():
    bench = _harness()
    ref = torch.tensor([[5, 6, 7, 8, 9]])
    assert bench._first_mismatch(ref.clone(), ref, 2) is None
    got = torch.tensor([[5, 6, 7, 1, 9]])
    assert bench._first_mismatch(got, ref, 2) == {"position": 1, "expected": 8, "got": 1}


def test_quick_args_and_job_order():
    bench = _harness()
    args = bench.parse_args(["--quick"])
    assert args.contexts == [4096, 16384] and args.budgets == [256, 1024] and args.gammas == [3, 5]
    assert args.new_tokens == 64 and args.repeats == 1 and args.prompts == 1
    jobs = bench._jobs(args)
    # references of every context before any speculative cell; the fixed γ (5) before the rest of the sweep
    first_spec = next(i for i, j in enumerate(jobs) if j["gamma"] is not None)
    assert all(j["gamma"] is None for j in jobs[:first_spec]) and all(j["gamma"] is not None for j in jobs[first_spec:])
    assert {j["context"] for j in jobs[:first_spec]} == {4096, 16384}
    assert jobs[first_spec]["gamma"] == 5 and jobs[-1]["gamma"] == 3
    full = bench.parse_args([])
    assert full.contexts == [4096, 8192, 16384] and full.budgets == [256, 512, 1024, 2048]
    assert full.gammas == list(range(1, 11)) and full.new_tokens == 256 and full.repeats >= 3


def test_minimal_run_on_the_pair(tmp_path, monkeypatch):
    bench = _harness()
    original = bench._generate_fn

    def broken_window4(method, *a, **kw):
        if method == "window4":
            raise RuntimeError("injected failure")
        return original(method, *a, **kw)

    monkeypatch.setattr(bench, "_generate_fn", broken_window4)
    out = tmp_path / "bench"
    rc = bench.main(["--contexts", "40", "64", "--budgets", "16", "--gammas", "2", "--new-tokens", "5",
                     "--prompts", "1", "--repeats", "1", "--warmup", "0", "--device", "cpu",
                     "--methods", *bench.ALL_METHODS, "--profile", "--projection", "--projection-shape", "tiny",
                     "--projection-contexts", "40", "--out", str(out)])
    assert rc == 1  # the injected failure
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 6
    assert {"results.json", "table.md", "acceptance_vs_context.png", "gamma_sweep.png"} <= set(files)
    result = json.loads((out / "results.json").read_text())
    cells = {(c["method"], c["context"]): c for c in result["cells"]}
    assert {m for m, _ in cells} == set(bench.ALL_METHODS)
    assert result["failures"] and all("window4" in f and "injected failure" in f for f in result["failures"])
    for (method, context), cell in cells.items():
        if method == "window4":
            assert cell["ok"] == 0
            continue
        assert cell["ok"] == 1 and cell["identical"], (method, context, cell)
        assert cell["new_tokens"] == 5 and cell["speedup_vs_ar"] > 0 and cell["speedup_vs_stock"] > 0
        if method in ("sd-base", "budgetdraft", "window0", "int4"):
            assert 0 <= cell["acceptance_rate"] <= 1 and cell["tau"] >= 1
            assert cell["draft_seconds"] > 0 and cell["verify_seconds"] > 0
    prof = result["profile"]
    assert prof["setting"]["method"] == "budgetdraft" and prof["timers"] and prof["torch_profiler_top"]
    proj = result["projection"]
    assert proj["formula"] == bench.PROJECTION_FORMULA and proj["costs"]["40"]["verifier_forward_3_s"] > 0
    rows = [r for r in proj["rows"] if r["method"] == "budgetdraft"]
    assert rows and all(r["E"] >= 1 and r["end_to_end_speedup"] > 0 for r in rows)
    table = (out / "table.md").read_text()
    assert "speedup vs AR (ours) / acceptance %" in table and "FAILURES" in table and "PROJECTION" in table
