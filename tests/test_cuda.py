"""Losslessness on a CUDA GPU: the engine's steps captured as CUDA graphs (the default there) and uncaptured (run on the GPU machine;
skipped on CPU). Most graph-path cases capture the uncompiled steps (conftest sets ``HF_SPARSEKV_COMPILE=0`` unless a test is marked ``compiled``: compiling every
tiny configuration would take minutes); a few cases run the default, torch.compile'd steps. Cases marked ``slow``
(``make test-cuda-slow``) complete the grids; ``make test-cuda`` keeps the default suite to one case a mode."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import hf_sparsekv
from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.generation import engine as static_engine

from .conftest import ARCHS, left_padded, prompt, tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("exact_cuda_float32")]
NO_EOS = dict(eos_token_id=None, pad_token_id=0)


def _on_cuda(arch, role="verifier", dtype=torch.float32):
    return copy.deepcopy(tiny_model(arch, role=role)).to("cuda", dtype)


def test_a_captured_steps_first_replay_is_reported_and_runs_the_step():
    """A step's graph uploads itself at its first replay (slower than later ones): calling the step says which replay
    was the first, so that the controller takes no round time from it; every replay runs the step."""
    from hf_sparsekv.generation.graph_steps import CapturedStep

    x = torch.zeros(4, device="cuda")
    step = CapturedStep(lambda: x.add_(1.0))
    step.capture((x,))
    assert float(x.sum()) == 0.0  # (the warm-up's writes were put back)
    assert [step() for _ in range(3)] == [True, False, False]
    assert torch.equal(x, torch.full((4,), 3.0, device="cuda"))


def test_an_engine_whose_capture_fails_still_samples_after_it(monkeypatch):
    """A capture that CUDA invalidates (here: a host sync inside it) leaves PyTorch's default generator marked as
    capturing; the engine's fallback to uncaptured steps releases it, so the call and every later sampled call draw
    as usual: with top_k=1 the sampled tokens are stock greedy's."""
    from hf_sparsekv.generation.graph_steps import CapturedStep

    real_run = CapturedStep.run

    def syncing_run(step):  # a step whose capture CUDA invalidates (and only its capture: eager runs sync freely)
        real_run(step)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()

    monkeypatch.setattr(CapturedStep, "run", syncing_run)
    monkeypatch.setattr(static_engine.logger, "warning_once", lambda message: None)  # (the fallback's warning)
    verifier = _on_cuda("llama")
    ids = prompt(40, 3).cuda()
    expected = verifier.generate(ids, max_new_tokens=12, do_sample=False, **NO_EOS)
    out = verifier.generate(ids, static_engine=True, do_sample=True, top_k=1, max_new_tokens=12, **NO_EOS)
    assert torch.equal(out, expected)
    torch.rand(1, device="cuda")  # the generator draws outside any graph
    monkeypatch.setattr(CapturedStep, "run", real_run)
    static_engine.release_engines()
    out = verifier.generate(ids, static_engine=True, do_sample=True, top_k=1, max_new_tokens=12, **NO_EOS)
    assert torch.equal(out, expected)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["chunk", "window", "int4"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_uncaptured_engine_lossless_on_cuda_float32(arch, mode, gamma, monkeypatch):
    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "0")
    verifier, drafter = _on_cuda(arch), _on_cuda(arch, "drafter")
    for seed, length in enumerate((5, 140, 400)):
        ids = prompt(length, seed).cuda()
        kwargs = dict(max_new_tokens=32, do_sample=False)
        if mode == "int4":
            reference = verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), **kwargs)
            spec = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32))
        else:
            reference = verifier.generate(ids, **kwargs)
            spec = dict(assistant_model=drafter, draft_cache=mode, kv_budget=64)
        out = verifier.generate(ids, num_assistant_tokens=gamma, **spec, **kwargs)
        assert torch.equal(out, reference)


def _reference_and_spec(verifier, drafter, mode, ids, kwargs):
    """Greedy AR (on the INT8 view for int4) and the speculative arguments of ``mode``."""
    if mode == "int4":
        reference = verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), **kwargs)
        return reference, dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32))
    spec = dict(assistant_model=drafter, draft_cache=mode, kv_budget=None if mode == "full" else 64)
    return verifier.generate(ids, **kwargs), spec


