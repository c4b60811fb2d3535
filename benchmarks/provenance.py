"""The commit a benchmark result comes from, for its JSON."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


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
