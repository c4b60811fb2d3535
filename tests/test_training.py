"""BudgetDraft training (Alg. 1) on tiny float64 models: views against independent references, the objective's
gradient, budget sampling, a short run that raises sparse-cache acceptance, checkpoints/resume, the CLI, model cards
and the Hub push (up to the HTTP boundary; a real server round trip runs only where one is configured)."""

from __future__ import annotations

import copy
import json
import math
import os
import string
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hf_sparsekv import ChunkBudgetCache
from hf_sparsekv.generation import speculative_generate
from hf_sparsekv.training import BudgetDraftTrainer, BudgetSampler, EvalSettings, TrainingConfig, measure_acceptance
from hf_sparsekv.training import acceptance_table
from hf_sparsekv.training.checkpoint import latest_checkpoint
from hf_sparsekv.training.objective import teacher_targets
from hf_sparsekv.training.views import prefill_prefix

from .conftest import ARCHS, VOCAB, prompt, tiny_model, torchrun_two


def _drafter(arch="llama", layers=None, seed=0):
    model = copy.deepcopy(tiny_model(arch, role="drafter", seed=seed, layers=layers))
    model.set_attn_implementation("sparsekv")
    return model


def _config(**kw):
    base = dict(seq_len=96, continuation_len=16, prefill_chunk=32, budgets=[16, 32], budget_weights=[0.5, 0.5],
                lr=1e-3, warmup_steps=2, max_steps=10)
    base.update(kw)
    return TrainingConfig(**base)


def _sequences(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(3, VOCAB, (length,), generator=g)


def _kept_chunks(indices: torch.Tensor, p: int, s: int) -> list[int]:
    """Chunk ids (token // s) covered by ``indices`` [N], checking every chunk is whole (or the trailing partial)."""
    tokens = indices.tolist()
    chunks = sorted({t // s for t in tokens})
    expected = [c * s + o for c in chunks for o in range(s) if c * s + o < p]
    assert tokens == expected, "kept tokens are not whole chunks in ascending order"
    return chunks


# ----------------------------------------------------------------------------------------------- config, sampling
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budgets=[4], budget_weights=[1.0]), "chunk_size"),
        (dict(budgets=[16, 32], budget_weights=[1.0]), "same length"),
        (dict(continuation_len=96), "smaller than seq_len"),
        (dict(loss="kl"), "loss must be one of"),
        (dict(budget_weights=[0.0, 0.0]), "positive sum"),
        (dict(lam=-1.0), "lam"),
        (dict(seq_len=0), "seq_len"),
        (dict(selection="snap"), "selection"),
        (dict(selection="observed", score_window=16), "score_window"),  # belongs to selection="cumulative"
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)


def test_paper_defaults():
    c = TrainingConfig()
    assert (c.seq_len, c.continuation_len, c.prefix_len, c.chunk_size, c.lam) == (16384, 256, 16128, 8, 0.5)
    assert c.budgets == [256, 512, 1024, 2048] and c.budget_weights == [0.4, 0.3, 0.2, 0.1]
    assert (c.lr, c.weight_decay, c.warmup_steps, c.clip_norm, c.loss) == (1e-5, 0.01, 150, 1.0, "budgetdraft")


def test_budget_sampling_follows_weights():
    budgets, weights = [256, 512, 1024, 2048], [0.4, 0.3, 0.2, 0.1]
    sampler = BudgetSampler(budgets, weights, seed=3)
    n = 20000
    draws = [sampler.sample() for _ in range(n)]
    for b, w in zip(budgets, weights):
        freq = draws.count(b) / n
        assert abs(freq - w) < 4 * math.sqrt(w * (1 - w) / n), (b, freq, w)
    # reproducible, resumable, and a zero weight is never drawn
    again = BudgetSampler(budgets, weights, seed=3)
    assert [again.sample() for _ in range(50)] == draws[:50]
    state = sampler.state_dict()
    nxt = [sampler.sample() for _ in range(20)]
    sampler.load_state_dict(state)
    assert [sampler.sample() for _ in range(20)] == nxt
    only = BudgetSampler([16, 32], [0.0, 1.0])
    assert {only.sample() for _ in range(200)} == {32}


# ----------------------------------------------------------------------------------------------- views
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("p, budget, selection", [(84, 32, "observed"), (96, 16, "cumulative"), (77, 64, "observed"),
                                                  (40, 64, "observed"), (300, 64, "observed")])
