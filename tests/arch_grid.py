"""Every causal-LM architecture of the installed transformers, tiny and random, through the engine's six ways in,
against stock greedy ``generate()``.

Each architecture is built from its config class with small sizes and with the options that change attention set small
enough to matter in a 200-token prompt (sliding windows and chunks of 64 positions); its untied output head is
sharpened so that greedy tokens are no near-ties. Variants add rope scaling past its threshold. Each call's outcome:

* ``engine``: it ran on the engine and gave stock greedy's tokens;
* ``stock``: a routed call (stock's own assisted or prompt-lookup call) that the engine handed back to stock;
* ``refused``: an explicit call (engine options) refused with ``NotImplementedError``, whose message is kept;
* ``DIFFERENT``: it ran on the engine and gave other tokens (the defect the grid exists to catch);
* ``error``: anything else raised.

``python -m tests.arch_grid [--write docs/architectures.md]`` prints (or writes) the table; ``tests/test_architectures.py``
asserts on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_sparsekv
from hf_sparsekv.caches import HierarchicalQuantCache

VOCAB = 256
PROMPT = 200
NEW = 16
MAX_PARAMETERS = 4_000_000
SMALL = 64  # sliding windows and chunks: smaller than the prompt, so that they matter
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=SMALL,
             attention_chunk_size=SMALL, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
             intermediate_size_mlp=128, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
             use_cache=True)
# settings an architecture names its own way
OVERRIDES = {
    "falcon": dict(new_decoder_architecture=True),  # (its multi-query default ignores num_kv_heads)
    "gptj": dict(rotary_dim=8),
    "codegen": dict(rotary_dim=8),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=SMALL),
}
# architecture -> extra config settings; "name@variant" rows repeat an architecture with other settings
VARIANTS = {
    "llama@dynamic-ntk": ("llama", dict(max_position_embeddings=128,
                                        rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))),
    "phi3@longrope": ("phi3", dict(max_position_embeddings=128, original_max_position_embeddings=64,
                                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                        short_factor=[1.0] * 8, long_factor=[2.0] * 8))),
}
CALLS = {  # name -> generate() arguments ("m": the model itself)
    "routed": dict(assistant_model="m"),
    "chunk": dict(assistant_model="m", kv_budget=SMALL),
    "window": dict(assistant_model="m", draft_cache="window", kv_budget=SMALL),
    "int4": dict(assistant_model="m", draft_cache="int4"),
    "static": dict(static_engine=True),
    "lookup": dict(prompt_lookup_num_tokens=3),
}
ROUTED = ("routed", "static", "lookup")  # handed back to stock's path when the engine cannot serve them


@dataclasses.dataclass
class Row:
    arch: str
    built: str  # "" when built, else why not
    outcomes: dict  # call -> (outcome, detail)


def architectures() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) + sorted(VARIANTS)


def build(arch: str, seed: int = 0, device: str = "cpu"):
    """The tiny model of ``arch`` (float32, eval, on ``device``), its head sharpened; raises whatever building it
    raises."""
    model_type, extra = VARIANTS.get(arch, (arch, {}))
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    def settable(name: str) -> bool:
        attribute = getattr(config_class, name, None)
        return not isinstance(attribute, property) or attribute.fset is not None

    known = {k: v for k, v in SIZES.items()
             if (hasattr(default, k) or k in getattr(config_class, "attribute_map", {})) and settable(k)}
    config = config_class(**{**known, **OVERRIDES.get(model_type, {}), **extra})
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters with the grid's sizes (names its config does not use)")
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config).eval()
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        with torch.no_grad():
            head.weight.mul_(16)
    return model.to(device)


def _stock(model, ids, **kwargs):
    hf_sparsekv.unregister()
    try:
        return model.generate(ids, **kwargs)
    finally:
        hf_sparsekv.register()


def run_call(model, ids, reference, name: str) -> tuple[str, str]:
    spec = {k: (model if v == "m" else v) for k, v in CALLS[name].items()}
    kwargs = dict(do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, return_dict_in_generate=True)
    hf_sparsekv.release_engines(model)
    try:
        out = model.generate(ids, **spec, **kwargs)
    except NotImplementedError as error:
        return "refused", str(error).splitlines()[0]
    except Exception as error:  # noqa: BLE001 (the grid records it)
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if name in ROUTED:  # the same call without the plugin: stock's own failure is no defect of ours
            try:
                _stock(model, ids, **spec, **kwargs)
            except Exception:  # noqa: BLE001
                return "stock fails", reason
        return "error", reason
    if getattr(out, "spec_stats", None) is None:
        return ("stock", "") if name in ROUTED else ("error", "no spec_stats on an engine call")
    if torch.equal(out.sequences, reference):
        return "engine", ""
    if name == "int4":  # lossless against greedy on the same quantized cache (its INT8 view)
        quantized = _stock(model, ids, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                           past_key_values=HierarchicalQuantCache(group_size=16))
        if torch.equal(out.sequences, quantized):
            return "engine", "the quantized cache's greedy tokens"
    return "DIFFERENT", ""


def run_arch(arch: str, calls=tuple(CALLS), device: str = "cpu") -> Row:
    try:
        model = build(arch, device=device)
        ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
        reference = _stock(model, ids, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    except Exception as error:  # noqa: BLE001 (not buildable with generic tiny settings, or stock fails)
        return Row(arch, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160], {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcomes = {name: run_call(model, ids, reference, name) for name in calls}
    hf_sparsekv.release_engines(model)
    return Row(arch, "", outcomes)


def table(rows: list[Row]) -> str:
    """The Markdown table of ``rows`` and the list of reasons."""
    reasons: dict[str, int] = {}
    lines = ["| architecture | " + " | ".join(CALLS) + " |", "| --- |" + " --- |" * len(CALLS)]
    for row in rows:
        if row.built:
            continue
        cells = []
        for name in CALLS:
            outcome, detail = row.outcomes.get(name, ("", ""))
            if detail and outcome != "engine":
                number = reasons.setdefault(detail, len(reasons) + 1)
                outcome = f"{outcome} [{number}]"
            cells.append(outcome)
        lines.append(f"| {row.arch} | " + " | ".join(cells) + " |")
    lines += ["", "Reasons:", ""] + [f"{n}. {r}" for r, n in reasons.items()]
    skipped = [f"- {row.arch}: {row.built}" for row in rows if row.built]
    if skipped:
        lines += ["", "Not built with the grid's generic tiny settings (or stock greedy generate() failed on them):", ""]
        lines += skipped
    return "\n".join(lines) + "\n"


HEADER = """# Architectures on the engine

