"""The examples run as written (on the bundled pair, on CPU), the batch example's rows equal greedy generate(), and
the prompt-lookup example's default prompt is one where retrieval pays (far fewer verifier forwards than tokens)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,expect", [
    ("speculative_generate.py", "identical to greedy AR: True"),
    ("batch_generate.py", "equals greedy generate() of the prompt alone: True"),
    ("prompt_lookup.py", "identical to greedy generate(): True; identical to stock's prompt lookup: True"),
    ("assisted_generation.py", "identical to greedy generate(): True; to stock's assisted generation: True"),
])
def test_example_runs_on_the_bundled_pair(script, expect):
    pair = ["--pair"] if script == "speculative_generate.py" else []
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *pair, "--max-new-tokens", "16"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if script == "batch_generate.py":
        assert proc.stdout.count(expect) == 3 and "False" not in proc.stdout, proc.stdout
    else:
        assert expect in proc.stdout, proc.stdout
    if script == "prompt_lookup.py":  # its default prompt is one where retrieval drafts well
        forwards, tokens = map(int, re.search(r"(\d+) verifier forwards for (\d+) tokens", proc.stdout).groups())
        assert tokens == 16 and forwards <= tokens // 3, proc.stdout
