"""One entry point for training and evaluation text: the project's code corpus, a Hub dataset, or local files."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .python_source import python_source_documents

PYTHON_SOURCE = "python-source"
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _local_files(path: Path) -> tuple[str, list[str]]:
    files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"no .txt/.json/.jsonl/.parquet files under {path}")
    builders = {_BUILDERS.get(f.suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise ValueError(f"local data must be files of one kind among {sorted(_BUILDERS)}; got {sorted(f.suffix for f in files)}")
    return builders.pop(), [str(f) for f in files]


def documents(source: str, split: str = "train", text_field: str = "text", streaming: bool | None = None) -> Iterator[str]:
    """Yield document texts from ``source``.

    - ``"python-source"``: :func:`~hf_sparsekv.data.python_source.python_source_documents` (``split`` is
      ``"train"`` or ``"eval"``, split by package);
    - an existing local path (a file, or a directory searched recursively) of ``.txt`` (one document per file),
      ``.json``/``.jsonl`` or ``.parquet`` files, read with ``datasets``; the files are served as ``split``;
    - otherwise a ``datasets`` Hub id, streamed unless ``streaming=False``.
    Each record's ``text_field`` column is the document text.
    """
    if source == PYTHON_SOURCE:
        for doc in python_source_documents(split):
            yield doc.text
        return
    import datasets  # imported here: the corpus builder and inference need no `datasets`

    path = Path(source)
    if path.exists():
        builder, files = _local_files(path)
        extra = {"sample_by": "document"} if builder == "text" else {}
        data = datasets.load_dataset(builder, data_files={split: files}, split=split, streaming=bool(streaming), **extra)
    else:
        data = datasets.load_dataset(source, split=split, streaming=True if streaming is None else streaming)
    columns = data.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(f"{source!r} has no column {text_field!r}; columns: {columns} (pass text_field=...)")
    for record in data:
        text = record[text_field]
        if text:
            yield text


def token_sequences(texts: Iterable[str], tokenizer, length: int) -> Iterator[torch.LongTensor]:
    """Documents tokenized, each followed by EOS, joined, and cut into consecutive sequences of exactly ``length``.

    The tail shorter than ``length`` is dropped. Yields ``LongTensor[length]``.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id to separate documents")
    buffer: list[int] = []
    for text in texts:
        buffer.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        buffer.append(tokenizer.eos_token_id)
        while len(buffer) >= length:
            yield torch.tensor(buffer[:length], dtype=torch.long)
            del buffer[:length]
