"""Speculative sampling (do_sample=True): the distribution of what is emitted, not tokens.

* ``accept_or_resample`` on random distributions, 200,000 vectorized rounds: the first and second emitted tokens are
  distributed as the verifier's ``p``; a wrong rule (accept every draft) fails the same test.
* End to end on a 16-token vocabulary: the exact joint distribution of the first two tokens under stock sampling
  with temperature, top-k and top-p (computed from the model's logits and transformers' own warpers) against
  speculative samples in each mode with a drafter that often disagrees (the engine's device-side rounds, which the
  CUDA graphs capture, run uncaptured on CPU).

Chi-square tests at significance 0.001 (critical values from the Wilson-Hilferty approximation); the seeds are
fixed, so each test is deterministic, and 0.001 is its false-failure rate over seeds.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.generation.acceptance import accept_or_resample
from hf_sparsekv.generation.sampling import draw

Z_999 = 3.0902  # standard normal quantile at 0.999


def _critical(df: int) -> float:
    """Chi-square critical value at significance 0.001 (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_999 * math.sqrt(c)) ** 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of ``counts`` against ``probs`` (cells with expected count < 5 pooled), degrees of freedom."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def _consistent(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    counts = torch.bincount(samples, minlength=probs.numel())
    stat, df = _chi_square(counts, probs)
    return stat < _critical(df)


def _random_distributions(t: int, rows: int, vocab: int, seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * sharp
    logits[:, -1] = -math.inf  # a token the distribution never takes
    return torch.softmax(logits, -1)[None].expand(t, rows, vocab)


def test_draw_never_picks_a_zero_entry_even_with_infinite_clocks(monkeypatch):
    """A uniform of exactly 0 makes a clock infinite and every ratio 0; the zero entries must still lose."""
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.3, 0.0, 0.7]])
    monkeypatch.setattr(torch, "rand_like", lambda x, dtype=None: torch.zeros_like(x, dtype=dtype))
    assert draw(probs).tolist() == [2, 1]