def test_sparse_view_is_the_inference_selection(arch, p, budget, selection):
    """Chunked training prefill + selection == ChunkBudgetCache after one inference prefill; ⌊B/s⌋ whole chunks."""
    drafter = _drafter(arch, layers=2)
    ids = prompt(p + 12, seed=p)
    prefix = prefill_prefix(drafter, ids[:, :p], chunk=24)
    view = prefix.sparse_view(budget, selection=selection)
    cache = ChunkBudgetCache(budget, selection=selection)
    with torch.no_grad():
        drafter(input_ids=ids[:, :p], past_key_values=cache, use_cache=True)
    for layer_idx in range(2):
        kept = view.kept_indices[layer_idx]
        assert kept.shape[:2] == (1, 1)
        chunks = _kept_chunks(kept[0, 0], p, 8)
        assert len(chunks) == min(budget // 8, math.ceil(p / 8))
        if p > budget:
            assert torch.equal(kept, cache.layers[layer_idx].kept_indices)
            torch.testing.assert_close(view.cache.layers[layer_idx].keys, cache.layers[layer_idx].keys, rtol=0, atol=1e-12)
        assert view.cache.layers[layer_idx].seen == p
    positions = torch.arange(p, p + 12).unsqueeze(0)
    ours = drafter(input_ids=ids[:, p:], past_key_values=view.cache, position_ids=positions).logits
    ref = drafter(input_ids=ids[:, p:], past_key_values=cache, position_ids=positions).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)


def _eager_chunk_selection(drafter, prefix_ids, budget, s=8):
    """Independent selection: eager attention probabilities of the prefix, summed over heads and queries, best
    ⌊B/s⌋ − [tail] full chunks by brute-force sort, plus the trailing partial chunk."""
    model = copy.deepcopy(drafter)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attn = model(input_ids=prefix_ids, output_attentions=True).attentions[0]  # [1, H, P, P]
    p = prefix_ids.shape[1]
    token_scores = attn[0].sum(dim=(0, 1))
    n_full, tail = divmod(p, s)
    chunk_scores = token_scores[: n_full * s].view(n_full, s).sum(-1)
    n_keep = budget // s - (1 if tail else 0)
    best = sorted(torch.argsort(chunk_scores, descending=True)[:n_keep].tolist())
    return [c * s + o for c in best for o in range(s)] + list(range(n_full * s, p))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("p, budget", [(84, 32), (101, 24), (64, 16)])
def test_sparse_branch_equals_masked_full_attention(arch, p, budget):
    """Sparse-branch logits == one full forward over [prefix; continuation] at positions 0..T-1 with a boolean mask
    letting continuation queries see only the kept prefix tokens (1 layer, so one kept set)."""
    drafter = _drafter(arch, layers=1)
    c = 10
    ids = prompt(p + c, seed=7 * p)
    prefix = prefill_prefix(drafter, ids[:, :p], chunk=16)
    view = prefix.sparse_view(budget, selection="cumulative")  # the paper's score, which the reference computes
    kept = view.kept_indices[0][0, 0].tolist()
    assert kept == _eager_chunk_selection(drafter, ids[:, :p], budget)
    assert view.cache.layers[0].keys.shape[-2] == len(kept) <= budget

    positions = torch.arange(p, p + c).unsqueeze(0)
    sparse_logits = drafter(input_ids=ids[:, p:], past_key_values=view.cache, position_ids=positions).logits
    t = p + c
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    dropped = sorted(set(range(p)) - set(kept))
    mask[p:, dropped] = False
    ref = drafter(input_ids=ids, attention_mask=mask[None, None]).logits[:, p:]
    torch.testing.assert_close(sparse_logits, ref, rtol=0, atol=1e-10)
    # The view is read-only: the full view still holds every prefix token afterwards.
    full = drafter(input_ids=ids[:, p:], past_key_values=prefix.full_view(), position_ids=positions).logits
    torch.testing.assert_close(full, drafter(input_ids=ids).logits[:, p:], rtol=0, atol=1e-10)


