"""Refusing, before anything loads, a model given as a local path that does not exist, and a tokenizer folder that
holds no tokenizer (``hf-sparsekv generate`` and ``train-drafter``). A leaf module, so that
:mod:`hf_sparsekv.commands` and :mod:`hf_sparsekv.training.run` share it without importing each other."""

from __future__ import annotations

from pathlib import Path


def _looks_local(name: str) -> bool:
    """Whether ``name`` can only be a local path: it starts with ``/``, ``./``, ``../`` or ``~``, has a backslash, or
    has more than one ``/`` (a Hub id is ``name`` or ``namespace/name``)."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.strip("/").count("/") > 1


def refuse_missing_model_paths(args, parser) -> None:
    """``parser.error`` for ``--verifier``/``--drafter``/``--tokenizer`` written as a local path (see
    :func:`_looks_local`) that does not exist: at once, naming it and where it was looked for, instead of asking
    the Hub for an id it cannot be."""
    for flag in ("verifier", "drafter", "tokenizer"):
        name = getattr(args, flag)
        if name and _looks_local(name) and not Path(name).expanduser().exists():
            where = "" if Path(name).expanduser().is_absolute() else f" (relative to {Path.cwd()})"
            parser.error(f"--{flag} {name}: no such file or directory{where}; it is not a Hub id (namespace/name) "
                         "either. For the bundled pair use --pair")


# What AutoTokenizer can load a tokenizer from in a local folder (a fast tokenizer's file, a config naming one, or a
# slow tokenizer's vocabulary). A model folder with none of them (the bundled pair's verifier: its tokenizer is in
# its own folder) makes AutoTokenizer fall back to the model type's slow tokenizer and fail deep inside transformers.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                    "vocab.txt", "merges.txt", "sentencepiece.bpe.model")


def _holds_a_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))


def refuse_folder_without_tokenizer(args, parser) -> None:
    """``parser.error`` when the tokenizer to load (``--tokenizer``, else the ``--verifier`` it defaults to) is a
    local folder holding no tokenizer file: one line naming the folder and ``--tokenizer``, instead of
    transformers' traceback about sentencepiece or tiktoken."""
    name = getattr(args, "tokenizer", None) or getattr(args, "verifier", None)
    if not name:
        return
    folder = Path(name).expanduser()
    if folder.is_dir() and not _holds_a_tokenizer(folder):
        given = "--tokenizer" if getattr(args, "tokenizer", None) not in (None, args.verifier) else "--verifier"
        parser.error(f"{given} {name}: the folder holds no tokenizer (none of {', '.join(_TOKENIZER_FILES[:3])}, "
                     f"...); pass --tokenizer PATH_OR_HUB_ID (the bundled pair's is {_bundled_tokenizer()})")


def _bundled_tokenizer() -> Path:
    """The bundled pair's tokenizer folder, absolute (wherever the package is installed)."""
    from .zoo import PAIR_DIR  # (here: the zoo imports torch)

    return (PAIR_DIR / "tokenizer").resolve()
