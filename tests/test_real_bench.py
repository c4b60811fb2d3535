"""benchmarks/real_models.py without the real weights: the cost script at tiny shapes on CPU (the code path the
GPU run takes), its projection arithmetic, and the grid harness's prefill replay on tiny random models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from .conftest import prompt, tiny_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_cost  # noqa: E402
import real_grid  # noqa: E402
import real_models  # noqa: E402


def test_cost_tiny_runs_every_step_and_writes_json(tmp_path):
    args = real_models.parse_args(["cost", "--tiny", "--pairs", "qwen2.5-coder", "--contexts", "40", "--batches", "1", "3",
                                   "--repeats", "1", "--warmup", "0", "--out", str(tmp_path), "--device", "cpu"])
    result = real_cost.run_cost(args)
    row, batched = result["rows"]
    assert row["context"] == 40 and row["verifier"] == "qwen2.5-coder-1.5b" and row["batch"] == 1
    assert set(row["seconds"]) == {"ar", "verify", "int4-draft", "int4-verify", "draft-full", "draft-chunk-16",
                                   "draft-chunk-32", "draft-window-32"}
    assert batched["batch"] == 3 and set(batched["seconds"]) == set(row["seconds"])  # int4 too: a batched engine
    assert all(v > 0 for r in (row, batched) for v in r["seconds"].values())
    assert {p["batch"] for p in result["projection"]} == {1, 3}
    saved = json.loads((tmp_path / "cost.json").read_text())
    assert saved["settings"]["tiny"] and saved["settings"]["group_size"] == 16
    assert saved["settings"]["path"].startswith("static engine")  # the steps of generate()'s CUDA path
    assert "PROJECTION" in (tmp_path / "cost.md").read_text()


def test_cost_refuses_full_size_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    args = real_models.parse_args(["cost", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="CUDA GPU"):
        real_cost.run_cost(args)


def test_real_shapes_build_the_published_configs():
    config = real_cost.model_config("llama-3.2-1b")
    assert config.head_dim == 64 and config.num_key_value_heads == 8
    qwen = real_cost.model_config("qwen2.5-coder-1.5b")
    assert qwen.hidden_size // qwen.num_attention_heads == 128 and qwen.model_type == "qwen2"


def test_projection_formula_and_measured_tau(tmp_path):
    steps = {"ar": 10.0, "verify": 12.0, "draft-full": 2.0, "draft-chunk-256": 1.0, "draft-window-1024": 1.5,
             "int4-draft": 6.0, "int4-verify": 13.0}
    grid = {"cells": [
        {"method": "chunk-256", "context": 4096, "new_tokens": 64, "rounds": 20, "accepted": 43, "drafted": 100},
        {"method": "chunk-256", "context": 4096, "new_tokens": 34, "rounds": 13, "accepted": 20, "drafted": 65},
        {"method": "full", "context": 8192, "error": "boom"},
    ]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(grid))
    measured = real_cost.measured_acceptance(str(path))
    alpha, tau = 63 / 165, (63 + 33) / 33
    assert measured == {("chunk-256", 4096): (pytest.approx(alpha), pytest.approx(tau))}
    rows = [{"pair": "qwen2.5-coder", "context": 4096, "seconds": steps}]
    by_mode = {p["mode"]: p for p in real_cost.project(rows, 5, measured)}
    sparse = by_mode["sparse/full B=256"]
    assert sparse["break_even_tau"] == pytest.approx((5 * 1.0 + 12.0) / 10.0)
    assert sparse["projected_speedup"] == pytest.approx(tau * 10.0 / 17.0)
    expected = sum(alpha**k for k in range(6))  # 1 + α + ... + α^γ
    assert sparse["projected_speedup_from_alpha"] == pytest.approx(expected * 10.0 / 17.0)
    assert real_cost.tokens_per_round(1.0, 5) == 6.0 and real_cost.tokens_per_round(0.0, 5) == 1.0
    assert by_mode["int4 self-spec"]["break_even_tau"] == pytest.approx((30.0 + 13.0) / 10.0)
    assert "projected_speedup" not in by_mode["full/full"]


def test_grid_on_tiny_models_replays_the_prefill_and_matches_greedy(tmp_path, monkeypatch):
    verifier, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")

    class Tok:  # documents() is bypassed below; the grid only needs eos from the verifier
        pass

    ids = prompt(300, seed=3)
    monkeypatch.setattr(real_grid, "documents", lambda tokenizer, n, min_tokens: [("doc", ids)])
    args = real_models.parse_args(["grid", "--out", str(tmp_path), "--contexts", "200", "--docs", "1", "--new-tokens",
                                   "12", "--budgets", "32", "--window-budget", "48", "--min-doc-tokens", "0"])
    calls = []
    original = verifier.forward

    def counting_forward(*a, **k):
        calls.append(k.get("input_ids", a[0] if a else None).shape[1])
        return original(*a, **k)

    verifier.forward = counting_forward
    try:
        data = real_grid.run_grid(args, models=(verifier, drafter, Tok()))
    finally:
        del verifier.forward
    methods = [c["method"] for c in data["cells"]]
    assert methods == ["full", "chunk-32", "window0-48", "window4-48", "int4", "lookup"]
    assert all(c["identical"] for c in data["cells"]), data["cells"]
    assert calls.count(200) == 1  # one verifier prefill shared by every method
    # the reference is stock greedy generate()
    stock = verifier.generate(ids[:, :200], max_new_tokens=12, do_sample=False)
    ref = next(r for r in data["references"] if r["kind"] == "full")
    assert ref["tokens"] == stock[0, 200:].tolist()
    # resume: nothing left to do
    again = real_grid.run_grid(args, models=(verifier, drafter, Tok()))
    assert len(again["cells"]) == 6
    assert "| chunk-32 |" in real_grid.table(again)
    # the paper's cumulative selection by name, on request
    cum = real_models.parse_args(["grid", "--out", str(tmp_path), "--contexts", "200", "--docs", "1", "--new-tokens",
                                  "12", "--methods", "chunkcum", "--cum-budgets", "32", "--min-doc-tokens", "0"])
    data = real_grid.run_grid(cum, models=(verifier, drafter, Tok()))
    assert [c["method"] for c in data["cells"]][6:] == ["chunkcum-32"] and data["cells"][6]["identical"]
    # prompt lookup beside the drafter, on request
    both = real_models.parse_args(["grid", "--out", str(tmp_path), "--contexts", "200", "--docs", "1", "--new-tokens",
                                   "12", "--methods", "chunklookup", "window4lookup", "--budgets", "32",
                                   "--window-budget", "48", "--min-doc-tokens", "0"])
    data = real_grid.run_grid(both, models=(verifier, drafter, Tok()))
    assert [c["method"] for c in data["cells"]][7:] == ["chunklookup-32", "window4lookup-48"]
    assert all(c["identical"] for c in data["cells"][7:]), data["cells"][7:]
    # trees of the chunk drafter, alone and with retrieval grafted in
    trees = real_models.parse_args(["grid", "--out", str(tmp_path), "--contexts", "200", "--docs", "1", "--new-tokens",
                                    "12", "--methods", "chunk", "chunklookup", "--budgets", "32", "--tree-sizes", "9",
                                    "--only-trees", "--min-doc-tokens", "0"])
    data = real_grid.run_grid(trees, models=(verifier, drafter, Tok()))
    assert [c["method"] for c in data["cells"]][9:] == ["chunk-32-t9", "chunklookup-32-t9"]
    assert all(c["identical"] for c in data["cells"][9:]), data["cells"][9:]


@pytest.mark.real
def test_cost_shapes_are_those_of_the_converted_pair():
    from transformers import AutoConfig

    from hf_sparsekv.zoo.real import converted_dir

    for role, name in (("verifier", "qwen2.5-coder-1.5b"), ("drafter", "qwen2.5-coder-0.5b")):
        real = AutoConfig.from_pretrained(converted_dir(role), local_files_only=True)
        ours = real_cost.model_config(name)
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size"):  # (tied or not: the same lm_head matmul)
            assert getattr(real, key) == getattr(ours, key), (role, key)
