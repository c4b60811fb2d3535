"""hf_sparsekv: long-context speculative decoding for HF transformers with compressed drafter KV caches.

Importing the package registers the ``"sparsekv"`` attention implementation and teaches ``generate()`` the
arguments ``kv_budget`` and ``draft_cache`` (see :mod:`hf_sparsekv.generation.registration`).
"""

from . import compile_cache

compile_cache.configure()  # before anything compiles (hf_sparsekv.compile_cache)

from . import attention, static_attention  # noqa: E402
from .caches import ChunkBudgetCache, ChunkSelection, HierarchicalQuantCache, SinkWindowCache
from .caches.query_hooks import prompt_queries
from .generation import attention_semantics
from .generation import (
    SpecStats, graph_greedy_generate, register, release_engines, set_routing, speculative_generate, unregister,
    warmup,
)

__version__ = "0.1.0"

attention.register()
static_attention.register()
attention_semantics.register()
register()

__all__ = [
    "ChunkBudgetCache",
    "ChunkSelection",
    "HierarchicalQuantCache",
    "SinkWindowCache",
    "SpecStats",
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
