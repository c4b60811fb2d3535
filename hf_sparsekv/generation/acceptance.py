"""Acceptance: how many of a round's drafts the verifier keeps. Greedy (:func:`accepted_length`: the leading drafts
equal to the verifier's argmaxes) and speculative sampling (:func:`accept_or_resample`: Leviathan et al. 2023, each
emitted token distributed exactly as the verifier's processed distribution; see :mod:`.sampling`). Both run on the
device without a host sync, inside the engine's captured verify step and on the host-side path alike."""

from __future__ import annotations

import torch

from .sampling import draw


def accepted_length(drafts: torch.Tensor, verified: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance on the device, per row: the number of leading ``drafts [B, γ]`` equal to the verifier's
    argmaxes ``verified [B, γ+1]`` (``verified[:, i]`` is the verifier's token after draft i-1), ``[B]`` int64."""
    return (verified[:, : drafts.shape[1]] == drafts).long().cumprod(1).sum(1)


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative-sampling round over ``T`` independent trials (``T = 1`` in generation).

    ``p [T, k+1, V]``: the verifier's probabilities after each prefix (``p[:, i]`` follows draft ``i - 1``);
    ``q [T, k, V]``: the drafter's probabilities the drafts ``drafts [T, k]`` were drawn from.
    Returns ``(accepted [T], token [T])``: the number of leading drafts accepted and the token drawn after them
    (from the residual at the first rejection, from ``p[:, k]`` when all are accepted)."""
    t, k = drafts.shape
    if k:
        p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_x = q.gather(-1, drafts[..., None])[..., 0]
        rejected = torch.rand(t, k, device=p.device, dtype=p.dtype) * q_x >= p_x  # u >= p/q, without dividing
        accepted = torch.where(rejected.any(-1), rejected.long().argmax(-1), k)  # first rejection, else all k
    else:
        accepted = torch.zeros(t, dtype=torch.long, device=p.device)
    rows = torch.arange(t, device=p.device)
    target = p[rows, accepted]
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # no draft after the last: residual = p itself
    residual = (target - q_pad[rows, accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), target)
    return accepted, draw(residual)
