"""Stock's own prompt-lookup call, served by our engine after the import (docs/options.md, "Prompt lookup gains by
the import alone"), on the bundled verifier: no drafter, no argument of ours.

    python examples/prompt_lookup.py --max-new-tokens 48

The prompt quotes a function and starts it again, the case retrieval drafting is made for. This prints the
completion, whether it equals plain greedy generate() and stock's own prompt lookup (the same call with the patch
removed), and how many verifier forwards the tokens took.
"""

import argparse

import torch

import hf_sparsekv
from hf_sparsekv.zoo import load_pair

parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--lookup-tokens", type=int, default=5, help="prompt_lookup_num_tokens: drafts per round")
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
verifier, _, tokenizer = load_pair(device=device)
source = (
    "def moving_average(values, window):\n"
    "    total = sum(values[:window])\n"
    "    averages = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        averages.append(total / window)\n"
    "    return averages\n\n\n"
)
prompt = source + "# the same function again\n" + source.split("\n")[0] + "\n"
ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)

out = verifier.generate(ids, prompt_lookup_num_tokens=args.lookup_tokens, return_dict_in_generate=True, **settings)
greedy = verifier.generate(ids, **settings)
hf_sparsekv.unregister()  # stock's own prompt lookup, for comparison
stock = verifier.generate(ids, prompt_lookup_num_tokens=args.lookup_tokens, **settings)
hf_sparsekv.register()

print(tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))
print(f"--- identical to greedy generate(): {torch.equal(out.sequences, greedy)}; "
      f"identical to stock's prompt lookup: {torch.equal(out.sequences, stock)}")
stats = out.spec_stats
print(f"--- {stats.summary()}: {stats.rounds} verifier forwards for {stats.new_tokens} tokens (speed: BENCHMARKS.md; this toy verifier on a CPU says little)")
