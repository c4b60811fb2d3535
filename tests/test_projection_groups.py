"""The compile pass that turns linear layers sharing an input into one ``hf_sparsekv::grouped_linear`` call: which
layers it groups (traced from real transformers models), that the rewritten graph computes the same logits, and
where it leaves cuBLAS alone. The kernel itself is tested against float64 in ``test_kernels.py``."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from hf_sparsekv.generation import graph_steps
from hf_sparsekv.generation.projection_groups import group_projections
from hf_sparsekv.kernels import grouped_linear, runtime

from .conftest import prompt, tiny_model

GROUPED = torch.ops.hf_sparsekv.grouped_linear.default


def _model(arch: str, dtype: torch.dtype, role: str = "verifier"):
    """A copy of the shared tiny model in ``dtype`` (conftest's models are cached: never cast them in place)."""
    return copy.deepcopy(tiny_model(arch, role=role)).to(dtype)


def _kernels_run(on: bool):
    """The pass and the operator ask :func:`runtime.enabled`; on this CPU process (no Triton interpreter) the kernels
    never run, so the pass's view of a CUDA machine is set here, and the operator then computes its reference."""
    return mock.patch.object(runtime, "enabled", lambda device: on)


def _traced(model, ids):
    """dynamo's graph of ``model(ids).logits`` (before any pass), and the logits of the uncompiled forward."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    with torch.no_grad(), _kernels_run(False):
        reference = model(input_ids=ids).logits
        torch._dynamo.reset()
        torch.compile(lambda ids: model(input_ids=ids).logits, backend=record, dynamic=False)(ids)
    assert len(graphs) == 1
    return graphs[0], reference


def _grouped_weights(gm) -> list[list[str]]:
    """The weight inputs of each grouped call, by the module path dynamo names them after."""
    out = []
    for node in gm.graph.nodes:
        if node.target is GROUPED:
            out.append([w.target.split("_modules_")[-1].split("_parameters")[0] for w in node.args[1]])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("rows,role", [(1, "verifier"), (4, "verifier"), (4, "drafter")])
def test_projections_sharing_an_input_become_one_call(arch, rows, role):
    """q/k/v and gate/up are one call each; lone layers too at one row, and at more rows only the output projection
    when it is wide (the drafter's: 96 outputs of 32 inputs; the verifier's 96 of 64 is not)."""
    model = _model(arch, torch.bfloat16, role)
    (gm, inputs), reference = _traced(model, prompt(rows, seed=rows))
    with _kernels_run(True):  # the pass groups only where the kernels run
        inserted = group_projections(gm)
    groups = _grouped_weights(gm)
    expected = []
    for _ in range(model.config.num_hidden_layers):
        expected += [["q_proj", "k_proj", "v_proj"]] + [["o_proj"]] * (rows == 1)
        expected += [["gate_proj", "up_proj"]] + [["down_proj"]] * (rows == 1)
    expected += [["lm_head"]] * (rows == 1 or role == "drafter")
    assert inserted == len(groups) and groups == expected
    with torch.no_grad(), _kernels_run(False):  # the operator's reference: F.linear per weight, exactly
        out = gm(*inputs)
    assert torch.equal(out[0] if isinstance(out, (tuple, list)) else out, reference)


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


def test_step_backend_runs_the_pass_unless_switched_off(monkeypatch):
    model = _model("qwen2", torch.bfloat16)
    seen = []

    def inner(gm, example_inputs):
        seen.append(_grouped_weights(gm))

        def run(*args):
            with _kernels_run(False):  # the operator's reference
                return gm.forward(*args)
        return run

    monkeypatch.setattr(graph_steps, "COMPILE_BACKEND", inner)
    ids = prompt(2, seed=3)
    for switch in ("1", "0"):
        monkeypatch.setenv(graph_steps.GROUPED_LINEAR_ENV, switch)
        torch._dynamo.reset()
        with torch.no_grad(), _kernels_run(True):
            torch.compile(lambda ids: model(input_ids=ids).logits, backend=graph_steps.step_backend)(ids)
    assert seen[0] == [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]] * 2
    assert seen[1] == []