def test_prefill_requires_the_sparsekv_attention():
    drafter = copy.deepcopy(tiny_model("llama", role="drafter"))
    with pytest.raises(ValueError, match="sparsekv"):
        prefill_prefix(drafter, prompt(20, 0), chunk=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_teacher_targets_are_the_verifiers_greedy_tokens(arch):
    verifier = tiny_model(arch)
    ids = prompt(90, seed=1)
    targets = teacher_targets(verifier, ids, 70, prefill_chunk=16)
    with torch.no_grad():
        ref = verifier(input_ids=ids).logits[0, 70:].argmax(-1)
    assert torch.equal(targets, ref)


# ----------------------------------------------------------------------------------------------- objective, step
def _reference_gradients(verifier, drafter, ids, cfg, budget):
    """∇(L_A + λ·L_C) the plain HF way: one unchunked no-grad prefill into a DynamicCache, then the continuation at
    positions P..T-1 on copies of it; L_C through a boolean mask hiding the prefix tokens the eager-attention
    selection drops."""
    from transformers import DynamicCache

    model = copy.deepcopy(drafter)
    model.zero_grad(set_to_none=True)
    p, t = cfg.prefix_len, cfg.seq_len
    cont, pos = ids[:, p:], torch.arange(p, t).unsqueeze(0)
    with torch.no_grad():
        targets = verifier(input_ids=ids).logits[0, p:].argmax(-1)
        prefix = DynamicCache()
        model(input_ids=ids[:, :p], past_key_values=prefix, use_cache=True)
    logits_a = model(input_ids=cont, past_key_values=copy.deepcopy(prefix), position_ids=pos).logits[0]
    loss = F.cross_entropy(logits_a.float(), targets)
    if cfg.loss == "budgetdraft":
        kept = _eager_chunk_selection(drafter, ids[:, :p], budget, cfg.chunk_size)
        mask = torch.ones(t - p, t, dtype=torch.bool)
        mask[:, p:] = torch.tril(torch.ones(t - p, t - p, dtype=torch.bool))
        mask[:, sorted(set(range(p)) - set(kept))] = False
        logits_c = model(input_ids=cont, past_key_values=copy.deepcopy(prefix), position_ids=pos,
                         attention_mask=mask[None, None]).logits[0]
        loss = loss + cfg.lam * F.cross_entropy(logits_c.float(), targets)
    loss.backward()
    return {n: q.grad for n, q in model.named_parameters()}


@pytest.mark.parametrize("loss", ["budgetdraft", "la-only"])
def test_gradient_is_that_of_la_plus_lambda_lc(loss):
    verifier = tiny_model("llama")
    cfg = _config(loss=loss, lam=0.7, selection="cumulative")  # the selection _reference_gradients computes
    trainer = BudgetDraftTrainer(verifier, _drafter(layers=1), cfg)
    ids = prompt(cfg.seq_len, seed=5)
    terms = trainer.accumulate_gradients(ids, budget=32)
    assert (terms["budget"] is None) == (loss == "la-only")
    ref = _reference_gradients(verifier, trainer.model, ids, cfg, 32)
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(param.grad, ref[name], rtol=1e-7, atol=1e-9, msg=name)


def test_one_step_changes_only_the_drafter():
    verifier = tiny_model("qwen2")
    before_v = {n: t.clone() for n, t in verifier.state_dict().items()}
    drafter = _drafter("qwen2", layers=2)
    before_d = {n: t.clone() for n, t in drafter.state_dict().items()}
    trainer = BudgetDraftTrainer(verifier, drafter, _config())
    result = trainer.train_step(prompt(96, seed=2))
    assert result.step == trainer.step == 1 and result.budget in (16, 32) and result.lr > 0
    assert all(torch.equal(t, before_v[n]) for n, t in verifier.state_dict().items())
    assert all(p.grad is None and not p.requires_grad for p in verifier.parameters())
    changed = [n for n, t in drafter.state_dict().items() if not torch.equal(t, before_d[n])]
    trainable = [n for n, p in drafter.named_parameters()]
    assert set(changed) == set(trainable), set(trainable) - set(changed)
    trainer.end_training()  # one process: nothing to destroy; the trained drafter stays reachable
    assert trainer.model is drafter and trainer.optimizer is None


def test_gradient_checkpointing_gives_the_same_gradients():
    verifier = tiny_model("llama")
    ids = prompt(96, seed=9)
    grads, forwards = [], []
    for ckpt in (False, True):
        trainer = BudgetDraftTrainer(verifier, _drafter(layers=2), _config(gradient_checkpointing=ckpt))
        count = [0]
        trainer.model.model.layers[0].self_attn.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        trainer.accumulate_gradients(ids, budget=16)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        forwards.append(count[0])
    # 3 prefill chunks + 2 branches; with checkpointing both branches are recomputed in backward, cache and all.
    assert forwards == [5, 7]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-9, atol=1e-12, msg=name)


