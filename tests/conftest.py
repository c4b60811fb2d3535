"""Tiny random models built in the tests (no downloads), in float64 so that batched and one-token forwards agree to
far below any argmax gap."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from transformers import (
    GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config,
    Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, StableLmConfig, StableLmForCausalLM,
)

import hf_sparsekv  # noqa: F401  (registers the attention implementation and the generate() arguments)

VOCAB = 96
ARCHS = ("llama", "qwen2", "mistral")
# Attention modules unlike Llama's: fused qkv_proj (Phi-3), partial rotary (StableLM, 1/4 of each head), both
# (GPT-NeoX: fused query_key_value, rotary_pct 1/4, no GQA). The lossless grid runs them in every mode.
OTHER_ARCHS = ("phi3", "stablelm", "gpt_neox")
_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "stablelm": (StableLmConfig, StableLmForCausalLM),
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM),
}


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str, role: str = "verifier", seed: int = 0, layers: int | None = None):
    """A tiny random model (float64), built once per arguments and shared by every test that asks for it: a test that
    changes its weights or settings (its attention implementation, say) works on a ``copy.deepcopy``."""
    config_cls, model_cls = _CLASSES[arch]
    big = role == "verifier"
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64 if big else 32,
        intermediate_size=128 if big else 64,
        num_hidden_layers=layers if layers is not None else (2 if big else 1),
        num_attention_heads=4 if big else 2,
        num_key_value_heads=2 if big else 1,
        max_position_embeddings=1024 if big else 64,  # the drafter runs far beyond its native positions
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = 256 if big else None
    if arch == "gpt_neox":  # multi-head attention only
        del kwargs["num_key_value_heads"]
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(torch.float64)
    # Spread the logits so that greedy paths are varied and argmax gaps are wide.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def stock_generate(model, ids: torch.Tensor, **kwargs):
    """``model.generate(ids, **kwargs)`` with the plugin unregistered: stock transformers' own output."""
    hf_sparsekv.unregister()
    try:
        return model.generate(ids, **kwargs)
    finally:
        hf_sparsekv.register()


def prompt(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=g)


def record_plain_reads(monkeypatch) -> tuple[list, list]:
    """Patch the static engine to record each read of a burst of plain tokens as ``(plain steps launched so far, the
    burst's steps)``, and before each draft step the number of reads so far: the two lists, filled as calls run."""
    from hf_sparsekv.generation import engine as static_engine, rounds

    launched, reads, drafts = [0], [], []
    run_step, read = static_engine.StaticEngine.run_step, rounds._Tokens.read

    def counted(engine, name, width=None, run=True):
        launched[0] += run and name == "ar_step"
        if run and name == "draft":
            drafts.append(len(reads))
        return run_step(engine, name, width, run)

    def recorded(tokens):
        reads.append((launched[0], tokens.k))
        return read(tokens)
    monkeypatch.setattr(static_engine.StaticEngine, "run_step", counted)
    monkeypatch.setattr(rounds._Tokens, "read", recorded)
    return reads, drafts


def torchrun_two(script_text: str, tmp_path, env: dict, timeout: float, *args: str) -> None:
    """Run ``script_text`` in two processes under torchrun (``python -m torch.distributed.run``), in ``tmp_path`` with
    ``env`` added, its arguments: the repository root, then ``args``; fail the test with its output if it fails or
    runs past ``timeout`` seconds (then the whole process group, torchrun and both workers, is killed: no orphans)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "two_processes.py"
    script.write_text(script_text)
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         str(repo), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        cwd=tmp_path, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the two processes did not finish in {timeout} s:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-4000:]


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts[b] [1, P_b]`` as one left-padded batch: ``(input_ids [B, max P], attention_mask)`` on the prompts'
    device."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[1] :] = p[0]
        mask[b, width - p.shape[1] :] = 1
    return ids, mask


@pytest.fixture(autouse=True)
def _uncompiled_unless_marked(request, monkeypatch):
    """On CUDA the graph path compiles its steps after its first calls (10-60 s per configuration); tests capture
    them uncompiled unless marked ``compiled``, then compiled from the first call. Each test counts the graphs of the shared tiny models' compiled prefills
    afresh (another test's backend compiled them anew)."""
    import weakref

    from hf_sparsekv.generation import graph_steps

    # (marked: compiled from the first call, not once uncompiled calls have taken long enough: compile_policy)
    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "0" if request.node.get_closest_marker("compiled") is None else "1")
    monkeypatch.setattr(graph_steps, "_prefill_graphs", weakref.WeakKeyDictionary())
    monkeypatch.setattr(graph_steps, "_eager_prefills", weakref.WeakSet())


