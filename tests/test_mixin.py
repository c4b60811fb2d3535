"""The explicit way in: ``SpeculativeGenerationMixin`` / ``hf_sparsekv.enable(model)``, beside the import-time patch,
and the import without the patch (``HF_SPARSEKV_PATCH=0``)."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.generation.utils import GenerationMixin

import hf_sparsekv
from hf_sparsekv.generation import engine as static_engine, registration

from .conftest import prompt, tiny_model

ROOT = Path(__file__).resolve().parent.parent
GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture
def unpatched():
    """The patch off for the test (as after an import with HF_SPARSEKV_PATCH=0), on again after it."""
    hf_sparsekv.unregister()
    static_engine.release_engines()
    yield
    hf_sparsekv.register()
    static_engine.release_engines()


def _stock(model, ids, **kwargs):
    return registration._STOCK(model, ids, **kwargs)


def _on_engine(out) -> bool:
    return getattr(out, "spec_stats", None) is not None


def test_without_the_patch_stock_models_are_stock_and_an_enabled_one_runs_on_the_engine(unpatched):
    assert GenerationMixin.generate is registration._STOCK
    plain, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    enabled = hf_sparsekv.enable(copy.deepcopy(plain))
    ids = prompt(60, seed=4)
    greedy = _stock(plain, ids, **GREEDY)
    for call in (dict(), dict(assistant_model=drafter), dict(prompt_lookup_num_tokens=3)):
        out = plain.generate(ids, return_dict_in_generate=True, **call, **GREEDY)
        assert torch.equal(out.sequences, greedy) and not _on_engine(out)
    torch.manual_seed(3)
    sampled = plain.generate(ids, max_new_tokens=10, do_sample=True, pad_token_id=0)
    torch.manual_seed(3)
    assert torch.equal(sampled, _stock(plain, ids, max_new_tokens=10, do_sample=True, pad_token_id=0))
    with pytest.raises(ValueError, match="kv_budget"):  # stock's own check of unknown arguments
        plain.generate(ids, assistant_model=drafter, kv_budget=16, **GREEDY)
    assert static_engine.current_engine(plain) is None
    for call in (dict(assistant_model=drafter), dict(assistant_model=drafter, kv_budget=16), dict(static_engine=True),
                 dict(prompt_lookup_num_tokens=3)):
        out = enabled.generate(ids, return_dict_in_generate=True, **call, **GREEDY)
        assert torch.equal(out.sequences, greedy) and _on_engine(out), call
    assert hf_sparsekv.is_enabled(enabled) and not hf_sparsekv.is_enabled(plain)
    hf_sparsekv.disable(enabled)
    assert not hf_sparsekv.is_enabled(enabled)
    assert not _on_engine(enabled.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **GREEDY))


def test_a_class_built_on_the_mixin_runs_on_the_engine(unpatched):
    class SpeculativeLlama(hf_sparsekv.SpeculativeGenerationMixin, LlamaForCausalLM):
        pass

    plain = tiny_model("llama")
    model = SpeculativeLlama(plain.config).to(torch.float64).eval()
    model.load_state_dict(plain.state_dict())
    ids = prompt(50, seed=5)
    out = model.generate(ids, assistant_model=model, kv_budget=16, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, _stock(plain, ids, **GREEDY)) and _on_engine(out)
    assert hf_sparsekv.is_enabled(model) and not hf_sparsekv.is_enabled(plain)


def test_threads_with_an_enabled_and_a_plain_model(unpatched):
    plain = copy.deepcopy(tiny_model("qwen2"))
    enabled = hf_sparsekv.enable(copy.deepcopy(tiny_model("llama")))
    drafter = tiny_model("llama", role="drafter")
    ids = [prompt(40 + 7 * i, seed=i) for i in range(4)]
    expected = {("p", i): _stock(plain, x, **GREEDY) for i, x in enumerate(ids)}
    expected |= {("e", i): _stock(enabled, x, **GREEDY) for i, x in enumerate(ids)}
    got, errors = {}, []

    def run(kind, model, i):
        try:
            extra = dict(assistant_model=drafter, kv_budget=16) if kind == "e" else {}
            got[(kind, i)] = model.generate(ids[i], **extra, **GREEDY)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=run, args=(k, m, i)) for i in range(4) for k, m in (("p", plain), ("e", enabled))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert static_engine.current_engine(enabled) is not None and static_engine.current_engine(plain) is None


def test_an_enabled_model_saves_loads_and_copies_as_stock_does(unpatched, tmp_path):
    model = hf_sparsekv.enable(copy.deepcopy(tiny_model("llama")))
    model.save_pretrained(tmp_path / "m")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float64).eval()
    assert type(loaded) is LlamaForCausalLM and not hf_sparsekv.is_enabled(loaded)
    assert (tmp_path / "m" / "config.json").read_text().count("LlamaForCausalLM") == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    twin = copy.deepcopy(model)
    assert hf_sparsekv.is_enabled(twin) and twin.generate.args[0] is twin  # the copy's generate is its own
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert hf_sparsekv.is_enabled(restored) and restored.generate.args[0] is restored
    ids = prompt(40, seed=6)
    assert torch.equal(restored.generate(ids, static_engine=True, **GREEDY), _stock(loaded, ids, **GREEDY))
    with pytest.raises(TypeError, match="enable"):
        hf_sparsekv.enable(torch.nn.Linear(2, 2))


def test_the_import_with_the_patch_off_changes_no_generate():
    code = ("import hf_sparsekv\nfrom transformers.generation.utils import GenerationMixin\n"
            "from hf_sparsekv.generation import registration\n"
            "assert GenerationMixin.generate is registration._STOCK\nprint('stock')")
    env = dict(os.environ, HF_SPARSEKV_PATCH="0")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "stock" in done.stdout, done.stderr[-2000:]
