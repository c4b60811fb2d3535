"""Where the engine's compiled code persists between processes.

The engine compiles its steps with ``torch.compile`` (Inductor, Triton). Inductor keeps what it compiled in an on-disk
cache (its FX graph and autograd caches, on by default in PyTorch) under ``TORCHINDUCTOR_CACHE_DIR``, by default a
folder in ``/tmp`` that a reboot or a temp cleaner empties; Triton keeps its kernels under ``TRITON_CACHE_DIR``
(default ``~/.triton/cache``). At import, where the user has not set ``TORCHINDUCTOR_CACHE_DIR``, hf_sparsekv sets it
to ``$HF_HOME/hf_sparsekv/torchinductor`` (``HF_HOME`` defaulting to ``~/.cache/huggingface``, as for every Hugging
Face cache), so that a later process finds the compiled steps and its first call traces them only. A variable the user
set is left as it is; ``HF_SPARSEKV_COMPILE_CACHE=0`` leaves PyTorch's defaults alone.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HF_SPARSEKV_COMPILE_CACHE"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_dir() -> Path:
    """``$HF_HOME/hf_sparsekv/torchinductor`` (``HF_HOME``: ``$XDG_CACHE_HOME/huggingface``, ``~/.cache/huggingface``)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home) / "hf_sparsekv" / "torchinductor"


def configure() -> str | None:
    """Point Inductor's on-disk cache at :func:`default_dir` unless the user set it or turned this off; the folder
    Inductor uses from then on, or None where this left it alone."""
    setting = os.environ.get(CACHE_ENV, "1") or "1"
    if setting not in ("0", "1"):
        raise ValueError(f"{CACHE_ENV} must be '0' or '1', got {setting!r}")
    if setting == "0" or os.environ.get(INDUCTOR_ENV):
        return None
    os.environ[INDUCTOR_ENV] = str(default_dir())
    return os.environ[INDUCTOR_ENV]
