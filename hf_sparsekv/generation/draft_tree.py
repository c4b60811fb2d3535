"""The tree a round verifies instead of one chain (``draft_tree_size``, or retrieval beside a drafter): the drafter's
chain, the drafter's most probable alternatives at each depth (Graft's confidence pruning: a fixed node budget, each
row keeping its most probable candidates) and the retrieved continuation grafted into the budget the pruning freed.
One verifier forward checks every node with tree attention (each node sees the sequence before the round and its
own ancestors: LongSpec §3.3's tree attention, one pass of the decode kernel with an ancestor mask per row).

Layout (``N`` draft nodes, the block ``N + 1`` with the root; node ``i`` at slot ``n - 1 + i`` of the verifier's full
cache and at position ``n - 1 + depth(i)``):

- node 0, the root ``seq[n-1]``;
- nodes ``1..γ``, the drafter's chain (node i at depth i), already at its positions' slots;
- nodes ``γ+1..N``, the extra nodes, filled per row: a row whose retrieval found a match puts its retrieved chain
  of ``R`` tokens first (a chain from the root), then its most probable siblings; a row without one, siblings only.
  A sibling at depth d is one of the drafter's next most probable tokens after chain node d-1, ranked by the
  drafter's probability of the path to it (its cumulative log-probability), the best first. Siblings are leaves:
  the drafter drafts only its chain (its alternatives come from the same γ draft steps), so no drafter cache needs
  tree attention.

The block is ancestor-closed by construction (a sibling's parent is a chain node, a retrieved node's the root or the
previous retrieved node), and every parent comes before its child. A node whose token repeats a sibling's, or a
retrieved node of a row without a match, is harmless: acceptance only follows a node whose token the verifier
itself chooses (:func:`~.acceptance.walk_tree`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHAIN, RETRIEVED, SIBLING = 0, 1, 2  # node kinds
MAX_TREE_NODES = 62  # draft nodes per round: the block (with its root) fits one int64 of ancestor bits per node


@dataclass(frozen=True)
class DraftTree:
    """A round's tree layout: ``gamma`` the depth (the chain's drafts), ``size`` the draft nodes N (>= γ),
    ``retrieved`` the retrieved chain's nodes R in a row with a match, ``siblings`` the drafter's candidates per
    depth K (0: no siblings; then the extra nodes hold the retrieved chain in every row)."""

    gamma: int
    size: int
    retrieved: int
    siblings: int

    @classmethod
    def plan(cls, gamma: int, size: int | None, retrieval: bool) -> "DraftTree | None":
        """The layout for ``draft_tree_size=size`` (None: the chain, or with retrieval the chain and the retrieved
        chain, ``2γ`` nodes); None where a round verifies one chain."""
        if size is None:
            return cls(gamma, 2 * gamma, gamma, 0) if retrieval else None
        extra = size - gamma
        if extra == 0:
            return None
        return cls(gamma, size, min(gamma, extra) if retrieval else 0, extra)

    def constants(self, device) -> dict[str, torch.Tensor]:
        """The layout's fixed parts as tensors on ``device``, made once (a captured step reads them as inputs rather
        than computing index arithmetic in the graph): the root's and the chain's parents and depths ``[γ+1]``, and
        for the extra nodes ``[E]`` the retrieved chain's index, parent and depth at each and each one's slot; each
        node's own ancestor bit."""
        gamma, extra, r = self.gamma, self.size - self.gamma, max(self.retrieved, 1)
        j = [min(e, r - 1) for e in range(extra)]
        values = dict(chain_parents=[0] + list(range(gamma)), chain_depths=list(range(gamma + 1)),
                      slot=list(range(extra)), ret_index=j, ret_parents=[0 if x == 0 else gamma + x for x in j],
                      ret_depths=[x + 1 for x in j],
                      depth_of=list(range(1, gamma + 1)), own=[1 << i for i in range(self.size + 1)])
        return {name: torch.tensor(v, dtype=torch.long, device=device) for name, v in values.items()}

    def build(self, const: dict, chain: torch.Tensor, chain_logq: torch.Tensor | None,
              candidates: torch.Tensor | None, candidate_logq: torch.Tensor | None, retrieved: torch.Tensor | None,
              matched: torch.Tensor | None):
        """Each row's tree, on the device (capturable: shapes fixed by the layout).

        ``const``: :meth:`constants`; ``chain [B, γ]`` the drafter's drafts; ``chain_logq [B, γ]`` their
        log-probabilities under the drafter; ``candidates [B, γ, K]`` the drafter's next most probable tokens at each
        depth (its draft excluded) and ``candidate_logq [B, γ, K]`` theirs; ``retrieved [B, R]`` each row's retrieved
        continuation and ``matched [B]`` whether it has one. Returns ``(tokens [B, N+1], parents [B, N+1], depths
        [B, N+1], bits [B, N+1], kinds [B, N+1])``: the node tokens (the root's is 0; the verify block takes
        ``seq[n-1]``), each node's parent (the root its own), depth, ancestor bits as the decode kernel reads them,
        and kind (``CHAIN`` for the root and the chain, ``RETRIEVED``, ``SIBLING``)."""
        gamma, size, r, k = self.gamma, self.size, self.retrieved, self.siblings
        rows = chain.shape[0]
        extra = size - gamma
        slot = const["slot"].expand(rows, -1)  # the extra nodes, 0..E-1
        if r:  # the retrieved chain in the first R extra nodes of a row with a match (of every row without siblings)
            in_chain = slot < (matched.long()[:, None] * r if k else r)
            ret_tokens = retrieved.gather(1, const["ret_index"].expand(rows, -1))
        if k:  # the most probable alternatives by the drafter's probability of the path to each
            before = torch.cat([chain_logq.new_zeros(rows, 1), chain_logq.cumsum(1)[:, :-1]], 1)  # [B, γ]
            best = (before[:, :, None] + candidate_logq).flatten(1).topk(extra, dim=1).indices  # [B, E], best first
            rank = (slot - in_chain.long().sum(1, keepdim=True)).clamp_min(0) if r else slot
            best = best.gather(1, rank)
            sib_tokens = candidates.flatten(1).gather(1, best)
            sib_depths = const["depth_of"][best // k]
            if r:
                ex_tokens = torch.where(in_chain, ret_tokens, sib_tokens)
                ex_parents = torch.where(in_chain, const["ret_parents"], sib_depths - 1)  # a chain node (the root)
                ex_depths = torch.where(in_chain, const["ret_depths"], sib_depths)
                ex_kinds = in_chain.long() * (RETRIEVED - SIBLING) + SIBLING
            else:
                ex_tokens, ex_parents, ex_depths = sib_tokens, sib_depths - 1, sib_depths
                ex_kinds = torch.full_like(slot, SIBLING)
        else:
            ex_tokens = ret_tokens
            ex_parents, ex_depths = const["ret_parents"].expand(rows, -1), const["ret_depths"].expand(rows, -1)
            ex_kinds = torch.full_like(slot, RETRIEVED)
        tokens = torch.cat([chain.new_zeros(rows, 1), chain, ex_tokens], 1)
        parents = torch.cat([const["chain_parents"].expand(rows, -1), ex_parents], 1)
        depths = torch.cat([const["chain_depths"].expand(rows, -1), ex_depths], 1)
        kinds = torch.cat([torch.full_like(const["chain_depths"], CHAIN).expand(rows, -1), ex_kinds], 1)
        return tokens, parents, depths, ancestor_bits_of(parents, gamma, const["own"]), kinds


def ancestor_bits_of(parents: torch.Tensor, depth: int, own: torch.Tensor | None = None) -> torch.Tensor:
    """Ancestor bits ``[B, L]`` (int64, bit j of node i set iff j is i or one of its ancestors) of trees given by
    ``parents [B, L]`` (the root its own parent, every parent before its child) no deeper than ``depth``; ``own``:
    each node's own bit ``[L]`` (made here if not given)."""
    if own is None:
        own = torch.ones((), dtype=torch.long, device=parents.device) << torch.arange(parents.shape[1],
                                                                                       device=parents.device)
    bits = own.expand_as(parents)
    for _ in range(depth):
        bits = own | bits.gather(1, parents)
    return bits


def path_nodes(bits: torch.Tensor, depths: torch.Tensor, node: torch.Tensor, gamma: int) -> torch.Tensor:
    """The nodes ``[B, γ]`` on the path from the root to ``node [B]``: entry d-1 the ancestor at depth d (0 past the
    node's depth)."""
    mine = bits.gather(1, node[:, None])  # [B, 1]
    index = torch.arange(bits.shape[1], device=bits.device)
    on_path = ((mine >> index) & 1) == 1  # [B, L]
    at = on_path[:, None, :] & (depths[:, None, :] == torch.arange(1, gamma + 1, device=bits.device)[None, :, None])
    return at.long().argmax(-1)