Generated by `make architectures` (`python -m tests.arch_grid --write docs/architectures.md`) on transformers {version}:
every causal-LM architecture of the installed transformers, tiny and random (float32, CPU, 2 layers, a {prompt}-token
prompt, {new} new tokens, sliding windows and chunks of {small} positions, the output head sharpened), through six calls,
each against stock greedy `generate()`. `engine`: ran on the engine with stock's tokens; `stock`: a routed call (stock's
own assisted or prompt-lookup call) handed back to stock's path; `refused`: a call with the engine's options refused
with the error shown. `make test-extended` runs the same grid and fails on any `DIFFERENT` or `error`.

Calls: `routed` = `generate(ids, assistant_model=model)` after the import; `chunk` = `assistant_model=model,
kv_budget={small}`; `window` = the same with `draft_cache="window"`; `int4` = `assistant_model=model,
draft_cache="int4"` (against greedy on the quantized cache where the two differ); `static` = `static_engine=True`;
`lookup` = `prompt_lookup_num_tokens=3`.

"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="write the Markdown page here instead of printing it")
    parser.add_argument("archs", nargs="*", help="architectures (default: all)")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    rows = [run_arch(a) for a in tqdm(args.archs or architectures(), desc="architectures")]
    page = HEADER.format(version=transformers.__version__, prompt=PROMPT, new=NEW, small=SMALL) + table(rows)
    if args.write:
        with open(args.write, "w") as f:
            f.write(page)
    else:
        print(page)
    bad = [r.arch for r in rows if any(o in ("DIFFERENT", "error") for o, _ in r.outcomes.values())]
    if bad:
        print("DIFFERENT or error:", ", ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
