"""The commit a benchmark result comes from, for its JSON; and the benchmarks' one setting: the engine's steps
compile from a configuration's first call (``HF_SPARSEKV_COMPILE=1``) unless the environment says otherwise, since a
benchmark measures warm calls (the library's default compiles them once a model's uncompiled calls have taken long
enough: ``hf_sparsekv.generation.compile_policy``; ``benchmarks/lifecycle.py`` measures that default)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

os.environ.setdefault("HF_SPARSEKV_COMPILE", "1")


def commit() -> str:
    """``$GIT_COMMIT`` if set (a copy of the tree without its history, e.g. the GPU machine's), else the short hash
    of HEAD with ``-dirty`` when tracked files have uncommitted changes, else "unknown"."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return (sha.strip() + ("-dirty" if dirty.strip() else "")) if sha.strip() else "unknown"
