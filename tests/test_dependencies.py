"""What a CPU user installs and imports: Triton (about 1 GB) is declared only in the extras that need it, and
generate() runs in every mode on a machine where it cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import pytest

        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_triton_is_declared_only_where_it_is_needed():
    project = _pyproject()
    assert not [d for d in project["dependencies"] if d.lower().startswith("triton")]
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["dev"])  # interpreter tests


def test_generate_runs_on_cpu_without_triton():
    """In a child process where importing triton fails: import hf_sparsekv and speculative generate() in the chunk,
    window, self-chunk and int4 modes equal stock greedy output (int4: greedy AR on its quantized cache)."""
    code = f"""
import importlib.abc, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            raise ImportError("no triton here")
sys.meta_path.insert(0, _NoTriton())
sys.path.insert(0, {str(ROOT)!r})
import torch, hf_sparsekv
from tests.conftest import prompt, tiny_model
v, d = tiny_model("llama"), tiny_model("llama", role="drafter")
ids = prompt(60, 1)
ref = v.generate(ids, max_new_tokens=6, do_sample=False)
for spec in (dict(assistant_model=d, kv_budget=16), dict(assistant_model=d, draft_cache="window", kv_budget=16),
             dict(assistant_model=v, kv_budget=16)):
    assert torch.equal(v.generate(ids, max_new_tokens=6, do_sample=False, **spec), ref), spec
q = hf_sparsekv.HierarchicalQuantCache
int4_ref = v.generate(ids, max_new_tokens=6, do_sample=False, **{{"past_key_values": q()}})
assert torch.equal(v.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=v, draft_cache="int4"), int4_ref)
assert not [m for m in sys.modules if m.split(".")[0] == "triton"]
print("ok")
"""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