@pytest.fixture(autouse=True)
def _no_failed_capture_on_cuda(request, caplog):
    """A CUDA test fails if a CUDA-graph capture or a step's compilation failed during it (the engine falls back to
    uncaptured or uncompiled steps with a warning, so the tokens alone would not tell) or if it leaves CUDA's
    generator unable to draw."""
    if "cuda" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    caplog.set_level("WARNING", logger="hf_sparsekv")
    yield
    failed = [r.getMessage() for r in caplog.records
              if "capture failed" in r.getMessage() or "compiling the static steps failed" in r.getMessage()]
    assert not failed, f"a CUDA-graph capture or a step's compilation failed: {failed[0]}"
    try:
        torch.rand(1, device="cuda")
    except RuntimeError as err:
        pytest.fail(f"the test left CUDA's generator unable to draw: {err}")


@pytest.fixture
def compiled_steps(monkeypatch):
    """The engine's steps compiled (``HF_SPARSEKV_COMPILE=1``) by torch.compile's tracing (dynamo + AOT autograd)
    without Inductor's code generation: the graphs the CUDA path compiles, run by PyTorch's own kernels; no engine
    kept from before or after."""
    from hf_sparsekv.generation import engine as static_engine, graph_steps

    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "1")
    monkeypatch.setattr(graph_steps, "COMPILE_BACKEND", "aot_eager")
    static_engine.release_engines()
    yield
    static_engine.release_engines()


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture
def exact_cuda_float32():
    """float32 CUDA tests: no TF32 matmuls, no engine kept from another test."""
    from hf_sparsekv.generation import engine as static_engine

    torch.backends.cuda.matmul.allow_tf32 = False
    static_engine.release_engines()
    yield
    static_engine.release_engines()


CHILD_SUMMARY = pytest.StashKey[str]()  # test_kernels' child run: its pytest summary line
REAL_ENV = "HF_SPARSEKV_REAL"
EXTENDED_ENV = "HF_SPARSEKV_EXTENDED"  # `make test-extended`: the extra cases of the randomized grids (marker extended)


def pytest_collection_modifyitems(config, items):
    # test_kernels.py's tests that run in its TRITON_INTERPRET=1 child process are not run (nor counted) here; the
    # child's own counts are printed by pytest_terminal_summary below.
    in_child = [
        item for item in items
        if getattr(item.module, "NEEDS_CHILD", False) and item.originalname != "test_kernels_in_triton_interpreter"
    ]
    if in_child:
        items[:] = [item for item in items if item not in in_child]
        config.stash[CHILD_SUMMARY] = f"{len(in_child)} collected, not run (test_kernels_in_triton_interpreter was not)"
    skip_cuda = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = None if torch.cuda.device_count() >= 2 else pytest.mark.skip(reason="needs two CUDA GPUs")
    # The real pair is 2 GB and its tests take tens of minutes on a CPU: only when asked for (make test-real).
    skip_real = None if os.environ.get(REAL_ENV) == "1" else pytest.mark.skip(
        reason=f"real-pair test: run `make test-real` (or set {REAL_ENV}=1 after benchmarks/real_models.py fetch)"
    )
    # More random cases of grids whose default cases already cover every architecture x mode (x path): opt-in, so
    # that `make test` stays within 10 minutes on 2 idle cores.
    skip_extended = None if os.environ.get(EXTENDED_ENV) == "1" else pytest.mark.skip(
        reason=f"opt-in (extended) case: run `make test-extended` (or set {EXTENDED_ENV}=1)"
    )
    for item in items:
        if skip_extended is not None and "extended" in item.keywords:
            item.add_marker(skip_extended)
        if skip_cuda is not None and "cuda" in item.keywords:
            item.add_marker(skip_cuda)
        if skip_multi is not None and "multi_gpu" in item.keywords:
            item.add_marker(skip_multi)
        if skip_real is not None and "real" in item.keywords:
            item.add_marker(skip_real)


def pytest_terminal_summary(terminalreporter, config):
    summary = config.stash.get(CHILD_SUMMARY, None)
    if summary is not None:
        terminalreporter.write_line(
            f"tests/test_kernels.py kernel tests, run in a TRITON_INTERPRET=1 child process: {summary}"
        )


@pytest.fixture(scope="module")
def kernel_asm():
    """benchmarks/kernel_asm.py as a module: kernels compiled for a CUDA architecture on a machine without a GPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_asm.py"
    spec = importlib.util.spec_from_file_location("kernel_asm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_drafter_holds(engine, drafter, sequence: torch.Tensor) -> None:
    """What an engine says its separate drafter's full cache holds of row 0 after a call (``drafter_holds``
    positions of ``sequence [1, T]``, the call's output) is what a fresh forward of the drafter over them keeps: each
    layer's keys and values at those positions (float64: equal to rounding)."""
    held = engine.drafter_holds
    assert 0 <= held <= sequence.shape[1] - 2
    if not held:
        return
    with torch.no_grad():
        reference = drafter(sequence[:, :held], use_cache=True).past_key_values
    for layer, expected in zip(engine.drafter_cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(layer.keys[0, :, :held], expected.keys[0])
        torch.testing.assert_close(layer.values[0, :, :held], expected.values[0])