# The default CUDA suite (make test-cuda; most of its time is compiling steps on the device's host) runs each mode
# on one architecture in float32 and two modes in bfloat16 (the int4 one takes the tensor-core path's bfloat16 code
# conversion); make test-cuda-slow runs the whole cross product.
FLOAT32_ARCH = {"chunk": "llama", "window": "mistral", "full": "qwen2", "int4": "llama"}
BFLOAT16_ARCH = {"window": "llama", "int4": "qwen2"}


def _graph_cases():
    """arch × mode × γ; γ=3 (every draft accepted) on FLOAT32_ARCH's architecture in the default CUDA suite."""
    return [
        pytest.param(arch, mode, gamma, marks=() if gamma == 3 and FLOAT32_ARCH[mode] == arch else pytest.mark.slow,
                     id=f"{arch}-{mode}-g{gamma}")
        for arch in ARCHS for mode in ("chunk", "window", "full", "int4") for gamma in (1, 3, 8)
    ]


@pytest.mark.parametrize("arch,mode,gamma", _graph_cases())
def test_graph_path_lossless_float32(arch, mode, gamma):
    verifier = _on_cuda(arch)
    drafter = _on_cuda(arch, "drafter") if gamma != 3 else copy.deepcopy(verifier)  # γ=3: every draft accepted
    for seed, length in enumerate((5, 140, 400)):
        ids = prompt(length, seed).cuda()
        for extra in ({}, NO_EOS):
            kwargs = dict(max_new_tokens=48, do_sample=False, **extra)
            reference, spec = _reference_and_spec(verifier, drafter, mode, ids, kwargs)
            out = verifier.generate(ids, num_assistant_tokens=gamma, **spec, **kwargs)
            assert torch.equal(out, reference), (length, extra)
    engine = static_engine.current_engine(verifier)
    assert engine.use_graphs and all(step.graph is not None for step in engine.steps.values())
    assert {"draft", "verify"} <= set(engine.steps)


def test_graph_path_queues_the_next_drafts_behind_each_verify_step(monkeypatch):
    """On CUDA a separate drafter's chain queues the next round's drafts behind each verify step with a constant γ:
    stock greedy, and with the verifier's copy as drafter on its full cache every draft accepted (the queued first
    draft step reads each round's last draft); none queued with HF_SPARSEKV_QUEUE_DRAFTS=0. Under the controller it
    queues only a width it expects to draft again: this drafter costs what the verifier does, so plain steps win and
    the output is stock greedy whatever it queued."""
    from hf_sparsekv.generation import rounds

    queued = []
    queue_drafts = rounds.RowsDecoding.queue_drafts

    def recorded(self, width):
        queued.append(width)
        return queue_drafts(self, width)

    monkeypatch.setattr(rounds.RowsDecoding, "queue_drafts", recorded)
    verifier = _on_cuda("llama")
    drafter = copy.deepcopy(verifier)
    ids = prompt(300, 1).cuda()
    kwargs = dict(max_new_tokens=64, do_sample=False, **NO_EOS)
    greedy = verifier.generate(ids, **kwargs)
    constant = dict(num_assistant_tokens=4, num_assistant_tokens_schedule="constant")
    for options in (dict(draft_cache="full"), dict(draft_cache="full", **constant), dict(kv_budget=64, **constant)):
        queued.clear()
        out = verifier.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **options, **kwargs)
        assert torch.equal(out.sequences, greedy), options
        assert queued or "num_assistant_tokens" not in options, options
        if "kv_budget" not in options and out.spec_stats.drafted:
            assert out.spec_stats.acceptance_rate == 1.0, options
    monkeypatch.setenv(rounds.QUEUE_DRAFTS_ENV, "0")
    queued.clear()
    out = verifier.generate(ids, assistant_model=drafter, draft_cache="full", **constant, **kwargs)
    assert torch.equal(out, greedy) and not queued


@pytest.mark.parametrize("mode", ["chunk", "window"])
def test_graph_path_self_drafting_lossless_float32(mode):
    verifier = _on_cuda("qwen2")
    for seed, length in enumerate((9, 400)):
        ids = prompt(length, seed).cuda()
        kwargs = dict(max_new_tokens=48, do_sample=False, **NO_EOS)
        out = verifier.generate(ids, assistant_model=verifier, draft_cache=mode, kv_budget=64, num_assistant_tokens=4,
                                **kwargs)
        assert torch.equal(out, verifier.generate(ids, **kwargs)), length
    engine = static_engine.current_engine(verifier)
    assert engine.drafter is verifier and engine.use_graphs and engine.steps["draft"].graph is not None