def test_bf16_autocast_step_keeps_float32_weights():
    verifier = copy.deepcopy(tiny_model("qwen2")).float()
    drafter = copy.deepcopy(tiny_model("qwen2", role="drafter")).float()
    drafter.set_attn_implementation("sparsekv")
    trainer = BudgetDraftTrainer(verifier, drafter, _config(bf16=True))
    result = trainer.train_step(prompt(96, seed=3))
    assert math.isfinite(result.loss) and result.loss_c is not None
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


def test_bad_inputs_are_rejected():
    verifier = tiny_model("llama")
    trainer = BudgetDraftTrainer(verifier, _drafter(), _config())
    with pytest.raises(ValueError, match=r"shape \[96\]"):
        trainer.train_step(prompt(95, seed=0))
    with pytest.raises(ValueError, match="integer tensor"):
        trainer.train_step(torch.zeros(96))
    with pytest.raises(ValueError, match="separate model"):
        BudgetDraftTrainer(verifier, verifier, _config())
    other = copy.deepcopy(tiny_model("llama", role="drafter"))
    other.resize_token_embeddings(VOCAB + 8)
    with pytest.raises(ValueError, match="vocab_size"):
        BudgetDraftTrainer(verifier, other, _config())


# ----------------------------------------------------------------------------------------------- acceptance
def test_measure_acceptance_pools_spec_stats():
    verifier, drafter = tiny_model("mistral"), tiny_model("mistral", role="drafter")
    prompts = [prompt(80, seed=s) for s in (1, 2)]
    res = measure_acceptance(verifier, drafter, prompts, contexts=[48, 80], budgets=[16, None], gamma=3,
                             max_new_tokens=12)
    assert set(res) == {48, 80} and set(res[80]) == {16, "full"}
    accepted = drafted = 0
    for p in prompts:
        out = speculative_generate(verifier, p[:, :80], assistant_model=drafter, draft_cache="chunk", kv_budget=16,
                                   num_assistant_tokens=3, max_new_tokens=12, eos_token_id=None,
                                   return_dict_in_generate=True)
        assert out.sequences.shape[1] == 92
        accepted += out.spec_stats["accepted"]
        drafted += out.spec_stats["drafted"]
    cell = res[80][16]
    assert (cell["accepted"], cell["drafted"]) == (accepted, drafted)
    assert cell["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert acceptance_table(res)[80][16] == cell["acceptance_rate"]
    with pytest.raises(ValueError, match="longer than the shortest prompt"):
        measure_acceptance(verifier, drafter, prompts, contexts=[81], budgets=[16])


def test_training_raises_sparse_cache_acceptance():
    """A few hundred steps on random token sequences: greedy acceptance of the trained drafter on a sparse cache
    beats the untrained drafter's at every budget, and L_A, L_C go down."""
    verifier = tiny_model("llama")
    cfg = _config(seq_len=160, continuation_len=32, prefill_chunk=64, budgets=[16, 32, 64],
                  budget_weights=[0.4, 0.3, 0.3], lr=3e-3, warmup_steps=10, max_steps=300)
    trainer = BudgetDraftTrainer(verifier, _drafter(), cfg)
    settings = EvalSettings([prompt(160, seed=100 + i) for i in range(3)], contexts=[128], budgets=[16, 32, 64],
                            gamma=4, max_new_tokens=32)
    history = trainer.train(_sequences(160), eval_settings=settings, progress=False)
    before, after = acceptance_table(history["eval"][0]["acceptance"]), acceptance_table(history["eval"][-1]["acceptance"])
    assert history["eval"][0]["step"] == 0 and history["eval"][-1]["step"] == 300
    for b in (16, 32, 64):
        assert after[128][b] > before[128][b] + 0.2, (b, before, after)
    steps = history["steps"]
    first = sum(s["loss_c"] for s in steps[:20]) / 20
    last = sum(s["loss_c"] for s in steps[-20:]) / 20
    assert last < 0.6 * first
    assert {s["budget"] for s in steps} == {16, 32, 64}


# ----------------------------------------------------------------------------------------------- checkpoints
def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    verifier = tiny_model("llama")
    cfg = _config(max_steps=6)
    straight = BudgetDraftTrainer(verifier, _drafter(layers=2), cfg)
    straight.train(_sequences(96, seed=4), progress=False)

    first = BudgetDraftTrainer(verifier, _drafter(layers=2), _config(max_steps=6))
    first.config.max_steps = 3  # interrupted after 3 steps (the schedule still spans 6)
    first.train(_sequences(96, seed=4), output_dir=tmp_path, progress=False)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt == tmp_path / "checkpoint-3" and (ckpt / "model.safetensors").is_file()
    resumed = BudgetDraftTrainer(verifier, _drafter(layers=2), cfg)
    resumed.load_checkpoint(ckpt)
    assert resumed.step == 3
    resumed.train(_sequences(96, seed=4), progress=False)
    assert [s["budget"] for s in resumed.history["steps"]] == [s["budget"] for s in straight.history["steps"]]
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="seq_len"):
        BudgetDraftTrainer(verifier, _drafter(layers=2), _config(seq_len=128)).load_checkpoint(ckpt)


