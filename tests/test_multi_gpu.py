"""A verifier dispatched over two GPUs with ``device_map`` on the static engine (make test-multi-gpu; skipped without
two CUDA GPUs): every layer's static cache on its layer's device, one captured graph spanning both devices, tokens
identical (float32) to the same split model's greedy ``generate()``; sampling identical to the same model on one GPU
(same seed: the draws are made on the model's input device from the same logits). On CPU, the same engine runs a
model carrying accelerate's device hooks (``dispatch_model``), compiled, token-identical to ``generate()``."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import dispatch_model

import hf_sparsekv
from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.generation import common, engine as static_engine

from .conftest import left_padded, prompt, tiny_model, torchrun_two

NO_EOS = dict(eos_token_id=None, pad_token_id=0)
pytestmark = pytest.mark.usefixtures("exact_cuda_float32")  # a no-op on the CPU tests below


def _split(arch: str, dtype=torch.float32, layers: int = 4):
    """A tiny verifier of ``layers`` layers, the first half (and the embedding) on cuda:0, the rest, the final norm
    and the head on cuda:1."""
    model = copy.deepcopy(tiny_model(arch, layers=layers)).to(dtype)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map.update({f"model.layers.{i}": int(i >= layers // 2) for i in range(layers)})
    for name, device in device_map.items():
        model.get_submodule(name).to(f"cuda:{device}")
    return dispatch_model(model, device_map=device_map)


def _spec(verifier, drafter, mode):
    if mode == "int4":
        return dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32))
    return dict(assistant_model=drafter, draft_cache=mode, kv_budget=None if mode == "full" else 64)


def _reference(verifier, mode, ids, kwargs):
    if mode == "int4":  # greedy AR on the INT8 view
        return verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), **kwargs)
    return verifier.generate(ids, **kwargs)


def _assert_spans_both_devices(verifier):
    engine = static_engine.current_engine(verifier)
    assert engine.devices == [0, 1] and engine.use_graphs
    assert all(step.graph is not None for step in engine.steps.values())
    devices = {layer.keys.device.index for layer in engine.verifier_cache.layers}
    assert devices == {0, 1}
    return engine


@pytest.mark.multi_gpu
@pytest.mark.parametrize("arch,mode", [("llama", "chunk"), ("qwen2", "window"), ("mistral", "full"),
                                       ("llama", "int4")])
def test_split_verifier_lossless_float32(arch, mode):
    verifier = _split(arch)
    drafter = copy.deepcopy(tiny_model(arch, role="drafter")).to("cuda:0", torch.float32)
    for seed, length in enumerate((5, 140, 400)):
        ids = prompt(length, seed).cuda()
        kwargs = dict(max_new_tokens=40, do_sample=False, **NO_EOS)
        out = verifier.generate(ids, num_assistant_tokens=3, **_spec(verifier, drafter, mode), **kwargs)
        assert torch.equal(out, _reference(verifier, mode, ids, kwargs)), length
    engine = _assert_spans_both_devices(verifier)
    assert {"draft", "verify"} <= set(engine.steps)


@pytest.mark.multi_gpu
@pytest.mark.compiled
def test_split_verifier_compiled_and_self_drafting():
    """The default path (torch.compile'd steps, captured) on a split model, and self-drafting on its chunk cache."""
    verifier = _split("qwen2")
    for seed, length in enumerate((9, 300)):
        ids = prompt(length, seed).cuda()
        kwargs = dict(max_new_tokens=40, do_sample=False, **NO_EOS)
        out = verifier.generate(ids, assistant_model=verifier, draft_cache="chunk", kv_budget=64,
                                num_assistant_tokens=4, **kwargs)
        assert torch.equal(out, verifier.generate(ids, **kwargs)), length
        ar = hf_sparsekv.graph_greedy_generate(verifier, ids, max_new_tokens=40, eos_token_id=[])
        assert torch.equal(ar, verifier.generate(ids, **kwargs)), length
    assert _assert_spans_both_devices(verifier).compiled


@pytest.mark.multi_gpu
def test_split_verifier_batch_rows():
    """A left-padded batch on a split verifier: each row is its prompt's greedy output alone."""
    verifier = _split("llama")
    drafter = copy.deepcopy(tiny_model("llama", role="drafter")).to("cuda:0", torch.float32)
    prompts = [prompt(n, 40 + n).cuda() for n in (250, 6, 90)]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    kwargs = dict(max_new_tokens=32, do_sample=False)
    out = verifier.generate(ids, attention_mask=mask, num_assistant_tokens=3, **_spec(verifier, drafter, "chunk"),
                            **kwargs)
    for b, p in enumerate(prompts):
        new = verifier.generate(p, **kwargs)[0, p.shape[1] :]
        row = out[b, width:]
        assert torch.equal(row[: new.shape[0]], new) and bool((row[new.shape[0] :] == 0).all()), b
    assert _assert_spans_both_devices(verifier).spec.batch == 3


@pytest.mark.multi_gpu
def test_split_verifier_sampling_equals_one_gpu():
    """Sampled speculative decoding on the split verifier draws the same tokens as on one GPU with the same seed."""
    split = _split("llama")
    whole = copy.deepcopy(tiny_model("llama", layers=4)).to("cuda:0", torch.float32)
    drafter = copy.deepcopy(tiny_model("llama", role="drafter")).to("cuda:0", torch.float32)
    ids = prompt(200, 7).cuda()
    outs = []
    for verifier in (whole, split):
        torch.manual_seed(11)
        outs.append(verifier.generate(ids, assistant_model=drafter, kv_budget=64, num_assistant_tokens=4,
                                      do_sample=True, top_k=20, max_new_tokens=40, **NO_EOS))
        assert static_engine.current_engine(verifier).warpers is not None
    assert torch.equal(outs[0], outs[1])
    _assert_spans_both_devices(split)


@pytest.mark.extended  # 19 s of CPU (compiling): make test-extended
def test_hooked_model_on_static_loop_cpu(monkeypatch):
    """A model carrying accelerate's device hooks (what device_map attaches) runs the compiled static loop on CPU
    (the hooks are traced with the step), token-identical to its greedy generate()."""
    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "1")
    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "1")
    monkeypatch.setattr("hf_sparsekv.generation.graph_steps.COMPILE_BACKEND", "aot_eager")
    verifier = dispatch_model(copy.deepcopy(tiny_model("llama")), device_map={"": "cpu"}, force_hooks=True)
    drafter = tiny_model("llama", role="drafter")
    assert hasattr(verifier, "_hf_hook")
    ids = prompt(70, 3)
    kwargs = dict(max_new_tokens=20, do_sample=False, **NO_EOS)
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=32, num_assistant_tokens=3, **kwargs)
    assert torch.equal(out, verifier.generate(ids, **kwargs))
    assert static_engine.current_engine(verifier).compiled
    static_engine.release_engines()