@pytest.mark.compiled
@pytest.mark.parametrize("arch,mode,gamma", [
    ("llama", "chunk", 5), pytest.param("mistral", "window", 3, marks=pytest.mark.slow),
    pytest.param("qwen2", "full", 1, marks=pytest.mark.slow), pytest.param("llama", "int4", 3, marks=pytest.mark.slow),
])
def test_compiled_graph_path_lossless_float32(arch, mode, gamma):
    engine = _lossless_on_compiled_graphs(arch, mode, gamma)
    assert not engine.light


def _lossless_on_compiled_graphs(arch: str, mode: str, gamma: int):
    """Two prompts' greedy tokens on ``mode`` equal stock greedy's; the engine (returned) ran compiled captured
    steps."""
    verifier, drafter = _on_cuda(arch), _on_cuda(arch, "drafter")
    for seed, length in enumerate((7, 400)):
        ids = prompt(length, seed).cuda()
        kwargs = dict(max_new_tokens=48, do_sample=False, **NO_EOS)
        reference, spec = _reference_and_spec(verifier, drafter, mode, ids, kwargs)
        out = verifier.generate(ids, num_assistant_tokens=gamma, **spec, **kwargs)
        assert torch.equal(out, reference), length
    engine = static_engine.current_engine(verifier)
    assert engine.compiled and engine.use_graphs and all(s.graph is not None for s in engine.steps.values())
    return engine


@pytest.mark.parametrize("arch,mode,gamma", [("llama", "chunk", 5), ("qwen2", "int4", 3)])
def test_light_compiled_graph_path_lossless_float32(arch, mode, gamma, monkeypatch):
    """Steps compiled light (dynamo's graph with our rewrites, PyTorch's kernels for the rest, no Inductor) and
    captured: the tokens are stock greedy's, and every step went through the light backend (float32: our rewrites
    leave its linear layers to cuBLAS)."""
    from hf_sparsekv.generation import graph_steps

    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "light")
    static_engine.release_engines()
    rewritten = []
    real = graph_steps.light_step_backend
    monkeypatch.setattr(graph_steps, "light_step_backend",
                        lambda gm, inputs: (real(gm, inputs), rewritten.append(gm.code))[0])
    assert _lossless_on_compiled_graphs(arch, mode, gamma).light and rewritten
    static_engine.release_engines()


@pytest.mark.parametrize("arch,mode", [
    pytest.param(arch, mode, marks=() if BFLOAT16_ARCH.get(mode) == arch else pytest.mark.slow, id=f"{mode}-{arch}")
    for arch in ARCHS for mode in ("chunk", "window", "full", "int4")
])
def test_graph_path_equals_uncaptured_steps_bfloat16(arch, mode, monkeypatch):
    """Uncompiled captured steps run the uncaptured steps' kernels, so in bfloat16 too they give the same tokens
    (Inductor's fused kernels round differently: the compiled path is held to float32 identity only)."""
    verifier, drafter = _on_cuda(arch, dtype=torch.bfloat16), _on_cuda(arch, "drafter", torch.bfloat16)
    for seed, length in enumerate((60, 333)):
        ids = prompt(length, seed).cuda()

        def spec():
            if mode == "int4":
                return dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32))
            return dict(assistant_model=drafter, draft_cache=mode, kv_budget=None if mode == "full" else 64)
        kwargs = dict(num_assistant_tokens=4, max_new_tokens=48, do_sample=False, **NO_EOS)
        monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "0")
        eager = verifier.generate(ids, **spec(), **kwargs)
        monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "auto")
        graphed = verifier.generate(ids, **spec(), **kwargs)
        assert torch.equal(graphed, eager)
        assert static_engine.current_engine(verifier).spec.mode == mode


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.compiled),
                                  pytest.param("qwen2", marks=pytest.mark.slow),
                                  pytest.param("mistral", marks=pytest.mark.slow)])
def test_graph_greedy_ar_equals_generate(arch):
    verifier = _on_cuda(arch)
    for seed, length in enumerate((1, 200, 450)):
        ids = prompt(length, seed).cuda()
        reference = verifier.generate(ids, max_new_tokens=40, do_sample=False, **NO_EOS)
        assert torch.equal(hf_sparsekv.graph_greedy_generate(verifier, ids, max_new_tokens=40, eos_token_id=[]),
                           reference)
    engine = static_engine.current_engine(verifier)
    assert engine.steps["ar_step"].graph is not None and engine.compiled == (arch == "llama")


