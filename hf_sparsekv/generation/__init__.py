"""Speculative decoding wired into ``generate()``."""

from .front import SpeculativeGenerateOutput, speculative_generate
from .engine import release_engines
from .rounds import graph_greedy_generate
from .registration import (
    PATCH_ENV, SpeculativeGenerationMixin, disable, enable, is_enabled, register, set_routing, unregister,
)
from .stats import SpecStats
from .warmup import warmup

__all__ = [
    "PATCH_ENV",
    "SpeculativeGenerationMixin",
    "disable",
    "enable",
    "is_enabled",
    "SpecStats",
    "SpeculativeGenerateOutput",
    "graph_greedy_generate",
    "register",
    "release_engines",
    "set_routing",
    "speculative_generate",
    "unregister",
    "warmup",
]
