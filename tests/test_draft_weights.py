"""QuantSpec's 4-bit draft weights: the quantizer against a float64 computation of its own rule, int4 self-speculation
with ``draft_weights="int4"`` still token-identical to greedy AR on the INT8 view (CPU runs the dequantized reference
path), the draft steps and only they reading the 4-bit copy, the copy's life cycle; tinygemm on CUDA against the
dequantized reference."""

from __future__ import annotations

import contextlib
import copy
import threading
import zipfile

import pytest
import torch
from torch import nn

import hf_sparsekv
from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.generation import draft_weights, engine as static_engine
from hf_sparsekv.kernels.w4_linear import dequantize_w4, quantize_w4, w4_linear, w4_shape_ok

from .conftest import ARCHS, prompt, tiny_model


@pytest.mark.parametrize("shape,group", [((8, 128), 128), ((16, 192), 64), ((24, 96), 32)])
def test_quantize_w4_follows_its_rule_in_float64(shape, group):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w4 = quantize_w4(weight, pack=False)
    assert w4.group == group and w4.codes.dtype == torch.uint8 and int(w4.codes.max()) <= 15
    w = weight.double().reshape(shape[0], -1, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = (high - low) / 15
    assert torch.allclose(w4.scales.double(), scale, rtol=1e-6)
    codes = ((w - low[..., None]) / w4.scales.double()[..., None]).round().clamp(0, 15)
    assert torch.equal(w4.codes.reshape_as(codes).double(), codes)
    error = (dequantize_w4(w4, torch.float64).reshape_as(w) - w).abs()
    assert bool((error <= scale[..., None] / 2 * (1 + 1e-5) + 1e-7).all())  # at most half a step off
    x = torch.randn(3, shape[1], dtype=torch.float64)
    reference = x @ dequantize_w4(w4, torch.float64).T
    assert torch.allclose(w4_linear(x, w4), reference)


def test_a_weight_on_the_grid_comes_back_exactly():
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1)).double()
    codes[:, 0], codes[:, 1] = 0, 15  # every group spans the whole code range
    weight = (codes - 3) * 0.25  # low -0.75, step 0.25
    w4 = quantize_w4(weight.float(), pack=False)
    assert torch.equal(dequantize_w4(w4, torch.float64), weight)


def _int8_view_greedy(verifier, ids, new_tokens):
    return verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), max_new_tokens=new_tokens,
                             do_sample=False)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gamma", [1, 4])
def test_int4_self_speculation_on_4bit_weights_is_greedy_on_the_int8_view(arch, gamma, monkeypatch):
    verifier = copy.deepcopy(tiny_model(arch))
    states = []  # this thread's drafting flag at every 4-bit matmul, and in every verify step
    real = draft_weights.w4_linear
    monkeypatch.setattr(draft_weights, "w4_linear",
                        lambda *a: (states.append(draft_weights._state.active), real(*a))[1])
    verify = static_engine.StaticEngine._verify
    monkeypatch.setattr(static_engine.StaticEngine, "_verify",
                        lambda self: (states.append(("verify", draft_weights._state.active)), verify(self))[1])
    for seed, length in enumerate((9, 100, 190)):
        ids = prompt(length, seed)
        out = verifier.generate(ids, assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32),
                                draft_weights="int4", num_assistant_tokens=gamma, max_new_tokens=30,
                                do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, _int8_view_greedy(verifier, ids, 30))
    assert static_engine.current_engine(verifier).spec.draft_weights == "int4"
    assert True in states and ("verify", False) in states and ("verify", True) not in states
    assert draft_weights.nbytes(verifier) > 0
    static_engine.release_engines()


