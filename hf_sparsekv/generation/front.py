"""``generate(..., kv_budget=..., draft_cache=...)``: argument checks, cache set-up, HF-shaped outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer
from transformers.generation import (
    LogitsProcessorList,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from ..attention import NAME as SPARSEKV_ATTENTION
from ..cache_keyword import output_field, pop_user_cache
from ..caches import ChunkBudgetCache, HierarchicalQuantCache, SinkWindowCache, query_hooks
from ..caches.base import is_integer
from .batch_rows import assemble, check_batch, generate_rows, pad_value, token_ids
from .common import CHUNK_SIZE, DEFAULT_WINDOW_BUDGET, WINDOW_SINK, _strip_left_padding, _text_config
from .drafters import ModelDrafter, SelfDrafter, SharedPrefillDrafter
from .graph_loop import engine_for, static_decode_rows, static_mode, static_speculative_decode
from .sampling import DEVICE_WARPERS, device_warpers, repetition_penalty, speculative_sample, stock_processors
from .speculative import GreedyRules, speculative_decode
from .stats import SpecStats

DRAFT_CACHES = ("chunk", "window", "int4", "full")
DEFAULT_GAMMA = 5

# Generation options this path does not serve (the logits processors stock builds from the rest of the config,
# repetition penalty, n-gram and bad-word bans included, are applied: sampling.stock_processors).
_UNSUPPORTED_OPTIONS = {
    "guidance_scale": lambda v: v is not None and v != 1.0,  # runs the model a second time, unconditionally
    "watermarking_config": lambda v: v is not None,  # SynthID keeps state across calls; verification repeats them
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "assistant_early_exit": lambda v: v is not None,
    "output_attentions": lambda v: bool(v),
    "output_hidden_states": lambda v: bool(v),
    "penalty_alpha": lambda v: v is not None and v > 0,  # contrastive search
    "dola_layers": lambda v: v is not None,
    "token_healing": lambda v: bool(v),
    "num_assistant_tokens_schedule": lambda v: v not in (None, "constant"),  # γ stays num_assistant_tokens
    "prefill_chunk_size": lambda v: v is not None,  # the prompt is prefilled in one forward (peak memory as such)
}


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``spec_stats``: a :class:`~hf_sparsekv.generation.stats.SpecStats`
    (attributes such as ``out.spec_stats.acceptance_rate``, ``out.spec_stats["acceptance_rate"]``, ``to_dict()``)."""

    spec_stats: SpecStats | None = None


_stock_logger = logging.get_logger("transformers.generation.utils")  # stock's warnings come from stock's logger