# ----------------------------------------------------------------------------------------------- CLI, card, Hub
def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = (" \n" + string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation)[: VOCAB - 4]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


@pytest.fixture
def pair_dirs(tmp_path):
    verifier_dir, drafter_dir = tmp_path / "verifier", tmp_path / "drafter"
    tiny_model("llama").save_pretrained(verifier_dir)
    _char_tokenizer().save_pretrained(verifier_dir)
    tiny_model("llama", role="drafter").save_pretrained(drafter_dir)
    data = tmp_path / "data"
    data.mkdir()
    for split, seed in (("train", 0), ("eval", 1)):
        g = torch.Generator().manual_seed(seed)
        with open(data / f"{split}.jsonl", "w") as f:
            for _ in range(12):
                words = ["".join(string.ascii_lowercase[i] for i in torch.randint(0, 26, (5,), generator=g).tolist())
                         for _ in range(30)]
                f.write(json.dumps({"content": " ".join(words)}) + "\n")
    return verifier_dir, drafter_dir, data


def _cli(verifier_dir, drafter_dir, data, out, *extra):
    from hf_sparsekv.cli import main

    return main([
        "train-drafter", "--verifier", str(verifier_dir), "--drafter", str(drafter_dir),
        "--data", str(data / "train.jsonl"), "--eval-data", str(data / "eval.jsonl"), "--text-field", "content",
        "--output", str(out), "--seq-len", "128", "--continuation-len", "16", "--prefill-chunk", "48",
        "--budgets", "16", "32", "--eval-contexts", "96", "--eval-budgets", "16", "32", "--eval-samples", "1",
        "--eval-new-tokens", "8", "--gamma", "3", "--lr", "1e-3", "--warmup-steps", "1", "--no-progress",
        "--drafter-dtype", "float64", "--verifier-dtype", "float64", *extra,
    ])


def test_cli_trains_saves_resumes_and_writes_the_card(pair_dirs, tmp_path):
    verifier_dir, drafter_dir, data = pair_dirs
    out = tmp_path / "run"
    assert _cli(verifier_dir, drafter_dir, data, out, "--max-steps", "3", "--save-every", "2", "--eval-every", "2") == 0
    assert (out / "checkpoint-2" / "trainer_state.pt").is_file() and (out / "checkpoint-3").is_dir()
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 2, 3]
    assert [e["budget"] in (16, 32) for e in events if e["event"] == "step"] == [True] * 3
    card = (out / "README.md").read_text()
    for text in (str(verifier_dir), "{16, 32}", "| 96 | untrained |", "| 96 | step 3 |", "Intended use", "Limitations",
                 "library_name: transformers"):
        assert text in card, text
    assert "There was no held-out data" not in card  # --eval-data was given
    snippet = card.split("## Use")[1].split("```python")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(snippet, "card-use-snippet", "exec"), namespace)  # the card's "Use" snippet runs as written
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 256
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    ckpt3 = AutoModelForCausalLM.from_pretrained(out / "checkpoint-3", dtype=torch.float64)
    untouched = tiny_model("llama", role="drafter")
    for (name, a), b, c in zip(trained.state_dict().items(), ckpt3.state_dict().values(), untouched.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(trained.state_dict().values(), untouched.state_dict().values()))

    assert _cli(verifier_dir, drafter_dir, data, out, "--max-steps", "4", "--resume-from", "latest", "--no-eval") == 0
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["config"]["budgets"] == [16, 32]
    with pytest.raises(SystemExit):  # a fresh run would overwrite its checkpoints and append to its metrics
        _cli(verifier_dir, drafter_dir, data, out, "--max-steps", "1", "--no-eval")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == len(events) + 1  # the resumed step 4 only


