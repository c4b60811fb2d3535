"""When a model's engine steps are compiled, and how far: from its first call, never, or in two stages once its
calls on steps not yet fully compiled have run as long as each stage is expected to take.

The engine's steps are CUDA graphs either way. Compiling makes each step several times faster on a small model
(fewer kernels: the bundled pair's AR step at 16K, H200: 1.08 ms uncompiled, 522 kernels) and costs time once per
configuration. There are two ways to compile:

- light (:func:`~.graph_steps.light_step_backend`): dynamo traces the step and our rewrites put in our fused kernels
  (grouped, gated and normed linear layers; the rotary embedding inside the decode attention); PyTorch's kernels run
  the rest. 0.34 ms a step (103 kernels); about a second of tracing a step.
- full: the same rewrites, then Inductor generates fused kernels for the rest. 0.27 ms a step (66 kernels); seconds
  to a minute per configuration (Inductor's code generation; kept on disk for later processes).

By default (``HF_SPARSEKV_COMPILE`` unset or ``"auto"``, with CUDA graphs) a model's calls start on uncompiled
captured steps, and each call's time on steps not fully compiled is charged to the model: once the total reaches
:data:`LIGHT_SHARE` of ``HF_SPARSEKV_COMPILE_AFTER`` seconds (default :data:`DEFAULT_COMPILE_AFTER_S`) the next call
of every configuration of the model compiles its steps light; once it reaches the whole, fully. This is the
rent-or-buy rule applied to each stage: whatever the number of calls, the total stays within a small factor of the
best fixed choice. Prefills stay eager under this rule: compiling a small model's prefill for prompts of every
length took 25-40 s per cache layout (H200) to save about 10 ms per 16K prompt.

``HF_SPARSEKV_COMPILE="1"`` compiles the steps fully and (small models') prefills from the first call, ``"light"``
the steps light from the first call, ``"0"`` nothing (``"later"``: the rule above also without CUDA graphs: tests);
:func:`~.warmup.warmup` compiles fully at once. Compiled and uncompiled steps compute the same tokens; in bf16 their
roundings may differ (a greedy near-tie may then resolve differently, as between any two kernels).
"""

from __future__ import annotations

import os
import threading
import weakref

COMPILE_ENV = "HF_SPARSEKV_COMPILE"
COMPILE_AFTER_ENV = "HF_SPARSEKV_COMPILE_AFTER"
DEFAULT_COMPILE_AFTER_S = 30.0
LIGHT_SHARE = 0.1  # light compilation is due at this share of HF_SPARSEKV_COMPILE_AFTER
LEVELS = (None, "light", "steps", "all")  # what compiles, weakest first

_charged: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> seconds on its uncompiled steps
_due: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> what compiles from its next call on
_lock = threading.Lock()


def compile_setting(use_graphs: bool) -> str:
    """``HF_SPARSEKV_COMPILE`` as the engine applies it: ``"now"`` (``"1"``: compile fully from the first call, also
    without graphs), ``"light"`` (light from the first call), ``"later"`` (``"auto"`` or unset with CUDA graphs, or
    ``"later"``: compile as :func:`charge` says), ``"never"`` (``"0"``, or ``"auto"`` without graphs)."""
    value = os.environ.get(COMPILE_ENV, "auto") or "auto"
    if value not in ("0", "1", "auto", "later", "light"):
        raise ValueError(f"{COMPILE_ENV} must be '0', '1', 'light', 'auto' or 'later', got {value!r}")
    if value == "1":
        return "now"
    if value == "light":
        return "light"
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
    """What ``model``'s engines compile now, under ``setting`` (:func:`compile_setting`): ``"all"`` (steps fully, and
    prefills), ``"steps"`` (fully), ``"light"`` (steps light), or None (one of :data:`LEVELS`)."""
    if setting != "later":
        return {"now": "all", "light": "light"}.get(setting)
    with _lock:
        return _due.get(model)


def charge(model, seconds: float) -> None:
    """Add ``seconds`` of a call on ``model``'s steps not fully compiled: past :data:`LIGHT_SHARE` of
    :func:`compile_after` its steps are due to compile light, past the whole fully."""
    with _lock:
        total = _charged[model] = _charged.get(model, 0.0) + seconds
        due = "steps" if total >= compile_after() else "light" if total >= LIGHT_SHARE * compile_after() else None
        if LEVELS.index(due) > LEVELS.index(_due.get(model)):
            _due[model] = due


def compile_from_now(model) -> None:
    """``model``'s engines compile their steps fully and prefills from their next call on (:func:`~.warmup.warmup`)."""
    with _lock:
        _due[model] = "all"


def charged(model) -> float:
    """Seconds charged to ``model`` so far."""
    with _lock:
        return _charged.get(model, 0.0)
