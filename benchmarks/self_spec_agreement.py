"""How often greedy decoding on the INT8 view of HierarchicalQuantCache agrees with full-precision greedy decoding.

Self-speculation (draft_cache="int4") is lossless against greedy AR on the INT8 view; this measures how far that
reference is from plain fp16/bf16 greedy on the same prompts. Prints a table and writes JSON.

    python benchmarks/self_spec_agreement.py --out runs/self_spec_agreement.json
"""

from __future__ import annotations

import argparse
import json

import torch
from tqdm import tqdm

import hf_sparsekv
from hf_sparsekv.cache_keyword import cache_keyword
from hf_sparsekv.zoo import eval_documents, load_pair


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=20, help="held-out documents used (at most 50)")
    parser.add_argument("--prompt-length", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--out", default="self_spec_agreement.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _, _ = load_pair(device=device, dtype=getattr(torch, args.dtype))
    documents = eval_documents()
    identical, matching_prefix, token_agreement = 0, [], []
    for i in tqdm(range(args.prompts), desc="prompts"):
        ids = documents[i % len(documents)][None, : args.prompt_length].to(device)
        kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        full = model.generate(ids, **kwargs)[0, args.prompt_length :]
        int8 = model.generate(ids, **{cache_keyword(model): hf_sparsekv.HierarchicalQuantCache()}, **kwargs)[0, args.prompt_length :]
        same = (full == int8).tolist()
        identical += all(same)
        matching_prefix.append(same.index(False) if False in same else len(same))
        token_agreement.append(sum(same) / len(same))
    result = {
        "model": "bundled verifier (hf_sparsekv.zoo, 12-layer Llama), held-out documents",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": args.dtype,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "prompts": args.prompts,
        "identical_outputs": identical / args.prompts,
        "mean_matching_prefix": sum(matching_prefix) / args.prompts,
        "position_wise_agreement": sum(token_agreement) / args.prompts,
    }
    print("| prompts | identical outputs | mean matching prefix | position-wise agreement |")
    print("|---|---|---|---|")
    print(f"| {args.prompts} | {result['identical_outputs']:.2f} | {result['mean_matching_prefix']:.1f} / "
          f"{args.new_tokens} | {result['position_wise_agreement']:.3f} |")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