def test_cli_takes_the_tokenizer_from_its_own_folder_and_refuses_bad_settings_before_loading(pair_dirs, tmp_path,
                                                                                               capsys):
    verifier_dir, drafter_dir, data = pair_dirs
    bare, tokenizer_dir = tmp_path / "bare-verifier", tmp_path / "tokenizer"
    tiny_model("llama").save_pretrained(bare)  # no tokenizer files, as in the bundled pair
    _char_tokenizer().save_pretrained(tokenizer_dir)
    out = tmp_path / "run"
    assert _cli(bare, drafter_dir, data, out, "--tokenizer", str(tokenizer_dir), "--max-steps", "1", "--no-eval") == 0
    assert (out / "checkpoint-1").is_dir()
    # The card's "Use" snippet loads the tokenizer from the drafter's folder (train-drafter saved it there), not from
    # the verifier's, which has none: its lines up to the prompt's ids run as written (generate: the test above).
    snippet = (out / "README.md").read_text().split("## Use")[1].split("```python")[1].split("```")[0]
    assert f'AutoTokenizer.from_pretrained("{out}")' in snippet
    namespace: dict = {}
    exec(compile(snippet.split("out = ")[0], "card-use-snippet", "exec"), namespace)
    assert namespace["ids"].shape[1] > 0
    with pytest.raises(SystemExit) as exit_info:  # no --tokenizer: one line naming it, before any model loads
        _cli(bare, drafter_dir, data, tmp_path / "no-tokenizer", "--max-steps", "1", "--no-eval")
    assert exit_info.value.code == 2 and "holds no tokenizer" in capsys.readouterr().err
    for extra, message in ((("--budgets", "4"), "budgets"), (("--tokenizer", "/no/such/dir"), "no such file")):
        with pytest.raises(SystemExit) as exit_info:
            _cli(verifier_dir, drafter_dir, data, tmp_path / "other", "--max-steps", "1", *extra)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cli_without_eval_data_says_there_is_no_held_out_data(pair_dirs, tmp_path, capsys):
    from hf_sparsekv.cli import main

    verifier_dir, drafter_dir, data = pair_dirs
    out = tmp_path / "run"
    assert main([
        "train-drafter", "--verifier", str(verifier_dir), "--drafter", str(drafter_dir),
        "--data", str(data / "train.jsonl"), "--text-field", "content", "--output", str(out), "--seq-len", "128",
        "--continuation-len", "16", "--prefill-chunk", "48", "--budgets", "16", "--eval-contexts", "96",
        "--eval-budgets", "16", "--eval-samples", "1", "--eval-new-tokens", "4", "--max-steps", "1", "--eval-every", "0",
        "--warmup-steps", "1", "--no-progress", "--drafter-dtype", "float64", "--verifier-dtype", "float64",
    ]) == 0
    assert "there is no held-out data" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "There was no held-out data" in card and "prompt(s) of the training data" in card
    assert "held-out prompt(s)" not in card


class _RecordingHubApi:
    """Stands in for ``HfApi`` at the HTTP boundary: records what would be sent and copies the files that
    ``upload_folder`` would upload (after its ignore patterns) into ``self.repo``."""

    def __init__(self, repo: Path):
        self.repo, self.calls = repo, []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, **kwargs):
        import shutil

        from huggingface_hub.utils import filter_repo_objects

        self.calls.append(("upload_folder", repo_id, kwargs))
        root = Path(folder_path)
        files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
        for rel in filter_repo_objects(files, ignore_patterns=ignore_patterns):
            (self.repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / rel, self.repo / rel)
        return type("CommitInfo", (), {"commit_url": f"local://{repo_id}/commit/0"})()


def _trained_folder(tmp_path):
    from hf_sparsekv.training.hub import render_model_card

    verifier = tiny_model("llama")
    cfg = _config(max_steps=2)
    trainer = BudgetDraftTrainer(verifier, _drafter(), cfg)
    settings = EvalSettings([prompt(96, seed=1)], contexts=[64], budgets=[16, 32], gamma=3, max_new_tokens=8)
    out = tmp_path / "drafter"
    history = trainer.train(_sequences(96), output_dir=out, eval_settings=settings, progress=False)
    trainer.model.save_pretrained(out)
    card = render_model_card(repo_id="someone/tiny-budgetdraft", verifier_id="someone/tiny-verifier",
                             drafter_base="someone/tiny-drafter", data="synthetic", config=cfg, steps=trainer.step,
                             evals=history["eval"], eval_info={"gamma": 3, "max_new_tokens": 8, "samples": 1,
                                                                "data": "synthetic"}, dataset_ids=["someone/data"])
    card.save(out / "README.md")
    return trainer, out


