"""``generate(..., kv_budget=..., draft_cache=...)``: argument checks, cache set-up, HF-shaped outputs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import GenerationConfig
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import (
    LogitsProcessorList,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from ..cache_keyword import output_field, pop_user_cache
from ..caches.base import is_integer
from .batch_rows import assemble, check_batch, generate_rows, pad_value, place_rows, token_ids
from .common import _strip_left_padding, _text_config, _tp_size
from .config_memo import prepare_generation_config
from .draft_modes import check_budget, check_prefix, draft_mode, routed_draft_cache
from .draft_tree import MAX_TREE_NODES
from .draft_weights import check_choice, default_choice
from .engine import captures, engine_for
from .rounds import static_decode_rows, static_speculative_decode
from .host_rules import GreedyRules
from .model_locks import holding
from .sampling import DEVICE_WARPERS, device_warpers, repetition_penalty, stock_processors
from .stats import SpecStats

DEFAULT_GAMMA = 5  # drafts per round of a constant γ when none is given (num_assistant_tokens_schedule="constant")
ADAPTIVE_GAMMA = 8  # the most drafts a round may verify when the controller chooses (:mod:`.controller`)
# stock's schedules: "constant" keeps γ; its adaptive ones are served by the controller
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
ADAPTIVE_MODES = ("chunk", "window", "full", "int4", "lookup")  # (retrieval beside a drafter keeps γ)

# Generation options this path does not serve (the logits processors stock builds from the rest of the config,
# repetition penalty, n-gram and bad-word bans included, are applied: sampling.stock_processors).
_UNSUPPORTED_OPTIONS = {
    "guidance_scale": lambda v: v is not None and v != 1.0,  # runs the model a second time, unconditionally
    "watermarking_config": lambda v: v is not None,  # SynthID keeps state across calls; verification repeats them
    "assistant_early_exit": lambda v: v is not None,
    "output_attentions": lambda v: bool(v),
    "output_hidden_states": lambda v: bool(v),
    "penalty_alpha": lambda v: v is not None and v > 0,  # contrastive search
    "dola_layers": lambda v: v is not None,
    "token_healing": lambda v: bool(v),
    "prefill_chunk_size": lambda v: v is not None,  # the prompt is prefilled in one forward (peak memory as such)
}


class EngineFailure(NotImplementedError):
    """The engine failed (building, capturing, prefilling or decoding) on a call that stock's own path serves too:
    raised in place of the error for the calls the import routes here, so that stock's path serves them."""


