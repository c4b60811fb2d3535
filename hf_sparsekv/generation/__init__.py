"""Speculative decoding wired into ``generate()``."""

from .front import SpeculativeGenerateOutput, speculative_generate
from .graph_loop import graph_greedy_generate, release_engines
from .registration import register, unregister
from .stats import SpecStats

__all__ = [
    "SpecStats",
    "SpeculativeGenerateOutput",
    "graph_greedy_generate",
    "register",
    "release_engines",
    "speculative_generate",
    "unregister",
]