def infer_attention_mask(config, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The ``attention_mask [B, L]`` stock ``generate()`` infers when none is passed, or None for all ones: zeros
    where ``input_ids`` holds ``pad_token_id``, if it occurs and is not an EOS id. Without a pad id, or with the pad
    id equal to EOS, nothing is inferred, and a batch gets the warning stock gives (the padding counts as tokens, in
    stock's output and in ours alike). Padding it infers that is not left padding (a pad id inside a prompt) is a
    ValueError: the speculative path decodes left-padded rows only."""
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
        raise ValueError(
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


def check_budget(kv_budget, draft_cache) -> None:
    """``kv_budget``: a positive integer, at least one chunk for ``'chunk'`` (the default), more than the sink
    tokens for ``'window'``."""
    if kv_budget is None:
        return
    if not is_integer(kv_budget) or kv_budget < 1:
        raise ValueError(f"kv_budget must be a positive integer, got {kv_budget!r}")
    if draft_cache in (None, "chunk") and kv_budget < CHUNK_SIZE:
        raise ValueError(f"kv_budget must be >= the chunk size ({CHUNK_SIZE}) with draft_cache='chunk', got {kv_budget}")
    if draft_cache == "window" and kv_budget <= WINDOW_SINK:
        raise ValueError(f"kv_budget must exceed the {WINDOW_SINK} sink tokens with draft_cache='window', got {kv_budget}")


def _draft_setup(model, drafter, draft_cache, kv_budget, gamma):
    """-> (drafter object, verifier cache). A chunk-budget cache gets the prompt's queries through hooks under any
    attention implementation. With ``assistant_model=model``, a chunk-budget or sink+window cache is built from the
    verifier's own prefill (:class:`SharedPrefillDrafter`)."""
    if isinstance(draft_cache, Cache):
        if draft_cache.get_seq_length() != 0:
            raise ValueError("draft_cache: a cache instance must be empty (fresh or reset())")
        if isinstance(draft_cache, SinkWindowCache) and draft_cache.max_rollback < gamma - 1:
            raise ValueError(
                f"draft_cache: this SinkWindowCache rolls back at most max_rollback={draft_cache.max_rollback} "
                f"tokens, but with num_assistant_tokens={gamma} up to {gamma - 1} rejected drafts are rolled back; "
                f"build it with max_rollback >= {gamma - 1}"
            )
        if (isinstance(draft_cache, ChunkBudgetCache) and draft_cache.generated_window is not None
                and draft_cache.max_rollback < gamma - 1):
            raise ValueError(
                f"draft_cache: this ChunkBudgetCache (generated_window={draft_cache.generated_window}) rolls back at "
                f"most max_rollback={draft_cache.max_rollback} tokens, but with num_assistant_tokens={gamma} up to "
                f"{gamma - 1} rejected drafts are rolled back; build it with max_rollback >= {gamma - 1}"
            )
        if drafter is model:
            if isinstance(draft_cache, HierarchicalQuantCache):
                return SelfDrafter(model, draft_cache), draft_cache
            if isinstance(draft_cache, (ChunkBudgetCache, SinkWindowCache)):
                return SharedPrefillDrafter(model, draft_cache), DynamicCache()
            raise NotImplementedError(
                "draft_cache: self-drafting (assistant_model is the model) needs a HierarchicalQuantCache, "
                f"ChunkBudgetCache or SinkWindowCache, got {type(draft_cache).__name__}"
            )
        return ModelDrafter(drafter, draft_cache), DynamicCache()
    kind = draft_cache if draft_cache is not None else "chunk"
    if kind not in DRAFT_CACHES:
        raise ValueError(f"draft_cache must be one of {DRAFT_CACHES} or a Cache instance, got {draft_cache!r}")
    if kind == "int4":
        if kv_budget is not None:
            raise ValueError("kv_budget does not apply to draft_cache='int4' (the quantized cache keeps every token)")
        store = HierarchicalQuantCache()
        if gamma >= store.group_size:
            raise ValueError(f"num_assistant_tokens must be < group_size ({store.group_size}) with draft_cache='int4'")
        if drafter is model:
            return SelfDrafter(model, store), store
        store.set_view("int4")
        return ModelDrafter(drafter, store), DynamicCache()
    drafter_class = SharedPrefillDrafter if drafter is model else ModelDrafter
    if kind == "chunk":
        if kv_budget is None:
            raise ValueError("draft_cache='chunk' needs kv_budget")
        return drafter_class(drafter, ChunkBudgetCache(kv_budget)), DynamicCache()
    if kind == "window":
        budget = DEFAULT_WINDOW_BUDGET if kv_budget is None else kv_budget
        cache = SinkWindowCache(sink=WINDOW_SINK, window=budget - WINDOW_SINK, max_rollback=gamma + 1)
        return drafter_class(drafter, cache), DynamicCache()
    return ModelDrafter(drafter, DynamicCache()), DynamicCache()


def _prefix_cache(past_key_values, verifier_cache, drafter, prompt_length: int, padded: bool) -> Cache:
    """Prompt caching: the user's ``past_key_values`` (a DynamicCache holding the first n < P prompt tokens) becomes
    the verifier's cache; only the rest of the prompt is prefilled. The drafter's cache is still built from the whole
    prompt. Anything else raises naming ``past_key_values``."""
    if not isinstance(past_key_values, DynamicCache):
        raise NotImplementedError(
            f"past_key_values must be a DynamicCache holding a prefix of the prompt, got {type(past_key_values).__name__}"
        )
    if any(isinstance(layer, DynamicSlidingWindowLayer) for layer in past_key_values.layers):
        raise NotImplementedError(
            "past_key_values has sliding-window layers, which cannot be rolled back after rejected drafts; build it "
            "as DynamicCache() (no config) to reuse a prefix with kv_budget/draft_cache"
        )
    if not isinstance(verifier_cache, DynamicCache):
        raise NotImplementedError(
            "past_key_values cannot be combined with self-drafting on draft_cache='int4' (the quantized store is the "
            "verifier's cache)"
        )
    n = past_key_values.get_seq_length()
    if n >= prompt_length:
        raise ValueError(
            f"past_key_values holds {n} tokens but the prompt has {prompt_length}: it must hold a proper prefix"
        )
    if n > 0 and isinstance(drafter, SharedPrefillDrafter) and query_hooks.needs_prompt_queries(drafter.cache):
        raise NotImplementedError(
            "past_key_values holding a prefix cannot seed a self-drafting chunk-budget cache: the chunk selection "
            "needs the queries of the whole prompt (pass a separate assistant_model, or draft_cache='window')"
        )
    if n > 0 and padded:
        raise NotImplementedError("past_key_values holding a prefix is not supported with a padded attention_mask")
    return past_key_values


def _switch_attention(model, drafter) -> list:
    """Route attention through ``"sparsekv"`` for the call on CUDA for models on plain SDPA, so that our caches use
    the Triton kernels. Returns ``[(model, previous)]``."""
    switched = []
    for m in {id(model): model, id(drafter): drafter}.values():
        previous = m.config._attn_implementation
        wanted = m.device.type == "cuda" and previous == "sdpa"
        if wanted and previous != SPARSEKV_ATTENTION:
            m.set_attn_implementation(SPARSEKV_ATTENTION)
            switched.append((m, previous))
    return switched


def _check_models(model, drafter, tokenizer=None) -> int | None:
    """Refuse a drafter that cannot serve the model; return the shared vocabulary size when the two embeddings differ
    only by padding (else None). Padding is accepted only when ``tokenizer`` (the shared one, passed to generate() as
    ``tokenizer=``) has no id outside the shared range ``[0, min(V_model, V_drafter))``."""
    if drafter is None:
        raise ValueError("kv_budget/draft_cache need assistant_model (the drafter; pass the model itself for int4)")
    if drafter is model:
        return None
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


def _refuse_source(name: str, value, kwargs: dict, generation_config, model) -> str:
    """Where an unsupported generation option came from, for the error message."""
    if name in kwargs:
        return f"{name}={value!r} was passed to generate()"
    if generation_config is not None and getattr(generation_config, name, None) == value:
        return f"{name}={value!r} comes from the generation_config passed to generate()"
    return f"{name}={value!r} comes from the model's generation config (model.generation_config.{name})"


def _assistant_gamma(assistant_model, model) -> int:
    """γ when the call and the model's generation config leave it unset: the assistant's own
    ``generation_config.num_assistant_tokens`` where its owner set it (where stock assisted generation reads it), else
    :data:`DEFAULT_GAMMA`. A non-constant schedule there is refused, as on the model's config."""
    config = getattr(assistant_model, "generation_config", None)
    if assistant_model is None or assistant_model is model or config is None:
        return DEFAULT_GAMMA
    diff = config.to_diff_dict()
    if _UNSUPPORTED_OPTIONS["num_assistant_tokens_schedule"](diff.get("num_assistant_tokens_schedule")):
        raise NotImplementedError(
            f"num_assistant_tokens_schedule={diff['num_assistant_tokens_schedule']!r} comes from the assistant's "
            "generation config (assistant_model.generation_config); kv_budget/draft_cache keep γ constant: set it "
            "to 'constant' or pass num_assistant_tokens=...")
    return diff.get("num_assistant_tokens", DEFAULT_GAMMA)


def _prepare_config(model, generation_config, kwargs: dict, input_ids: torch.Tensor):
    """The call's ``GenerationConfig`` exactly as stock ``generate()`` builds it: the user's config or kwargs over the
    model's ``generation_config`` over the library defaults, then ``max_length``/``min_length`` made absolute (the
    default length with the same warning stock gives). Returns ``(config, kwargs generate() would not use)``.

    Uses the same ``GenerationMixin`` helpers stock ``generate()`` calls (identical in transformers 5.17-5.24)."""
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
    config, unused = model._prepare_generation_config(generation_config, **kwargs)
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
    **kwargs,
):
    """The speculative path of ``generate()``; same arguments, greedy or sampled (``do_sample``). A batch of more
    than one (left-padded) prompt is decoded by the static engine with one row per prompt when greedy decoding takes
    the static path, else row by row (:mod:`.batch_rows`); either way each row is what its prompt alone gives."""
    check_budget(kv_budget, draft_cache)
    kv_budget = None if kv_budget is None else int(kv_budget)  # a NumPy integer from a sweep, say
    for name, value in (
        ("prefix_allowed_tokens_fn", prefix_allowed_tokens_fn),
        ("negative_prompt_ids", negative_prompt_ids),
        ("custom_generate", custom_generate),
    ):
        if value is not None:
            raise NotImplementedError(f"{name} is not supported together with kv_budget/draft_cache")
    if synced_gpus:
        raise NotImplementedError("synced_gpus is not supported together with kv_budget/draft_cache")
    if kv_budget is not None and (draft_cache == "full" or isinstance(draft_cache, Cache)):
        what = "draft_cache='full'" if draft_cache == "full" else "a draft_cache instance"
        raise ValueError(f"kv_budget does not apply to {what} (it sets the budget of 'chunk'/'window' only); drop it")
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    if input_ids is None:
        raise ValueError("input_ids (or inputs) is required with kv_budget/draft_cache")
    attention_mask = kwargs.pop("attention_mask", None)
    past_key_values = pop_user_cache(kwargs)  # past_key_values= or, from transformers 5.24 on, cache=
    tokenizer = kwargs.pop("tokenizer", None)  # as stock: for stop_strings (and the vocabulary check)
    gamma_given = "num_assistant_tokens" in kwargs or any(  # set by the user, not the library default (20)
        c is not None and "num_assistant_tokens" in c.to_diff_dict() for c in (generation_config, model.generation_config)
    )
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
    batch = input_ids.shape[0]
    row_kwargs = dict(kwargs)  # what each row gets when a batch is decoded row by row
    config, unused = _prepare_config(model, generation_config, kwargs, input_ids)
    if unused:
        raise ValueError(f"unsupported arguments with kv_budget/draft_cache: {sorted(unused)}")
    if attention_mask is None:  # inferred from pad_token_id as stock infers it
        attention_mask = infer_attention_mask(config, input_ids)

    if not config.use_cache:
        raise ValueError(
            f"use_cache=False is not supported with kv_budget/draft_cache: speculative decoding works on KV caches "
            f"({_refuse_source('use_cache', False, kwargs, generation_config, model)}); drop it"
        )
    if config.cache_implementation is not None:
        source = _refuse_source("cache_implementation", config.cache_implementation, kwargs, generation_config, model)
        raise NotImplementedError(
            f"cache_implementation is not supported with kv_budget/draft_cache: {source}; the verifier runs on a "
            "dynamic cache and the drafter on draft_cache"
        )
    if (config.num_beams or 1) > 1:
        raise NotImplementedError("num_beams > 1 (beam search) is not supported with kv_budget/draft_cache")
    if (config.num_return_sequences or 1) > 1:
        raise NotImplementedError("num_return_sequences > 1 is not supported with kv_budget/draft_cache")
    for name, is_active in _UNSUPPORTED_OPTIONS.items():
        value = getattr(config, name, None)
        if is_active(value):
            raise NotImplementedError(f"{name} is not supported together with kv_budget/draft_cache: "
                                      f"{_refuse_source(name, value, kwargs, generation_config, model)}")
    gamma = config.num_assistant_tokens if gamma_given else _assistant_gamma(assistant_model, model)
    if not is_integer(gamma) or gamma < 1:
        raise ValueError(f"num_assistant_tokens must be a positive integer, got {gamma!r}")
    gamma = int(gamma)
    shared_vocab = _check_models(model, assistant_model, tokenizer)
    if batch > 1:
        check_batch(input_ids, attention_mask, config, streamer=streamer,
                    prefix_cache=past_key_values is not None, max_time=config.max_time)
        static = rows = None
        if not config.do_sample:
            rows = [
                _row_rules(model, config, input_ids[b : b + 1],
                           None if attention_mask is None else attention_mask[b : b + 1], stopping_criteria,
                           logits_processor, tokenizer)
                for b in range(batch)
            ]
            static = static_mode(
                model, assistant_model, draft_cache, kv_budget, wants_outputs=False,
                logits_processor=logits_processor,
                processor_blocker=device_warpers(rows[0][1].logits_processor, sampling=False)[1])
        pad = pad_value(config)
        if static is not None:
            prompts, rules = [r[0] for r in rows], [r[1] for r in rows]
            mode, budget, layout, host = static
            engine = engine_for(
                model, assistant_model, mode, budget, gamma, max(r.max_length for r in rules),
                max(r.max_length - r.prompt_length for r in rules), use_graphs=model.device.type == "cuda", batch=batch,
                penalty=None if host else repetition_penalty(rules[0].logits_processor), layout=layout, host=host)
            results = static_decode_rows(engine, prompts, rules)
            sequences = [torch.cat([input_ids[b : b + 1].to(model.device), res.sequence[:, prompts[b].shape[1] :]], 1)
                         for b, res in enumerate(results)]
            return assemble(sequences, [res.stats for res in results], pad, config.return_dict_in_generate,
                            SpeculativeGenerateOutput, shared_seconds=True)

        def one_row(ids, mask, cache):
            return speculative_generate(
                model, ids, generation_config, logits_processor, stopping_criteria, assistant_model=assistant_model,
                kv_budget=kv_budget, draft_cache=cache, attention_mask=mask, tokenizer=tokenizer,
                **{**row_kwargs, "return_dict_in_generate": True},
            )

        return generate_rows(one_row, input_ids, attention_mask, draft_cache, pad,
                             config.return_dict_in_generate)

    prompt, rules = _row_rules(model, config, input_ids, attention_mask, stopping_criteria, logits_processor,
                               tokenizer)

    drafter, verifier_cache = _draft_setup(model, assistant_model, draft_cache, kv_budget, gamma)
    if past_key_values is not None:
        verifier_cache = _prefix_cache(
            past_key_values, verifier_cache, drafter, prompt.shape[1], prompt.shape[1] != input_ids.shape[1]
        )
    if shared_vocab is not None:
        drafter.limit_vocabulary(shared_vocab, _text_config(assistant_model).vocab_size)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    warpers, blocker = device_warpers(rules.logits_processor, sampling=config.do_sample)
    static = static_mode(
        model, assistant_model, draft_cache, kv_budget, wants_outputs=bool(config.output_scores or config.output_logits),
        logits_processor=logits_processor,
        prefix_cache=past_key_values is not None, processor_blocker=blocker,
    )
    if static is not None:
        mode, budget, layout, host = static
        if host and config.do_sample:  # the drafts' q: whichever warpers the device applies (any q is exact)
            warpers = [p for p in rules.logits_processor if type(p) in DEVICE_WARPERS]
        engine = engine_for(model, assistant_model, mode, budget, gamma, rules.max_length,
                            rules.max_length - prompt.shape[1], use_graphs=model.device.type == "cuda",
                            warpers=warpers if config.do_sample else None,
                            penalty=None if host else repetition_penalty(rules.logits_processor), layout=layout,
                            host=host)
        result = static_speculative_decode(engine, prompt, rules, streamer, prefix=past_key_values)
        # the engine's buffers belong to it (and its CUDA graphs); a caller's prefix cache was extended as stock would
        verifier_cache = past_key_values
    else:
        switched = _switch_attention(model, assistant_model)
        try:
            with torch.no_grad():
                if config.do_sample:
                    result = speculative_sample(model, verifier_cache, drafter, prompt, gamma, rules,
                                                rules.logits_processor, streamer)
                else:
                    result = speculative_decode(model, verifier_cache, drafter, prompt, gamma, rules, streamer)
        finally:
            for m, previous in switched:
                m.set_attn_implementation(previous)

    sequences = torch.cat([input_ids.to(model.device), result.sequence[:, prompt.shape[1] :]], dim=1)
    if not config.return_dict_in_generate:
        return sequences
    return SpeculativeGenerateOutput(
        sequences=sequences,
        scores=tuple(result.scores) if config.output_scores else None,
        logits=tuple(result.logits) if config.output_logits else None,
        **{output_field(SpeculativeGenerateOutput): verifier_cache if config.use_cache else None},
        spec_stats=result.stats,
    )