def test_push_to_hub_up_to_the_http_boundary(tmp_path):
    """Not a server test: ``push_to_hub`` calls ``HfApi`` correctly and what it would upload reloads as the same
    drafter with a valid card."""
    from huggingface_hub import ModelCard

    from hf_sparsekv.training.hub import push_to_hub

    trainer, folder = _trained_folder(tmp_path)
    api = _RecordingHubApi(tmp_path / "remote")
    url = push_to_hub(folder, "someone/tiny-budgetdraft", private=True, api=api)
    assert url.startswith("local://someone/tiny-budgetdraft")
    assert api.calls[0] == ("create_repo", "someone/tiny-budgetdraft", {"repo_type": "model", "private": True,
                                                                        "exist_ok": True})
    uploaded = sorted(p.name for p in (tmp_path / "remote").rglob("*") if p.is_file())
    assert "model.safetensors" in uploaded and "README.md" in uploaded and "config.json" in uploaded
    assert not any(n.endswith(".pt") or n == "metrics.jsonl" for n in uploaded)
    assert not (tmp_path / "remote" / "checkpoint-2").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "remote", dtype=torch.float64)
    for (name, a), b in zip(trainer.model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    card = ModelCard.load(tmp_path / "remote" / "README.md")
    assert card.data.base_model == "someone/tiny-drafter" and card.data.datasets == ["someone/data"]
    assert "speculative-decoding" in card.data.tags
    assert "| 64 | untrained |" in card.text and "| 64 | step 2 |" in card.text
    with pytest.raises(ValueError, match="README.md"):
        (folder / "README.md").unlink()
        push_to_hub(folder, "someone/x", api=api)


def _unreachable_hub(*args, **kwargs):
    """Stands in for ``HfApi`` where the server cannot be reached: every call raises the HTTP client's own
    connection error (httpx's ``ConnectError`` on huggingface_hub 1.x and later)."""
    import sys

    from huggingface_hub.errors import HTTPError

    client = sys.modules[HTTPError.__module__]
    refused = getattr(client, "ConnectError", None) or client.ConnectionError

    class Unreachable:
        def create_repo(self, *args, **kwargs):
            raise refused("[Errno 111] Connection refused")

        upload_folder = create_repo

    return Unreachable()


def test_a_push_that_cannot_reach_the_hub_says_how_to_push_later(pair_dirs, tmp_path, monkeypatch, capsys):
    """train-drafter --push-to-hub to an unreachable endpoint: the drafter is saved, one line says the push failed,
    where the drafter is and the command that pushes it later, and the exit status is 1; that command (push-drafter)
    then pushes the saved folder."""
    import shlex

    import hf_sparsekv_cli
    from hf_sparsekv.training import hub

    verifier_dir, drafter_dir, data = pair_dirs
    out = tmp_path / "run"
    monkeypatch.setattr(hub, "HfApi", _unreachable_hub)
    assert _cli(verifier_dir, drafter_dir, data, out, "--max-steps", "1", "--no-eval", "--push-to-hub", "someone/x",
                "--hub-endpoint", "http://127.0.0.1:9") == 1
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    lines = [line for line in capsys.readouterr().err.splitlines() if "push" in line]
    assert len(lines) == 1 and "the push to someone/x failed (ConnectError: [Errno 111] Connection refused)" in lines[0]
    command = lines[0].split("push it later with: ")[1]
    assert f"the drafter is saved in {out}" in lines[0]
    assert shlex.split(command) == ["hf-sparsekv", "push-drafter", str(out), "someone/x", "--hub-endpoint",
                                    "http://127.0.0.1:9"]

    assert hf_sparsekv_cli.main(shlex.split(command)[1:]) == 1  # still unreachable: the same line
    assert "push it later with: " + command in capsys.readouterr().err
    remote = tmp_path / "remote"
    api = _RecordingHubApi(remote)
    monkeypatch.setattr(hub, "HfApi", lambda endpoint=None, token=None: api)
    assert hf_sparsekv_cli.main(shlex.split(command)[1:]) == 0
    assert "pushed to local://someone/x" in capsys.readouterr().out
    assert (remote / "model.safetensors").is_file() and not (remote / "checkpoint-1").exists()


@pytest.mark.skipif(
    not os.environ.get("HF_SPARSEKV_TEST_HUB_ENDPOINT"),
    reason="no Hub-compatible server configured (set HF_SPARSEKV_TEST_HUB_ENDPOINT and HF_TOKEN); hf-local-hub 3.0.0 "
    "on PyPI ships only a client CLI, without the server binary",
)
def test_push_and_reload_through_a_real_hub_server(tmp_path):
    from huggingface_hub import snapshot_download

    from hf_sparsekv.training.hub import push_to_hub

    endpoint = os.environ["HF_SPARSEKV_TEST_HUB_ENDPOINT"]
    trainer, folder = _trained_folder(tmp_path)
    repo = os.environ.get("HF_SPARSEKV_TEST_HUB_REPO", "hf-sparsekv-test/tiny-budgetdraft")
    push_to_hub(folder, repo, endpoint=endpoint)
    local = snapshot_download(repo, endpoint=endpoint, cache_dir=tmp_path / "cache")
    reloaded = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float64)
    for (name, a), b in zip(trainer.model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name


_DDP_SCRIPT = r'''
import copy, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from tests.conftest import prompt, tiny_model
from hf_sparsekv.cache_keyword import cache_keyword
from hf_sparsekv.training import BudgetDraftTrainer, TrainingConfig
from hf_sparsekv.training.objective import continuation_logits, teacher_targets, top1_loss
from hf_sparsekv.training.views import prefill_prefix

cfg = TrainingConfig(seq_len=96, continuation_len=16, prefill_chunk=32, budgets=[16, 32], budget_weights=[0.5, 0.5],
                     lr=1e-3, warmup_steps=1, max_steps=3, lam=0.5)
drafter = copy.deepcopy(tiny_model("llama", role="drafter", layers=2))
trainer = BudgetDraftTrainer(tiny_model("llama"), drafter, cfg)
acc = trainer.accelerator
assert acc.num_processes == 2, acc.num_processes
rank = acc.process_index
seq = prompt(96, seed=10 + rank).to(acc.device)  # different data on each process
local = copy.deepcopy(trainer.model)  # plain module: this process's own gradient, no DDP
assert isinstance(trainer.drafter, torch.nn.parallel.DistributedDataParallel)
assert cache_keyword(trainer.drafter) == cache_keyword(local)  # DDP's forward(*inputs, **kwargs) hides the name
prefix = prefill_prefix(local, seq[:, :80], 32)
targets = teacher_targets(trainer.verifier, seq, 80, 32)
la, _ = top1_loss(continuation_logits(local, seq[:, 80:], prefix.full_view(), 80), targets)
lc, _ = top1_loss(continuation_logits(local, seq[:, 80:], prefix.sparse_view(16, selection=cfg.selection).cache, 80),
                  targets)
(la + 0.5 * lc).backward()
trainer.accumulate_gradients(seq, budget=16)
for (name, p), q in zip(trainer.model.named_parameters(), local.parameters()):
    expected = q.grad.clone()
    dist.all_reduce(expected)
    torch.testing.assert_close(p.grad, expected / 2, rtol=1e-9, atol=1e-12, msg=name)
trainer.optimizer.zero_grad()
trainer.train([prompt(96, seed=20 + i) for i in range(6)], progress=False)  # 3 each
flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(gathered, flat)
assert torch.equal(gathered[0], gathered[1])
open(f"rank{rank}.ok", "w").write(str(trainer.step))  # cwd: the test's tmp_path
trained = trainer.model
trainer.end_training()
assert not dist.is_initialized() and trainer.model is trained
'''


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.multi_gpu)])
def test_ddp_two_processes_average_the_objective_gradient(tmp_path, backend):
    """Two processes (torchrun; gloo: on CPU, nccl: one GPU each): the synced gradient is the mean over processes of
    each one's ∇(L_A + λ·L_C), though L_A's backward runs without sync; the replicas stay identical while
    training."""
    torchrun_two(_DDP_SCRIPT, tmp_path, {"ACCELERATE_USE_CPU": "true"} if backend == "gloo" else {}, 150)
    assert [(tmp_path / f"rank{r}.ok").read_text() for r in (0, 1)] == ["3", "3"]
