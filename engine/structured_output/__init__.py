"""Structured outputs: grammar-constrained decoding with xgrammar or llguidance.

Importing this package loads neither library (xgrammar imports torch): a backend module is
imported by `create_backend`.
"""

from tidegate.engine.structured_output.backend import (
    GrammarError,
    GrammarMatcher,
    StructuredOutputBackend,
    bitmask_words,
    create_backend,
)
from tidegate.engine.structured_output.manager import StructuredOutputManager

__all__ = [
    "GrammarError",
    "GrammarMatcher",
    "StructuredOutputBackend",
    "StructuredOutputManager",
    "bitmask_words",
    "create_backend",
]
