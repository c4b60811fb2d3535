"""The compile pass that turns linear layers sharing an input into one ``hf_sparsekv::grouped_linear`` call: which
layers it groups (traced from real transformers models), that the rewritten graph computes the same logits, and
where it leaves cuBLAS alone. The kernel itself is tested against float64 in ``test_kernels.py``."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from hf_sparsekv.generation import graph_steps
from hf_sparsekv.generation.projection_groups import gate_projections, group_projections, norm_projections
from hf_sparsekv.kernels import grouped_linear, runtime

from .conftest import prompt, tiny_model

GROUPED = torch.ops.hf_sparsekv.grouped_linear.default
GATED = torch.ops.hf_sparsekv.gated_linear.default
NORMED = torch.ops.hf_sparsekv.normed_linear.default


def _model(arch: str, dtype: torch.dtype, role: str = "verifier"):
    """A copy of the shared tiny model in ``dtype`` (conftest's models are cached: never cast them in place)."""
    return copy.deepcopy(tiny_model(arch, role=role)).to(dtype)


def _kernels_run(on: bool):
    """The pass and the operator ask :func:`runtime.enabled`; on this CPU process (no Triton interpreter) the kernels
    never run, so the pass's view of a CUDA machine is set here, and the operator then computes its reference."""
    return mock.patch.object(runtime, "enabled", lambda device: on)


def _traced(model, ids):
    """dynamo's graph of ``model(ids).logits`` (before any pass), and the logits of the uncompiled forward."""
    return _traced_call(lambda ids: model(input_ids=ids).logits, ids)


def _traced_call(fn, *args):
    """dynamo's graph of ``fn(*args)`` (before any pass) with its example inputs, and ``fn(*args)`` uncompiled."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    with torch.no_grad(), _kernels_run(False):
        reference = fn(*args)
        torch._dynamo.reset()
        torch.compile(fn, backend=record, dynamic=False)(*args)
    assert len(graphs) == 1
    return graphs[0], reference


def _rewritten_output(gm, inputs) -> torch.Tensor:
    """``gm``'s output on its example inputs, each operator computing its reference (eager PyTorch)."""
    with torch.no_grad(), _kernels_run(False):
        out = gm(*inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _grouped_weights(gm) -> list[list[str]]:
    """The weight inputs of each grouped call, by the module path dynamo names them after."""
    return _grouped_weights_through(gm, lambda w: w)


def _grouped_weights_through(gm, graph_input) -> list[list[str]]:
    """As :func:`_grouped_weights`, each weight node mapped to its graph input by ``graph_input``."""
    out = []
    for node in gm.graph.nodes:
        if node.target is GROUPED or (node.target is NORMED and not node.args[6]):
            weights = node.args[1] if node.target is GROUPED else node.args[4]
            out.append([graph_input(w).target.split("_modules_")[-1].split("_parameters")[0] for w in weights])
    return out


def _gated_weights(gm) -> list[list[str]]:
    """The (gate, up) weight inputs of each gated call (a normed one's too), by module path."""
    return [[w.target.split("_modules_")[-1].split("_parameters")[0]
             for w in (node.args[1:] if node.target is GATED else node.args[4])]
            for node in gm.graph.nodes if node.target is GATED or (node.target is NORMED and node.args[6])]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("rows,role", [(1, "verifier"), (4, "verifier"), (4, "drafter")])
@pytest.mark.parametrize("small", [True, False], ids=["small-weights", "large-weights"])
def test_projections_sharing_an_input_become_one_call(arch, rows, role, small, monkeypatch):
    """q/k/v and gate/up are one call each; lone layers too at one row, and at more rows those whose weight is small
    (every weight of these tiny models) or, counted as large weights (``SMALL_WEIGHT`` 0), only the output projection
    when it is wide (the drafter's: 96 outputs of 32 inputs; the verifier's 96 of 64 is not)."""
    if not small:
        monkeypatch.setattr(grouped_linear, "SMALL_WEIGHT", 0)
    model = _model(arch, torch.bfloat16, role)
    (gm, inputs), reference = _traced(model, prompt(rows, seed=rows))
    with _kernels_run(True):  # the pass groups only where the kernels run
        inserted = group_projections(gm)
    groups = _grouped_weights(gm)
    lone = rows == 1 or small
    expected = []
    for _ in range(model.config.num_hidden_layers):
        expected += [["q_proj", "k_proj", "v_proj"]] + [["o_proj"]] * lone
        expected += [["gate_proj", "up_proj"]] + [["down_proj"]] * lone
    expected += [["lm_head"]] * (lone or role == "drafter")
    assert inserted == len(groups) and groups == expected
    assert torch.equal(_rewritten_output(gm, inputs), reference)  # the operator's reference: F.linear per weight


def test_float32_and_wide_batches_keep_cublas():
    model = _model("llama", torch.float32)
    (gm, _), _ = _traced(model, prompt(3, seed=0))
    with _kernels_run(True):
        assert group_projections(gm) == 0
    model = _model("llama", torch.bfloat16)
    rows = grouped_linear.MAX_ROWS + 1  # more rows than one pass over the weight serves
    (gm, _), _ = _traced(model, prompt(rows, seed=0))
    with _kernels_run(True):
        assert group_projections(gm) == 0


def test_nothing_is_grouped_where_the_kernels_do_not_run():
    model = _model("llama", torch.bfloat16)
    (gm, _), _ = _traced(model, prompt(1, seed=0))
    assert group_projections(gm) == 0  # CPU: runtime.enabled is False


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_gated_mlp_becomes_one_gated_call(arch, rows):
    """After grouping, each layer's gate/up call and its ``silu(gate) * up`` become one ``gated_linear`` call (no
    activation left in the graph), and the rewritten graph's logits equal the model's (the operator's reference is
    eager PyTorch's computation)."""
    model = _model(arch, torch.bfloat16)
    (gm, inputs), reference = _traced(model, prompt(rows, seed=rows + 10))
    with _kernels_run(True):
        group_projections(gm)
        rewritten = gate_projections(gm)
    layers = model.config.num_hidden_layers
    assert rewritten == layers and _gated_weights(gm) == [["gate_proj", "up_proj"]] * layers
    assert ["gate_proj", "up_proj"] not in _grouped_weights(gm)
    assert not [n for n in gm.graph.nodes if n.target is torch.nn.functional.silu]
    assert torch.equal(_rewritten_output(gm, inputs), reference)


class _Gated(torch.nn.Module):
    """A gated MLP whose gate output is also read after the activation (``leak``), or whose product is written
    ``up * silu(gate)``."""

    def __init__(self, leak: bool):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(32, 48, bias=False)
        self.leak = leak

    def forward(self, x):
        gate = self.gate(x)
        out = self.up(x) * torch.nn.functional.silu(gate)
        return out + gate if self.leak else out


@pytest.mark.parametrize("leak", [False, True])
def test_a_gate_read_elsewhere_keeps_its_projections(leak):
    """The product written ``up * silu(gate)`` is rewritten too; where the gate's output is read again the grouped
    call stays (its outputs are needed), and the result is unchanged either way."""
    module = _Gated(leak).to(torch.bfloat16)
    (gm, inputs), reference = _traced_call(module, torch.randn(1, 2, 32, dtype=torch.bfloat16))
    with _kernels_run(True):
        assert group_projections(gm) == 1
        assert gate_projections(gm) == (0 if leak else 1)
    assert torch.equal(_rewritten_output(gm, inputs), reference)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("rows", [1, 4])
def test_norms_before_projections_become_part_of_their_calls(arch, rows):
    """After grouping and gating, both RMSNorms of every layer become part of the call that reads them, the residual
    add before each (all but the first layer's input norm, which reads the embeddings) too; the final norm, read
    through a slice, stays. The rewritten graph's logits equal the model's."""
    model = _model(arch, torch.bfloat16)
    (gm, inputs), reference = _traced(model, prompt(rows, seed=rows + 20))
    with _kernels_run(True):
        group_projections(gm)
        gate_projections(gm)
        rewritten = norm_projections(gm)
    layers = model.config.num_hidden_layers
    normed = [n for n in gm.graph.nodes if n.target is NORMED]
    assert rewritten == len(normed) == 2 * layers
    assert [n.args[6] for n in normed] == [False, True] * layers  # q/k/v, then gate/up
    assert [n.args[1] is not None for n in normed] == [False] + [True] * (2 * layers - 1)
    assert len([n for n in gm.graph.nodes if n.op == "call_method" and n.target == "pow"]) == 1
    assert torch.equal(_rewritten_output(gm, inputs), reference)


class _NormRead(torch.nn.Module):
    """A norm whose output is also read after its projections (``leak``)."""

    def __init__(self, leak: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(32) + 0.5)
        self.q, self.k = torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(32, 16, bias=False)
        self.leak = leak

    def forward(self, x, residual):
        h = x + residual
        h32 = h.to(torch.float32)
        normed = self.weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        out = torch.cat([self.q(normed), self.k(normed)], -1) + h[..., :32]
        return out + normed if self.leak else out


@pytest.mark.parametrize("leak", [False, True])
def test_a_norm_read_elsewhere_stays(leak):
    """A norm whose output another node reads stays as it is; otherwise it and its residual add fold into the call,
    whose sum the later reader gets. The result is unchanged either way."""
    module = _NormRead(leak).to(torch.bfloat16)
    x, residual = torch.randn(1, 2, 32, dtype=torch.bfloat16), torch.randn(1, 2, 32, dtype=torch.bfloat16)
    (gm, inputs), reference = _traced_call(module, x, residual)
    with _kernels_run(True):
        assert group_projections(gm) == 1
        assert norm_projections(gm) == (0 if leak else 1)
    assert torch.equal(_rewritten_output(gm, inputs), reference)


def test_step_backend_runs_the_passes_unless_switched_off(monkeypatch):
    model = _model("qwen2", torch.bfloat16)
    seen = []

    def inner(gm, example_inputs):
        seen.append((_grouped_weights(gm), _gated_weights(gm), len([n for n in gm.graph.nodes if n.target is NORMED])))

        def run(*args):
            with _kernels_run(False):  # the operator's reference
                return gm.forward(*args)
        return run

    monkeypatch.setattr(graph_steps, "COMPILE_BACKEND", inner)
    monkeypatch.setattr(grouped_linear, "SMALL_WEIGHT", 0)  # lone layers at 2 rows stay cuBLAS (as at real sizes)
    ids = prompt(2, seed=3)
    for grouped, gated, normed in (("1", "1", "1"), ("1", "0", "0"), ("0", "1", "1"), ("1", "1", "0")):
        monkeypatch.setenv(graph_steps.GROUPED_LINEAR_ENV, grouped)
        monkeypatch.setenv(graph_steps.GATED_LINEAR_ENV, gated)
        monkeypatch.setenv(graph_steps.NORMED_LINEAR_ENV, normed)
        torch._dynamo.reset()
        with torch.no_grad(), _kernels_run(True):
            torch.compile(lambda ids: model(input_ids=ids).logits, backend=graph_steps.step_backend)(ids)
    qkv, gate_up = ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]
    assert seen[0] == ([qkv] * 2, [gate_up] * 2, 4)
    assert seen[1] == ([qkv, gate_up] * 2, [], 0)
    assert seen[2] == ([], [], 0)
    assert seen[3] == ([qkv] * 2, [gate_up] * 2, 0)


_TP_SCRIPT = r'''
import copy, os, sys
from unittest import mock
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from transformers import AutoModelForCausalLM
from tests.conftest import prompt, tiny_model
import hf_sparsekv
from hf_sparsekv.generation.projection_groups import _local_shard, group_projections
from hf_sparsekv.kernels import runtime
from tests.test_projection_groups import GROUPED, _grouped_weights_through

rank = int(os.environ["LOCAL_RANK"])
path = os.path.join(sys.argv[2], f"rank{rank}")
copy.deepcopy(tiny_model("llama")).to(torch.bfloat16).save_pretrained(path)
tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16)
assert tp._tp_size == 2
graphs = []
ids = prompt(1, seed=3)
with torch.no_grad(), mock.patch.object(runtime, "enabled", lambda device: False):
    reference = tp(input_ids=ids).logits
    torch.compile(lambda ids: tp(input_ids=ids).logits, backend=lambda gm, ex: graphs.append((gm, ex)) or gm.forward,
                  dynamic=False)(ids)
(gm, inputs), = graphs
with mock.patch.object(runtime, "enabled", lambda device: True):
    inserted = group_projections(gm)
groups = _grouped_weights_through(gm, lambda w: w.args[0])
for node in gm.graph.nodes:
    if node.target is GROUPED:
        weights = node.args[1]
        assert all(_local_shard(w) for w in weights), weights  # (a method call, or torch 2.11's function call)
        shards = [tuple(w.meta["example_value"].shape) for w in weights]
        full = [tuple(w.args[0].meta["example_value"].shape) for w in weights]
        assert all(s != f and s[0] * s[1] * 2 == f[0] * f[1] for s, f in zip(shards, full)), (shards, full)
expected = []
for _ in range(tp.config.num_hidden_layers):
    expected += [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
assert groups[:len(expected)] == expected and inserted == len(groups), groups
with torch.no_grad(), mock.patch.object(runtime, "enabled", lambda device: False):
    out = gm(*inputs)
assert torch.equal(out[0] if isinstance(out, (tuple, list)) else out, reference)
dist.barrier()
dist.destroy_process_group()
open(os.path.join(sys.argv[2], f"rank{rank}.ok"), "w").write("ok")
'''


@pytest.mark.extended  # two processes under torchrun: about 15 s of CPU
def test_sharded_projections_of_a_tensor_parallel_model_are_grouped(tmp_path):
    """A model loaded with ``tp_plan="auto"`` (two ranks, gloo) computes each linear layer on its local shard
    (``weight.to_local()``): the pass groups q/k/v and gate/up on those shards as on one GPU (the kernel reads half of
    each weight), the row-parallel o_proj/down_proj before their all-reduces, and the rewritten graph's logits equal
    the sharded model's own on every rank."""
    from .conftest import torchrun_two

    torchrun_two(_TP_SCRIPT, tmp_path, {"CUDA_VISIBLE_DEVICES": ""}, 180, str(tmp_path))
    assert all((tmp_path / f"rank{r}.ok").exists() for r in (0, 1))


def _to_local_fn_with_prim_types(weight):  # the name torch 2.11's dynamo gives the call it writes for to_local()
    return weight


def test_shards_written_as_a_function_call_are_grouped():
    """torch 2.11's dynamo writes a sharded parameter's ``to_local()`` as a call of a wrapper function, just before
    each linear layer: every weight read that way still joins its group (its shard read moved before the group's
    call), and the logits are unchanged."""
    model = _model("llama", torch.bfloat16)
    (gm, inputs), reference = _traced(model, prompt(1, seed=5))
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (torch._C._nn.linear, torch.nn.functional.linear):
            weight = node.args[1]
            with gm.graph.inserting_before(node):
                shard = gm.graph.call_function(_to_local_fn_with_prim_types, (weight,))
            shard.meta["example_value"] = weight.meta["example_value"]
            node.replace_input_with(weight, shard)
    gm.recompile()
    with _kernels_run(True):
        group_projections(gm)
    groups = _grouped_weights_through(gm, lambda w: w.args[0])
    assert groups[:4] == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    assert len(groups) == 4 * model.config.num_hidden_layers + 1  # and the lm_head
    assert torch.equal(_rewritten_output(gm, inputs), reference)