def _tail_frequency(device: str, tail: int, draws: int) -> float:
    """How often ``draw`` leaves the top entry (0.97) for a tail of ``tail`` equal entries holding 0.03."""
    probs = torch.cat([torch.tensor([0.97]), torch.full((tail,), 0.03 / tail)]).to(device)
    torch.manual_seed(1)
    hits = sum(int((draw(probs.expand(50, -1)) != 0).sum()) for _ in range(draws // 50))
    return hits / draws


@pytest.mark.cuda
def test_draw_keeps_the_mass_of_a_long_tail_on_cuda():
    """600,000 tail entries each 5e-8 of the top one (below float32 clocks' resolution): their 3 % is drawn as often
    as it should be (float32 uniforms drew it about half as often)."""
    freq = _tail_frequency("cuda", 600_000, 200_000)
    assert abs(freq - 0.03) < Z_999 * math.sqrt(0.03 * 0.97 / 200_000)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_accept_or_resample_emits_the_verifier_distribution(k):
    torch.manual_seed(k)
    t, vocab = 200_000, 7
    p = _random_distributions(t, k + 1, vocab, seed=10 + k, sharp=1.5)
    q = _random_distributions(t, k, vocab, seed=20 + k, sharp=2.5)  # a drafter that often disagrees
    drafts = torch.multinomial(q.reshape(-1, vocab), 1).reshape(t, k)
    accepted, token = accept_or_resample(p, q, drafts)
    assert 0 < float((accepted == 0).double().mean()) < 1  # both branches are taken
    first = torch.where(accepted > 0, drafts[:, 0], token)
    assert _consistent(first, p[0, 0])
    # The second emitted token (a round that accepted the first draft): p[1] (here independent of the prefix).
    went_on = accepted > 0
    second = torch.where(accepted[went_on] > 1, drafts[went_on, min(1, k - 1)], token[went_on]) if k > 1 else token[went_on]
    assert _consistent(second, p[0, 1])
    # The deliberately wrong rule (accept every draft) emits q's distribution: the same test must reject it.
    assert not _consistent(drafts[:, 0], p[0, 0])
    assert float(0.5 * (torch.bincount(first, minlength=vocab) / t - p[0, 0]).abs().sum()) < 0.01  # TV distance


VOCAB = 16
WARPERS = dict(temperature=0.7, top_k=8, top_p=0.9)


def _tiny(layers: int, seed: int, width: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


def _stock_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """The next-token distribution of stock sampling with WARPERS (transformers' warpers, stock order)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(WARPERS["temperature"]), TopKLogitsWarper(WARPERS["top_k"]),
                                   TopPLogitsWarper(WARPERS["top_p"])])
    with torch.no_grad():
        logits = model(ids).logits[:, -1].double()
    return torch.softmax(warpers(ids, logits), -1)[0]


def _joint(model, ids: torch.Tensor) -> torch.Tensor:
    """Exact probability of each (first, second) new-token pair, flattened ``[VOCAB * VOCAB]``."""
    first = _stock_probs(model, ids)
    rows = [first[a] * _stock_probs(model, torch.cat([ids, torch.tensor([[a]])], 1)) for a in range(VOCAB)]
    return torch.stack(rows).flatten()


_EXTENDED = pytest.mark.extended  # 60-470 s of CPU each: make test-extended


@pytest.mark.parametrize("mode,gamma", [
    pytest.param("chunk", 3, marks=_EXTENDED), pytest.param("window", 1, marks=_EXTENDED),
    pytest.param("window", 5, marks=_EXTENDED), ("full", 1), pytest.param("int4", 5, marks=_EXTENDED),
])
def test_speculative_sampling_matches_the_exact_joint_distribution(mode, gamma):
    static_engine.release_engines()
    verifier = _tiny(2, seed=0, width=32)
    drafter = _tiny(1, seed=1, width=16)
    # int4: most of the prompt is quantized (G=16 on a 64-token prompt), so the INT4 drafts differ from p
    group = 16
    ids = torch.randint(3, VOCAB, (1, 64 if mode == "int4" else 40),
                        generator=torch.Generator().manual_seed(5))
    joint = _joint(verifier, ids)
    if mode == "int4":
        spec = lambda: dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=group))  # noqa: E731
        joint = _joint_on_int8_view(verifier, ids, group)  # int4 samples AR on the INT8 view
    elif mode == "full":
        spec = lambda: dict(assistant_model=drafter, draft_cache="full")  # noqa: E731
    else:
        spec = lambda: dict(assistant_model=drafter, draft_cache=mode, kv_budget=16)  # noqa: E731
    torch.manual_seed(123)
    samples = []
    for _ in range(2500):
        out = verifier.generate(ids, do_sample=True, max_new_tokens=2, min_new_tokens=2, eos_token_id=None,
                                num_assistant_tokens=gamma, **WARPERS, **spec())
        samples.append(int(out[0, -2]) * VOCAB + int(out[0, -1]))
    samples = torch.tensor(samples)
    assert static_engine.current_engine(verifier).spec.mode == mode
    assert _consistent(samples, joint)
    counts = torch.bincount(samples, minlength=VOCAB * VOCAB).double() / samples.numel()
    assert float(0.5 * (counts - joint).abs().sum()) < 0.08  # TV distance at 2,500 samples over <= 64 cells


def _joint_on_int8_view(model, ids: torch.Tensor, group_size: int) -> torch.Tensor:
    """The exact joint of two new tokens for AR on HierarchicalQuantCache(group_size): the first from the
    full-precision prefill, the second from a step reading the quantized prompt in the INT8 view."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(WARPERS["temperature"]), TopKLogitsWarper(WARPERS["top_k"]),
                                   TopPLogitsWarper(WARPERS["top_p"])])

    def probs(prefix):
        cache = HierarchicalQuantCache(group_size=group_size)
        with torch.no_grad():
            logits = model(prefix[:, : ids.shape[1]], past_key_values=cache).logits[:, -1]
            if prefix.shape[1] > ids.shape[1]:
                logits = model(prefix[:, ids.shape[1] :], past_key_values=cache).logits[:, -1]
        return torch.softmax(warpers(prefix, logits.double()), -1)[0]

    first = probs(ids)
    return torch.stack([first[a] * probs(torch.cat([ids, torch.tensor([[a]])], 1)) for a in range(VOCAB)]).flatten()


def test_sampling_is_reproducible_with_a_seed_and_temperature_to_zero_is_greedy():
    verifier, drafter = _tiny(2, seed=0, width=32), _tiny(1, seed=1, width=16)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
    kwargs = dict(assistant_model=drafter, kv_budget=16, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(verifier.generate(ids, do_sample=True, temperature=0.9, **kwargs))
    assert torch.equal(runs[0], runs[1])
    greedy = verifier.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    cold = verifier.generate(ids, do_sample=True, temperature=1e-4, **kwargs)
    assert torch.equal(cold, greedy)


@pytest.mark.parametrize("output_scores", [False, True])
def test_sampling_reports_acceptance(output_scores):
    """A drafter equal to the verifier (p == q) has every draft accepted on the static loop; scores are picked and kept
    on the host (host-side rules), 12 of them."""
    static_engine.release_engines()
    verifier = _tiny(2, seed=0, width=32)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    out = verifier.generate(ids, assistant_model=copy.deepcopy(verifier), kv_budget=64, do_sample=True,
                            max_new_tokens=12, min_new_tokens=12, return_dict_in_generate=True,
                            output_scores=output_scores)
    stats = out.spec_stats
    assert stats.new_tokens == 12 and stats.drafted > 0 and stats.acceptance_rate == 1.0
    assert out.sequences.shape[1] == 30 + 12
    if output_scores:
        assert len(out.scores) == 12
    assert static_engine.current_engine(verifier).spec.host == output_scores


def test_sampling_never_ends_below_min_new_tokens():
    static_engine.release_engines()
    verifier, drafter = _tiny(2, seed=0, width=32), _tiny(1, seed=1, width=16)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))
    kwargs = dict(assistant_model=drafter, kv_budget=16, do_sample=True, temperature=3.0, eos_token_id=2,
                  pad_token_id=0, max_new_tokens=10, num_assistant_tokens=3)
    torch.manual_seed(1)
    free = [verifier.generate(ids, **kwargs).shape[1] - 20 for _ in range(40)]
    floored = [verifier.generate(ids, min_new_tokens=10, **kwargs).shape[1] - 20 for _ in range(40)]
    assert min(free) < 10  # EOS is likely at this temperature...
    assert min(floored) == 10  # ...and never drawn below the floor


