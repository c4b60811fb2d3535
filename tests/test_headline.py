"""benchmarks/headline.py on the committed results JSON: the plot is written and every number it draws is one of the
JSON files' own (end to end: 1 / seconds per token; projections: τ / (γ·t_draft + t_verify))."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _headline():
    spec = importlib.util.spec_from_file_location("bench_headline", ROOT / "benchmarks" / "headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_headline_plot_from_the_committed_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    headline = _headline()
    lines = {s["label"]: s for s in headline.main(["--out", str(tmp_path / "headline.png")])}
    assert (tmp_path / "headline.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "| our graph AR (measured) | – | 139 | 132 | – | 81 |" in table
    # HISTORY.md "Plain decoding at 8B shape": 7.19 / 7.60 / 12.40 ms (ours), 18.36 / 22.93 / 78.47 ms (HF)
    ours, hf = lines["our graph AR"]["tokens_per_s"], lines["HF static-cache AR"]["tokens_per_s"]
    assert [round(1e3 / ours[c], 2) for c in (16384, 32768, 131072)] == [7.19, 7.60, 12.40]
    assert [round(1e3 / hf[c], 2) for c in (16384, 32768, 131072)] == [18.36, 22.93, 78.47]
    int4 = lines["int4 self-speculation, no drafter"]
    assert all(s["projection"] for s in lines.values() if s["label"] not in ("our graph AR", "HF static-cache AR"))
    assert round(int4["tau"], 2) == 5.73 and sorted(int4["tokens_per_s"]) == [32768, 65536, 131072]
    # × the captured AR step of the same run (7.50 ms at 32K): HISTORY.md's projected 1.44×
    assert round(int4["tokens_per_s"][32768] * 7.50e-3, 2) == 1.44
    assert round(lines["1B drafter, chunk budget 1024"]["tau"], 2) == 3.00
    chain, tree = (lines[k]["tokens_per_s"][16384] for k in ("1B drafter, chunk budget 1024",
                                                            "1B drafter, chunk 1024, tree of 16"))
    assert 1.19 <= tree / chain <= 1.21  # HISTORY.md: a tree of 16 about 1.19-1.21× the chain's speed