def test_the_copy_follows_the_weights_and_is_freed():
    verifier = copy.deepcopy(tiny_model("qwen2"))
    layers = [m for m in verifier.modules() if type(m) is nn.Linear and w4_shape_ok(*m.weight.shape)]
    assert layers and draft_weights.default_choice(verifier) == "full"  # on CPU the default is the full weights
    ids = prompt(60, 3)
    spec = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32), draft_weights="int4",
                max_new_tokens=12, do_sample=False)
    verifier.generate(ids, **spec)
    first = layers[0]._hf_sparsekv_w4.codes.clone()
    with torch.no_grad():
        layers[0].weight.mul_(-1.0)  # in place: the copy is remade on the next call
    out = verifier.generate(ids, **spec)
    assert not torch.equal(layers[0]._hf_sparsekv_w4.codes, first)
    assert torch.equal(out, _int8_view_greedy(verifier, ids, 12))
    twin = copy.deepcopy(verifier)  # a copy's converted layers compute with the copy's own weights
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)
    x = torch.randn(1, 3, verifier.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(twin.lm_head(x), x @ twin.lm_head.weight.T)
    torch.testing.assert_close(verifier.lm_head(x), x @ verifier.lm_head.weight.T)
    hf_sparsekv.release_engines()
    assert draft_weights.nbytes(verifier) == 0
    assert all("forward" not in m.__dict__ and not hasattr(m, "_hf_sparsekv_w4") for m in layers)


def test_what_draft_weights_refuses():
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(20, 1)
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        verifier.generate(ids, assistant_model=verifier, draft_cache="int4", draft_weights="int8", max_new_tokens=3)
    with pytest.raises(ValueError, match="draft_weights applies to draft_cache='int4'"):
        verifier.generate(ids, assistant_model=drafter, kv_budget=16, draft_weights="int4", max_new_tokens=3)
    sharded = copy.deepcopy(verifier)
    sharded._tp_size = 2  # as transformers marks a model loaded with tp_plan
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        sharded.generate(ids, assistant_model=sharded, draft_cache="int4", draft_weights="int4", max_new_tokens=3)
    assert draft_weights.default_choice(sharded) == "full"


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 6, 16])
def test_tinygemm_matches_the_dequantized_reference(rows):
    torch.manual_seed(0)
    weight = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16()
    plain, packed = quantize_w4(weight, pack=False), quantize_w4(weight, pack=True)
    x = torch.randn(rows, 4096, device="cuda").bfloat16()
    reference = x.float() @ dequantize_w4(plain, torch.float32).T
    out = w4_linear(x, packed)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 4096)
    assert torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2), float((out.float() - reference).abs().max())


def _converted(model) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, draft_weights.W4Linear) or hasattr(m, "_hf_sparsekv_w4")]


def test_the_draft_weights_flag_is_per_thread():
    """While one thread drafts, a plain forward of a converted model on another thread computes with the full
    weights; a converted layer outside drafting is nn.Linear."""
    model = copy.deepcopy(tiny_model("qwen2"))
    ids = prompt(12, 0)
    full = model(ids).logits
    assert draft_weights.attach(model)
    with draft_weights.drafting(True):
        assert not torch.allclose(model(ids).logits, full)  # the 4-bit copies are in use
    inside, leave = threading.Event(), threading.Event()

    def draft():
        with draft_weights.drafting(True):
            inside.set()
            leave.wait(30)

    drafter = threading.Thread(target=draft)
    drafter.start()
    try:
        assert inside.wait(30)
        assert torch.equal(model(ids).logits, full)
        layer = _converted(model)[0]
        x = torch.randn(3, layer.in_features, dtype=torch.float64)
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    finally:
        leave.set()
        drafter.join()
    draft_weights.release_model(model)


def test_a_converted_model_saves_loads_and_copies_as_a_stock_model(tmp_path):
    """torch.save/torch.load, copy.deepcopy and save_pretrained/from_pretrained of a model holding 4-bit copies give a
    stock model (the file names nothing of hf_sparsekv) with the same logits; the original keeps its copies."""
    # a model of its own, not a copy of the cached one: a stock call with output_hidden_states elsewhere in the suite
    # leaves transformers' output-capturing hooks (local functions, which torch.save cannot pickle) on that one
    model = tiny_model.__wrapped__("llama")
    ids = prompt(12, 2)
    logits = model(ids).logits
    assert draft_weights.attach(model)
    with draft_weights.drafting(True):
        drafted = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    with zipfile.ZipFile(tmp_path / "model.pt") as archive:
        assert not any(b"hf_sparsekv" in archive.read(name) for name in archive.namelist() if name.endswith(".pkl"))
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    twin = copy.deepcopy(model)
    model.save_pretrained(tmp_path / "saved")
    reloaded = type(model).from_pretrained(tmp_path / "saved", dtype=torch.float64).eval()
    for other in (loaded, twin, reloaded):
        assert not _converted(other)
        with draft_weights.drafting(True):  # a stock model has no copy to draft with
            assert torch.equal(other(ids).logits, logits)
    assert draft_weights.models() == [model]
    with draft_weights.drafting(True):
        assert torch.equal(model(ids).logits, drafted)
    hf_sparsekv.release_engines()
    assert not _converted(model) and torch.equal(model(ids).logits, logits)


