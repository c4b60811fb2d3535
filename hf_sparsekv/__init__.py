"""hf_sparsekv: long-context speculative decoding for HF transformers with compressed drafter KV caches.

Importing the package registers the ``"sparsekv"`` attention implementation and teaches ``generate()`` the
arguments ``kv_budget`` and ``draft_cache`` (see :mod:`hf_sparsekv.generation.registration`); with
``HF_SPARSEKV_PATCH=0`` it patches nothing, and models opt in one by one (:func:`enable`,
:class:`SpeculativeGenerationMixin`).
"""

import os

from . import compile_cache

compile_cache.configure()  # before anything compiles (hf_sparsekv.compile_cache)

from . import attention, static_attention  # noqa: E402
from .caches import ChunkBudgetCache, ChunkSelection, HierarchicalQuantCache, SinkWindowCache
from .caches.query_hooks import prompt_queries
from .generation import attention_semantics
from .generation import (  # noqa: E402
    PATCH_ENV, SpecStats, SpeculativeGenerationMixin, disable, enable, graph_greedy_generate, is_enabled, register,
    release_engines, set_routing, speculative_generate, unregister, warmup,
)

__version__ = "0.1.0"

attention.register()
static_attention.register()
attention_semantics.register()
if os.environ.get(PATCH_ENV, "1") != "0":  # the default: every model's generate() is the front door
    register()

__all__ = [
    "ChunkBudgetCache",
    "ChunkSelection",
    "HierarchicalQuantCache",
    "SinkWindowCache",
    "SpecStats",
    "SpeculativeGenerationMixin",
    "disable",
    "enable",
    "is_enabled",
    "graph_greedy_generate",
    "prompt_queries",
    "release_engines",
    "register",
    "set_routing",
    "speculative_generate",
    "unregister",
    "warmup",
    "__version__",
]