@pytest.mark.parametrize("mode", ["chunk", "window", "full", "int4"])
def test_graph_path_batch_rows_equal_each_prompt_alone(mode):
    """A left-padded batch on the graph path: each row is the greedy output of its prompt alone (int4: on the INT8
    view), padded after an early stop; the rows reuse one engine."""
    verifier, drafter = _on_cuda("qwen2"), _on_cuda("qwen2", "drafter")
    prompts = [prompt(n, 30 + n).cuda() for n in (300, 7, 120)]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    kwargs = dict(max_new_tokens=40, do_sample=False)
    _, spec = _reference_and_spec(verifier, drafter, mode, prompts[0], kwargs)
    out = verifier.generate(ids, attention_mask=mask, num_assistant_tokens=3, **spec, **kwargs)
    for b, p in enumerate(prompts):
        reference, _ = _reference_and_spec(verifier, drafter, mode, p, kwargs)
        new = reference[0, p.shape[1] :]
        row = out[b, width:]
        assert torch.equal(row[: new.shape[0]], new) and bool((row[new.shape[0] :] == 0).all()), b
    engine = static_engine.current_engine(verifier)
    assert engine.use_graphs and all(step.graph is not None for step in engine.steps.values())
    assert engine.spec.batch == len(prompts)  # every mode: one engine of all rows


# every mode at batch 2-5: test_graph_path_batch_rows_equal_each_prompt_alone
@pytest.mark.parametrize("mode", [pytest.param("chunk", marks=pytest.mark.slow),
                                  pytest.param("window", marks=pytest.mark.slow), "int4",
                                  pytest.param("ar", marks=pytest.mark.slow)])
def test_graph_path_batch_of_64_rows(mode):
    """64 left-padded prompts of 1-400 tokens on the graph path (one engine of 64 rows; rows stop at EOS at
    different rounds; int4 with G = 32, so rows cross quantization points at their own rounds): each row is its
    prompt's greedy generate() alone (int4: on the INT8 view), padded after its stop."""
    verifier, drafter = _on_cuda("llama"), _on_cuda("llama", "drafter")
    g = torch.Generator().manual_seed(64)
    lengths = [1, 400] + torch.randint(1, 401, (62,), generator=g).tolist()
    prompts = [prompt(n, 1000 + b).cuda() for b, n in enumerate(lengths)]
    store = (lambda: dict(past_key_values=HierarchicalQuantCache(group_size=32))) if mode == "int4" else dict
    free = [verifier.generate(p, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                              **store())[0, p.shape[1]:] for p in prompts]
    eos = int(torch.cat([f[:12] for f in free]).mode().values)  # the commonest early token: some rows stop on it
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=eos)
    references = [verifier.generate(p, **kwargs, **store())[0, p.shape[1]:] for p in prompts]
    assert 1 < sum(r.shape[0] < 16 for r in references) < 63
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[1]:], mask[b, width - p.shape[1]:] = p[0], 1
    if mode == "ar":
        out = hf_sparsekv.graph_greedy_generate(verifier, ids, 16, eos_token_id=eos, attention_mask=mask, pad_token_id=0)
    else:
        spec = (dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32)) if mode == "int4"
                else dict(assistant_model=drafter, draft_cache=mode, kv_budget=64))
        out = verifier.generate(ids, attention_mask=mask, num_assistant_tokens=3, **spec, **kwargs)
    for b, ref in enumerate(references):
        row = out[b, width:]
        assert torch.equal(row[: ref.shape[0]], ref) and not row[ref.shape[0]:].any(), b
    engine = static_engine.current_engine(verifier)
    assert engine.spec.batch == 64 and engine.use_graphs and all(s.graph is not None for s in engine.steps.values())


def _prefix_cache(model, ids, n):
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("feature", ["repetition_penalty", "no_repeat_ngram", "scores", "padded_drafter",
                                     "chunk_instance", "chunk_window", "prefix"])
