"""The tree a round verifies when retrieval drafts beside a drafter: the drafter's chain and the retrieved chain as
two branches from the round's root, checked by one verifier forward with tree attention (each node sees the
sequence before the round and its own ancestors, never the other branch: LongSpec §3.3's tree attention, done in
one pass of the decode kernel by an ancestor mask over the block).

Nodes (``N = 2γ + 1``): 0 the root ``seq[n-1]``; ``1..γ`` the drafter's drafts; ``γ+1..2γ`` the retrieved ones.
Node ``i`` sits at position ``n - 1 + depth(i)`` and at slot ``n - 1 + i`` of the verifier's full cache, so the
drafter's branch is already at its positions' slots; where the retrieved branch is kept, its keys/values move there
(:meth:`~hf_sparsekv.caches.static.StaticFullCache.keep_path`). Acceptance keeps the longer accepted branch (the
drafter's on a tie), or, sampling, walks the tree by recursive rejection over the siblings
(:func:`~.acceptance.accept_or_resample_two_chains`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.reference import ancestor_bits


@dataclass(frozen=True)
class TwoChains:
    """The constants of the two-branch tree of γ drafts per branch, on ``device``.

    ``depths [N]``: each node's position offset from the root; ``bits [N]``: its ancestor mask as the kernel reads it
    (:func:`~hf_sparsekv.kernels.reference.ancestor_bits`); ``branches [2, γ+1]``: the nodes of each root-to-leaf
    path (row 0 the drafter's, row 1 the retrieved one), so ``logits[:, branches[k]]`` are branch k's verifier
    logits after the root and after each of its drafts."""

    depths: torch.Tensor
    bits: torch.Tensor
    branches: torch.Tensor

    @classmethod
    def build(cls, gamma: int, device) -> "TwoChains":
        drafter = list(range(gamma + 1))
        retrieved = [0] + list(range(gamma + 1, 2 * gamma + 1))
        mask = torch.zeros(2 * gamma + 1, 2 * gamma + 1, dtype=torch.bool)
        for path in (drafter, retrieved):
            for depth, node in enumerate(path):
                mask[node, path[: depth + 1]] = True
        depths = torch.tensor(list(range(gamma + 1)) + list(range(1, gamma + 1)))
        return cls(depths.to(device), ancestor_bits(mask).to(device), torch.tensor([drafter, retrieved]).to(device))
