"""Text for training and evaluation: the project's Python-source corpus, ``datasets`` ids and local files."""

from .loading import PYTHON_SOURCE, documents, token_sequences
from .python_source import SourceDocument, default_roots, python_source_documents, split_of

__all__ = [
    "PYTHON_SOURCE",
    "SourceDocument",
    "default_roots",
    "documents",
    "python_source_documents",
    "split_of",
    "token_sequences",
]
