"""Refusing, before anything loads, a model given as a local path that does not exist (``hf-sparsekv generate``
and ``train-drafter``). A leaf module, so that :mod:`hf_sparsekv.commands` and :mod:`hf_sparsekv.training.run` share
it without importing each other."""

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
