"""benchmarks/kernel_asm.py: the decode kernel compiled for sm_90 on a machine without a GPU, with the launch
arguments (and alignment hints) a real launch would give it."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")


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


# shared memory a block may use (opt-in maximum): A100, RTX 30xx/40xx and L4 (Ampere/Ada consumer), H100
SHARED_LIMIT = {80: 166912, 86: 101376, 90: 232448}


class _GpuWithLimit:
    """Stands in for a JIT kernel on a GPU of ``arch``: each call compiles the kernel for that architecture (Triton's
    compiler and ptxas, no GPU) and raises ``OutOfResources`` where it needs more shared memory than the GPU gives a
    block, as loading it on that GPU does; else records the settings it would run with."""

    def __init__(self, kernel_asm, fn, arch: int):
        self.kernel_asm, self.fn, self.arch, self.tried, self.ran = kernel_asm, fn, arch, [], []

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def call(*args, **kwargs):
            shared = self.kernel_asm.compile_for(self.fn, (grid, args, kwargs), self.arch).metadata.shared
            self.tried.append((kwargs["num_stages"], shared))
            if shared > SHARED_LIMIT[self.arch]:
                raise OutOfResources(shared, SHARED_LIMIT[self.arch], "shared memory")
            self.ran.append((kwargs["num_stages"], shared))
        return call


def test_kernels_launch_with_fewer_stages_where_the_gpu_has_less_shared_memory(kernel_asm, monkeypatch):
    """The launch settings were tuned on an H100. On a GPU with less shared memory a block (99 KiB on Ampere/Ada
    consumer cards) a setting that does not fit runs with fewer pipeline stages instead of failing: the decode
    kernel for a batch of 4 rows with 6 queries at Llama-3-8B's shape (4 stages tuned), the grouped GEMV at 16 rows
    with a deep setting, and the grouped GEMV's own setting for an MLP's gate/up at 6 rows on an H100. Each ends
    running a kernel that fits, the first two with fewer stages than asked; the chosen stages are remembered."""
    import torch

    from hf_sparsekv.kernels import _decode_triton, _grouped_linear_triton, decode_core, grouped_linear, runtime

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(runtime, "require", lambda *tensors: None)  # CPU tensors: nothing runs
    monkeypatch.setattr(runtime, "_FITTED_STAGES", {})
    split_fn, combine_fn, grouped_fn = (_decode_triton.decode_split_kernel, _decode_triton.combine_kernel,
                                        _grouped_linear_triton.grouped_linear_kernel)

    def decode(arch, split=None):
        split = split or _GpuWithLimit(kernel_asm, split_fn, arch)
        monkeypatch.setattr(decode_core, "_kernels", lambda: (split, _GpuWithLimit(kernel_asm, combine_fn, arch)))
        q = torch.zeros(4, 32, 6, 128, dtype=torch.bfloat16)
        k = torch.zeros(4, 8, 4096, 128, dtype=torch.bfloat16)
        decode_core.launch_decode(q, 0.1, k, k, fp_length=torch.full((4,), 4096, dtype=torch.int32))
        return split

    def grouped(arch, rows, ns, config=None):
        kernel = _GpuWithLimit(kernel_asm, grouped_fn, arch)
        monkeypatch.setattr(_grouped_linear_triton, "grouped_linear_kernel", kernel)
        x = torch.zeros(rows, 4096, dtype=torch.bfloat16)
        grouped_linear.launch(x, [torch.zeros(n, 4096, dtype=torch.bfloat16) for n in ns], [], config=config)
        return kernel

    consumer = decode(86)
    for kernel, fewer in ((consumer, True), (grouped(86, 16, (4096,), config=(64, 256, 4, 4)), True),
                          (grouped(90, 6, (14336, 14336)), False)):
        asked = kernel.tried[0][0]
        (stages, shared), = kernel.ran
        assert shared <= SHARED_LIMIT[kernel.arch] and 1 <= stages <= asked
        assert stages < asked or not fewer
    tries = len(consumer.tried)
    decode(86, consumer)  # the same kernel and settings again: the stages that fit, at once
    assert len(consumer.tried) == tries + 1 and consumer.ran[1] == consumer.ran[0]


def test_merge_kernel_compiles_for_hopper_without_spills(kernel_asm, monkeypatch):
    """The merge of the splits, as a Llama-3 verification launches it (24 rows, lengths on the device), compiles for
    sm_90 in registers alone."""
    import torch

    from hf_sparsekv.kernels import decode_core
    from hf_sparsekv.kernels.quantize import quantize_keys_reference, quantize_values_reference

    launches = {}

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.setdefault(self.fn.__name__, (self.fn, (grid, args, kwargs)))

    split, combine = decode_core._kernels()
    monkeypatch.setattr(decode_core, "_kernels", lambda: (Recorder(split), Recorder(combine)))
    monkeypatch.setattr(decode_core.runtime, "require", lambda *tensors: None)  # CPU tensors: nothing runs
    q, kv = torch.randn(1, 32, 6, 128, dtype=torch.float16), torch.randn(1, 8, 160, 128, dtype=torch.float16)
    codes = torch.randn(1, 8, 1024, 128, dtype=torch.float16)
    quant = quantize_keys_reference(codes, 128), quantize_values_reference(codes)
    lengths = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    with decode_core.quant_config(kernel="triton"):
        decode_core.launch_decode(q, 0.1, kv, kv, quant=quant, group_size=128, int8=True, fp_length=lengths(100),
                                  quant_length=lengths(512))
    fn, call = launches["combine_kernel"]
    res = kernel_asm.resources(kernel_asm.compile_for(fn, call, 90))
    assert res["registers"] <= 128 and res["local"] in (0, None)
