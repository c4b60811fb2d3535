"""Device-only steps of the static loop, run eagerly or captured once and replayed as CUDA graphs.

A step is a Python function that reads and writes only preallocated device tensors (token and length buffers, the
static caches of :mod:`hf_sparsekv.caches.static`) and never syncs with the host, so a CUDA graph recorded from
one call replays it exactly with whatever those tensors hold at replay time.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .. import static_attention

GRAPHS_ENV = "HF_SPARSEKV_GRAPHS"


def graphs_setting() -> str:
    """``HF_SPARSEKV_GRAPHS``: ``"0"`` never use the static/graph path, ``"1"`` always (on CPU the static loop runs
    without capture: tests), unset or ``"auto"``: on CUDA."""
    value = os.environ.get(GRAPHS_ENV, "auto") or "auto"
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{GRAPHS_ENV} must be '0', '1' or 'auto', got {value!r}")
    return value


def static_forward(model, tokens: torch.Tensor, positions: torch.Tensor, cache, logits_to_keep: int) -> torch.Tensor:
    """``model`` on ``tokens [1, L]`` at ``positions [L]`` (device int64) over a static cache; logits ``[L', V]``
    (L' = logits_to_keep, 0 for all), in the model dtype."""
    cache.begin_step(positions)
    out = model(
        input_ids=tokens, position_ids=positions[None], past_key_values=cache, use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits[0]


def static_prefill(model, prompt: torch.Tensor, cache) -> torch.Tensor:
    """Feed ``prompt [1, P]`` to an empty static cache (eager); the last position's logits ``[V]``."""
    cache.begin_prefill(prompt.shape[1])
    positions = torch.arange(prompt.shape[1], device=prompt.device)[None]
    out = model(input_ids=prompt, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.end_prefill()
    return out.logits[0, -1]


class CapturedStep:
    """``fn`` (device ops on static tensors only) replayed as a CUDA graph once :meth:`capture` succeeded, else run
    eagerly. ``restore``: tensors whose contents the warm-up and capture may change and must be put back (the
    warm-up really runs ``fn``)."""

    def __init__(self, fn, pool=None):
        self.fn, self.pool = fn, pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def capture(self, restore: tuple[torch.Tensor, ...] = (), warmup: int = 2) -> None:
        saved = [t.clone() for t in restore]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # Triton compilation, cuBLAS handles, allocator warm-up: outside the graph
                self.fn()
                for t, s in zip(restore, saved):
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.fn()
        for t, s in zip(restore, saved):
            t.copy_(s)
        self.graph = graph

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


@contextlib.contextmanager
def static_attention_for(*models):
    """Run ``models`` with the ``"sparsekv_static"`` attention inside the block (each model once)."""
    switched = []
    try:
        for m in {id(m): m for m in models}.values():
            previous = m.config._attn_implementation
            if previous != static_attention.NAME:
                m.set_attn_implementation(static_attention.NAME)
                switched.append((m, previous))
        yield
    finally:
        for m, previous in switched:
            m.set_attn_implementation(previous)
