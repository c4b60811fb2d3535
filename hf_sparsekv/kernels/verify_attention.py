"""Verification attention (LongSpec's Hybrid Tree Attention, chain mask by default): Triton + a dense kernel, and
its PyTorch reference, same signature.

``query [1, Hq, L, D]`` (the γ+1 verified tokens, L = 2..16) against a long full-precision cache
``key/value [1, Hkv, S, D]`` whose last L tokens are the queries' own. The unmasked prefix (tokens ``0..S-L-1``,
seen by every query) goes through the fastest dense kernel present, which also returns its log-sum-exp:

* flash-attn's ``flash_attn_with_kvcache`` when the ``flash_attn`` package imports (CUDA, float16/bfloat16);
* else PyTorch's flash SDPA kernel (``aten._scaled_dot_product_flash_attention``), GQA folded into query rows;
* on CPU (interpreter tests) a float32 PyTorch computation.

The masked speculative block (L x L: ``spec_mask[i, j]`` = query i sees block token j, default causal/chain; tree
masks are a boolean ``[L, L]`` with a true diagonal) runs in one Triton program per KV head, which also merges the
two parts by log-sum-exp and writes the result. Returns ``[1, L, Hq, D]`` in the query dtype.
"""

from __future__ import annotations

import functools

import torch

from . import runtime
from .decode_core import LOG2E, _block_m, dot_config, triton_next_pow2
from .reference import masked_attention_reference


@functools.lru_cache(maxsize=None)
def _flash_attn_with_kvcache():
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def dense_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
    """Unmasked attention of ``query [1, Hq, L, D]`` over ``key/value [1, Hkv, P, D]`` (P >= 1).

    Returns ``(out, lse)`` with ``out`` indexable as ``[L, Hq, D]`` (a strided view) and ``lse [Hq, L]`` float32,
    natural log, and the name of the kernel used."""
    _, hq, length, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    if query.device.type == "cuda":
        flash = _flash_attn_with_kvcache()
        if flash is not None:
            out, lse = flash(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                softmax_scale=scaling, causal=False, return_softmax_lse=True,
            )
            return out[0], lse[0].float(), "flash_attn_with_kvcache"
        q = query.reshape(1, hkv, group * length, d)  # GQA: a KV head's query heads become rows (no mask here)
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, key, value, 0.0, False, False, scale=scaling)
        out, lse = res[0], res[1]
        return out.view(hq, length, d).transpose(0, 1), lse.view(hq, -1)[:, :length].float(), "sdpa_flash"
    q = query.float().reshape(1, hkv, group * length, d)
    logits = torch.matmul(q, key.float().transpose(-1, -2)) * scaling
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.matmul(torch.softmax(logits, dim=-1), value.float())
    return out.view(hq, length, d).transpose(0, 1), lse.view(hq, length), "torch_float32"


@runtime.on_input_device
def verify_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    spec_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hybrid attention; see the module docstring."""
    _, hq, length, d = query.shape
    runtime.check_attention_inputs(query, key, value)
    if query.dtype == torch.float32 and query.device.type == "cuda":
        raise NotImplementedError("verify_attention on CUDA needs float16/bfloat16 (the dense flash kernels)")
    s = key.shape[-2]
    if s < length or value.shape[-2] != s:
        raise ValueError(f"key/value must hold the same number of tokens, at least {length}; got {s}, {value.shape[-2]}")
    if spec_mask is not None:
        if spec_mask.shape != (length, length):
            raise ValueError(f"spec_mask must be [{length}, {length}], got {tuple(spec_mask.shape)}")
        spec_mask = spec_mask.to(device=query.device, dtype=torch.int8).contiguous()
    runtime.require(query, key, value)
    from . import _verify_triton as tk

    hkv = key.shape[1]
    group = hq // hkv
    prefix = s - length
    out = torch.empty(length, hq, d, dtype=query.dtype, device=query.device)
    if prefix > 0:
        po, pl, _ = dense_prefix_attention(query, key[:, :, :prefix], value[:, :, :prefix], scaling)
    else:
        po, pl = out, out[:, :, 0]
    dot_prec, dot_dtype = dot_config(query.dtype)
    mask = spec_mask if spec_mask is not None else out
    tk.block_merge_kernel[(hkv,)](
        query, query.stride(1), query.stride(2),
        key, value, key.stride(1), key.stride(2), value.stride(1), value.stride(2), prefix,
        po, po.stride(0), po.stride(1), pl, pl.stride(0), pl.stride(1),
        mask, mask.stride(0),
        out, out.stride(0), out.stride(1),
        scaling * LOG2E, length,
        GROUP=group, HEAD_DIM=d, BLOCK_M=_block_m(group * length), BLOCK_N=max(16, triton_next_pow2(length)),
        HAS_PREFIX=prefix > 0, HAS_MASK=spec_mask is not None, DOT_PREC=dot_prec, DOT_DTYPE=dot_dtype,
        num_warps=4, **runtime.LAUNCH_OPTIONS,
    )
    return out.unsqueeze(0)


def verify_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    spec_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference (float32 math over the whole cache with the block mask)."""
    return masked_attention_reference(query, key, value, scaling, spec_mask)
