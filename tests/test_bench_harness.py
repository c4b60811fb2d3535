"""benchmarks/speculative.py in a minimal CPU mode on the bundled pair: every method runs, outputs are checked
against greedy AR, a crashing method is recorded without stopping the grid, and the outputs (JSON, table, plots,
profile, the projection code path at a tiny shape) are written."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _harness():
    if str(ROOT / "benchmarks") not in sys.path:  # its sibling modules (spec_methods, spec_report, ...)
        sys.path.insert(0, str(ROOT / "benchmarks"))
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


@pytest.mark.extended  # ~70 s of CPU; the benchmark is itself opt-in (make bench): make test-extended
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
    assert proj["formula"] == sys.modules["spec_methods"].PROJECTION_FORMULA and proj["costs"]["40"]["verifier_forward_3_s"] > 0
    rows = [r for r in proj["rows"] if r["method"] == "budgetdraft"]
    assert rows and all(r["E"] >= 1 and r["end_to_end_speedup"] > 0 for r in rows)
    table = (out / "table.md").read_text()
    assert "speedup vs AR (ours) / acceptance %" in table and "FAILURES" in table and "PROJECTION" in table


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval().to(dtype)


def test_chunked_last_logits_equal_one_forward():
    from transformers.cache_utils import DynamicCache

    from hf_sparsekv.training.views import chunked_prefill

    model = _tiny_llama(torch.float64)
    ids = torch.randint(0, 64, (1, 23))
    with torch.no_grad():
        whole = model(ids).logits[0, -1]
    torch.testing.assert_close(chunked_prefill(model, ids, 5, DynamicCache())[0], whole, rtol=1e-10, atol=1e-10)


def test_tie_check_separates_ties_from_failures():
    from transformers.cache_utils import DynamicCache

    from hf_sparsekv.training.views import chunked_prefill

    bench = _harness()
    model = _tiny_llama(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight[7] = model.lm_head.weight[3]  # tokens 3 and 7 have equal logits everywhere
    ids = torch.randint(0, 64, (1, 20))
    reference = torch.cat([ids, torch.tensor([[3, 5]])], 1)
    tie = bench.tie_check(model, ids, reference, {"position": 0, "expected": 3, "got": 7})
    assert tie["tie"] and tie["float64_margin"] == 0 and tie["float64_picks"] == "either" and tie["dtype"] == "bfloat16"
    assert model.dtype == torch.bfloat16  # the float64 copy leaves the model as it was
    # at new token 1 the prefix includes the reference's token 3; the float64 best and worst tokens are no tie
    prefix = reference[:, :21]
    exact = chunked_prefill(copy.deepcopy(model).to(torch.float64), prefix, 1024, DynamicCache())[0]
    best, worst = int(exact.argmax()), int(exact.argmin())
    failure = bench.tie_check(model, ids, reference, {"position": 1, "expected": best, "got": worst})
    assert not failure["tie"] and failure["float64_picks"] == "expected"
    assert failure["float64_margin"] == pytest.approx(float(exact[best] - exact[worst]))
    assert failure["float64_margin"] > 2 * failure["run_dtype_error"] > 0


def test_full_grid_plan():
    bench = _harness()
    args = bench.parse_args([])
    assert args.sweep_budget == 1024 and args.table_gammas == [3, 5, 7] and args.prompts >= 2
    jobs = bench._jobs(args)
    sparse = [j for j in jobs if j["method"] == "budgetdraft"]
    # every context × budget at γ 3, 5, 7 (Table 1); every γ at the sweep budget (Fig. 3)
    assert {(j["context"], j["budget"]) for j in sparse if j["gamma"] == 7} == {
        (c, b) for c in args.contexts for b in args.budgets}
    assert {j["gamma"] for j in sparse if j["budget"] == 1024} == set(range(1, 11))
    assert {j["gamma"] for j in sparse if j["budget"] == 256} == {3, 5, 7}
    assert {j["gamma"] for j in jobs if j["method"] == "int4"} == set(range(1, 11))
    assert len({bench._job_key(j) for j in jobs}) == len(jobs)
    with pytest.raises(SystemExit):
        bench.parse_args(["--budgets", "256", "--sweep-budget", "512"])
    assert bench.parse_args(["--budgets", "256", "512"]).sweep_budget == 512


def test_resume_keeps_finished_records_and_runs_the_rest(tmp_path, capsys):
    bench = _harness()
    out = tmp_path / "bench"
    common = ["--contexts", "48", "--budgets", "16", "--new-tokens", "6", "--prompts", "1", "--repeats", "1",
              "--warmup", "1", "--warmup-tokens", "2", "--device", "cpu", "--methods", "budgetdraft", "--no-plots",
              "--out", str(out)]
    assert bench.main(common + ["--gammas", "2"]) == 0
    first = json.loads((out / "results.json").read_text())["records"]
    assert bench.main(common + ["--gammas", "2", "3", "--resume"]) == 0
    second = json.loads((out / "results.json").read_text())
    kept = [r for r in second["records"] if r["gamma"] in (None, 2)]
    assert [r["seconds"] for r in kept] == [r["seconds"] for r in first]  # not re-run
    new = [r for r in second["records"] if r["gamma"] == 3]
    assert len(new) == 1 and new[0]["identical"] is True  # checked against the reference rebuilt from JSON
    assert len(new[0]["tokens"]) == 6 and "--resume: kept 2 finished records" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="other settings"):
        bench.main(common + ["--gammas", "2", "--new-tokens", "7", "--resume"])


def test_graph_engine_tells_a_tie_from_a_failure_at_the_first_token_apart():
    """``graph_engine.near_tie``: a call apart from our AR at a token whose float64 logit equals the reference's
    token's is a tie; apart at the float64 worst token it is not; int4 (verifying on the INT8 view) and outputs that
    differ in length only get no answer."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import graph_engine

    from transformers.cache_utils import DynamicCache

    from hf_sparsekv.training.views import chunked_prefill

    model = _tiny_llama(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight[7] = model.lm_head.weight[3]  # tokens 3 and 7 have equal logits everywhere
    ids = torch.randint(0, 64, (1, 20))
    reference = torch.cat([ids, torch.tensor([[5, 3, 9]])], 1)
    tied = reference.clone()
    tied[0, 21] = 7
    assert graph_engine.near_tie(model, "chunk-512-gA", ids, tied, reference) is True
    exact = chunked_prefill(copy.deepcopy(model).to(torch.float64), reference[:, :21], 1024, DynamicCache())[0]
    reference[0, 21] = int(exact.argmax())
    apart = reference.clone()
    apart[0, 21] = int(exact.argmin())
    assert graph_engine.near_tie(model, "chunk-512-gA", ids, apart, reference) is False
    assert graph_engine.near_tie(model, "int4-self-gA", ids, apart, reference) is None
    assert graph_engine.near_tie(model, "lookup-gA", ids, reference[:, :22], reference) is None
