"""When a model's engine steps are compiled: from its first call, never, or once its uncompiled steps have run as long
as compiling is expected to take.

The engine's steps are CUDA graphs either way; ``torch.compile`` makes each step several times faster on a small
model (fewer, fused kernels: the bundled pair's AR step at 16K, H200, 0.05 s a call compiled against 0.16 s
uncompiled) but costs seconds to a minute per configuration the first time (tracing the model's forward through
dynamo, then Inductor's code generation). Paying that before the first token is a bad trade for a loop of a few
calls, and a good one for a server. By default (``HF_SPARSEKV_COMPILE`` unset or ``"auto"``, with CUDA graphs) a
model's calls run on uncompiled captured steps and each call's time on them is charged to the model; once the total
reaches ``HF_SPARSEKV_COMPILE_AFTER`` seconds (default :data:`DEFAULT_COMPILE_AFTER_S`, about what compiling the
bundled pair's steps costs) the next call of every configuration of that model compiles its steps, and they stay
compiled. This is the rent-or-buy rule: whatever the number of calls, the total is at most about twice that of the
better of the two fixed choices (compile first, or never). Prefills stay eager under this rule: compiling a small
model's prefill for prompts of every length took 25-40 s per cache layout (H200) to save about 10 ms per 16K prompt.

``HF_SPARSEKV_COMPILE="1"`` compiles the steps and (small models') prefills from the first call, ``"0"`` nothing
(``"later"``: the rule above also without CUDA graphs: tests); :func:`~.warmup.warmup` compiles both at once. The
tokens of compiled and uncompiled steps are the same computation; in bf16 their roundings may differ (a greedy
near-tie may then resolve differently, as between any two kernels).
"""

from __future__ import annotations

import os
import threading
import weakref

COMPILE_ENV = "HF_SPARSEKV_COMPILE"
COMPILE_AFTER_ENV = "HF_SPARSEKV_COMPILE_AFTER"
DEFAULT_COMPILE_AFTER_S = 30.0

_charged: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> seconds on its uncompiled steps
_due: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> what compiles from its next call on
_lock = threading.Lock()


def compile_setting(use_graphs: bool) -> str:
    """``HF_SPARSEKV_COMPILE`` as the engine applies it: ``"now"`` (``"1"``: compile from the first call, also without
    graphs), ``"later"`` (``"auto"`` or unset with CUDA graphs, or ``"later"``: compile once :func:`charge` says so),
    ``"never"`` (``"0"``, or ``"auto"`` without graphs)."""
    value = os.environ.get(COMPILE_ENV, "auto") or "auto"
    if value not in ("0", "1", "auto", "later"):
        raise ValueError(f"{COMPILE_ENV} must be '0', '1', 'auto' or 'later', got {value!r}")
    if value == "1":
        return "now"
    if value == "later" or (value == "auto" and use_graphs):
        compile_after()  # (a wrong value is an error at the call's start)
        return "later"
    return "never"


def compile_after() -> float:
    """``HF_SPARSEKV_COMPILE_AFTER``: seconds of calls on uncompiled steps after which a model compiles its steps."""
    value = os.environ.get(COMPILE_AFTER_ENV, "")
    if not value:
        return DEFAULT_COMPILE_AFTER_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{COMPILE_AFTER_ENV} must be a number of seconds, got {value!r}") from None
    if not seconds >= 0:
        raise ValueError(f"{COMPILE_AFTER_ENV} must not be negative, got {value!r}")
    return seconds


def compiles(model, setting: str) -> str | None:
    """What ``model``'s engines compile now, under ``setting`` (:func:`compile_setting`): ``"all"`` (steps and
    prefills), ``"steps"``, or None."""
    if setting != "later":
        return "all" if setting == "now" else None
    with _lock:
        return _due.get(model)


def charge(model, seconds: float) -> None:
    """Add ``seconds`` of a call on ``model``'s uncompiled steps; past :func:`compile_after` its steps are due."""
    with _lock:
        total = _charged[model] = _charged.get(model, 0.0) + seconds
        if total >= compile_after() and model not in _due:
            _due[model] = "steps"


def compile_from_now(model) -> None:
    """``model``'s engines compile their steps and prefills from their next call on (:func:`~.warmup.warmup`)."""
    with _lock:
        _due[model] = "all"


def charged(model) -> float:
    """Seconds charged to ``model`` so far."""
    with _lock:
        return _charged.get(model, 0.0)