@contextlib.contextmanager
def _handing_back(active: bool):
    """Within: an error of the engine becomes :class:`EngineFailure` where ``active`` (a routed call that has streamed
    nothing yet); refusals (``NotImplementedError``) pass as they are."""
    try:
        yield
    except NotImplementedError:
        raise
    except Exception as err:
        if not active:
            raise
        raise EngineFailure(f"{type(err).__name__}: {err}") from err


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``spec_stats``: a :class:`~hf_sparsekv.generation.stats.SpecStats`
    (attributes such as ``out.spec_stats.acceptance_rate``, ``out.spec_stats["acceptance_rate"]``, ``to_dict()``)."""

    spec_stats: SpecStats | None = None


logger = logging.get_logger(__name__)
_stock_logger = logging.get_logger("transformers.generation.utils")  # stock's warnings come from stock's logger
_criteria_logger = logging.get_logger("transformers.generation.stopping_criteria")


def _length_reminder(model, config, output):
    """Stock's one-time reminder (its ``MaxLengthCriteria``'s) when a sequence grew past the model's
    ``max_position_embeddings`` before reaching ``max_length``; returns ``output``."""
    bound = getattr(model.config, "max_position_embeddings", None)
    width = (output if isinstance(output, torch.Tensor) else output.sequences).shape[1]
    if bound is not None and min(width, config.max_length - 1) > bound:
        _criteria_logger.warning_once(
            "This is a friendly reminder - the current text generation call has exceeded the model's predefined "
            f"maximum length ({bound}). Depending on the model, you may observe exceptions, performance "
            "degradation, or nothing at all."
        )
    return output


def infer_attention_mask(config, input_ids: torch.Tensor, refusal: type[Exception] = ValueError) -> torch.Tensor | None:
    """The ``attention_mask [B, L]`` stock ``generate()`` infers when none is passed, or None for all ones: zeros
    where ``input_ids`` holds ``pad_token_id``, if it occurs and is not an EOS id. Without a pad id, or with the pad
    id equal to EOS, nothing is inferred, and a batch gets the warning stock gives (the padding counts as tokens, in
    stock's output and in ours alike). Padding it infers that is not left padding (a pad id inside a prompt) raises
    ``refusal``: the speculative path decodes left-padded rows only (NotImplementedError where stock's path then
    serves the call: stock's prompt lookup, routed here by the import)."""
    batched = input_ids.shape[0] > 1
    eos = token_ids(config.eos_token_id)
    if config.pad_token_id is None:
        if batched and eos:
            _stock_logger.warning(
                "The attention mask and the pad token id were not set, with a batched input. As a consequence, you may "
                "observe unexpected behavior. Please pass your input's `attention_mask` to obtain reliable results."
            )
        return None
    pad = int(config.pad_token_id)
    if pad in eos:
        if batched:
            _stock_logger.warning_once(
                "The attention mask is not set with a batched input, and cannot be inferred from input because pad "
                "token is same as eos token. As a consequence, you may observe unexpected behavior. Please pass your "
                "input's `attention_mask` to obtain reliable results."
            )
        return None
    padding = input_ids == pad
    if not bool(padding.any()):
        return None
    mask = (~padding).long()
    first = mask.argmax(dim=1)  # the first non-pad column of each row (0 for a row of pads only)
    columns = torch.arange(mask.shape[1], device=mask.device)
    if not bool(mask.any(dim=1).all()) or not torch.equal(mask, (columns[None, :] >= first[:, None]).long()):
        raise refusal(
            f"input_ids contains pad_token_id={pad} where it is not left padding, and no attention_mask was passed: "
            "stock generate() would mask those tokens, which the speculative path cannot (it decodes left-padded "
            "rows); pass attention_mask (all ones if the pad id is meant as a token) or left-pad the prompts"
        )
    return mask


def _row_rules(model, config, input_ids: torch.Tensor, attention_mask, stopping_criteria, logits_processor,
               tokenizer) -> tuple[torch.Tensor, GreedyRules]:
    """The unpadded prompt ``[1, P]`` (on the model's device) of one row ``input_ids [1, L]`` and the rules stock
    ``generate()`` applies to it alone (``max_length``/``min_length`` count its own left padding, as stock does):
    stopping rules and the logits processors (with ``do_sample``, warpers included: the sampling loop applies them,
    :meth:`GreedyRules.process` serves greedy only)."""
    prompt = _strip_left_padding(input_ids, attention_mask).to(model.device)
    eos_ids = token_ids(config.eos_token_id)
    pad = input_ids.shape[1] - prompt.shape[1]  # rules see the unpadded sequence
    min_length, max_length = max((config.min_length or 0) - pad, 0), config.max_length - pad
    processors = stock_processors(model, config, prompt, logits_processor, min_length, max_length)
    criteria = StoppingCriteriaList(stopping_criteria or [])
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(config.max_time))
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=tok to generate() (as stock generate())")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings))
    return prompt, GreedyRules(
        prompt_length=prompt.shape[1],
        max_length=max_length,  # absolute (prompt included), as stock generate() sets it
        eos_token_ids=eos_ids,
        min_length=min_length,
        min_new_tokens=config.min_new_tokens or 0,
        logits_processor=processors,
        stopping_criteria=criteria,
        keep_scores=bool(config.return_dict_in_generate and (config.output_scores or config.output_logits)),
    )


def _engine_rules(rules: GreedyRules, logits_processor, sampling: bool, wants_outputs: bool):
    """``(warpers, host, penalty)`` for the engine: host-side rules (:mod:`.host_rules`) where a processor the device
    cannot apply, a user's ``logits_processor`` or every token's scores are needed; otherwise the device warpers
    (sampling; None when greedy) and the repetition penalty are baked into the steps. With host-side rules and
    sampling, the drafts' q takes whichever warpers the device applies (any q is exact)."""
    warpers, blocker = device_warpers(rules.logits_processor, sampling=sampling)
    host = blocker is not None or bool(logits_processor) or wants_outputs
    if host and sampling:
        warpers = [p for p in rules.logits_processor if type(p) in DEVICE_WARPERS]
    return (warpers if sampling else None), host, (None if host else repetition_penalty(rules.logits_processor))


def _check_models(model, drafter, tokenizer=None) -> int | None:
    """Refuse a drafter that cannot serve the model; return the shared vocabulary size when the two embeddings differ
    only by padding (else None). Padding is accepted only when ``tokenizer`` (the shared one, passed to generate() as
    ``tokenizer=``) has no id outside the shared range ``[0, min(V_model, V_drafter))``."""
    if drafter is None:
        raise ValueError("kv_budget/draft_cache need assistant_model (the drafter; pass the model itself for int4)")
    if drafter is model:  # self-speculation: whatever serves as the model serves as its drafter
        return None
    if not isinstance(drafter, torch.nn.Module) or getattr(drafter, "config", None) is None:
        raise TypeError(f"assistant_model must be a causal LM (a transformers model sharing the verifier's "
                        f"vocabulary, or the model itself for int4), got {type(drafter).__name__}")
    if drafter.device != model.device:
        raise ValueError(
            f"assistant_model is on {drafter.device} but the model is on {model.device}: move it with "
            f"assistant_model.to('{model.device}')"
        )
    v_vocab, d_vocab = _text_config(model).vocab_size, _text_config(drafter).vocab_size
    if v_vocab == d_vocab:
        return None
    shared = min(v_vocab, d_vocab)
    mismatch = (
        f"assistant_model has vocab_size {d_vocab} but the model has {v_vocab}: the drafter must share the "
        "verifier's tokenizer and vocabulary"
    )
    if tokenizer is None:
        raise ValueError(
            f"{mismatch}. If the two differ only by embedding padding, pass the shared tokenizer to generate() "
            f"(tokenizer=tok): drafting is then restricted to the shared ids [0, {shared}), accepted if the "
            "tokenizer has no id beyond them"
        )
    if len(tokenizer) > shared:
        raise ValueError(
            f"{mismatch}; the tokenizer has {len(tokenizer)} ids, more than the {shared} both models have, so this "
            "is not embedding padding"
        )
    return shared


def _draft_weights(choice: str | None, mode: str, drafter) -> str:
    """The draft steps' weights: ``choice`` (checked), else 4-bit where QuantSpec drafts (``draft_cache="int4"``),
    tinygemm runs and the model's layers are large enough for the copy to pay (:func:`~.draft_weights.default_choice`;
    logged; not for a tensor-parallel model), else the model's own."""
    check_choice(choice, mode, drafter)
    if choice is not None:
        return choice
    if mode not in ("int4", "int4-drafter"):
        return "full"
    choice = default_choice(drafter)
    logger.info_once(f"hf_sparsekv: draft_cache='int4' drafts with {choice} weights (draft_weights='int4'|'full' "
                     "chooses)")
    return choice


def _lookup_settings(config, drafter_gamma: int | None) -> tuple[int, int]:
    """``(γ, longest n-gram)`` of retrieval drafting (prompt lookup, :mod:`.retrieval`), stock's settings:
    ``prompt_lookup_num_tokens`` drafts per round, suffixes of up to ``max_matching_ngram_size`` (default 2) tokens
    matched. Beside a drafter one chain length serves both: ``num_assistant_tokens`` (``drafter_gamma``), if set, must
    agree."""
    gamma, ngram = config.prompt_lookup_num_tokens, config.max_matching_ngram_size or 2
    for name, value in (("prompt_lookup_num_tokens", gamma), ("max_matching_ngram_size", ngram)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if drafter_gamma is not None and drafter_gamma != gamma:
        raise ValueError(
            f"num_assistant_tokens={drafter_gamma!r} and prompt_lookup_num_tokens={gamma!r}: a round "
            "drafts one chain, from the drafter or from retrieval; pass one of them, or the same value")
    return int(gamma), int(ngram)


def _tree_size(size, mode: str, gamma: int) -> int | None:
    """``draft_tree_size`` checked: draft nodes per round (at least γ, the chain; at most MAX_TREE_NODES), with the
    drafter caches whose rounds take a catch-up of several tokens; None keeps the chain."""
    if size is None:
        return None
    if not is_integer(size) or not gamma <= size <= MAX_TREE_NODES:
        raise ValueError(f"draft_tree_size must be an integer from num_assistant_tokens (γ = {gamma}: the chain) to "
                         f"{MAX_TREE_NODES}, got {size!r}")
    if mode not in ("chunk", "window", "full"):
        raise NotImplementedError(
            f"draft_tree_size with mode {mode!r}: trees are drafted by a separate or self-drafting model on "
            "draft_cache 'chunk', 'window' or 'full'")
    return int(size)


def _retrieval_beside(mode: str) -> None:
    """Retrieval beside a drafter runs with the drafter caches that take a catch-up of several tokens."""
    if mode not in ("chunk", "window", "full"):
        raise NotImplementedError(
            f"prompt_lookup_num_tokens together with draft_cache giving mode {mode!r}: retrieval beside a drafter runs "
            "with draft_cache 'chunk', 'window' or 'full' (or alone, without assistant_model)")


def _refuse_source(name: str, value, kwargs: dict, generation_config, model) -> str:
    """Where an unsupported generation option came from, for the error message."""
    if name in kwargs:
        return f"{name}={value!r} was passed to generate()"
    if generation_config is not None and getattr(generation_config, name, None) == value:
        return f"{name}={value!r} comes from the generation_config passed to generate()"
    return f"{name}={value!r} comes from the model's generation config (model.generation_config.{name})"


_DEFAULTS = GenerationConfig()  # the library defaults, read only
_UNSET = object()


def _user_setting(name: str, kwargs: dict, configs: tuple) -> tuple[bool, object]:
    """``(set, value)`` of the generation option ``name`` as its owner set it (not a library default): the keyword,
    else the first of ``configs`` whose value differs from the library default (what ``to_diff_dict()`` would keep,
    without its deep copies: this runs on every call)."""
    if name in kwargs:
        return True, kwargs[name]
    for config in configs:
        value = getattr(config, name, _UNSET)
        if value is not _UNSET and value != getattr(_DEFAULTS, name, _UNSET):
            return True, value
    return False, None


def _draft_length(model, assistant_model, generation_config, kwargs: dict, sampling: bool) -> tuple[int | None, bool]:
    """``(γ, adaptive)`` of the call from stock's options: ``num_assistant_tokens`` (the call's or its configs', else
    the assistant's own generation config where its owner set it) and ``num_assistant_tokens_schedule``.

    - a schedule of ``"heuristic"`` or ``"heuristic_transient"`` (stock's adaptive ones), or neither option set in a
      greedy call: the controller chooses each round's drafts (:mod:`.controller`), at most γ (default
      :data:`ADAPTIVE_GAMMA`). A sampled call keeps a constant γ unless the schedule asks for the controller: its
      choices follow measured times, so a seeded run would draw another realisation each time;
    - ``num_assistant_tokens`` set, or the schedule ``"constant"``: every round drafts γ (default
      :data:`DEFAULT_GAMMA`).

    γ is None where none was set (the caller's mode picks the default)."""
    own = (generation_config, model.generation_config)
    assistant = getattr(assistant_model, "generation_config", None)
    if assistant_model is model or assistant_model is None:
        assistant = None
    configs = tuple(config for config in own + (assistant,) if config is not None)
    given, gamma = _user_setting("num_assistant_tokens", kwargs, configs)
    scheduled, schedule = _user_setting("num_assistant_tokens_schedule", kwargs, configs)
    if scheduled and schedule not in SCHEDULES:
        raise ValueError(f"num_assistant_tokens_schedule must be one of {SCHEDULES}, got {schedule!r}")
    adaptive = schedule in SCHEDULES[1:] or not (given or scheduled or sampling)
    return (gamma if given else None), adaptive


def _prepare_config(model, generation_config, kwargs: dict, input_ids: torch.Tensor):
    """The call's ``GenerationConfig`` exactly as stock ``generate()`` builds it: the user's config or kwargs over the
    model's ``generation_config`` over the library defaults, then ``max_length``/``min_length`` made absolute (the
    default length with the same warning stock gives). Returns ``(config, kwargs generate() would not use)``.

    Uses the same ``GenerationMixin`` helpers stock ``generate()`` calls (identical in transformers 5.17-5.24); the
    merged config is remembered per model (:mod:`.config_memo`)."""
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, unused = prepare_generation_config(model, generation_config, kwargs)
    for name in ("output_attentions", "output_hidden_states"):  # refused below, naming them
        if name not in kwargs:
            unused.pop(name, None)
    if unused:
        return config, unused
    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length, model_input_name="input_ids",
        input_ids_length=input_ids.shape[1], inputs_tensor=input_ids,
    )
    model._validate_generated_length(config, input_ids.shape[1], has_default_max_length)
    return config, unused


def _refuse_config(config, kwargs: dict, generation_config, model) -> None:
    """Refuse the generation options the engine does not serve, naming where each came from."""
    if not config.use_cache:  # stock's assisted generation and prompt lookup raise this RuntimeError too
        raise RuntimeError(
            f"Assisted decoding requires a cache: use_cache=False is not supported on hf_sparsekv's engine or "
            f"prompt lookup ({_refuse_source('use_cache', False, kwargs, generation_config, model)}); drop it"
        )
    if config.cache_implementation is not None:
        source = _refuse_source("cache_implementation", config.cache_implementation, kwargs, generation_config, model)
        raise NotImplementedError(
            f"cache_implementation is not supported on hf_sparsekv's engine: {source}; the verifier runs on a "
            "dynamic cache and the drafter on draft_cache"
        )
    if (config.num_beams or 1) > 1:
        raise NotImplementedError("num_beams > 1 (beam search) is not supported on hf_sparsekv's engine")
    if (config.num_return_sequences or 1) > 1 and not config.do_sample:
        raise NotImplementedError("num_return_sequences > 1 needs do_sample=True (greedy rows would be identical)")
    for name, is_active in _UNSUPPORTED_OPTIONS.items():
        value = getattr(config, name, None)
        if is_active(value):
            raise NotImplementedError(f"{name} is not supported on hf_sparsekv's engine: "
                                      f"{_refuse_source(name, value, kwargs, generation_config, model)}")


class DraftPlan(NamedTuple):
    """How the engine drafts for a call (:func:`_draft_plan`)."""

    mode: str  # the engine's mode: "ar" (plain decoding), "lookup", or :func:`~.draft_modes.draft_mode`'s
    budget: int | None  # the chunk/window budget (int4: the group size), or prompt lookup's n-gram size
    layout: tuple  # the drafter cache's settings (empty: the defaults)
    gamma: int  # drafts a round (at most, when adaptive)
    draft_weights: str  # "full" or "int4": the weights the drafter's steps read
    retrieval: int  # retrieval beside the drafter: the longest n-gram matched (0: none)
    tree_size: int | None  # draft nodes a round (None: one chain)
    adaptive: bool  # the controller chooses each round's drafts


def _decode_rows_together(model, assistant_model, config, input_ids, attention_mask, plan: DraftPlan,
                          logits_processor, stopping_criteria, tokenizer, use_graphs: bool):
    """A batch's rows decoded together on one engine of ``len(input_ids)`` rows under ``plan``
    (:func:`_draft_plan`), its steps captured where ``use_graphs`` (:func:`~.engine.captures`). Returns the output as
    stock assembles a batch."""
    mode, budget, layout, gamma, draft_weights, retrieval, tree_size, adaptive = plan
    rows = [
        _row_rules(model, config, input_ids[b : b + 1], None if attention_mask is None else attention_mask[b : b + 1],
                   stopping_criteria, logits_processor, tokenizer)
        for b in range(input_ids.shape[0])
    ]
    prompts, rules = [r[0] for r in rows], [r[1] for r in rows]
    # the warpers and the penalty's settings are the same for every row (only the EOS floor differs, per row)
    warpers, host, penalty = _engine_rules(rules[0], logits_processor, sampling=config.do_sample, wants_outputs=False)
    engine = engine_for(
        model, assistant_model, mode, budget, gamma, max(r.max_length for r in rules),
        max(r.max_length - r.prompt_length for r in rules), use_graphs=use_graphs, warpers=warpers,
        batch=len(prompts), penalty=penalty, layout=layout, host=host, draft_weights=draft_weights,
        retrieval=retrieval, tree_size=tree_size, adaptive=adaptive)
    results = static_decode_rows(engine, prompts, rules)
    sequences = [torch.cat([input_ids[b : b + 1].to(prompts[b].device), res.sequence[:, prompts[b].shape[1] :]], 1)
                 for b, res in enumerate(results)]
    cache = None
    if config.return_dict_in_generate:
        cache = _place_engine_rows(engine, _stock_cache(model), [input_ids.shape[1] - p.shape[1] for p in prompts],
                                   [res.sequence.shape[1] - 1 for res in results])
    return assemble(sequences, [res.stats for res in results], pad_value(config), config.return_dict_in_generate,
                    SpeculativeGenerateOutput, shared_seconds=True, cache=cache)


# Models whose forward only adds token_type_ids to the input embeddings (through the token embedding), as stock
# generate() feeds them: the prompt's, then the last one for every new token.
TOKEN_TYPE_MODELS = ("gpt2", "gptj", "codegen", "gpt_neo")


def _row_token_types(model, token_types, input_ids: torch.Tensor, prompt: torch.Tensor, mode: str,
                     drafter) -> torch.Tensor | None:
    """The one row's ``token_type_ids`` ``[1, P]`` for the unpadded ``prompt`` (its left padding cut as the prompt's),
    or None; refuses (``NotImplementedError``) what the engine does not serve with them."""
    if token_types is None:
        return None
    model_type = getattr(_text_config(model), "model_type", None)
    if model_type not in TOKEN_TYPE_MODELS:
        raise NotImplementedError(f"token_type_ids on {type(model).__name__}: the engine feeds them only to models "
                                  f"that add them to the input embeddings alone ({', '.join(TOKEN_TYPE_MODELS)})")
    if drafter is model or mode == "int4":
        raise NotImplementedError("token_type_ids with self-drafting or int4 self-speculation")
    if tuple(token_types.shape) != tuple(input_ids.shape):
        raise ValueError(f"token_type_ids has shape {tuple(token_types.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}")
    return token_types[:, input_ids.shape[1] - prompt.shape[1] :].long().to(prompt.device)


def _stock_cache(model) -> DynamicCache:
    """An empty cache as stock ``generate()`` makes one: ``DynamicCache`` of the model's text config (a sliding
    layer keeps its last tokens)."""
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def _place_engine_rows(engine, target: DynamicCache, pads: list[int], lengths: list[int]) -> DynamicCache:
    """Fill the empty ``target`` with each row's first ``lengths[b]`` tokens (the sequence but its last token) from the
    engine's verifier cache, after its ``pads[b]`` columns of left padding, as stock's cache of the batch ends
    (:func:`~.batch_rows.place_rows`)."""
    cache = engine.verifier_cache
    return place_rows(target, lambda b, i: cache.sequence(i, b, 0, lengths[b]),
                      [pad + n for pad, n in zip(pads, lengths)], max(pad + n for pad, n in zip(pads, lengths)),
                      len(cache.layers))


def _asked_for(kv_budget, draft_cache, draft_tree_size, static_engine: bool, lookup, assistant_model) -> str:
    """The arguments that brought this call to the engine, as its caller passed them (for messages)."""
    cache = draft_cache if draft_cache is None or isinstance(draft_cache, str) else type(draft_cache).__name__
    named = [f"{name}={value!r}" for name, value in (("kv_budget", kv_budget), ("draft_cache", cache),
                                                      ("draft_tree_size", draft_tree_size)) if value is not None]
    named += ["static_engine=True"] * bool(static_engine) + ["prompt_lookup_num_tokens"] * (lookup is not None)
    if not named and assistant_model is not None:
        named.append("assistant_model")
    return ", ".join(named) or "hf_sparsekv's engine"


@holding("model", "assistant_model")
def speculative_generate(
    model,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    prefix_allowed_tokens_fn=None,
    synced_gpus=None,
    assistant_model=None,
    streamer=None,
    negative_prompt_ids=None,
    negative_prompt_attention_mask=None,
    custom_generate=None,
    *,
    kv_budget: int | None = None,
    draft_cache: str | Cache | None = None,
    draft_weights: str | None = None,
    draft_tree_size: int | None = None,
    static_engine: bool = False,
    stock_fallback: bool = False,
    **kwargs,
):
    """The speculative path of ``generate()``; same arguments, greedy or sampled (``do_sample``). A batch of more
    than one (left-padded) prompt is decoded by the engine with one row per prompt (sampled int4 self-speculation:
    row by row, :mod:`.batch_rows`); either way each row is what its prompt alone gives (sampled: drawn from the
    distribution its prompt alone has). The call holds the locks of ``model`` and ``assistant_model``
    (:mod:`.model_locks`).

    ``static_engine=True`` without ``assistant_model`` (and without prompt lookup): plain decoding on the engine, one
    verifier step per token (captured on CUDA). ``stock_fallback``: the call is one of stock's own (assisted generation
    or prompt lookup routed by the import, or ``static_engine``), so what the engine cannot serve raises
    ``NotImplementedError`` and stock's path serves it (:mod:`.registration`)."""
    check_budget(kv_budget, draft_cache)
    kv_budget = None if kv_budget is None else int(kv_budget)  # a NumPy integer from a sweep, say
    for name, value in (
        ("prefix_allowed_tokens_fn", prefix_allowed_tokens_fn),
        ("negative_prompt_ids", negative_prompt_ids),
        ("custom_generate", custom_generate),
    ):
        if value is not None:
            raise NotImplementedError(f"{name} is not supported on hf_sparsekv's engine")
    if synced_gpus:
        raise NotImplementedError("synced_gpus is not supported on hf_sparsekv's engine")
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    if input_ids is None:
        asked = _asked_for(kv_budget, draft_cache, draft_tree_size, static_engine,
                           kwargs.get("prompt_lookup_num_tokens"), assistant_model)
        raise ValueError(f"input_ids (or inputs) is required with {asked}")
    attention_mask = kwargs.pop("attention_mask", None)
    token_types = kwargs.pop("token_type_ids", None)
    past_key_values = pop_user_cache(kwargs)  # past_key_values= or, from transformers 5.24 on, cache=
    tokenizer = kwargs.pop("tokenizer", None)  # as stock: for stop_strings (and the vocabulary check)
    input_ids = _checked_ids(input_ids, attention_mask)
    batch = input_ids.shape[0]
    row_kwargs = dict(kwargs)  # what each row gets when a batch is decoded row by row
    config, unused = _prepare_config(model, generation_config, kwargs, input_ids)
    if unused:
        asked = _asked_for(kv_budget, draft_cache, draft_tree_size, static_engine, config.prompt_lookup_num_tokens,
                           assistant_model)
        raise NotImplementedError(f"arguments for the model's forward are not supported on hf_sparsekv's engine "
                                  f"({asked}): {sorted(unused)}")
    lookup = config.prompt_lookup_num_tokens is not None
    alone = lookup and assistant_model is None and kv_budget is None and draft_cache is None  # stock's prompt lookup
    plain = static_engine and assistant_model is None and not lookup  # plain decoding on the engine
    if plain and (kv_budget is not None or draft_cache is not None or draft_tree_size is not None):
        raise ValueError("kv_budget/draft_cache/draft_tree_size need assistant_model (static_engine=True alone is "
                         "plain decoding)")
    if attention_mask is None:  # inferred from pad_token_id as stock infers it
        attention_mask = infer_attention_mask(config, input_ids,
                                              NotImplementedError if alone or stock_fallback else ValueError)

    _refuse_config(config, kwargs, generation_config, model)
    copies = config.num_return_sequences or 1
    if copies > 1:  # sampling: each prompt's row repeated, as stock expands them (each row its own draws)
        input_ids = input_ids.repeat_interleave(copies, 0)
        attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(copies, 0)
        batch = input_ids.shape[0]
        row_kwargs["num_return_sequences"] = 1
    if stock_fallback and draft_cache == "full" and assistant_model is not model:  # stock's assisted call, routed
        draft_cache = routed_draft_cache(assistant_model, config.max_length)
    plan = _draft_plan(model, assistant_model, config, generation_config, kwargs, tokenizer, kv_budget, draft_cache,
                       draft_tree_size, draft_weights, plain, alone)
    if batch > 1 and token_types is not None:
        raise NotImplementedError("token_type_ids with a batch of several prompts (one prompt at a time is served)")
    use_graphs = captures(model)  # (the engine's settings checked here: a wrong value is the caller's error, not a
    # fallback)
    if batch == 1:
        return _decode_one_row(model, assistant_model, config, input_ids, attention_mask, plan, token_types,
                               past_key_values, streamer, logits_processor, stopping_criteria, tokenizer,
                               stock_fallback, use_graphs)
    one_by_one = config.do_sample and plan.mode == "int4"  # a row's quantization cap would cut a sampled block
    check_batch(input_ids, attention_mask, config, streamer=streamer,
                prefix_cache=past_key_values is not None, max_time=config.max_time if one_by_one else None)
    if one_by_one:

        def one_row(ids, mask, cache):
            return speculative_generate(
                model, ids, generation_config, logits_processor, stopping_criteria, assistant_model=assistant_model,
                kv_budget=kv_budget, draft_cache=cache, draft_weights=plan.draft_weights,
                draft_tree_size=draft_tree_size, attention_mask=mask,
                tokenizer=tokenizer,
                **{**row_kwargs, "return_dict_in_generate": config.return_dict_in_generate},
            )

        return generate_rows(one_row, input_ids, attention_mask, draft_cache, pad_value(config),
                             _stock_cache(model) if config.return_dict_in_generate else None)
    with _handing_back(stock_fallback and plain):  # (stock's speculative calls take one row: its error is ours)
        output = _decode_rows_together(model, assistant_model, config, input_ids, attention_mask, plan,
                                       logits_processor, stopping_criteria, tokenizer, use_graphs)
    return _length_reminder(model, config, output)


def _checked_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``input_ids [B, P]`` as the engine takes them (int64), after checking their shape and the mask's."""
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise ValueError(f"input_ids must have shape [batch, length], got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}"
        )
    if not input_ids.dtype.is_floating_point:
        input_ids = input_ids.long()  # the output is int64 whatever integer type came in, as stock's is
    return input_ids


def _draft_plan(model, assistant_model, config, generation_config, kwargs: dict, tokenizer, kv_budget: int | None,
                draft_cache, draft_tree_size: int | None, draft_weights: str | None, plain: bool,
                alone: bool) -> DraftPlan:
    """How the engine drafts for this call (``plain``: one verifier step per token; ``alone``: retrieval without a
    drafter)."""
    gamma, adaptive = _draft_length(model, assistant_model, generation_config, kwargs, bool(config.do_sample))
    retrieval = 0  # retrieval beside the drafter: the longest n-gram matched
    if plain:  # one verifier step per token
        gamma, adaptive, mode, budget, layout = 1, False, "ar", None, ()
    elif alone:  # retrieval drafting without a drafter
        gamma, ngram = _lookup_settings(config, None)
        mode, budget, layout = "lookup", ngram, ()
    else:
        lookup = config.prompt_lookup_num_tokens is not None
        if lookup:
            gamma, retrieval = _lookup_settings(config, gamma)
        else:
            gamma = gamma if gamma is not None else ADAPTIVE_GAMMA if adaptive else DEFAULT_GAMMA
        if not is_integer(gamma) or gamma < 1:
            raise ValueError(f"num_assistant_tokens must be a positive integer, got {gamma!r}")
        gamma = int(gamma)
        _check_models(model, assistant_model, tokenizer)
        mode, budget, layout = draft_mode(model, assistant_model, draft_cache, kv_budget, gamma)
        if lookup:
            _retrieval_beside(mode)
    tree_size = _tree_size(draft_tree_size, mode, gamma)
    # (tensor parallelism: every rank must run the same steps, and each would choose from its own clock)
    # (a tree: its one size or a plain step, with a separate drafter, which catches up after plain steps)
    adaptive = (adaptive and mode in ADAPTIVE_MODES and (tree_size is None or assistant_model is not model)
                and not retrieval and _tp_size(model) == 1)
    draft_weights = _draft_weights(draft_weights, mode, assistant_model)
    return DraftPlan(mode, budget, layout, gamma, draft_weights, retrieval, tree_size, adaptive)


def _decode_one_row(model, assistant_model, config, input_ids: torch.Tensor, attention_mask, plan: DraftPlan,
                    token_types, past_key_values, streamer, logits_processor, stopping_criteria, tokenizer,
                    stock_fallback: bool, use_graphs: bool):
    """One prompt ``input_ids [1, P]`` (left padding dropped) decoded on its engine under ``plan``
    (:func:`_draft_plan`), its steps captured where ``use_graphs`` (:func:`~.engine.captures`): the sequences, or
    stock's output class with the cache, scores, logits and stats."""
    mode, budget, layout, gamma, draft_weights, retrieval, tree_size, adaptive = plan
    prompt, rules = _row_rules(model, config, input_ids, attention_mask, stopping_criteria, logits_processor,
                               tokenizer)
    token_types = _row_token_types(model, token_types, input_ids, prompt, mode, assistant_model)
    if past_key_values is not None:
        check_prefix(past_key_values, mode, assistant_model is model, prompt.shape[1],
                     prompt.shape[1] != input_ids.shape[1])
    warpers, host, penalty = _engine_rules(rules, logits_processor, sampling=config.do_sample,
                                           wants_outputs=bool(config.output_scores or config.output_logits))
    # (not with a streamer, which may have had tokens, nor with the caller's cache, which may have been extended)
    with _handing_back(stock_fallback and streamer is None and past_key_values is None):
        engine = engine_for(model, assistant_model, mode, budget, gamma, rules.max_length,
                            rules.max_length - prompt.shape[1], use_graphs=use_graphs, warpers=warpers,
                            penalty=penalty, layout=layout, host=host, draft_weights=draft_weights,
                            retrieval=retrieval, tree_size=tree_size, adaptive=adaptive,
                            token_types=token_types is not None)
        # The engine's buffers belong to it (and its CUDA graphs). The cache the call leaves, as stock's, with the
        # sequence but its last token: the caller's (a prefix of the prompt, extended in place), or a new one for the
        # output; a row's left padding first (zero columns: a prefix is refused with padding)
        cache = _stock_cache(model) if past_key_values is None and config.return_dict_in_generate else past_key_values
        pad = input_ids.shape[1] - prompt.shape[1]
        result = static_speculative_decode(engine, prompt, rules, streamer, prefix=None if pad else cache,
                                           streamed_prompt=None if streamer is None else input_ids.cpu(),
                                           token_types=token_types)
        if cache is not None and pad:
            _place_engine_rows(engine, cache, [pad], [result.sequence.shape[1] - 1])

    sequences = torch.cat([input_ids.to(prompt.device), result.sequence[:, prompt.shape[1] :]], dim=1)
    _length_reminder(model, config, sequences)
    if not config.return_dict_in_generate:
        return sequences
    return SpeculativeGenerateOutput(
        sequences=sequences,
        scores=tuple(result.scores) if config.output_scores else None,
        logits=tuple(result.logits) if config.output_logits else None,
        **{output_field(SpeculativeGenerateOutput): cache},
        spec_stats=result.stats,
    )
