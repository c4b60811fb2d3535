"""hf-sparsekv: long-context speculative decoding for HF transformers. A small drafter proposes tokens on a compressed
KV cache (a chunk budget, a sliding window, or INT4 self-speculation), the full model verifies them; the output is
token for token the model's own greedy output.

(Developer note: this module only parses arguments, outside the ``hf_sparsekv`` package, so that ``--help``
answers at once without importing torch and transformers; the commands are in :mod:`hf_sparsekv.commands`, and
``train-drafter``'s options, defined in :mod:`hf_sparsekv.training.run`, load only when that command is named.)
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = (
    "Long-context speculative decoding for HF transformers: a drafter proposes tokens on a compressed KV cache (chunk "
    "budget, sliding window or INT4 self-speculation) and the model verifies them, so the output is token for token "
    "its own greedy output. `generate` runs one prompt both ways and prints the completion, acceptance and tau; "
    "`demo` does it with the bundled trained pair on a held-out document; `train-drafter` trains a drafter "
    "(BudgetDraft); `push-drafter` pushes a trained one to the Hub."
)
EPILOG = "example: hf-sparsekv generate --pair --mode chunk --budget 256 --max-new-tokens 64"
COMMANDS = {
    "generate": "speculative vs greedy AR generation on one prompt",
    "demo": "speculative generation with the bundled pair on a held-out document",
    "train-drafter": "BudgetDraft multi-view sparse training of a drafter",
    "push-drafter": "push a saved drafter (train-drafter --output) and its model card to the Hub",
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default in ``--help`` (not for flags and options without one). argparse prints nothing
    for an option without ``help``, default included: every option that has a default needs a help text."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    g = gen.add_argument_group("models (a path or Hub id each, or --pair)")
    g.add_argument("--pair", action="store_true",
                   help="the bundled trained pair (hf_sparsekv/zoo/pair): sets --verifier, --drafter (the "
                        "BudgetDraft-trained one) and --tokenizer unless given")
    g.add_argument("--verifier", help="path or Hub id of the verifier")
    g.add_argument("--drafter", help="path or Hub id of the drafter (same tokenizer); not needed for --mode int4 or "
                                     "lookup")
    g.add_argument("--tokenizer", help="path or Hub id of the tokenizer (default: the verifier's)")
    s = gen.add_argument_group("speculative decoding")
    s.add_argument("--mode", default="chunk", choices=["chunk", "window", "int4", "full", "lookup"],
                   help="drafter cache; lookup: prompt lookup alone, no drafter")
    s.add_argument("--budget", type=_positive_int, default=256, help="drafter KV budget (chunk/window)")
    s.add_argument("--gamma", type=_positive_int, default=5, help="draft tokens per round")
    s.add_argument("--prompt-lookup-num-tokens", type=_positive_int, metavar="N",
                   help="tokens prompt lookup drafts a round from the text itself (generate()'s "
                        "prompt_lookup_num_tokens): alone with --mode lookup (there: --gamma unless given), else "
                        "beside the drafter as a second branch (N = --gamma)")
    s.add_argument("--static-engine", action="store_true",
                   help="decode the greedy AR reference on hf_sparsekv's engine (generate()'s static_engine=True) "
                        "instead of stock generate(); both outputs are still compared")
    s.add_argument("--prompt", help="the prompt text (default: the start of a held-out Python source document of the "
                                    "bundled pair, --prompt-tokens long, so that the budget bites)")
    s.add_argument("--prompt-file", help="read the prompt from this file (instead of --prompt)")
    s.add_argument("--prompt-tokens", type=_positive_int, default=1024,
                   help="length of the default prompt, in tokens of the bundled pair's tokenizer")
    s.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate")
    s.add_argument("--device", default="auto", help="'auto': cuda if available, else cpu")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"],
                   help="'auto': bfloat16 on cuda, float32 on cpu")


def _add_push_arguments(push: argparse.ArgumentParser) -> None:
    push.add_argument("folder", help="the drafter's folder (train-drafter --output: its save_pretrained files and "
                                     "README.md)")
    push.add_argument("repo", help="the Hub repository to push to (created if needed)")
    push.add_argument("--hub-private", action="store_true", help="create the Hub repo private")
    push.add_argument("--hub-endpoint", help="another Hub-compatible server; unset: HF_ENDPOINT / huggingface.co")


def _version() -> str:
    """The installed distribution's version (read from its metadata: importing the package would load torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf_sparsekv")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The full parser; ``train-drafter``'s options are added (importing the training code) only if ``argv`` names it."""
    parser = argparse.ArgumentParser(prog="hf-sparsekv", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"hf-sparsekv {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    parser.commands = {}  # name -> its sub-parser, whose error() names the command's usage
    for name, text in COMMANDS.items():
        command = parser.commands[name] = sub.add_parser(name, help=text, description=text, formatter_class=_Formatter)
        if name == "generate":
            _add_generate_arguments(command)
        elif name == "push-drafter":
            _add_push_arguments(command)
        elif name == "train-drafter" and _names_command(argv, name):
            from hf_sparsekv.training.run import add_arguments

            add_arguments(command)
    return parser


def _names_command(argv: list[str], name: str) -> bool:
    positionals = [a for a in argv if not a.startswith("-")]
    return bool(positionals) and positionals[0] == name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command == "generate":
        from hf_sparsekv.commands import resolve_generate_args

        resolve_generate_args(args, parser.commands["generate"])
    elif args.command == "train-drafter":
        from hf_sparsekv.training.run import check_arguments

        check_arguments(args, parser.commands["train-drafter"])
    from hf_sparsekv import commands

    return {"generate": commands.cmd_generate, "demo": commands.cmd_demo,
            "train-drafter": commands.cmd_train_drafter, "push-drafter": commands.cmd_push_drafter}[args.command](args)
