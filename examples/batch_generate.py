"""A batch of prompts through speculative generate(), on the bundled pair: left padding and the attention mask, as
for stock generate().

    python examples/batch_generate.py --max-new-tokens 48

Each row of the output is what the same call gives for that prompt alone (greedy: the verifier's greedy output),
padded after it stops. The rows are decoded together on one engine (docs/options.md, "Batches"); this prints each
completion, whether it equals stock greedy generate() of that prompt, and the per-row acceptance.
"""

import argparse

import torch

import hf_sparsekv  # noqa: F401  (teaches generate() kv_budget / draft_cache)
from hf_sparsekv.zoo import load_pair

parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--budget", type=int, default=64, help="kv_budget of the drafter's chunk-budget cache")
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
verifier, drafter, tokenizer = load_pair(device=device)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
prompts = [
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def fibonacci(n):\n",
]
enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
out = verifier.generate(**enc, assistant_model=drafter, kv_budget=args.budget, max_new_tokens=args.max_new_tokens,
                        do_sample=False, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
width = enc.input_ids.shape[1]
for b, text in enumerate(prompts):
    alone = tokenizer(text, return_tensors="pt").input_ids.to(device)
    reference = verifier.generate(alone, max_new_tokens=args.max_new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)[0, alone.shape[1] :]
    row = out.sequences[b, width : width + reference.shape[0]]
    stats = out.spec_stats.rows[b]
    print(f"--- row {b}: equals greedy generate() of the prompt alone: {torch.equal(row, reference)}; "
          f"{stats.summary()}")
    print(text + tokenizer.decode(row, skip_special_tokens=True))
print(f"--- batch: {out.spec_stats.summary()}; {out.spec_stats.new_tokens} new tokens over {out.spec_stats.prompts} "
      "rows")
