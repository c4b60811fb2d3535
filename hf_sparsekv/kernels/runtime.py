"""When the Triton kernels run: availability (Triton importable, CUDA or the interpreter) and the on/off switch.

Nothing here imports Triton at module import time, so the package imports on machines without Triton or CUDA.

* :func:`enabled` ``(device)`` is what the caches and the attention function ask: True on a CUDA device when Triton
  imports, False on CPU, unless overridden by :func:`use_kernels` (a context manager) or the environment variable
  ``HF_SPARSEKV_KERNELS`` (``0`` = never, ``1`` = always, also on CPU, which needs ``TRITON_INTERPRET=1``).
* :func:`require` raises a clear error when a kernel is called where it cannot run.
* :func:`launch` launches a kernel with fewer pipeline stages where its settings need more shared memory than the
  GPU has.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

_override: contextvars.ContextVar[bool | None] = contextvars.ContextVar("_override", default=None)

# Launch options every kernel of the package passes: multiply-add contraction on, as the kernels were tuned and
# timed with it (Triton up to 3.9 defaults to it and warns that 3.10 will not).
LAUNCH_OPTIONS = dict(enable_fp_fusion=True)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _env_override() -> bool | None:
    value = os.environ.get("HF_SPARSEKV_KERNELS", "")
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"HF_SPARSEKV_KERNELS must be '0' or '1', got {value!r}")
    return value == "1"


def enabled(device: torch.device | str) -> bool:
    """Whether the attention/quantization of tensors on ``device`` goes through the Triton kernels."""
    forced = _override.get()
    if forced is None:
        forced = _env_override()
    if forced is False or not triton_available():
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return bool(forced) and interpreting()


@contextlib.contextmanager
def use_kernels(on: bool):
    """``with use_kernels(False):`` forces the PyTorch reference path; ``use_kernels(True)`` forces the kernels,
    also on CPU tensors when ``TRITON_INTERPRET=1`` (tests)."""
    token = _override.set(bool(on))
    try:
        yield
    finally:
        _override.reset(token)


@functools.lru_cache(maxsize=None)
def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter converts scalar tensors (1-element arrays) to Python ints with ``int(array)``, which
    NumPy >= 2.3 rejects, so any loop with a runtime bound fails under ``TRITON_INTERPRET=1``. Re-define that one
    conversion with ``.item()``; nothing else about the interpreter (or the compiled path) changes."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_hf_sparsekv", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    patched._hf_sparsekv = True
    interpreter._patch_lang_tensor = patched


def require(*tensors: torch.Tensor) -> None:
    """Raise unless the Triton kernels can run on these tensors."""
    if not triton_available():
        raise NotImplementedError("the hf_sparsekv Triton kernels need the `triton` package")
    if interpreting():
        _patch_interpreter_index()
    for t in tensors:
        if t.device.type != "cuda" and not interpreting():
            raise NotImplementedError(
                f"the hf_sparsekv Triton kernels run on CUDA tensors (got a tensor on {t.device}); on CPU set "
                "TRITON_INTERPRET=1 (tests) or use the PyTorch reference"
            )


_FITTED_STAGES: dict = {}  # (kernel, device, settings) -> the pipeline stages that fit the device's shared memory


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, with fewer pipeline stages (``num_stages``) where the compiled kernel needs
    more shared memory than the device gives a block. Triton raises ``OutOfResources`` for that when it loads the
    kernel, before anything runs on the GPU; the settings here were tuned on an H100 (227 KiB a block), while Ampere
    and Ada consumer GPUs give 99 KiB, and Triton releases differ in what a setting takes. The stages that fit are
    remembered per kernel, device and settings, so the retry happens once (in a captured step's warm-up, never in the
    capture). Raises ``NotImplementedError`` where one stage does not fit either."""
    from triton.runtime.errors import OutOfResources

    key, stages = None, kwargs.get("num_stages")
    if _FITTED_STAGES:  # some launch needed fewer stages (where every setting fits, no key is built per launch)
        key = _fitting_key(kernel, kwargs)
        stages = _FITTED_STAGES.get(key, stages)
    while True:
        try:
            kernel[grid](*args, **(kwargs if stages == kwargs.get("num_stages") else {**kwargs, "num_stages": stages}))
        except OutOfResources as err:
            if not stages or stages <= 1:
                raise NotImplementedError(f"the hf_sparsekv kernel {getattr(kernel, '__name__', kernel)} does not "
                                          f"fit this GPU's shared memory ({err})") from err
            stages -= 1
            continue
        if stages != kwargs.get("num_stages"):
            _FITTED_STAGES[key or _fitting_key(kernel, kwargs)] = stages
        return


def _fitting_key(kernel, kwargs: dict) -> tuple:
    device = torch.cuda.current_device() if torch.cuda.is_available() and not interpreting() else None
    return kernel, device, tuple(sorted(kwargs.items()))


def on_input_device(fn):
    """Decorate a kernel launcher so that it launches on its first tensor argument's device: Triton launches on the
    *current* CUDA device, which for a layer of a model dispatched over several devices is not its tensors' own."""

    @functools.wraps(fn)
    def launch(first, *args, **kwargs):
        if first.device.type != "cuda" or first.device.index == torch.cuda.current_device():
            return fn(first, *args, **kwargs)
        with torch.cuda.device(first.device):
            return fn(first, *args, **kwargs)

    return launch


def check_attention_inputs(q: torch.Tensor, *kv: torch.Tensor, max_q: int = 16,
                           max_rows: int | None = 128) -> tuple[int, int, int, int, int]:
    """Validate ``q [B, Hq, L, D]`` and ``kv`` tensors ``[B, Hkv, *, D]`` for the decode kernels (B > 1 only over
    preallocated buffers with lengths on the device, see decode_core.launch_decode): at most ``max_q`` queries and
    ``max_rows`` query rows per KV head (query heads per KV head x L; None: any).

    Returns ``(Hq, Hkv, L, D, group)``. Raises ValueError/NotImplementedError naming what is unsupported.
    """
    if q.dim() != 4:
        raise NotImplementedError(f"query must be [B, Hq, L, D], got shape {tuple(q.shape)}")
    batch, hq, length, d = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise NotImplementedError(f"dtype {q.dtype} is not supported (float16, bfloat16, float32)")
    if d not in (32, 64, 128):
        raise NotImplementedError(f"head_dim {d} is not supported (32, 64, 128)")
    if not 1 <= length <= max_q:
        raise NotImplementedError(f"query length {length} is not supported (1..{max_q})")
    hkv = kv[0].shape[1] if kv else hq
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    group = hq // hkv
    if max_rows is not None and group * length > max_rows:
        raise NotImplementedError(f"query heads per KV head x query length = {group * length} > {max_rows} is not "
                                  "supported")
    for t in kv:
        if t.shape[0] != batch or t.shape[1] != hkv:
            raise ValueError(f"key/value tensors must be [{batch}, {hkv}, *, *], got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"all tensors must be on {q.device}, got one on {t.device}")
        if t.dtype.is_floating_point and t.dtype != q.dtype:
            raise ValueError(f"key/value dtype {t.dtype} differs from the query dtype {q.dtype}")
    return hq, hkv, length, d, group
