"""Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): ``do_sample=True`` with a drafter, drawing every
token from exactly the distribution stock sampling ``generate()`` draws it from.

Both models' logits go through the same processors stock ``generate()`` builds from the generation config
(temperature, top-k, top-p, min-p, typical-p, epsilon/eta cutoffs, min-length EOS masking, repetition penalty, n-gram
and bad-word bans, the user's ``logits_processor``, ...; see :func:`stock_processors`), each applied to the scores
after the exact prefix they follow, and a softmax: ``q`` for the drafter, ``p`` for the verifier. A round drafts
``x_1..x_k`` from ``q``; draft ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
rejection the token is drawn from ``norm(max(0, p_i - q_i))`` and the round ends; if every draft is accepted a
bonus token is drawn from ``p_{k+1}`` (:func:`~.acceptance.accept_or_resample`). Each emitted token is then distributed as
``p`` given the tokens before it, whatever the drafter proposes.

Random numbers come from torch's global generator in a fixed order, so ``torch.manual_seed(s)`` before a call makes
it reproducible (on the same device and path; not the same tokens as stock sampling, which draws differently).
Every draw is :func:`draw` (an exponential race: no host sync, so the static loop runs it inside its CUDA graphs).
"""

from __future__ import annotations

import copy

import torch
from transformers.generation import (
    EpsilonLogitsWarper,
    LogitNormalization,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)



def stock_processors(model, config, prompt: torch.Tensor, logits_processor, min_length: int,
                     max_length: int) -> LogitsProcessorList:
    """The processors (and, with ``do_sample``, warpers) stock ``generate()`` applies to the next-token logits of
    ``model`` under ``config``, for the (unpadded) ``prompt [1, P]`` with absolute ``min_length``/``max_length`` of
    that unpadded sequence (the same ``GenerationMixin`` helpers stock ``generate()`` calls, identical in
    transformers 5.17-5.24). Greedy: no warpers, as stock."""
    config = copy.copy(config)  # (the helpers below only assign its attributes: the call's own config stays as it was)
    config.min_length, config.max_length = min_length, max_length  # forced EOS counts from the unpadded sequence
    model._prepare_special_tokens(config, True, device=prompt.device, batch_size=1)
    return model._get_logits_processor(
        generation_config=config, input_ids_seq_length=prompt.shape[1], encoder_input_ids=prompt,
        logits_processor=LogitsProcessorList(logits_processor or []), device=prompt.device,
    )


# Warpers that read only the scores (row by row, no host sync): the static loop applies them on the device.
DEVICE_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
                  EpsilonLogitsWarper)
# EOS masking below a minimum length: the static loop does it itself (its EOS floor).
EOS_FLOOR_PROCESSORS = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)


def device_warpers(processors: LogitsProcessorList, sampling: bool = True) -> tuple[list, str | None]:
    """``(warpers, None)`` when the static loop can apply ``processors`` itself: with ``sampling``, the
    :data:`DEVICE_WARPERS` among them, in order; greedy (``sampling=False``), none at all. Min-length EOS masking is
    the loop's EOS floor, the repetition penalty its seen-token mask (:func:`repetition_penalty`), and
    ``LogitNormalization`` (a log-softmax: a shift per row) changes neither the argmax nor any warper's result nor
    the softmax, so these are left to the loop. Else ``([], name)`` of the first processor it cannot apply
    (sequence-dependent ones such as ``no_repeat_ngram_size`` need the host at every token)."""
    warpers = []
    for proc in processors:
        if isinstance(proc, EOS_FLOOR_PROCESSORS) or type(proc) is LogitNormalization:
            continue
        if type(proc) is RepetitionPenaltyLogitsProcessor and not warpers and _penalty_on_device(proc):
            continue  # first of the scores' changes, as stock orders it; the loop applies it before the warpers
        if not sampling or type(proc) not in DEVICE_WARPERS:
            return [], type(proc).__name__
        warpers.append(proc)
    return warpers, None


def _penalty_on_device(proc) -> bool:
    ignore = getattr(proc, "prompt_ignore_length", None)
    return ignore is None or isinstance(ignore, int)


def repetition_penalty(processors: LogitsProcessorList) -> tuple[float, int] | None:
    """``(penalty, ignored)`` of the repetition penalty among ``processors`` (``ignored``: leading prompt tokens it
    does not count), or None. Stock semantics (``RepetitionPenaltyLogitsProcessor``): the score of every token that
    occurs in the sequence so far is divided by ``penalty`` where positive, multiplied where negative."""
    for proc in processors:
        if type(proc) is RepetitionPenaltyLogitsProcessor:
            return float(proc.penalty), int(getattr(proc, "prompt_ignore_length", None) or 0)
    return None


def penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits [..., V]`` with the repetition penalty applied where ``seen [..., V]`` (bool) is set, in float32 as
    stock ``generate()`` applies it."""
    logits = logits.float()
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs [..., V]`` (rows need not be normalized, at least one entry positive), drawn with
    probability proportional to its entry: the argmax of ``probs / E`` with ``E`` i.i.d. Exp(1) (the smallest of
    independent exponential clocks of rates ``probs``). The clocks come from float64 uniforms: with float32 ones the
    smallest clock is 2^-24, so entries below ~6e-8 of the largest could never win and a vocabulary's tail lost its
    mass. A zero entry is never drawn, even where a clock is infinite. Returns ``[...]`` int64; no host sync."""
    clocks = -torch.log(torch.rand_like(probs, dtype=torch.float64))  # u in [0, 1): clocks in (0, inf]
    ratios = probs.double() / clocks
    return torch.where(probs > 0, ratios, -1.0).argmax(-1)
