"""The ``hf-sparsekv`` command line and ``make demo``: fast ``--help``, the bundled pair from the command line,
no CPU speedup figures."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hf_sparsekv_cli
from hf_sparsekv.zoo import PAIR_DIR

HEAVY = ("torch", "transformers", "hf_sparsekv")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["demo", "--help"], ["push-drafter", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    code = (
        "import sys, hf_sparsekv_cli\n"
        "try:\n"
        f"    hf_sparsekv_cli.main({argv!r})\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: hf-sparsekv" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        hf_sparsekv_cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-sparsekv {version('hf_sparsekv')}"


def test_train_drafter_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        hf_sparsekv_cli.main(["train-drafter", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--seq-len SEQ_LEN T (default: 16384)" in text
    assert "--max-steps MAX_STEPS optimizer steps (default: 5000)" in text
    # the letters (T, C, B, s, λ) are the paper's: --help names it and says what each stands for
    assert "BudgetDraft: Acceptance-Aware Multi-View Training for Sparse-KV Speculative Decoding" in text
    assert "arXiv:2606.00144" in text and "T the training sequence length" in text and "λ·L_C" in text


def test_generate_help_shows_every_default(capsys):
    """argparse prints nothing for an option without help text, its default included: each option of ``generate``
    that has a default shows it (``--max-new-tokens`` once did not)."""
    with pytest.raises(SystemExit):
        hf_sparsekv_cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-new-tokens MAX_NEW_TOKENS tokens to generate (default: 128)" in text
    parser = hf_sparsekv_cli.build_parser(["generate"]).commands["generate"]
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, "==SUPPRESS=="):
            assert f"{action.option_strings[-1]} " in text and f"(default: {action.default})" in text, action.dest


@pytest.mark.parametrize("tokenizer", [None, "verifier"])
def test_a_folder_without_a_tokenizer_is_refused_naming_tokenizer(tokenizer, capsys, monkeypatch):
    """The bundled pair's verifier folder holds no tokenizer (it has a folder of its own): one line naming
    ``--tokenizer``, before any model loads, instead of transformers' traceback about sentencepiece / tiktoken."""
    import hf_sparsekv.commands

    monkeypatch.setattr(hf_sparsekv.commands, "_load", lambda *a: pytest.fail("a model was loaded"))
    argv = ["generate", "--verifier", str(PAIR_DIR / "verifier"), "--drafter", str(PAIR_DIR / "drafter")]
    if tokenizer:
        argv += ["--tokenizer", str(PAIR_DIR / tokenizer)]
    with pytest.raises(SystemExit) as exit_info:
        hf_sparsekv_cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and "sentencepiece" not in err
    message = err.strip().splitlines()[-1]
    assert f"{PAIR_DIR / 'verifier'}: the folder holds no tokenizer" in message and "pass --tokenizer" in message
    assert f"the bundled pair's is {(PAIR_DIR / 'tokenizer').resolve()})" in message  # (absolute: from any folder)


