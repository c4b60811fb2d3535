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


def test_float16_codes_are_converted_in_the_dot_operand_layout(kernel_asm):
    """With ``f16_codes`` the code bytes go from shared memory straight into the tensor-core operand layout and are
    converted there; without it the converted tile is written back to shared memory first."""
    import re

    from hf_sparsekv.kernels import decode_core

    byte_operand = re.compile(r"local_load .*-> tensor<64x64xi8, #ttg\.dot_op")
    found = {}
    for on in (False, True):
        with decode_core.quant_config(f16_codes=on):
            fn, call = kernel_asm.recorded_launch("llama3-8b", "int4", 1)
        found[on] = len(byte_operand.findall(kernel_asm.compile_for(fn, call, 90).asm["ttgir"]))
    assert found == {False: 0, True: 2}  # keys and values