@pytest.mark.parametrize("where", ["quantize_w4", "_convert"])
@pytest.mark.parametrize("had_copies", [False, True])
def test_an_interrupted_attach_leaves_the_model_as_it_was(where, had_copies, monkeypatch):
    """Ctrl-C while the 4-bit copies are made (the third layer's quantization) or put in place (the third layer's
    conversion), in a generate() call: the model is as it was (no copy, or its earlier copies where it had them),
    stock generate() is unchanged, and the next call attaches every copy and is exact."""
    verifier = copy.deepcopy(tiny_model("qwen2"))
    ids = prompt(40, 5)
    spec = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32), draft_weights="int4",
                max_new_tokens=12, do_sample=False)
    if had_copies:
        verifier.generate(ids, **spec)
        with torch.no_grad():
            verifier.lm_head.weight.mul_(-1.0)  # in place: the next call remakes the copies
    reference = verifier.generate(ids, max_new_tokens=12, do_sample=False)
    logits = verifier(ids).logits
    before = {id(m): m.__dict__.get("_hf_sparsekv_w4") for m in verifier.modules()}
    real, calls = getattr(draft_weights, where), []

    def third_interrupts(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(draft_weights, where, third_interrupts)
    with pytest.raises(KeyboardInterrupt):
        verifier.generate(ids, **spec)
    monkeypatch.undo()
    assert {id(m): m.__dict__.get("_hf_sparsekv_w4") for m in verifier.modules()} == before
    assert all("forward" not in m.__dict__ for m in verifier.modules())
    assert len(_converted(verifier)) == (len(draft_weights._qualifying(verifier)[0]) if had_copies else 0)
    assert verifier.config._attn_implementation == "sdpa"
    assert torch.equal(verifier(ids).logits, logits)
    assert torch.equal(verifier.generate(ids, max_new_tokens=12, do_sample=False), reference)
    out = verifier.generate(ids, **spec)
    assert len(_converted(verifier)) == len(draft_weights._qualifying(verifier)[0]) > 0
    assert torch.equal(out, _int8_view_greedy(verifier, ids, 12))
    hf_sparsekv.release_engines()


def _traced_in_fresh_thread(model, ids, order):
    """``order``: ``"full"`` / ``"int4"`` compiles, each ``torch.compile``'d as the engine compiles such steps (the
    steps' backend outside :func:`drafting`; the 4-bit draft steps' own inside :func:`drafting` and
    :func:`compiling_drafts`), all in one new thread whose flags only the ``"int4"`` ones set (a thread that never
    drafted: its flag is the class default, which dynamo's guard read in place of later values) -> each compiled
    forward's logits."""
    from hf_sparsekv.generation import graph_steps

    outputs, failure = [], []

    def forward(x):
        return model(x).logits

    def body():
        try:
            for weights in order:
                backend = graph_steps.draft_weights_backend if weights == "int4" else graph_steps.step_backend
                with contextlib.ExitStack() as stack:
                    if weights == "int4":
                        stack.enter_context(draft_weights.drafting(True))
                        stack.enter_context(draft_weights.compiling_drafts())
                    outputs.append(torch.compile(forward, backend=backend, dynamic=False)(ids))
        except BaseException as err:  # noqa: BLE001 (re-raised in the test's thread)
            failure.append(err)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outputs


def _model_with_copies(arch: str):
    """A copy of the tiny ``arch`` model with its 4-bit copies, and a prompt whose logits the copies change."""
    model = copy.deepcopy(tiny_model(arch))
    assert draft_weights.attach(model)
    ids = prompt(12, 5)
    with torch.no_grad():
        eager = {"full": model(ids).logits}
        with draft_weights.drafting(True):
            eager["int4"] = model(ids).logits
    assert not torch.allclose(eager["full"], eager["int4"])  # the copy's logits differ from the weights'
    return model, ids, eager


@pytest.mark.parametrize("order", [("full", "int4"), pytest.param(("int4", "full"), marks=pytest.mark.extended)])
def test_compiled_code_keeps_the_weights_it_was_traced_for(compiled_steps, order):
    """A forward compiled outside drafting and the same forward compiled for the draft steps each compute with their
    own weights, in either order: dynamo never replays one's trace for the other (under torch 2.11 every compiled
    draft step ran the full weights: 4-bit draft weights never reached the GPU's draft steps)."""
    torch._dynamo.reset()
    model, ids, eager = _model_with_copies("llama")
    with torch.no_grad():
        outputs = _traced_in_fresh_thread(model, ids, order)
    for weights, out in zip(order, outputs):
        torch.testing.assert_close(out, eager[weights])
    draft_weights.release_model(model)


def test_a_forward_the_user_compiled_keeps_the_full_weights(compiled_steps):
    """The model's forward compiled by its user (``model.forward = torch.compile(model.forward)``), first traced
    inside :func:`drafting` (as an uncompiled draft step calls it), computes with the full weights there and after:
    only the engine's own draft-step compiles trace the copies, so no trace of them is ever replayed where the full
    weights are meant (a verification)."""
    torch._dynamo.reset()
    model, ids, eager = _model_with_copies("qwen2")
    model.forward = torch.compile(model.forward, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        with draft_weights.drafting(True):
            inside = model(ids).logits
        outside = model(ids).logits
    torch.testing.assert_close(outside, eager["full"])
    torch.testing.assert_close(inside, eager["full"])
    del model.forward
    draft_weights.release_model(model)


def _accepted(verifier, ids, weights: str) -> tuple[torch.Tensor, int]:
    """A constant-γ int4 self-speculation call's tokens and accepted drafts (deterministic: greedy, fixed rounds)."""
    out = verifier.generate(ids, assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32),
                            draft_weights=weights, num_assistant_tokens=3, num_assistant_tokens_schedule="constant",
                            max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    return out.sequences, out.spec_stats.accepted


@pytest.mark.compiled
def test_compiled_draft_steps_draft_with_the_weights_their_call_asks_for(compiled_steps, monkeypatch):
    """Compiled int4 engines on one model, their 4-bit copies kept between the calls: ``"int4"``, ``"full"``,
    ``"int4"`` again. Each call's drafts are those of the same call on uncompiled steps (the accepted counts of
    fixed rounds, which the copy changes on this prompt), and every call is greedy on the INT8 view."""
    verifier = copy.deepcopy(tiny_model("qwen2"))
    ids = prompt(90, 4)
    reference = _int8_view_greedy(verifier, ids, 40)
    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "0")
    eager = {w: _accepted(verifier, ids, w)[1] for w in ("int4", "full")}
    assert eager["int4"] != eager["full"]  # (else this prompt could not tell the weights apart)
    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "1")
    for weights in ("int4", "full", "int4"):
        tokens, accepted = _accepted(verifier, ids, weights)
        assert static_engine.current_engine(verifier).compiled
        assert torch.equal(tokens, reference) and accepted == eager[weights], weights
    static_engine.release_engines()


def test_the_4bit_copy_is_the_default_only_for_layers_large_enough(monkeypatch):
    """default_choice: the full weights where tinygemm does not run (CPU, here); where it runs, 4-bit only from
    W4_MIN_LAYER_ELEMENTS qualifying weights per decoder layer (counted against the decoder layers' own shapes; the
    output embedding, which gets a copy too, left out of the count)."""
    model = tiny_model("qwen2")
    layers = [m for layer in model.model.layers for m in layer.modules()
              if type(m) is nn.Linear and w4_shape_ok(*m.weight.shape)]  # the decoder layers' (not lm_head)
    per_layer = sum(m.weight.numel() for m in layers) / model.config.num_hidden_layers
    assert w4_shape_ok(*model.lm_head.weight.shape) and draft_weights.layer_elements(model) == per_layer > 0
    assert draft_weights.default_choice(model) == "full"  # no tinygemm on CPU
    monkeypatch.setattr(draft_weights, "_tinygemm_runs", lambda m: True)
    for bound, choice in [(per_layer, "int4"), (per_layer + 1, "full"), (1 << 25, "full")]:
        monkeypatch.setattr(draft_weights, "W4_MIN_LAYER_ELEMENTS", bound)
        assert draft_weights.default_choice(model) == choice, bound
