"""PyTorch reference of the attention every kernel computes (float32 math): the spec the kernels are tested against.

Shapes (batch size 1 throughout): query ``[1, Hq, L, D]``; keys/values ``[1, Hkv, S, D]`` with ``Hq = group·Hkv``
(query head ``h`` reads KV head ``h // group``). The last ``L`` keys are the queries' own tokens: query ``i`` sees
every key before them and, among them, key ``j`` iff ``j <= i`` (a chain) or ``spec_mask[i, j]`` when a mask is
given. Outputs are ``[1, L, Hq, D]`` (the layout transformers' attention functions return) in the query dtype.
"""

from __future__ import annotations

import torch


def masked_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    spec_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over ``key/value`` in float32; see the module docstring for shapes and the mask."""
    _, hq, length, d = query.shape
    s = key.shape[-2]
    if s < length:
        raise ValueError(f"the cache holds {s} tokens, fewer than the {length} queries it must contain")
    group = hq // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    logits = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling
    block = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    if spec_mask is not None:
        if spec_mask.shape != (length, length):
            raise ValueError(f"spec_mask must be [{length}, {length}], got {tuple(spec_mask.shape)}")
        block = spec_mask.to(device=query.device, dtype=torch.bool)
    visible = torch.ones(length, s, dtype=torch.bool, device=query.device)
    visible[:, s - length :] = block
    logits = logits.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(logits, dim=-1), v)
    return out.transpose(1, 2).to(query.dtype)


def ancestor_bits(mask: torch.Tensor) -> torch.Tensor:
    """A tree block's visibility ``mask [L, L]`` (bool: query i sees block key j) as the kernels read it: int64
    ``[L]``, bit j of entry i set iff ``mask[i, j]`` (L <= 63)."""
    length = mask.shape[-1]
    if mask.shape != (length, length) or not 1 <= length <= 63:
        raise ValueError(f"a tree block's mask must be [L, L] with 1 <= L <= 63, got {tuple(mask.shape)}")
    weights = torch.tensor([1 << j for j in range(length)], dtype=torch.int64, device=mask.device)
    return (mask.to(torch.int64) * weights).sum(-1)


def ancestor_mask(bits: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`ancestor_bits`: int64 ``[..., L]`` -> bool ``[..., L, L]``."""
    length = bits.shape[-1]
    return (bits[..., :, None] >> torch.arange(length, device=bits.device)) & 1 == 1
