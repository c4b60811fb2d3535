"""The bundled pair loads offline and really predicts held-out code; the corpus/zoo pipeline runs end to end."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_sparsekv import speculative_generate
from hf_sparsekv.data import documents, python_source_documents, split_of, token_sequences
from hf_sparsekv.zoo import PAIR_DIR, eval_documents, load_pair
from hf_sparsekv.zoo.build import main as build_main
from hf_sparsekv.zoo.quality import position_metrics, window_mask


@pytest.fixture(scope="module")
def pair():
    return load_pair(drafter="base")


def _acceptance(verifier, drafter, docs, prompt_len=1024, new=32):
    drafted = accepted = 0
    for doc in docs:
        ids = doc[None, :prompt_len]
        out = speculative_generate(verifier, ids, assistant_model=drafter, draft_cache="full",
                                   num_assistant_tokens=4, max_new_tokens=new, return_dict_in_generate=True)
        reference = verifier.generate(ids, do_sample=False, max_new_tokens=new)
        assert torch.equal(out.sequences, reference)
        drafted += out.spec_stats["drafted"]
        accepted += out.spec_stats["accepted"]
    return accepted / drafted


def test_pair_is_small_and_complete():
    size = sum(f.stat().st_size for f in PAIR_DIR.rglob("*") if f.is_file())
    assert size <= 40e6
    assert all(f.stat().st_size <= 15e6 for f in PAIR_DIR.rglob("*.safetensors"))
    docs = eval_documents()
    assert len(docs) == 50 and all(len(d) == 16384 for d in docs)


def test_pair_loads_offline_and_tokenizer_round_trips(pair):
    verifier, drafter, tokenizer = pair
    assert verifier.config.num_hidden_layers >= 10 and drafter.config.num_hidden_layers == 2
    assert drafter.config.max_position_embeddings == 2048
    assert verifier.config.vocab_size == drafter.config.vocab_size == len(tokenizer)
    text = "def forward(self, hidden_states):\n    return self.proj(hidden_states)  # ünïcode\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_trained_drafter_is_accepted_where_an_untrained_one_is_not(pair):
    verifier, drafter, _ = pair
    docs = eval_documents()[:2]
    trained = _acceptance(verifier, drafter, docs)
    torch.manual_seed(0)
    random_drafter = LlamaForCausalLM(drafter.config).eval()  # same shape, untrained
    untrained = _acceptance(verifier, random_drafter, docs[:1], new=16)
    assert trained > 0.2, trained
    assert untrained < 0.2, untrained


def test_verifier_beats_drafter_and_uses_long_context(pair):
    verifier, drafter, _ = pair
    doc = [eval_documents()[3][:2560]]
    buckets = ((0, 2048), (2048, 2560))
    v = position_metrics(verifier, doc, buckets=buckets)
    d = position_metrics(drafter, doc, buckets=buckets)
    assert v["0-2K"]["loss"] < d["0-2K"]["loss"]
    short = position_metrics(verifier, doc, window=256, buckets=buckets)
    assert v["2-2K"]["loss"] < short["2-2K"]["loss"]


def test_budgetdraft_drafter_beats_the_base_drafter_on_a_sparse_cache(pair):
    verifier, base, _ = pair
    _, trained, _ = load_pair()  # drafter="budgetdraft"
    ids = eval_documents()[5][None, :3072]
    rates = []
    for drafter in (base, trained):
        out = speculative_generate(verifier, ids, assistant_model=drafter, draft_cache="chunk", kv_budget=256,
                                   num_assistant_tokens=4, max_new_tokens=40, return_dict_in_generate=True)
        rates.append(out.spec_stats["acceptance_rate"])
    assert rates[1] > 2 * rates[0] and rates[1] > rates[0] + 0.03, rates


def test_window_mask():
    m = window_mask(6, 3, "cpu")[0, 0]
    assert m[5].tolist() == [False, False, False, True, True, True]
    assert m[1].tolist() == [True, True, False, False, False, False]


def _source_tree(root):
    (root / "alpha").mkdir()
    (root / "alpha" / "__init__.py").write_text("A = 1\n")
    (root / "alpha" / "core.py").write_text("def f():\n    return 2\n" * 50)
    (root / "alpha" / "copy.py").write_text("A = 1\n")  # exact duplicate of alpha/__init__.py
    (root / "beta.py").write_text("import alpha\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.py").write_text("skipped = True\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "y.py").write_text("skipped = True\n")


def test_python_source_documents(tmp_path):
    _source_tree(tmp_path)
    train = list(python_source_documents("train", roots=[tmp_path], eval_fraction=0.0, max_doc_chars=700))
    assert [d.package for d in train] == ["alpha", "alpha", "beta"]  # alpha cut at a file boundary
    alpha = "".join(d.text for d in train if d.package == "alpha")
    assert alpha.startswith("# ==== file: alpha/__init__.py ====\nA = 1\n")
    assert "alpha/copy.py" not in alpha and "skipped" not in "".join(d.text for d in train)
    assert list(python_source_documents("eval", roots=[tmp_path], eval_fraction=0.0)) == []
    both = list(python_source_documents("eval", roots=[tmp_path], eval_fraction=1.0))
    assert {d.package for d in both} == {"alpha", "beta"}
    assert split_of("alpha", 0.5) == split_of("alpha", 0.5)
    with pytest.raises(ValueError, match="split"):
        next(python_source_documents("test", roots=[tmp_path]))


def test_documents_from_local_files_and_token_sequences(tmp_path, pair):
    tokenizer = pair[2]
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x = 1"}) + "\n" + json.dumps({"body": "y = 2"}) + "\n")
    assert list(documents(str(tmp_path / "a.jsonl"), text_field="body")) == ["x = 1", "y = 2"]
    with pytest.raises(ValueError, match="no column"):
        list(documents(str(tmp_path / "a.jsonl")))
    txt = tmp_path / "txt"
    txt.mkdir()
    (txt / "one.txt").write_text("line one\nline two\n")
    assert list(documents(str(txt))) == ["line one\nline two\n"]
    seqs = list(token_sequences(["def f(): pass"] * 10, tokenizer, 7))
    flat = torch.cat(seqs)
    assert all(len(s) == 7 for s in seqs) and (flat == tokenizer.eos_token_id).sum() >= 1
    one = tokenizer("def f(): pass", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert flat[: len(one)].tolist() == one


def test_zoo_pipeline_smoke(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"pkg{i}").mkdir()
        (src / f"pkg{i}" / "mod.py").write_text("".join(f"def function_{i}_{j}(x):\n    return x * {j}\n" for j in range(900)))
    assert {split_of(f"pkg{i}", 0.3) for i in range(12)} == {"train", "eval"}
    work, pair_dir = tmp_path / "work", tmp_path / "pair"
    build_main(["data", "--work", str(work), "--roots", str(src), "--vocab-size", "300", "--eval-fraction", "0.3"])
    data = json.loads((work / "data.json").read_text())
    assert data["train_documents"] > 0 and data["eval_documents"] > 0
    for model in ("verifier", "drafter"):
        build_main(["train", "--work", str(work), "--model", model, "--max-steps", "2", "--seq-len", "64",
                    "--device", "cpu"])
    build_main(["export", "--work", str(work), "--to", str(pair_dir)])
    with pytest.raises(FileNotFoundError, match="drafter-budgetdraft"):
        load_pair(pair_dir)
    verifier, drafter, tokenizer = load_pair(pair_dir, drafter="base")
    assert len(tokenizer) == 300 and verifier.config.num_hidden_layers == 12
    assert json.loads((pair_dir / "verifier" / "training.json").read_text())["steps"] == 2