def test_graph_path_options_equal_stock_float32(feature):
    """The options the captured engine serves on the device (a repetition penalty baked into the steps), with the
    host between captured steps (processors, scores), or through the cache or drafter it is handed (a ChunkBudgetCache
    instance, a token window over generated tokens, a padded-vocabulary drafter, a DynamicCache prefix): the same
    tokens (and scores) as stock greedy generate() on the GPU, and the captured graphs exist."""
    from .test_generation import _padded, _word_tokenizer

    verifier, drafter = _on_cuda("llama"), _on_cuda("llama", "drafter")
    ids = prompt(300, 11).cuda()
    stock = dict(max_new_tokens=40, do_sample=False, **NO_EOS)
    spec = dict(assistant_model=drafter, kv_budget=64, num_assistant_tokens=4)
    if feature == "repetition_penalty":
        stock["repetition_penalty"] = 1.3
    elif feature == "no_repeat_ngram":
        stock["no_repeat_ngram_size"] = 2
    elif feature == "scores":
        stock.update(output_scores=True, return_dict_in_generate=True)
    elif feature == "padded_drafter":
        spec.update(assistant_model=_padded(drafter, 32), tokenizer=_word_tokenizer())
    elif feature in ("chunk_instance", "chunk_window"):
        window = 24 if feature == "chunk_window" else None
        spec.update(kv_budget=None, draft_cache=hf_sparsekv.ChunkBudgetCache(64, chunk_size=16,
                                                                             generated_window=window))
    reference = verifier.generate(ids, **stock)
    if feature == "prefix":
        cache = _prefix_cache(verifier, ids, 200)
        out = verifier.generate(ids, past_key_values=cache, **spec, **stock)
        assert cache.get_seq_length() == out.shape[1] - 1
    else:
        out = verifier.generate(ids, **spec, **stock)
    if feature == "scores":
        assert torch.equal(out.sequences, reference.sequences)
        torch.testing.assert_close(torch.stack(out.scores), torch.stack(reference.scores))
    else:
        assert torch.equal(out, reference)
    engine = static_engine.current_engine(verifier)
    assert engine.use_graphs and all(step.graph is not None for step in engine.steps.values())
    assert engine.spec.host == (feature in ("no_repeat_ngram", "scores"))
    assert (engine.spec.penalty is not None) == (feature == "repetition_penalty")


@pytest.mark.parametrize("do_sample", [False, True])
def test_prompt_lookup_on_the_captured_engine_float32(do_sample):
    """Stock's prompt-lookup call runs on the captured engine (retrieval drafting in the captured draft step) with
    greedy AR's tokens; sampled with top_k=1 too. A left-padded batch of two rows, one of them quoting itself."""
    model = _on_cuda("llama")
    base = prompt(30, 1)
    prompts = [torch.cat([base, base[:, 5:], base[:, :8]], 1).cuda(), prompt(140, 2).cuda()]
    sampling = dict(do_sample=True, top_k=1) if do_sample else dict(do_sample=False)
    for p in prompts:
        out = model.generate(p, prompt_lookup_num_tokens=6, max_new_tokens=40, return_dict_in_generate=True,
                             **sampling)
        engine = static_engine.current_engine(model)
        assert engine.spec.mode == "lookup" and engine.use_graphs
        assert torch.equal(out.sequences, model.generate(p, max_new_tokens=40, do_sample=False))
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=6, max_new_tokens=40, **sampling)
    assert static_engine.current_engine(model).spec.batch == 2
    for b, p in enumerate(prompts):
        reference = model.generate(p, max_new_tokens=40, do_sample=False)[0, p.shape[1] :]
        assert torch.equal(out[b, ids.shape[1] : ids.shape[1] + reference.shape[0]], reference), b


def _compiled_and_slow(mode: str):
    return pytest.param(mode, marks=[pytest.mark.compiled, pytest.mark.slow], id=f"{mode}-compiled")


# The default CUDA suite captures the chunk drafter's steps uncompiled; make test-cuda-slow compiles every cache's.
@pytest.mark.parametrize("mode", ["chunk"] + [_compiled_and_slow(m) for m in ("chunk", "window", "full")])
def test_prompt_lookup_beside_a_drafter_on_the_captured_engine_float32(mode):
    """Retrieval beside a drafter on the captured engine (compiled in the slow cases): tree rounds (the drafter's and the retrieved chain
    in one verifier forward, the decode kernel's ancestor mask), chain rounds and the catch-up block (each its own
    captured step) give greedy AR's tokens; a left-padded batch too."""
    verifier, drafter = _on_cuda("qwen2"), _on_cuda("qwen2", "drafter")
    base = prompt(40, 3)
    prompts = [torch.cat([base, base[:, 4:], base[:, :9]], 1).cuda(), prompt(300, 4).cuda()]
    spec = dict(assistant_model=drafter, draft_cache=mode, kv_budget=None if mode == "full" else 64,
                prompt_lookup_num_tokens=4)
    kwargs = dict(max_new_tokens=40, do_sample=False, **NO_EOS)
    for p in prompts:
        out = verifier.generate(p, **spec, **kwargs)
        assert torch.equal(out, verifier.generate(p, **kwargs))
    engine = static_engine.current_engine(verifier)
    assert engine.spec.retrieval and engine.use_graphs and {"draft", "verify_tree", "catch_up_block"} <= set(engine.steps)
    assert all(step.graph is not None for step in engine.steps.values())
    ids, mask = left_padded(prompts)
    out = verifier.generate(ids, attention_mask=mask, **spec, **kwargs)
    for b, p in enumerate(prompts):
        assert torch.equal(out[b, ids.shape[1] :], verifier.generate(p, **kwargs)[0, p.shape[1] :]), b


