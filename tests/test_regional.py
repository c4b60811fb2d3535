"""Light compilation traces one decoder layer for every layer alike (:mod:`hf_sparsekv.generation.regional`): as many
traces for a deep model as for a shallow one, the tokens stock greedy's, and the layers left as they were."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.generation import graph_steps, regional

from .conftest import prompt, tiny_model

CALLS = {
    "ar": dict(static_engine=True),
    "drafter": dict(num_assistant_tokens=3),  # a separate drafter on the full cache, the controller's widths
    "self-chunk": dict(kv_budget=16, num_assistant_tokens=3),  # self-drafting: the model's own chunk cache
}


@pytest.fixture
def light(monkeypatch):
    """Steps compiled light from the first call; each trace of a decoder layer counted (in ``traced``) and each
    trace of a whole step (in ``whole``); nothing kept from before."""
    traced, whole = [], []
    real = graph_steps.light_step_backend
    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "light")
    monkeypatch.setattr(graph_steps, "regional_light_backend", lambda gm, inputs: (traced.append(gm),
                                                                                   real(gm, inputs))[1])
    monkeypatch.setattr(graph_steps, "light_step_backend", lambda gm, inputs: (whole.append(gm),
                                                                               real(gm, inputs))[1])
    static_engine.release_engines()
    torch._dynamo.reset()
    yield traced, whole
    static_engine.release_engines()


def _generate(model, drafter, call: str, n: int):
    ids = prompt(n, seed=n)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    spec = dict(CALLS[call])
    if call == "drafter":
        spec["assistant_model"] = drafter
    elif call.startswith("self"):
        spec["assistant_model"] = model
    out = model.generate(ids, **spec, **kwargs)
    assert torch.equal(out, model.generate(ids, **kwargs)), (call, n)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_light_steps_trace_as_often_for_six_layers_as_for_two(light, arch, call):
    """The same calls on a 2-layer and a 6-layer model of one architecture trace their decoder layers the same
    number of times (dynamo's guards let one layer's trace serve the others), never a whole step, and every call's
    tokens are stock greedy's (float64)."""
    traced, whole = light
    counts = []
    for layers in (2, 6):
        model = copy.deepcopy(tiny_model(arch, layers=layers))
        drafter = tiny_model(arch, role="drafter")
        del traced[:]
        torch._dynamo.reset()  # (else the 6-layer model's layers reuse the 2-layer model's traces: same shapes)
        for n in (40, 90, 60):
            _generate(model, drafter, call, n)
        counts.append(len(traced))
        static_engine.release_engines()
    assert counts[0] == counts[1] > 0, counts
    assert not whole


def test_a_whole_step_is_traced_where_regional_is_off(light, monkeypatch):
    """``HF_SPARSEKV_REGIONAL=0``: light steps are traced whole (no layer trace), the tokens the same."""
    traced, whole = light
    monkeypatch.setenv("HF_SPARSEKV_REGIONAL", "0")
    _generate(copy.deepcopy(tiny_model("llama")), None, "ar", 50)
    assert whole and not traced


def test_layers_keep_their_own_forward_outside_the_engines_steps(light):
    """A layer's forward is replaced only while an engine's step runs on this thread: after a call no layer holds a
    forward of its own (a deep copy of the model is a plain model), and meanwhile a forward on another thread, or
    one on a cache that is not an engine's, runs the layer's own code (eagerly: nothing traced)."""
    traced, _ = light
    model = copy.deepcopy(tiny_model("llama"))
    _generate(model, None, "ar", 50)
    assert traced
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    assert all("forward" not in vars(layer) for layer in copy.deepcopy(model).model.layers)
    layers = regional.decoder_layers(model)
    hidden = torch.randn(1, 3, model.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(3)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    expected = type(layers[0]).forward(layers[0], hidden, position_embeddings=rotary, position_ids=positions)
    del traced[:]
    results = []
    with regional.regional_layers([layers], graph_steps.regional_light_backend):
        assert "forward" in vars(layers[0])
        other = threading.Thread(target=lambda: results.append(layers[0](hidden, position_embeddings=rotary,
                                                                         position_ids=positions)))
        other.start()
        other.join()
        results.append(layers[0](hidden, position_embeddings=rotary, position_ids=positions))  # no static cache
    assert len(results) == 2 and all(torch.equal(r, expected) for r in results) and not traced
    assert "forward" not in vars(layers[0])


def test_decoder_layers_are_found_only_where_every_layer_is_alike():
    """:func:`~hf_sparsekv.generation.regional.decoder_layers`: Llama's, Qwen2's and Mistral's layers in order; a
    layer with a forward of its own (accelerate's hooks) or layer indices out of order: None."""
    for arch in ("llama", "qwen2", "mistral"):
        model = tiny_model(arch, layers=3)
        assert regional.decoder_layers(model) == list(model.model.layers)
    model = copy.deepcopy(tiny_model("llama", layers=3))
    model.model.layers[1].forward = model.model.layers[1].forward
    assert regional.decoder_layers(model) is None
    model = copy.deepcopy(tiny_model("llama", layers=3))
    model.model.layers[2].self_attn.layer_idx = 0
    assert regional.decoder_layers(model) is None


def test_longer_prompts_trace_a_layer_at_most_once_more(light):
    """Prompts of other lengths after a configuration's first call, each of the first three longer than the engine
    (a new engine of twice the length each time): at most one more trace of a decoder layer over the whole sequence
    (the caches' lengths become dynamic dimensions), every call's tokens stock greedy's."""
    traced, _ = light
    model = copy.deepcopy(tiny_model("llama"))
    _generate(model, None, "ar", 60)
    first = len(traced)
    capacities = [static_engine.current_engine(model).max_tokens]
    for n in (300, 700, 120, 900, 200):
        _generate(model, None, "ar", n)
        capacities.append(static_engine.current_engine(model).max_tokens)
    assert len(set(capacities)) >= 3  # (it grew twice at least)
    assert first > 0 and len(traced) <= first + 1, (first, len(traced))


def test_a_layer_cache_answers_what_else_a_layer_asks_as_its_cache_does():
    """:class:`~hf_sparsekv.generation.regional.LayerCache` writes through its layer and hands anything else a layer's
    code may ask of ``past_key_values`` (here ``get_seq_length``, ``is_compileable``, ``prefilling``) to the cache it
    belongs to."""
    from hf_sparsekv.caches.static import StaticFullCache

    cache = StaticFullCache(2, 1, 4, 16, torch.float64, torch.device("cpu"))
    cache.begin_prefill(3)
    cache.update(torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64), 0)
    cache.update(torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64), 1)
    cache.end_prefill()
    view = regional.LayerCache(cache, 1)
    assert view.layer is cache.layers[1] and view.companion is None
    assert view.get_seq_length() == cache.get_seq_length() == 3
    assert view.is_compileable and view.prefilling is cache.prefilling is False
    with pytest.raises(AttributeError):
        view.no_such_thing
