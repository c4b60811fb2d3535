"""QuantSpec's 4-bit draft weights: with ``draft_cache="int4"`` the draft steps run the drafting model's linear layers
on a 4-bit weight-only copy (:mod:`hf_sparsekv.kernels.w4_linear`), the verify steps on the original weights, so the
output is still exactly greedy AR on the INT8 view (verification alone decides every token).

The copy is made once per model, on the first call that asks for it, and kept on the model (remade when a weight
changes in place); :func:`release` (called by ``hf_sparsekv.release_engines()``) frees it and restores the layers.
Each qualifying ``nn.Linear`` (tinygemm's shapes, :func:`~hf_sparsekv.kernels.w4_linear.w4_shape_ok`) gets a forward
that reads the 4-bit copy while :func:`drafting` is active and is its original forward otherwise; the engine
activates it around its draft and catch-up steps (their compilation and capture included: a captured step holds the
kernels it was traced with).
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch
from torch import nn
from transformers.utils import logging

from ..kernels.w4_linear import W4Weight, quantize_w4, w4_linear, w4_shape_ok

logger = logging.get_logger(__name__)

CHOICES = ("int4", "full")
_ATTRIBUTE = "_hf_sparsekv_w4"  # on a layer: its 4-bit copy
_OWN_FORWARD = "_hf_sparsekv_w4_forward"  # on a layer: a forward it held as an instance attribute before (a hook's)
_VERSIONS = "_hf_sparsekv_w4_versions"  # on the model: the weights its copies were made from
_active = False  # read by every converted layer's forward: the draft steps' weights
_models: "weakref.WeakSet" = weakref.WeakSet()


def _layers(model) -> list[nn.Linear]:
    """The linear layers that get a 4-bit copy: plain ``nn.Linear`` of a shape tinygemm takes."""
    return [m for m in model.modules() if type(m) is nn.Linear and w4_shape_ok(*m.weight.shape)]


def default_choice(model) -> str:
    """``"int4"`` where tinygemm runs (a CUDA model, not tensor-parallel, with at least one qualifying layer), else
    ``"full"``."""
    if model.device.type != "cuda" or not hasattr(torch.ops.aten, "_weight_int4pack_mm") or _sharded(model):
        return "full"
    return "int4" if _layers(model) else "full"


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


def _w4_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A converted layer's forward (bound to the layer, so that a deep copy of the model binds it to the copy)."""
    if _active:
        return w4_linear(x, getattr(self, _ATTRIBUTE), self.bias)
    own = getattr(self, _OWN_FORWARD)
    return own(x) if own is not None else type(self).forward(self, x)


def nbytes(model) -> int:
    """The bytes ``model``'s 4-bit copies hold (0 without them)."""
    return sum(getattr(m, _ATTRIBUTE).nbytes() for m in model.modules() if hasattr(m, _ATTRIBUTE))


def attach(model) -> bool:
    """Give every qualifying linear layer of ``model`` its 4-bit copy (once; again where a weight changed in place).
    Returns whether copies were made (earlier ones, and whatever captured them, are stale then)."""
    held = getattr(model, _VERSIONS, None)
    layers = _layers(model)
    if held is not None and held == _versions(layers):
        return False
    release_model(model)
    pack = model.device.type == "cuda"
    total = 0
    with torch.no_grad():
        for layer in layers:
            w4: W4Weight = quantize_w4(layer.weight, pack=pack)
            setattr(layer, _ATTRIBUTE, w4)
            setattr(layer, _OWN_FORWARD, layer.__dict__.get("forward"))
            layer.forward = types.MethodType(_w4_forward, layer)
            total += w4.nbytes()
    setattr(model, _VERSIONS, _versions(layers))
    _models.add(model)
    logger.info("hf_sparsekv: 4-bit draft weights for %d linear layers (%.1f MB)", len(layers), total / 2**20)
    return True


def release_model(model) -> None:
    """Drop ``model``'s 4-bit copies and give its layers their original forward back."""
    if getattr(model, _VERSIONS, None) is None:
        return
    for layer in model.modules():
        if hasattr(layer, _ATTRIBUTE):
            own = getattr(layer, _OWN_FORWARD)
            delattr(layer, _ATTRIBUTE)
            delattr(layer, _OWN_FORWARD)
            if own is None:
                del layer.forward  # the class's forward shows again
            else:
                layer.forward = own
    delattr(model, _VERSIONS)
    _models.discard(model)


def release() -> None:
    """Free every model's 4-bit copies."""
    for model in list(_models):
        release_model(model)


@contextlib.contextmanager
def drafting(active: bool):
    """Inside the block, converted layers compute with their 4-bit copies (when ``active``)."""
    global _active
    previous, _active = _active, active
    try:
        yield
    finally:
        _active = previous