def test_a_warper_the_device_does_not_apply_runs_on_the_host():
    static_engine.release_engines()
    verifier, drafter = _tiny(2, seed=0, width=32), _tiny(1, seed=1, width=16)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, do_sample=True, eta_cutoff=1e-3,
                            max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    assert out.shape[1] == 26
    assert static_engine.current_engine(verifier).spec.host


@pytest.mark.cuda
@pytest.mark.parametrize("mode,gamma", [
    ("chunk", 3), pytest.param("window", 5, marks=[pytest.mark.compiled, pytest.mark.slow]), pytest.param("int4", 3, marks=pytest.mark.slow),
])
def test_graph_path_sampling_matches_the_exact_joint_distribution(mode, gamma):
    """The captured draft and verify steps draw on the device (compiled: Inductor's random numbers): the same
    distribution test at 1,500 samples, and the same tokens from the same seed."""
    static_engine.release_engines()
    verifier, drafter = _tiny(2, seed=0, width=32), _tiny(1, seed=1, width=16)
    ids = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(5))
    joint = _joint_on_int8_view(verifier, ids, 16) if mode == "int4" else _joint(verifier, ids)
    torch.backends.cuda.matmul.allow_tf32 = False
    verifier, drafter, ids = verifier.cuda(), drafter.cuda(), ids.cuda()
    if mode == "int4":
        spec = lambda: dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=16))  # noqa: E731
    else:
        spec = lambda: dict(assistant_model=drafter, draft_cache=mode, kv_budget=16)  # noqa: E731
    kwargs = dict(do_sample=True, max_new_tokens=2, min_new_tokens=2, eos_token_id=None, num_assistant_tokens=gamma,
                  **WARPERS)
    torch.manual_seed(123)
    samples = torch.tensor([int(out[0, -2]) * VOCAB + int(out[0, -1])
                            for out in (verifier.generate(ids, **kwargs, **spec()) for _ in range(1500))])
    engine = static_engine.current_engine(verifier)
    assert engine.use_graphs and all(step.graph is not None for step in engine.steps.values())
    assert engine.spec.sampling is not None
    assert _consistent(samples, joint)
    counts = torch.bincount(samples, minlength=VOCAB * VOCAB).double() / samples.numel()
    assert float(0.5 * (counts - joint).abs().sum()) < 0.1
    longer = dict(kwargs, max_new_tokens=24, min_new_tokens=24)
    runs = []
    for _ in range(2):
        torch.manual_seed(9)
        runs.append(verifier.generate(ids, **longer, **spec()))
    assert torch.equal(runs[0], runs[1])
    static_engine.release_engines()