# The default CUDA suite captures the chunk drafter's tree steps uncompiled (seconds); make test-cuda-slow compiles
# every drafter cache's (80-270 s a mode on a cold compile cache).
@pytest.mark.parametrize("mode", ["chunk"] + [_compiled_and_slow(m) for m in ("chunk", "window", "full")])
def test_draft_trees_on_the_captured_engine_float32(mode):
    """``draft_tree_size`` on the captured engine (compiled in the slow cases): trees of 32 nodes (grown by the drafter on its own cache
    through the decode kernel's tree block, retrieval grafted in, one tree per batch row): greedy AR's tokens, sampled
    with top_k=1 too, and a left-padded batch."""
    from .test_trees import _near_drafter

    verifier = _on_cuda("qwen2")
    drafter = copy.deepcopy(_near_drafter("qwen2")).to("cuda", torch.float32)
    base = prompt(40, 3)
    prompts = [torch.cat([base, base[:, 4:], base[:, :9]], 1).cuda(), prompt(300, 4).cuda()]
    spec = dict(assistant_model=drafter, draft_cache=mode, kv_budget=None if mode == "full" else 64,
                prompt_lookup_num_tokens=5, draft_tree_size=32)
    kwargs = dict(max_new_tokens=40, do_sample=False, **NO_EOS)
    for p in prompts:
        out = verifier.generate(p, **spec, **kwargs, return_dict_in_generate=True)
        assert torch.equal(out.sequences, verifier.generate(p, **kwargs))
        assert out.spec_stats.sibling_rounds > 0
    engine = static_engine.current_engine(verifier)
    assert engine.use_graphs and {"draft", "verify_tree"} <= set(engine.steps) and "catch_up_block" not in engine.steps
    assert engine.compiled == engine.spec.compiled  # no step fell back to capturing uncompiled
    assert all(step.graph is not None for step in engine.steps.values())
    sampled = verifier.generate(prompts[0], **spec, max_new_tokens=40, do_sample=True, top_k=1, **NO_EOS)
    assert torch.equal(sampled, verifier.generate(prompts[0], **kwargs))
    ids, mask = left_padded(prompts)
    out = verifier.generate(ids, attention_mask=mask, **spec, **kwargs)
    for b, p in enumerate(prompts):
        assert torch.equal(out[b, ids.shape[1] :], verifier.generate(p, **kwargs)[0, p.shape[1] :]), b


@pytest.mark.parametrize("mode", ["chunk", "window"])
def test_sampled_batch_rows_together_on_the_captured_engine_float32(mode):
    """A sampled batch decodes its rows together on the captured engine (the warpers baked into the batch's steps):
    with top_k=1 every row's draws are its argmaxes, so each row equals its prompt's greedy output alone."""
    verifier, drafter = _on_cuda("qwen2"), _on_cuda("qwen2", "drafter")
    prompts = [prompt(n, 70 + n).cuda() for n in (3, 150, 400, 41)]
    ids, mask = left_padded(prompts)
    kwargs = dict(max_new_tokens=24, **NO_EOS)
    out = verifier.generate(ids, attention_mask=mask, do_sample=True, top_k=1, assistant_model=drafter,
                            draft_cache=mode, kv_budget=64, num_assistant_tokens=3, **kwargs)
    engine = static_engine.current_engine(verifier)
    assert engine.spec.batch == 4 and engine.warpers is not None and engine.use_graphs
    for b, p in enumerate(prompts):
        reference = verifier.generate(p, do_sample=False, **kwargs)[0, p.shape[1] :]
        assert torch.equal(out[b, ids.shape[1] :], reference), b


