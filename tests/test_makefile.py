"""The Makefile's torch install: an installed torch is kept, TORCH_INDEX_URL picks the index (checked with
``make -n``, which prints the commands without running them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(tmp_path, *variables):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").touch()
    done = subprocess.run(["make", "-n", "install", "test-lowest", *variables], cwd=tmp_path, capture_output=True,
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