def test_layer_devices_of_a_dispatched_model():
    """layer_devices reads each layer's device from its parameters; a model on one device gives None."""
    model = copy.deepcopy(tiny_model("llama", layers=4))
    assert common.layer_devices(model) is None
    model.hf_device_map = {"model.layers.0": "cpu", "model.layers.1": "meta"}
    model.model.layers[3].to("meta")
    assert common.layer_devices(model) == [torch.device("cpu")] * 3 + [torch.device("meta")]


_TP_SCRIPT = r'''
import copy, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from transformers import AutoModelForCausalLM
from tests.conftest import prompt, tiny_model
import hf_sparsekv
from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.generation import engine as static_engine

torch.backends.cuda.matmul.allow_tf32 = False
rank = int(os.environ["LOCAL_RANK"])
path = os.path.join(sys.argv[2], f"rank{rank}")  # one copy per rank: no barrier before the group exists
copy.deepcopy(tiny_model("llama")).to(torch.float32).save_pretrained(path)
tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
assert tp._tp_size == 2 and dist.is_initialized()
device = tp.device
drafter = copy.deepcopy(tiny_model("llama", role="drafter")).to(device, torch.float32)
no_eos = dict(eos_token_id=None, pad_token_id=0, do_sample=False, max_new_tokens=32)
for seed, length in enumerate((6, 150, 400)):
    ids = prompt(length, seed).to(device)
    reference = tp.generate(ids, **no_eos)
    out = tp.generate(ids, assistant_model=drafter, kv_budget=64, num_assistant_tokens=3, **no_eos)
    assert torch.equal(out, reference), ("chunk", length)
    engine = static_engine.current_engine(tp)
    assert engine.use_graphs == torch.cuda.is_available()  # nccl: captured steps, their all-reduces included
    assert engine.verifier_cache.layers[0].keys.shape[1] == 1  # 2 key/value heads over 2 ranks
    out = tp.generate(ids, assistant_model=tp, draft_cache=HierarchicalQuantCache(group_size=32), **no_eos)
    assert torch.equal(out, tp.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), **no_eos))
    ar = hf_sparsekv.graph_greedy_generate(tp, ids, max_new_tokens=32, eos_token_id=[])
    assert torch.equal(ar, reference), ("ar", length)
torch.manual_seed(100 + rank)  # different generators on purpose: rank 0 seeds both
sampled = tp.generate(ids, assistant_model=drafter, kv_budget=64, do_sample=True, top_k=20, max_new_tokens=32,
                      eos_token_id=None, pad_token_id=0)
gathered = [torch.empty_like(sampled) for _ in range(2)]
dist.all_gather(gathered, sampled)
assert torch.equal(gathered[0], gathered[1])
hf_sparsekv.release_engines()  # before destroying the group: a live graph holding NCCL calls makes the destroy hang
dist.barrier()
dist.destroy_process_group()
open(os.path.join(sys.argv[2], f"rank{rank}.ok"), "w").write("ok")
'''


