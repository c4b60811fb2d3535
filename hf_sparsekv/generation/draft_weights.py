"""QuantSpec's 4-bit draft weights: with ``draft_cache="int4"`` the draft steps run the drafting model's linear layers
on a 4-bit weight-only copy (:mod:`hf_sparsekv.kernels.w4_linear`), the verify steps on the original weights, so the
output is still exactly greedy AR on the INT8 view (verification alone decides every token).

The copy is made once per model, on the first call that asks for it, and kept on the model (remade when a weight
changes in place); :func:`release` (called by ``hf_sparsekv.release_engines()``) frees it and restores the layers.
Each qualifying ``nn.Linear`` (tinygemm's shapes, :func:`~hf_sparsekv.kernels.w4_linear.w4_shape_ok`) becomes a
:class:`W4Linear` (its class swapped, its 4-bit copy an attribute): its forward reads the 4-bit copy while the calling
thread is inside :func:`drafting` and is ``nn.Linear``'s otherwise, so forwards on other threads never see the copy.
The engine activates it around its draft and catch-up steps (their compilation and capture included: a captured step
holds the kernels it was traced with). Code that dynamo traces reads the copy only inside the engine's own compiled
draft steps (:func:`compiling_drafts`, under their own compile backend), so that no trace on the copies is ever
replayed where the full weights are meant (:func:`_traced_active`).

What is attached survives the model's life cycle: a :class:`W4Linear` pickles and deep-copies as the plain
``nn.Linear`` it was, without the copy, so ``torch.save``/``torch.load``, ``copy.deepcopy`` and ``save_pretrained``
give a stock model, and the weights each model's copies were made from are kept here, not on the model.
:func:`attach` converts every layer or none (an interrupt leaves the model as it was). A layer with a forward of its
own (an instance attribute, as accelerate's hooks of a ``device_map`` model set) keeps its full-precision weights.
"""

from __future__ import annotations

import contextlib
import copyreg
import threading
import weakref

import torch
from torch import nn
from transformers.utils import logging

from ..kernels.w4_linear import W4Weight, quantize_w4, w4_linear, w4_shape_ok

logger = logging.get_logger(__name__)

CHOICES = ("int4", "full")
_ATTRIBUTE = "_hf_sparsekv_w4"  # on a converted layer: its 4-bit copy (a W4Weight)


class _Drafting(threading.local):
    """``active``: whether this thread's converted layers compute with their 4-bit copies (:func:`drafting`);
    ``compiling``: whether a forward dynamo traces on this thread now belongs to one of the engine's own compiled
    draft steps (:func:`compiling_drafts`)."""

    active = False
    compiling = False


_state = _Drafting()
_made_from: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # model -> _versions(layers)
_registry = threading.Lock()  # guards _made_from


def active() -> bool:
    """Whether the calling thread's converted layers compute with their 4-bit copies: eagerly, inside
    :func:`drafting`; in code dynamo traces, only inside :func:`drafting` and :func:`compiling_drafts` both (see
    :func:`_traced_active`)."""
    if torch.compiler.is_compiling():
        return _traced_active()
    return _state.active


@torch._dynamo.assume_constant_result
def _traced_active() -> bool:
    """What a trace reads for :func:`active`: run as Python when dynamo traces, its result a constant of the
    compiled code (dynamo's guards do not follow a ``threading.local``'s attribute: torch 2.11 read the class
    default, so that every compiled draft step kept the full weights). True only for the engine's own draft steps
    on the copies, which compile under a backend of their own (:func:`~.graph_steps.draft_weights_backend`; dynamo
    keeps compiled code per backend, so code traced one way is never replayed the other); any other compile, a
    user's ``torch.compile`` of the model's forward reached from an uncompiled draft step included, traces the full
    weights."""
    return _state.active and _state.compiling


@contextlib.contextmanager
def compiling_drafts(active: bool = True):
    """Inside the block (when ``active``), code dynamo traces on this thread is one of the engine's draft steps on
    the 4-bit copies, compiled under :func:`~.graph_steps.draft_weights_backend`."""
    previous, _state.compiling = _state.compiling, active
    try:
        yield
    finally:
        _state.compiling = previous


