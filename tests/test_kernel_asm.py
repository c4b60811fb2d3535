"""benchmarks/kernel_asm.py: the decode kernel compiled for sm_90 on a machine without a GPU, with the launch
arguments (and alignment hints) a real launch would give it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kernel_asm():
    spec = importlib.util.spec_from_file_location("kernel_asm", ROOT / "benchmarks" / "kernel_asm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quantized_kernel_compiles_for_hopper_without_int_to_float_converts(kernel_asm):
    """Llama-3-8B's shape takes the tensor-core path (4 query rows per KV head): its codes become floats by the
    mask|OR trick, so the compiled loop has no I2F; loads are vectorized (asynchronous copies into shared memory),
    which needs the alignment hints a launch gives."""
    interpret = os.environ.get("TRITON_INTERPRET")
    fn, call = kernel_asm.recorded_launch("llama3-8b", "int8", 1)
    assert os.environ.get("TRITON_INTERPRET") == interpret  # left as it was
    kernel = kernel_asm.compile_for(fn, call, 90)
    res = kernel_asm.resources(kernel)
    assert 16 <= res["registers"] <= 255 and res["local"] is not None
    mix, _ = kernel_asm.sass_mix(kernel, top=200)
    ops = dict(mix)
    assert "HMMA" in ops and "LDGSTS" in ops
    assert "I2F" not in ops


def test_codes_are_converted_in_the_dot_operand_layout(kernel_asm):
    """On the tensor-core path the code bytes go from shared memory straight into the dot's operand layout and are
    converted there (inline PTX by default, both views and dtypes; bfloat16 INT8 as separate upper/lower dots).
    Without the PTX, bfloat16 INT8 takes the float32 route, which writes the converted tile back to shared memory."""
    import re

    import torch

    from hf_sparsekv.kernels import decode_core

    byte_operand = re.compile(r"local_load .*-> tensor<64x64xi8, #ttg\.dot_op")

    def count(dtype, view):
        fn, call = kernel_asm.recorded_launch("llama3-8b", view, 1, dtype=dtype)
        return len(byte_operand.findall(kernel_asm.compile_for(fn, call, 90).asm["ttgir"]))

    found = {(str(dtype)[6:], view): count(dtype, view)
             for dtype in (torch.float16, torch.bfloat16) for view in ("int4", "int8")}
    # keys and values (INT8: upper and lower bytes of each)
    assert found == {("float16", "int4"): 2, ("float16", "int8"): 4, ("bfloat16", "int4"): 2, ("bfloat16", "int8"): 4}
    with decode_core.quant_config(asm_codes=False):
        assert count(torch.bfloat16, "int8") == 0 and count(torch.float16, "int8") == 4
