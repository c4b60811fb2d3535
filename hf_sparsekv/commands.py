"""The commands of ``hf-sparsekv``: ``generate`` (speculative vs AR on one prompt), ``demo``, ``train-drafter``
(BudgetDraft training, see :mod:`hf_sparsekv.training.run`) and ``push-drafter`` (a saved drafter to the Hub).
Argument parsing is in :mod:`hf_sparsekv_cli` (kept light so that ``--help`` is fast), which calls these;
:mod:`hf_sparsekv.cli` (``python -m hf_sparsekv.cli``) runs the same and re-exports them."""

from __future__ import annotations

from pathlib import Path

import torch

from .compare import SPEED_ON_CPU, compare, report
from .generation.draft_modes import check_budget
from .model_paths import refuse_folder_without_tokenizer, refuse_missing_model_paths


def resolve_generate_args(args, parser) -> None:
    """Fill ``--pair`` paths, ``auto`` device/dtype and the tokenizer default; refuse missing models, a tokenizer
    folder without a tokenizer, prompt files, an empty prompt, a budget the mode cannot take and an absent CUDA
    device by name, before any model loads."""
    if args.pair:
        from .zoo import DRAFTERS, PAIR_DIR

        args.verifier = args.verifier or str(PAIR_DIR / "verifier")
        args.drafter = args.drafter or str(PAIR_DIR / DRAFTERS["budgetdraft"])
        args.tokenizer = args.tokenizer or str(PAIR_DIR / "tokenizer")
    if not args.verifier:
        parser.error("--verifier is required (or --pair for the bundled pair)")
    if args.mode not in ("int4", "lookup") and not args.drafter:
        parser.error("--drafter is required unless --mode int4 or lookup (or --pair for the bundled pair)")
    lookup = args.prompt_lookup_num_tokens
    if lookup is not None and args.mode == "int4":
        parser.error("--prompt-lookup-num-tokens: prompt lookup does not run beside --mode int4")
    if lookup is not None and args.mode != "lookup" and lookup != args.gamma:
        parser.error(f"--prompt-lookup-num-tokens {lookup} beside a drafter must equal --gamma ({args.gamma}): "
                     "both branches draft the same number of tokens a round")
    if args.mode == "lookup" and lookup is None:
        args.prompt_lookup_num_tokens = args.gamma
    if args.static_engine and args.mode == "int4":
        parser.error("--static-engine: the int4 reference decodes on a quantized cache, which the engine's plain "
                     "decoding does not take")
    args.tokenizer = args.tokenizer or args.verifier
    refuse_missing_model_paths(args, parser)
    refuse_folder_without_tokenizer(args, parser)
    if args.prompt_file and not Path(args.prompt_file).is_file():
        parser.error(f"--prompt-file {args.prompt_file}: no such file")
    if args.prompt is not None and not args.prompt_file and not args.prompt:
        parser.error("--prompt is empty")
    if args.mode in ("chunk", "window"):
        try:
            check_budget(args.budget, args.mode)
        except ValueError as err:
            parser.error(f"--budget: {err}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"


def _load(name: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).to(device).eval()


TAIL_TOKENS = 48  # how much of the prompt is echoed before the completion


def default_prompt(tokens: int) -> str:
    """The first ``tokens`` tokens of the bundled pair's first held-out evaluation document (Python source from a
    package the pair never trained on), as text."""
    from transformers import AutoTokenizer

    from .zoo import PAIR_DIR, eval_documents

    tokenizer = AutoTokenizer.from_pretrained(PAIR_DIR / "tokenizer", local_files_only=True)
    return tokenizer.decode(eval_documents()[0][:tokens])


def cmd_generate(args) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    verifier = _load(args.verifier, args.device, args.dtype)
    if args.mode in ("int4", "lookup"):  # self-speculation drafts with the verifier; prompt lookup with no model
        drafter = verifier if args.mode == "int4" else None
    else:
        drafter = _load(args.drafter, args.device, args.dtype)
    if args.prompt_file:
        text, source = open(args.prompt_file).read(), args.prompt_file
    elif args.prompt is not None:
        text, source = args.prompt, "--prompt"
    else:
        text, source = default_prompt(args.prompt_tokens), "a held-out document of the bundled pair (--prompt-tokens)"
    ids = tokenizer(text, return_tensors="pt").input_ids.to(args.device)
    print(f"prompt: {source}, {ids.shape[1]} tokens; its last {min(ids.shape[1], TAIL_TOKENS)}:")
    print(tokenizer.decode(ids[0, -TAIL_TOKENS:]))
    print("---")
    if args.mode in ("chunk", "window") and ids.shape[1] <= args.budget:
        print(f"(the prompt fits the budget of {args.budget} tokens: the drafter's cache keeps all of it, nothing is "
              "compressed; give a longer prompt or a smaller --budget)")
    lookup = args.prompt_lookup_num_tokens
    result = compare(verifier, drafter, ids, args.mode, args.budget, args.gamma, args.max_new_tokens,
                     lookup=lookup, static_engine=args.static_engine)
    on_gpu = torch.device(args.device).type == "cuda"
    if args.mode == "lookup":
        name = f"prompt lookup alone (N {lookup})"
    else:
        name = f"{args.mode} (budget {args.budget}, gamma {args.gamma}" + (f", prompt lookup N {lookup})" if lookup
                                                                         else ")")
    if args.static_engine:
        name += "; greedy AR on hf_sparsekv's engine (static_engine=True)"
    report(name, result, tokenizer, ids.shape[1], on_gpu)
    if not on_gpu:
        print(SPEED_ON_CPU)
    return 0 if result["identical_to_ar"] else 1


def cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main()


def cmd_train_drafter(args) -> int:
    from .training.run import run

    return run(args)


def cmd_push_drafter(args) -> int:
    """Push a saved drafter folder (``train-drafter --output``) and its model card; 1 (with one line saying why and
    how to retry) if the push fails."""
    from .training.hub import push_saved

    pushed = push_saved(args.folder, args.repo, private=args.hub_private or None, endpoint=args.hub_endpoint)
    return 0 if pushed else 1