class W4Linear(nn.Linear):
    """An ``nn.Linear`` holding a 4-bit copy of its weight (attribute ``_hf_sparsekv_w4``), which its forward reads
    while the calling thread drafts (:func:`drafting`). Pickled and deep-copied as a plain ``nn.Linear`` (the copy
    left behind): the file references ``torch.nn.Linear`` alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if active():
            return w4_linear(x, getattr(self, _ATTRIBUTE), self.bias)
        return super().forward(x)

    def __reduce_ex__(self, protocol):
        state = {name: value for name, value in self.__getstate__().items() if name != _ATTRIBUTE}
        return copyreg._reconstructor, (nn.Linear, object, None), state


def _qualifying(model) -> tuple[list[nn.Linear], int]:
    """``(layers, skipped)``: the linear layers that get a 4-bit copy (plain ``nn.Linear``, or converted already, of a
    shape tinygemm takes) and how many such layers were left out for a forward of their own (hooks)."""
    shaped = [m for m in model.modules() if type(m) in (nn.Linear, W4Linear) and w4_shape_ok(*m.weight.shape)]
    layers = [m for m in shaped if "forward" not in m.__dict__]
    return layers, len(shaped) - len(layers)


# Qualifying weight elements per decoder layer from which the 4-bit copy is the default. Each converted layer is a
# tinygemm launch of its own (the grouped, gated and normed kernels take no 4-bit weights), about 6 launches more a
# layer, so the copy pays only where the bytes it saves take longer to read than those launches (H200, draft steps
# on int4 self-speculation's quantized store, 2026-12-02): Llama-3.1-8B shape (218M a layer) 4.03 against 5.45 ms at
# 32K, Llama-3.2-1B shape (61M) 1.01 against 1.21 ms at 4K, the bundled verifier (0.8M) 2.08 against 1.58 ms for
# 6 drafts at 16K (963 against 531 kernels).
W4_MIN_LAYER_ELEMENTS = 1 << 25


def layer_elements(model) -> float:
    """The weight elements of the qualifying linear layers of ``model``'s decoder (its language model's, for a
    multimodal one; the output embedding left out) per decoder layer; 0 where the decoder or its layer count is not
    known."""
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not count or decoder is None:
        return 0.0
    return sum(m.weight.numel() for m in _qualifying(decoder)[0]) / count


def _tinygemm_runs(model) -> bool:
    return model.device.type == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm") and not _sharded(model)


def default_choice(model) -> str:
    """``"int4"`` where tinygemm runs (a CUDA model, not tensor-parallel) and the qualifying layers hold at least
    :data:`W4_MIN_LAYER_ELEMENTS` weights per decoder layer, else ``"full"``."""
    return "int4" if _tinygemm_runs(model) and layer_elements(model) >= W4_MIN_LAYER_ELEMENTS else "full"


def _sharded(model) -> bool:
    return (getattr(model, "_tp_size", None) or 1) > 1 or any(hasattr(p, "to_local") for p in model.parameters())


def check_choice(draft_weights, mode: str, drafter) -> None:
    if draft_weights is None:
        return
    if draft_weights not in CHOICES:
        raise ValueError(f"draft_weights must be one of {CHOICES}, got {draft_weights!r}")
    if mode not in ("int4", "int4-drafter"):
        raise ValueError("draft_weights applies to draft_cache='int4' (QuantSpec self-speculation or a drafter on a "
                         "quantized cache)")
    if draft_weights == "int4" and _sharded(drafter):
        raise NotImplementedError("draft_weights='int4' with a tensor-parallel model (tp_plan): its weights are "
                                  "sharded; use draft_weights='full'")


def _versions(layers: list[nn.Linear]) -> tuple:
    return tuple((m.weight.data_ptr(), m.weight._version) for m in layers)


def nbytes(model) -> int:
    """The bytes ``model``'s 4-bit copies hold (0 without them)."""
    return sum(getattr(m, _ATTRIBUTE).nbytes() for m in model.modules() if isinstance(m, W4Linear))


def _convert(layer: nn.Linear, w4: W4Weight | None) -> None:
    """Make ``layer`` a :class:`W4Linear` reading ``w4``, or (None) the plain ``nn.Linear`` again."""
    if w4 is None:
        layer.__dict__.pop(_ATTRIBUTE, None)
        layer.__class__ = nn.Linear
    else:
        layer.__dict__[_ATTRIBUTE] = w4
        layer.__class__ = W4Linear


def attach(model) -> bool:
    """Give every qualifying linear layer of ``model`` its 4-bit copy (once; again where a weight changed in place),
    all or none: every copy is made before any layer changes, and an exception or interrupt while they change puts
    each layer back as it was. Returns whether copies were made (earlier ones, and whatever captured them, are stale
    then). The caller holds ``model``'s lock (:mod:`.model_locks`)."""
    layers, skipped = _qualifying(model)
    versions = _versions(layers)
    with _registry:
        if _made_from.get(model) == versions:
            return False
    pack = model.device.type == "cuda"
    with torch.no_grad():
        copies = [quantize_w4(layer.weight, pack=pack) for layer in layers]
    stale = [m for m in model.modules() if isinstance(m, W4Linear)]
    before = {id(m): (m, m.__dict__.get(_ATTRIBUTE)) for m in stale + layers}  # each layer's copy (None: plain)
    try:
        for layer in stale:
            _convert(layer, None)
        for layer, w4 in zip(layers, copies):
            _convert(layer, w4)
    except BaseException:
        for layer, w4 in before.values():
            _convert(layer, w4)
        raise
    with _registry:
        _made_from[model] = versions
    if skipped:
        logger.info("hf_sparsekv: %d linear layers with a forward of their own (hooks) keep their full-precision "
                    "weights in the draft steps", skipped)
    logger.info("hf_sparsekv: 4-bit draft weights for %d linear layers (%.1f MB)", len(layers),
                sum(w4.nbytes() for w4 in copies) / 2**20)
    return True


def release_model(model) -> None:
    """Drop ``model``'s 4-bit copies: its converted layers are plain ``nn.Linear`` again. The caller holds
    ``model``'s lock."""
    with _registry:
        _made_from.pop(model, None)
    for layer in model.modules():
        if isinstance(layer, W4Linear):
            _convert(layer, None)


def models() -> list[nn.Module]:
    """The models that hold 4-bit copies."""
    with _registry:
        return list(_made_from)


@contextlib.contextmanager
def drafting(active: bool):
    """Inside the block, this thread's converted layers compute with their 4-bit copies (when ``active``)."""
    previous, _state.active = _state.active, active
    try:
        yield
    finally:
        _state.active = previous
