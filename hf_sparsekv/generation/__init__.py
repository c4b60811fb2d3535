"""Speculative decoding wired into ``generate()``."""

from .front import SpeculativeGenerateOutput, speculative_generate
from .registration import register, unregister
from .stats import SpecStats

__all__ = ["SpecStats", "SpeculativeGenerateOutput", "register", "speculative_generate", "unregister"]
