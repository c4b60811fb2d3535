"""When a model's engine steps are compiled, and how far: from its first call, never, or in two stages once its
calls on steps not yet fully compiled have run as long as each stage is expected to take.

The engine's steps are CUDA graphs either way. Compiling makes each step several times faster on a small model
(fewer kernels) and costs time once per configuration. There are two ways to compile:

- light (:func:`~.graph_steps.light_step_backend`, which gives the measured step times): dynamo traces the step and
  our rewrites put in our fused kernels (grouped, gated and normed linear layers; the rotary embedding inside the
  decode attention); PyTorch's kernels run the rest. Where a model's decoder layers are alike, one layer's trace
  serves every layer (:mod:`.regional`): a few seconds for a configuration, half a second more per step (Triton's
  first compilations of our kernels included); traced whole, about a second a step.
- full (:func:`~.graph_steps.step_backend`): the same rewrites, then Inductor generates fused kernels for the rest.
  Seconds to a minute per configuration (Inductor's code generation; kept on disk for later processes).

By default (``HF_SPARSEKV_COMPILE`` unset or ``"auto"``, with CUDA graphs) a model's calls start on uncompiled
captured steps, and what compiling would have saved of each call is charged to the model (:func:`charge`: half of its
rounds on uncompiled steps, a quarter on light ones; the prefill is the same either way). Once the total reaches what
tracing a configuration's steps light is expected to cost (:func:`light_after`: a few seconds for plain decoding's one
step, more for a drafting configuration's dozen), that configuration's next call compiles its steps light; once it
reaches ``HF_SPARSEKV_COMPILE_AFTER`` seconds (default :data:`DEFAULT_COMPILE_AFTER_S`), every configuration's next
call compiles them fully. This is the rent-or-buy rule applied to each stage (rent: what compiling would save, buy:
what it costs): whatever the number of calls, the total stays within about twice the best fixed choice. Prefills
stay eager under this rule: compiling a small model's prefill for prompts of every length took 25-40 s per cache
layout (H200) to save about 10 ms per 16K prompt.

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
LIGHT_FIXED_S = 6.0  # tracing whole steps light: the first configuration in a process, about (bundled pair, H200:
# an AR call that traced its step took 4.5-8 s)
LIGHT_STEP_S = 1.0  # and per step traced and captured (bundled pair: 17 s for a routed call's 14; 30-layer 135M
# shape: about 2.7 s)
REGIONAL_FIXED_S = 1.5  # the same where one decoder layer is traced for all (.regional). Bundled pair, H200, a
# process after the first (Triton's on-disk cache warm), the tracing call against the uncompiled calls around it: AR
# (1 step) 1.3 s more, prompt lookup (7) 2.8 s, the routed call (14) 5.8 s; the first process pays Triton's first
# compilations of our kernels on top (up to 8 s once)
REGIONAL_STEP_S = 0.3
UNCOMPILED_CHARGE_SHARE = 0.5  # of a call's rounds on uncompiled steps, what light steps save (bundled pair, H200,
# 64-prompt loops, a call before and after the trace: AR 0.17 -> 0.06 s, routed 0.13 -> 0.065 s, prompt lookup 0.08 ->
# 0.04 s, chunk 0.14 -> 0.06 s)
LIGHT_CHARGE_SHARE = 0.25  # of a call on light steps, what full compilation would save (bundled pair, H200, 16K: a
# warm call 0.059 s light, 0.045 s compiled by Inductor)

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


def compiles(model, setting: str, steps: int = 0, regional: bool = False) -> str | None:
    """What an engine of ``model`` that ran ``steps`` steps compiles now, under ``setting`` (:func:`compile_setting`):
    ``"all"`` (steps fully, and prefills), ``"steps"`` (fully), ``"light"`` (steps light), or None. An engine that
    ran no step yet compiles nothing light (what it would trace is not known). ``regional``: its light steps trace
    one decoder layer for all (:mod:`.regional`)."""
    if setting != "later":
        return {"now": "all", "light": "light"}.get(setting)
    with _lock:
        due = _due.get(model)
        if due is None and steps and _charged.get(model, 0.0) >= light_after(steps, regional):
            due = "light"
        return due


def light_after(steps: int, regional: bool = False) -> float:
    """Seconds of calls after which a configuration that runs ``steps`` steps traces them light: about what that costs
    (:data:`LIGHT_FIXED_S` + :data:`LIGHT_STEP_S` a step; ``regional``: :data:`REGIONAL_FIXED_S` +
    :data:`REGIONAL_STEP_S` a step); never later than the full compilation."""
    fixed, per_step = (REGIONAL_FIXED_S, REGIONAL_STEP_S) if regional else (LIGHT_FIXED_S, LIGHT_STEP_S)
    return min(compile_after(), fixed + per_step * steps)


def charge(model, seconds: float, light: bool = False) -> None:
    """Add what compiling would have saved of ``seconds`` of a call's rounds on ``model``'s steps not fully compiled
    (its prefill, the same either way, and an adaptive engine's first captures of its widths excluded):
    :data:`UNCOMPILED_CHARGE_SHARE` of rounds on uncompiled steps, :data:`LIGHT_CHARGE_SHARE` of rounds on light
    steps (``light``). Past :func:`compile_after` the model's steps are due to compile fully (the light stage:
    :func:`compiles`)."""
    share = LIGHT_CHARGE_SHARE if light else UNCOMPILED_CHARGE_SHARE
    with _lock:
        total = _charged[model] = _charged.get(model, 0.0) + share * seconds
        if total >= compile_after() and model not in _due:
            _due[model] = "steps"


def compile_from_now(model) -> None:
    """``model``'s engines compile their steps fully and prefills from their next call on (:func:`~.warmup.warmup`)."""
    with _lock:
        _due[model] = "all"


def charged(model) -> float:
    """Seconds charged to ``model`` so far."""
    with _lock:
        return _charged.get(model, 0.0)
