"""The Makefile's torch install: an installed torch is kept, TORCH_INDEX_URL picks the index; every benchmark
script is a documented tool with a target, whose options ARGS replaces (checked with ``make -n``, which prints the
commands without running them)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(tmp_path, *variables, targets=("install", "test-lowest")):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").touch()
    done = subprocess.run(["make", "-n", *targets, *variables], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_torch_index_is_a_make_variable(tmp_path):
    url = "https://download.pytorch.org/whl/cpu"
    out = _dry_run(tmp_path, f"TORCH_INDEX_URL={url}", "PYTHON=/nonexistent/python3")
    installs = [line for line in out.splitlines() if '"torch==' in line]
    assert len(installs) == 2 and all(f"--index-url {url}" in line for line in installs)
    assert all(line.startswith(("./.venv", ".venv")) and '-c "import torch" 2>/dev/null ||' in line for line in installs)


def test_default_leaves_the_index_to_pips_configuration(tmp_path):
    out = _dry_run(tmp_path, "PYTHON=/nonexistent/python3")
    assert "--index-url" not in out and "--system-site-packages" not in out


def test_a_python_that_has_torch_is_reused(tmp_path):
    fake = tmp_path / "python-with-torch"  # answers the Makefile's probe ("import torch", not a venv) with success
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    out = _dry_run(tmp_path, f"PYTHON={fake}")
    assert out.count("-m venv --system-site-packages") == 2


def test_a_venv_python_is_not_taken_for_a_system_torch(tmp_path):
    if sys.prefix == sys.base_prefix:
        pytest.skip("the suite does not run in a venv here")
    assert "--system-site-packages" not in _dry_run(tmp_path, f"PYTHON={sys.executable}")


def test_every_benchmark_script_is_a_documented_tool_with_a_target():
    """Each runnable script of benchmarks/ (the others are its helper modules) says in its docstring what it
    measures and is run by a Makefile target."""
    recipes = (ROOT / "Makefile").read_text()
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        source = script.read_text()
        if '__name__ == "__main__"' not in source:
            continue
        doc = ast.get_docstring(ast.parse(source))
        assert doc and len(doc.split()) >= 8, f"{script.name}: no module docstring saying what it measures"
        assert re.search(rf"\$\(PY\) benchmarks/{re.escape(script.name)}\b", recipes), f"{script.name}: no make target"


def test_args_replace_a_benchmark_targets_default_options(tmp_path):
    out = _dry_run(tmp_path, "PYTHON=/nonexistent/python3", targets=("bench-bundled", "bench-quant-kernels"))
    lines = [line for line in out.splitlines() if "benchmarks/" in line]
    assert "--gammas 3,5 --only hf-static-ar,graph-ar,chunk-256-g5,window-g5,lookup-g3 --extra" in lines[0]
    assert lines[1].endswith("--quant-only --breakdown --contexts 65536,131072")
    out = _dry_run(tmp_path, "PYTHON=/nonexistent/python3", 'ARGS=--gammas 5,7 --only graph-ar',
                   targets=("bench-bundled",))
    line = next(line for line in out.splitlines() if "benchmarks/" in line)
    assert line.endswith("graph_engine.py --out runs/bundled --gammas 5,7 --only graph-ar")