@pytest.mark.compiled
def test_compiled_bfloat16_steps_read_projections_through_the_grouped_kernel(monkeypatch):
    """bf16 steps compiled by Inductor call the grouped kernel for q/k/v and the gated kernel for gate/up with their
    activation, each computing the RMSNorm before it (the compile passes), and the compiled forward's logits match
    the eager forward's (relative error, bf16 rounding)."""
    from hf_sparsekv.generation import graph_steps
    from hf_sparsekv.kernels import gated_linear, grouped_linear

    launches, normed = [], []
    launch, gated_launch = grouped_linear.launch, gated_linear.launch

    def counted(kind, fn):
        def run(*a, **k):
            launches.append(kind if kind == "gated" else len(a[1]))
            normed.append(k.get("norm") is not None)
            return fn(*a, **k)
        return run

    monkeypatch.setattr(grouped_linear, "launch", counted("grouped", launch))
    monkeypatch.setattr(gated_linear, "launch", counted("gated", gated_launch))
    model = _on_cuda("qwen2", dtype=torch.bfloat16)
    ids = prompt(3, 0).cuda()
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(input_ids=ids).logits.float()
        compiled = torch.compile(lambda ids: model(input_ids=ids).logits, backend=graph_steps.step_backend)(ids)
    assert launches.count(3) == launches.count("gated") == model.config.num_hidden_layers
    assert 2 not in launches and normed.count(True) == 2 * model.config.num_hidden_layers  # both norms of each layer
    assert float((compiled.float() - eager).norm() / eager.norm()) < 1e-2
    launches.clear()
    out = hf_sparsekv.graph_greedy_generate(model, prompt(50, 1).cuda(), max_new_tokens=8, eos_token_id=[])
    engine = static_engine.current_engine(model)
    assert out.shape == (1, 58) and engine.compiled and engine.steps["ar_step"].graph is not None
    assert 3 in launches and "gated" in launches  # the captured AR step (one row: every layer goes through them)


@pytest.mark.parametrize("do_sample", [False, True])
def test_routed_assisted_generation_and_static_engine_on_the_captured_engine_float32(do_sample):
    """Stock's ``generate(ids, assistant_model=drafter)`` (no argument of ours) and ``static_engine=True`` run on the
    captured engine with greedy AR's tokens (sampled: with top_k=1), one prompt and a left-padded batch of two."""
    verifier, drafter = _on_cuda("qwen2"), _on_cuda("qwen2", "drafter")
    prompts = [prompt(30, 1).cuda(), prompt(140, 2).cuda()]
    sampling = dict(do_sample=True, top_k=1) if do_sample else dict(do_sample=False)
    from hf_sparsekv.generation.draft_modes import routed_draft_cache

    for extra, mode in ((dict(assistant_model=drafter), "routed"), (dict(static_engine=True), "ar")):
        for p in prompts:
            out = verifier.generate(p, max_new_tokens=40, **extra, **sampling)
            engine = static_engine.current_engine(verifier)
            expected = routed_draft_cache(drafter, p.shape[1] + 40) if mode == "routed" else mode  # (full or window)
            assert engine.spec.mode == expected and engine.use_graphs
            assert torch.equal(out, verifier.generate(p, max_new_tokens=40, do_sample=False))
        ids, mask = left_padded(prompts)
        out = verifier.generate(ids, attention_mask=mask, max_new_tokens=40, **extra, **sampling)
        assert static_engine.current_engine(verifier).spec.batch == 2
        for b, p in enumerate(prompts):
            reference = verifier.generate(p, max_new_tokens=40, do_sample=False)[0, p.shape[1] :]
            assert torch.equal(out[b, ids.shape[1] : ids.shape[1] + reference.shape[0]], reference), b