def test_generate_needs_a_verifier(capsys):
    with pytest.raises(SystemExit):
        hf_sparsekv_cli.main(["generate", "--drafter", "x"])
    assert "--verifier is required (or --pair" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--budget", "4"], "--budget: kv_budget must be >= the chunk size"),
        (["--mode", "window", "--budget", "4"], "sink tokens"),
        (["--gamma", "0"], "expected a positive integer, got 0"),
        (["--max-new-tokens", "x"], "expected a positive integer, got 'x'"),
        (["--dtype", "foo"], "invalid choice: 'foo'"),
        (["--prompt-file", "/no/such/prompt.txt"], "no such file"),
        (["--prompt", ""], "--prompt is empty"),
        (["--verifier", "/no/such/model"], "--verifier /no/such/model: no such file or directory"),
    ],
)
def test_generate_refuses_bad_arguments_before_loading_anything(extra, message, capsys, monkeypatch):
    import hf_sparsekv.commands

    monkeypatch.setattr(hf_sparsekv.commands, "_load", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        hf_sparsekv_cli.main(["generate", "--pair", *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "usage: hf-sparsekv generate" in err


@pytest.mark.parametrize("how", ["pair", "paths"])
def test_generate_runs_the_bundled_pair_and_prints_no_cpu_speedup(how, capsys):
    if how == "pair":
        argv = ["generate", "--pair", "--mode", "window", "--budget", "64"]
    else:  # the README's explicit form: the tokenizer lives in its own folder
        argv = ["generate", "--verifier", str(PAIR_DIR / "verifier"), "--drafter", str(PAIR_DIR / "drafter"),
                "--tokenizer", str(PAIR_DIR / "tokenizer"), "--mode", "chunk", "--budget", "16"]
    assert hf_sparsekv_cli.main(argv + ["--max-new-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "identical to greedy AR: True | acceptance" in out and "tau" in out
    assert "speedup" not in out.replace("no speedup printed on CPU", "")
    assert "speed is measured on the GPU" in out


def test_demo_on_cpu_prints_acceptance_and_tau_not_speedup(monkeypatch, capsys):
    from hf_sparsekv import demo

    monkeypatch.setattr(demo, "PROMPT_TOKENS", 256)
    monkeypatch.setattr(demo, "NEW_TOKENS", 8)
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)
    assert demo.main() == 0
    out = capsys.readouterr().out
    assert out.count("identical to greedy AR: True | acceptance") == 2
    assert "speedup" not in out.replace("no speedup printed on CPU", "")
    assert "speed is measured on the GPU" in out


def test_generate_on_a_missing_cuda_device_is_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        hf_sparsekv_cli.main(["generate", "--pair", "--device", "cuda"])
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_a_local_looking_model_path_that_does_not_exist_is_named_at_once(tmp_path, monkeypatch, capsys):
    """``hf_sparsekv/zoo/pair/verifier`` outside the repository root: not a Hub id (two slashes), so it is refused
    at once naming the path, where it was looked for and ``--pair``, before any model or network access."""
    import hf_sparsekv.commands

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hf_sparsekv.commands, "_load", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        hf_sparsekv_cli.main(["generate", "--verifier", "hf_sparsekv/zoo/pair/verifier", "--drafter",
                              str(PAIR_DIR / "drafter")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"--verifier hf_sparsekv/zoo/pair/verifier: no such file or directory (relative to {tmp_path})" in err
    assert "--pair" in err


def test_top_level_help_says_what_the_command_does():
    code = "import hf_sparsekv_cli\ntry:\n    hf_sparsekv_cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    text = " ".join(out.split())
    assert "speculative decoding" in text and "greedy output" in text and "hf-sparsekv generate --pair" in text
    assert "argument parsing" not in text and "``" not in text


def test_default_prompt_is_a_held_out_document_the_budget_bites_into(capsys):
    """Without --prompt, generate continues a held-out document longer than the budget and echoes the prompt's
    tail; a prompt within the budget is named as such (nothing compressed)."""
    from transformers import AutoTokenizer

    from hf_sparsekv.zoo import eval_documents

    base = ["generate", "--pair", "--mode", "chunk", "--budget", "64", "--max-new-tokens", "4", "--device", "cpu"]
    assert hf_sparsekv_cli.main(base + ["--prompt-tokens", "200"]) == 0
    out = capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(PAIR_DIR / "tokenizer")
    doc = eval_documents()[0][:200]
    assert "prompt: a held-out document" in out and "fits the budget" not in out
    assert tok.decode(doc[-40:]) in out  # the tail of the prompt is shown before the completion
    assert out.index(tok.decode(doc[-40:])) < out.index("identical to greedy AR: True")
    assert hf_sparsekv_cli.main(base + ["--prompt", "def fibonacci(n):"]) == 0
    assert "the prompt fits the budget of 64 tokens" in capsys.readouterr().out


def test_generate_runs_prompt_lookup_alone_without_loading_a_drafter(capsys, monkeypatch):
    import hf_sparsekv.commands

    loaded = []
    real_load = hf_sparsekv.commands._load
    monkeypatch.setattr(hf_sparsekv.commands, "_load", lambda name, *a: loaded.append(name) or real_load(name, *a))
    argv = ["generate", "--pair", "--mode", "lookup", "--prompt-lookup-num-tokens", "3", "--max-new-tokens", "8",
            "--device", "cpu"]
    assert hf_sparsekv_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert loaded == [str(PAIR_DIR / "verifier")]
    assert "== prompt lookup alone (N 3)" in out and "identical to greedy AR: True" in out


def test_generate_static_engine_decodes_the_reference_on_the_engine(capsys, monkeypatch):
    """--static-engine: the greedy AR reference is generate(static_engine=True); --prompt-lookup-num-tokens beside
    the drafter reaches generate() as prompt_lookup_num_tokens."""
    import hf_sparsekv.compare

    calls = []
    real = hf_sparsekv.compare.timed_generate
    monkeypatch.setattr(hf_sparsekv.compare, "timed_generate",
                        lambda m, ids, **kw: calls.append(kw) or real(m, ids, **kw))
    argv = ["generate", "--pair", "--mode", "window", "--budget", "64", "--static-engine",
            "--prompt-lookup-num-tokens", "5", "--max-new-tokens", "8", "--device", "cpu"]
    assert hf_sparsekv_cli.main(argv) == 0
    reference, speculative = calls
    assert reference.get("static_engine") is True and "assistant_model" not in reference
    assert speculative["prompt_lookup_num_tokens"] == 5 and speculative["draft_cache"] == "window"
    out = capsys.readouterr().out
    assert "prompt lookup N 5" in out and "static_engine=True" in out and "identical to greedy AR: True" in out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--mode", "int4", "--prompt-lookup-num-tokens", "5"], "does not run beside --mode int4"),
        (["--prompt-lookup-num-tokens", "3"], "must equal --gamma (5)"),
        (["--mode", "int4", "--static-engine"], "--static-engine: the int4 reference"),
    ],
)
def test_generate_refuses_lookup_and_static_engine_where_they_cannot_run(extra, message, capsys, monkeypatch):
    import hf_sparsekv.commands

    monkeypatch.setattr(hf_sparsekv.commands, "_load", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        hf_sparsekv_cli.main(["generate", "--pair", *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
