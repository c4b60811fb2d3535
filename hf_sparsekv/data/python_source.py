"""Long documents from the ``.py`` files of the local Python installation (repository-level code context).

Each top-level package (``email``, ``torch``, ``transformers``, a single-file module like ``six``) becomes one or
more documents: its files, in path order, each preceded by a header line naming the file, concatenated. Large
packages are cut at file boundaries into documents of at most ``max_doc_chars`` characters (code tokenizes to about
3-4 characters per token, so the default gives documents of up to ~32K tokens). Exact duplicate files are dropped
(the first in walk order is kept). Packages are split into train and held-out eval by a hash of the package name,
so eval code is never seen in training. Everything is deterministic for a given installation.
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "eval")
MAX_FILE_BYTES = 1 << 20  # larger .py files are generated tables, not code
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


@dataclass(frozen=True)
class SourceDocument:
    package: str  # top-level package or module name (the unit of the train/eval split)
    part: int  # index of this document within its package
    text: str


def default_roots() -> list[Path]:
    """The standard library and every site-packages directory of the running interpreter."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    roots: list[Path] = []
    for p in candidates:
        path = Path(p).resolve()
        if path.is_dir() and path not in roots:
            roots.append(path)
    return roots


def split_of(package: str, eval_fraction: float) -> str:
    """``"eval"`` for a fixed pseudo-random ``eval_fraction`` of package names, ``"train"`` for the rest."""
    bucket = int.from_bytes(hashlib.sha1(package.encode()).digest()[:4], "big") / 2**32
    return "eval" if bucket < eval_fraction else "train"


def _package_files(roots: list[Path]) -> dict[str, list[tuple[str, Path]]]:
    """package name -> [(display path, file)], in deterministic walk order."""
    packages: dict[str, list[tuple[str, Path]]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".dist-info", ".egg-info")))
            rel_dir = Path(dirpath).relative_to(root)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                rel = rel_dir / name
                package = rel.parts[0].removesuffix(".py")
                packages.setdefault(package, []).append((rel.as_posix(), Path(dirpath) / name))
    return packages


def python_source_documents(
    split: str = "train",
    roots: list[str | Path] | None = None,
    eval_fraction: float = 0.1,
    max_doc_chars: int = 128_000,
) -> Iterator[SourceDocument]:
    """Documents of one split, packages in name order, files in path order.

    ``roots`` defaults to :func:`default_roots`. Deduplication runs over both splits, in package order, so a file
    that appears in two packages is kept only in the first, whatever split is asked for.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    root_paths = [Path(r).resolve() for r in roots] if roots is not None else default_roots()
    for r in root_paths:
        if not r.is_dir():
            raise ValueError(f"root {r} is not a directory")
    seen: set[bytes] = set()
    files_by_package = _package_files(root_paths)
    for package in sorted(files_by_package):
        wanted = split_of(package, eval_fraction) == split
        parts: list[str] = []
        size = 0
        index = 0
        for shown, path in files_by_package[package]:
            try:
                raw = path.read_bytes()
            except OSError:
                continue
            if not raw.strip() or len(raw) > MAX_FILE_BYTES:
                continue
            digest = hashlib.sha1(raw).digest()
            if digest in seen:
                continue
            seen.add(digest)
            if not wanted:
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            piece = f"# ==== file: {shown} ====\n{text.rstrip()}\n\n"
            if parts and size + len(piece) > max_doc_chars:
                yield SourceDocument(package, index, "".join(parts))
                parts, size, index = [], 0, index + 1
            parts.append(piece)
            size += len(piece)
        if parts:
            yield SourceDocument(package, index, "".join(parts))