@pytest.mark.parametrize("layout", ["full", "chunk", "window", "quant"])
def test_the_inductor_compiled_prefill_fills_each_drafter_cache_as_the_eager_one(layout, monkeypatch):
    """The prefill compiled by Inductor on the GPU (dynamic shapes; a chunk cache's selection and a quantized
    store's writes behind their opaque ops) leaves what the eager forward leaves in a full, chunk, sink+window or
    quantized cache: the same slot positions and kept tokens, keys/values and logits within float32 rounding (the
    quantized store: the same T_q, its INT8 view within a code step, at most 1 % of its codes one step off), for
    prompts within and past the budget (the ring: its window); the prompts past the budget after the first compile
    nothing new, whatever their lengths."""
    from hf_sparsekv.caches.static import (StaticChunkBudgetCache, StaticFullCache, StaticQuantCache,
                                           StaticSinkWindowCache)
    from hf_sparsekv.generation import graph_steps

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return graph_steps.prefill_backend(gm, inputs)

    monkeypatch.setattr(graph_steps, "compiled_prefill", graph_steps.compile_prefill(backend))
    model = _on_cuda("llama", "drafter")
    config = model.config
    shape = (config.num_hidden_layers, config.num_key_value_heads, config.hidden_size // config.num_attention_heads)
    make = {"full": lambda: StaticFullCache(*shape, 400, torch.float32, "cuda"),
            "chunk": lambda: StaticChunkBudgetCache(64, *shape, 100, torch.float32, "cuda", chunk_size=8),
            "window": lambda: StaticSinkWindowCache(4, 48, 4, *shape, torch.float32, "cuda"),
            "quant": lambda: StaticQuantCache(32, 400, 4, *shape, torch.float32, "cuda")}[layout]
    counts = []
    for length in (40, 150, 333, 97):
        ids = prompt(length, seed=length).cuda()
        filled = []
        for compiled in (False, True):
            cache = make()
            with torch.no_grad(), graph_steps.static_attention_for(model):
                logits = graph_steps.static_prefill(model, ids, cache, compiled=compiled)
            filled.append((logits, cache))
        (eager_logits, eager), (compiled_logits, compiled) = filled
        assert torch.equal(eager.slot_positions, compiled.slot_positions), length
        assert torch.equal(eager.fp_length, compiled.fp_length)
        assert getattr(eager, "kept", 0) == getattr(compiled, "kept", 0)
        torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-4, atol=1e-4)
        for a, b in zip(eager.layers, compiled.layers):
            torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(b.values, a.values, rtol=1e-4, atol=1e-4)
        if layout == "quant":
            assert eager.quantized == compiled.quantized == [32 * max(0, length // 32 - 1)], length
            for i, (a, b) in enumerate(zip(eager.layers, compiled.layers)):
                codes = [(getattr(x, part), getattr(y, part)) for x, y in ((a.qkeys, b.qkeys), (a.qvalues, b.qvalues))
                         for part in ("upper", "lower")]
                assert sum(int((x != y).sum()) for x, y in codes) <= 0.01 * sum(x.numel() for x, _ in codes)
                for x, y in zip(eager.sequence(i, 0, 0, length), compiled.sequence(i, 0, 0, length)):
                    torch.testing.assert_close(y, x, rtol=0, atol=0.05 * float(x.abs().max()))
        counts.append(len(graphs))
    assert counts[1] == counts[2] == counts[3] <= graph_steps.PREFILL_MAX_GRAPHS, counts


@pytest.mark.parametrize("call", ["ar", "drafter", "self-chunk"])
def test_steps_compiled_light_after_uncompiled_captures_are_captured_again(call, monkeypatch):
    """The default rule's stages on CUDA graphs: a configuration's first calls on uncompiled captured steps, then the
    call that compiles them light (the old graphs released, the steps traced one layer for all and captured again,
    into a new memory pool), then light calls; none fails to compile or capture (the conftest fixture), and every
    call's tokens are stock greedy's (float32)."""
    from hf_sparsekv.generation import compile_policy

    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "auto")
    monkeypatch.setenv("HF_SPARSEKV_COMPILE_AFTER", "3600")
    monkeypatch.setattr(compile_policy, "REGIONAL_FIXED_S", 0.0)
    monkeypatch.setattr(compile_policy, "REGIONAL_STEP_S", 0.0)
    static_engine.release_engines()
    verifier = copy.deepcopy(_on_cuda("llama"))
    spec = {"ar": dict(static_engine=True), "drafter": dict(assistant_model=_on_cuda("llama", "drafter")),
            "self-chunk": dict(assistant_model=verifier, kv_budget=64)}[call]
    stages = []
    for seed, length in enumerate((300, 120, 200)):
        ids = prompt(length, seed).cuda()
        kwargs = dict(max_new_tokens=32, do_sample=False, **NO_EOS)
        assert torch.equal(verifier.generate(ids, **spec, **kwargs), verifier.generate(ids, **kwargs)), seed
        engine = static_engine.current_engine(verifier)
        stages.append((engine.compiled, engine.light, engine.use_graphs))
    assert stages == [(False, False, True), (True, True, True), (True, True, True)]
    static_engine.release_engines()
