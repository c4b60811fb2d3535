"""The project's `transformers.Cache` subclasses."""

from .chunk_budget import ChunkBudgetCache
from .chunk_selection import ChunkSelection
from .quantized import HierarchicalQuantCache
from .sink_window import SinkWindowCache

__all__ = ["ChunkBudgetCache", "ChunkSelection", "HierarchicalQuantCache", "SinkWindowCache"]
