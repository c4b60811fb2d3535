"""``make demo``: speculative generation on a tiny *random* model pair, on CPU or CUDA.

The project's trained verifier/drafter pair is not bundled yet, so the models here are random: the output text is
noise and a random drafter's acceptance is near zero. What the demo shows is the mechanics: every mode reproduces
greedy AR token for token, and self-speculation (INT4 draft view of the verifier's own cache) is accepted at a high
rate because drafter and verifier are the same network.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .cli import compare, report


def tiny_random_pair(device: str):
    torch.manual_seed(0)
    common = dict(vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)
    verifier = LlamaForCausalLM(
        LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, **common)
    )
    drafter = LlamaForCausalLM(
        LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, **{**common, "max_position_embeddings": 512})
    )
    return verifier.to(device).eval(), drafter.to(device).eval()


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("hf_sparsekv demo: TINY RANDOM model pair (the trained bundled pair does not exist yet);")
    print(f"text is noise, the point is that every mode equals greedy AR. Device: {device}\n")
    verifier, drafter = tiny_random_pair(device)
    ids = torch.randint(3, 512, (1, 1500), generator=torch.Generator().manual_seed(1)).to(device)
    ok = True
    for mode, budget in (("chunk", 256), ("window", 256), ("int4", None)):
        result = compare(verifier, drafter, ids, mode, budget, gamma=5, max_new_tokens=64)
        report(f"{mode} drafter cache" + (f", kv_budget={budget}" if budget else " (self-speculative)"), result)
        ok &= result["identical_to_ar"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