@pytest.mark.parametrize("backend", [pytest.param("gloo", marks=pytest.mark.extended),  # 25 s of CPU
                                     pytest.param("nccl", marks=pytest.mark.multi_gpu)])
def test_tensor_parallel_verifier_under_torchrun(tmp_path, backend):
    """``tp_plan="auto"`` under torchrun, two processes (gloo: on CPU, the static steps uncaptured; nccl: two GPUs, the
    steps captured with their all-reduces, the group destroyed after release_engines()): each rank's static cache
    holds its half of the key/value heads, the drafter is replicated; greedy (chunk budget, INT4 self-speculation, AR)
    equals the sharded model's own greedy generate() on every rank, and sampled tokens agree across ranks seeded
    differently."""
    env = {"HF_SPARSEKV_COMPILE": "0"}
    if backend == "gloo":  # transformers shards on the CPU when CUDA is hidden
        env.update(CUDA_VISIBLE_DEVICES="", HF_SPARSEKV_GRAPHS="1")
    torchrun_two(_TP_SCRIPT, tmp_path, env, 240, str(tmp_path))
    assert all((tmp_path / f"rank{r}.ok").exists() for r in (0, 1))


@pytest.mark.extended  # two processes under torchrun: about 10 s of CPU
def test_tensor_parallel_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/tensor_parallel.py --tiny on the CPU (gloo, uncaptured steps): the one-process steps, then the same
    steps sharded over two ranks (transformers' tp_plan, each rank holding half of the key/value heads), one row per
    context and step with both times, and its JSON, table and plot."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("tensor_parallel", bench / "tensor_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--device", "cpu", "--contexts", "64", "128", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["context"], r["step"]) for r in rows] == [(L, s) for L in (64, 128)
                                                         for s in ("ar", "verify", "draft-chunk-16")]
    assert all(r["one_gpu_ms"] > 0 and r["tp_ms"] > 0 for r in rows)
    assert "tensor parallel over 2" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "tp_speedup.png").exists()
    for who in ("one-gpu", "tp"):  # the AR step's costliest operators (host ones on CPU)
        assert "aten::" in (tmp_path / f"profile-ar-{who}-128.txt").read_text()
