"""Compile the split-KV decode kernel for a CUDA architecture without a GPU and report what the compiler made of it:
registers per thread, spills, shared memory, and the SASS instruction mix of the loop (kernel work is judged on the
generated code before any device time is spent on it).

The launch arguments are those :func:`hf_sparsekv.kernels.decode_core.launch_decode` passes for one decode step of a
model shape (recorded from a call on small CPU tensors, then compiled with Triton's own ``ptxas`` for ``--arch``).

Usage: ``python benchmarks/kernel_asm.py [--gluon] [--shape llama2-7b|llama3-8b] [--view int4|int8] [--queries 1]
[--dtype float16|bfloat16] [--config '{"path": "vec", ...}'] [--arch 90] [--sass out.sass]`` (no GPU needed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}  # (query heads, KV heads, head_dim)
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8", torch.int32: "i32",
          torch.int64: "i64"}


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records the call instead of launching it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _zero_store(hkv: int, d: int, tokens: int, group: int, dtype) -> tuple:
    """(key, value) QuantizedTensors of ``tokens`` tokens on CPU, zeros: a launch's argument types and strides."""
    from hf_sparsekv.kernels.quant_reference import QuantizedTensor

    codes = lambda: torch.zeros(1, hkv, tokens, d // 2, dtype=torch.uint8)  # noqa: E731
    qk = QuantizedTensor(codes(), codes(), torch.zeros(1, hkv, tokens // group, d, dtype=dtype),
                         torch.zeros(1, hkv, tokens // group, d, dtype=dtype))
    qv = QuantizedTensor(codes(), codes(), torch.zeros(1, hkv, tokens, 1, dtype=dtype),
                         torch.zeros(1, hkv, tokens, 1, dtype=dtype))
    return qk, qv


def recorded_launch(shape: str, view: str, queries: int, dtype=torch.float16, tokens: int = 1024, group: int = 128):
    """The decode kernel's arguments for one step of ``shape`` over ``tokens`` quantized tokens, as a GPU launch
    would pass them (CPU tensors; only their dtypes and strides matter). ``TRITON_INTERPRET`` is left as found."""
    saved_env = os.environ.get("TRITON_INTERPRET")
    # unset: the kernels are decorated as compiled kernels at first import, and dot_config picks a GPU's settings
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        from hf_sparsekv.kernels import _decode_triton, decode_core

        hq, hkv, d = SHAPES[shape]
        split, combine = _Recorder(_decode_triton.decode_split_kernel), _Recorder(_decode_triton.combine_kernel)
        qk, qv = _zero_store(hkv, d, tokens, group, dtype)
        q = torch.zeros(1, hq, queries, d, dtype=dtype)
        buf = torch.zeros(1, hkv, group, d, dtype=dtype)
        saved = decode_core._kernels, decode_core.runtime.require
        decode_core._kernels = lambda: (split, combine)
        decode_core.runtime.require = lambda *tensors: None  # CPU tensors are fine: nothing runs
        try:
            decode_core.launch_decode(q, 0.1, buf, buf, quant=(qk, qv), group_size=group, int8=view == "int8")
        finally:
            decode_core._kernels, decode_core.runtime.require = saved
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
    return split.fn, split.calls[0]


def recorded_gluon_launch(shape: str, view: str, queries: int, dtype=torch.float16, tokens: int = 1024,
                          group: int = 128, lengths_on_device: bool = False):
    """The Gluon quantized kernel's arguments for one decode step of ``shape`` (quant_gluon.launch_quant_splits on CPU
    tensors, rows per program, block and stages from decode_core.gluon_settings), as :func:`recorded_launch` does for
    the Triton kernel."""
    from hf_sparsekv.kernels import _quant_gluon, decode_core, quant_gluon

    hq, hkv, d = SHAPES[shape]
    split = _Recorder(_quant_gluon.quant_split_kernel)
    qk, qv = _zero_store(hkv, d, tokens, group, dtype)
    q = torch.zeros(1, hq, queries, d, dtype=dtype)
    rows = hq // hkv * queries
    op = torch.zeros(hkv, 8, rows, d)
    lp = torch.zeros(hkv, 8, rows)
    length = torch.zeros(1, dtype=torch.int32) if lengths_on_device else None
    n_rows, block, stages = decode_core.gluon_settings(rows, view == "int8")
    saved = quant_gluon._module
    quant_gluon._module = lambda: type("M", (), {"quant_split_kernel": split})
    try:
        quant_gluon.launch_quant_splits(q, 0.1, (qk, qv), group, view == "int8", tokens, 256, 4, op, lp, length, hkv,
                                        queries, block, stages, n_rows)
    finally:
        quant_gluon._module = saved
    return split.fn, split.calls[0]


def compile_for(fn, call, arch: int):
    """Compile ``fn`` for the recorded ``call`` on ``cuda:arch``; returns Triton's compiled kernel (asm, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1 in this process: run in a fresh one")

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    _, args, kwargs = call
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
    signature, constexprs, attrs = {}, {}, {}
    values = list(args) + [kwargs[n] for n in fn.arg_names[len(args):]]
    for i, (param, value) in enumerate(zip(fn.params, values)):
        name = param.name
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        # as a launch specializes: 16-byte-aligned pointers and ints divisible by 16 are marked so, ints of 1 become
        # constants (without these hints the compiler cannot vectorize the loads)
        kind, attr = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
        if isinstance(attr, str) and attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                          options=options)


def _tool(name: str) -> str:
    """A CUDA binary tool shipped inside Triton's NVIDIA backend."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(kernel) -> dict:
    """Registers, spill bytes (local memory per thread) and shared memory of the compiled kernel (from its cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    grab = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else None  # noqa: E731
    return dict(registers=grab(r"REG:(\d+)"), local=grab(r"STACK:(\d+)") or grab(r"LOCAL:(\d+)"),
                shared=kernel.metadata.shared)


def sass_mix(kernel, top: int = 25) -> list[tuple[str, int]]:
    """The most frequent SASS opcodes of the kernel (static counts)."""
    nvdisasm = _tool("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?", text, re.M)
    return collections.Counter(ops).most_common(top), text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--view", choices=("int4", "int8"), default="int4")
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    ap.add_argument("--config", default=None, help="quantized launch settings (JSON), as HF_SPARSEKV_QUANT_CONFIG")
    ap.add_argument("--gluon", action="store_true", help="the Gluon kernel of quant_gluon instead of the Triton one")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sass", default=None, help="write the disassembly here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from hf_sparsekv.kernels import decode_core

    settings = decode_core.load_quant_config(args.config) if args.config else {}
    with decode_core.quant_config(**settings):
        record = recorded_gluon_launch if args.gluon else recorded_launch
        fn, call = record(args.shape, args.view, args.queries, getattr(torch, args.dtype))
    kernel = compile_for(fn, call, args.arch)
    res = resources(kernel)
    mix, text = sass_mix(kernel)
    if args.sass:
        open(args.sass, "w").write(text)
    row = dict(shape=args.shape, view=args.view, queries=args.queries, dtype=args.dtype, config={**decode_core.QUANT_CONFIG, **settings},
               **res, sass_top=mix)
    if args.json:
        print(json.dumps(row))
    else:
        print(f"{args.shape} {args.view} {args.dtype} q={args.queries}: {res['registers']} registers, local (spill) "
              f"{res['local']} B per thread, shared {res['shared']} B")
        print("  " + ", ".join(f"{op} {n}" for op, n in mix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
