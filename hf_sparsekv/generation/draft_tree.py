"""The tree a round verifies instead of one chain (``draft_tree_size``, or retrieval beside a drafter): the drafter's
chain, the drafter's most probable other paths (grown level by level on its own cache, then Graft's confidence
pruning: a fixed node budget, each row keeping its most probable nodes) and the retrieved continuation grafted into
the budget the pruning freed. One verifier forward checks every node with tree attention (each node sees the
sequence before the round and its own ancestors: LongSpec §3.3's tree attention, one pass of the decode kernel with
an ancestor mask per row).

**Drafting** (:func:`~.drafting.draft_tree`, ``width`` W >= 2): depth by depth, the drafter expands a *frontier* of W
nodes, its chain node first (the argmax, or the draw, of the chain node before it) and the W - 1 most probable other
nodes of that depth (by the drafter's probability of the path to each, its cumulative log-probability). One drafter
forward per depth reads the frontiers so far (depth d's at block slots ``(d-1)·W ..``, at most ``block = (γ-1)·W``
nodes) as a tree block on its compressed cache, so a round takes γ drafter forwards, as the chain does. Every
node the drafter scored off its chain joins the *pool*: the root's ``first`` best children other than the chain's,
then for each deeper frontier node its W best children (the chain node's other than the chain's) at the pool slots
``first + (d-2)·W² + w·W + k`` (depth d, frontier node w, its children k = 0..W-1 in no particular order);
``from`` holds each pool node's parent as its frontier slot w (0: the chain node, or the root at depth 1; a constant
of the layout, ``pool_from``), ``frontier [B, γ-1, W]`` each frontier node's pool slot (-1 for the chain's).

**Layout** (``N`` draft nodes, the block ``N + 1`` with the root; node ``i`` at slot ``n - 1 + i`` of the verifier's
full cache and at position ``n - 1 + depth(i)``):

- node 0, the root ``seq[n-1]``;
- nodes ``1..γ``, the drafter's chain (node i at depth i), already at its positions' slots;
- nodes ``γ+1..N``, the extra nodes, filled per row: a row whose retrieval found a match puts its retrieved chain
  of ``R`` tokens first (a chain from the root), then its most probable pool nodes, best first; a row without one,
  pool nodes only.

The block is ancestor-closed by construction: a pool node's parent is a chain node or a frontier node, which is
itself a pool node of a strictly higher score (a child's log-probability is at most its parent's, and ties are
broken against depth), so it is kept whenever its child is, and comes before it; a retrieved node's parent is the
root or the previous retrieved node. A node whose token repeats another's, or a retrieved node of a row without a
match, is harmless: acceptance only follows a node whose token the verifier itself chooses
(:func:`~.acceptance.walk_tree`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CHAIN, RETRIEVED, SIBLING = 0, 1, 2  # node kinds (SIBLING: a node the drafter proposed off its chain)
MAX_TREE_NODES = 62  # draft nodes per round: the block (with its root) fits one int64 of ancestor bits per node
DEPTH_TIE = 1e-3  # subtracted per depth from a pool node's score: a child ranks strictly below its parent
SCORE_FLOOR = -1e4  # the lowest log-probability a pool node carries (an impossible token stays finite and ordered)


@dataclass(frozen=True)
class DraftTree:
    """A round's tree layout: ``gamma`` the depth (the chain's drafts), ``size`` the draft nodes N (>= γ),
    ``retrieved`` the retrieved chain's nodes R in a row with a match, ``width`` the frontier W the drafter expands
    at each depth (0: the drafter proposes no other nodes; then the extra nodes hold the retrieved chain in every
    row)."""

    gamma: int
    size: int
    retrieved: int
    width: int

    @classmethod
    def plan(cls, gamma: int, size: int | None, retrieval: bool) -> "DraftTree | None":
        """The layout for ``draft_tree_size=size`` (None: the chain, or with retrieval the chain and the retrieved
        chain, ``2γ`` nodes); None where a round verifies one chain. The frontier grows with the nodes per depth
        the budget allows (``1 + ceil(extra / γ)``), within a drafter block of at most MAX_TREE_NODES."""
        if size is None:
            return cls(gamma, 2 * gamma, gamma, 0) if retrieval else None
        extra = size - gamma
        if extra == 0:
            return None
        width = 1 + math.ceil(extra / gamma)
        if gamma > 1:
            width = max(2, min(width, MAX_TREE_NODES // (gamma - 1)))
        return cls(gamma, size, min(gamma, extra) if retrieval else 0, width)

    @property
    def first(self) -> int:
        """The root's children in the pool (all extra nodes may be depth-1 nodes)."""
        return max(self.size - self.gamma, self.width - 1)

    @property
    def block(self) -> int:
        """The drafter's tree block: the frontiers of depths 1..γ-1."""
        return (self.gamma - 1) * self.width

    @property
    def pool(self) -> int:
        return self.first + (self.gamma - 1) * self.width**2

    def constants(self, device) -> dict[str, torch.Tensor]:
        """The layout's fixed parts as tensors on ``device``, made once (a captured step reads them as inputs rather
        than computing index arithmetic in the graph): the root's and the chain's parents and depths ``[γ+1]``, and
        for the extra nodes ``[E]`` the retrieved chain's index, parent and depth at each and each one's slot; each
        node's own ancestor bit; the drafter's block (each node's depth, own bit) and the pool's depths and parents'
        frontier slots."""
        gamma, extra, r, w = self.gamma, self.size - self.gamma, max(self.retrieved, 1), self.width
        j = [min(e, r - 1) for e in range(extra)]
        values = dict(chain_parents=[0] + list(range(gamma)), chain_depths=list(range(gamma + 1)),
                      slot=list(range(extra)), ret_index=j, ret_parents=[0 if x == 0 else gamma + x for x in j],
                      ret_depths=[x + 1 for x in j],
                      depth_of=list(range(1, gamma + 1)), own=[1 << i for i in range(self.size + 1)])
        if w:
            values.update(
                pool_depth=[1] * self.first + [2 + i // w**2 for i in range((gamma - 1) * w**2)],
                pool_from=[0] * self.first + [(i // w) % w for i in range((gamma - 1) * w**2)],
                block_depth=[1 + i // w for i in range(self.block)], block_own=[1 << i for i in range(self.block)],
                block_index=list(range(self.block)),
                frontier_zeros=[0] * w)
        return {name: torch.tensor(v, dtype=torch.long, device=device) for name, v in values.items()}

    def build(self, const: dict, chain: torch.Tensor, pool: tuple | None, frontier: torch.Tensor | None,
              retrieved: torch.Tensor | None, matched: torch.Tensor | None):
        """Each row's tree, on the device (capturable: shapes fixed by the layout).

        ``const``: :meth:`constants`; ``chain [B, γ]`` the drafter's drafts; ``pool = (tokens, scores)`` each
        ``[B, P]`` and ``frontier [B, γ-1, W]`` the drafter's other nodes (module docstring); ``retrieved [B, R]``
        each row's retrieved continuation and ``matched [B]`` whether it has one. Returns ``(tokens [B, N+1],
        parents [B, N+1], depths [B, N+1], bits [B, N+1], kinds [B, N+1])``: the node tokens (the root's is 0; the
        verify block takes ``seq[n-1]``), each node's parent (the root its own), depth, ancestor bits as the decode
        kernel reads them, and kind (``CHAIN`` for the root and the chain, ``RETRIEVED``, ``SIBLING``)."""
        gamma, size, r, w = self.gamma, self.size, self.retrieved, self.width
        rows = chain.shape[0]
        extra = size - gamma
        slot = const["slot"].expand(rows, -1)  # the extra nodes, 0..E-1
        if r:  # the retrieved chain in the first R extra nodes of a row with a match (of every row without a pool)
            in_chain = slot < (matched.long()[:, None] * r if w else r)
            ret_tokens = retrieved.gather(1, const["ret_index"].expand(rows, -1))
        if w:  # the most probable pool nodes by the drafter's probability of the path to each
            pool_tokens, pool_scores = pool
            best = (pool_scores - DEPTH_TIE * const["pool_depth"]).topk(extra, dim=1).indices  # [B, E], best first
            rank = torch.zeros_like(pool_tokens).scatter(1, best, slot)  # a kept pool node's rank among the kept
            shift = in_chain.long().sum(1, keepdim=True) if r else torch.zeros_like(slot[:, :1])
            pick = best.gather(1, (slot - shift).clamp_min(0))
            depths = const["pool_depth"][pick]
            via = const["pool_from"][pick]  # the parent's frontier slot at depth - 1
            if gamma > 1:
                parent_pool = frontier.flatten(1).gather(1, (depths - 2).clamp_min(0) * w + via)
            else:
                parent_pool = torch.full_like(pick, -1)
            on_chain = (depths == 1) | (parent_pool < 0)
            parents = torch.where(on_chain, depths - 1, gamma + 1 + shift + rank.gather(1, parent_pool.clamp_min(0)))
            tokens = pool_tokens.gather(1, pick)
            if r:
                ex_tokens = torch.where(in_chain, ret_tokens, tokens)
                ex_parents = torch.where(in_chain, const["ret_parents"], parents)
                ex_depths = torch.where(in_chain, const["ret_depths"], depths)
                ex_kinds = in_chain.long() * (RETRIEVED - SIBLING) + SIBLING
            else:
                ex_tokens, ex_parents, ex_depths = tokens, parents, depths
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
