"""Stock's own prompt-lookup call, served by our engine after the import (docs/options.md, "Prompt lookup gains by
the import alone"), on the bundled verifier: no drafter, no argument of ours.

    python examples/prompt_lookup.py --max-new-tokens 48

Prompt lookup drafts the tokens that followed the last few tokens where they occurred earlier in the text, so it
pays where the output repeats spans of its input: code being edited, a passage quoted back. The default prompt is
such a text: a held-out Python source file cut where a function starts to repeat lines of the one above it. This
prints the completion, whether it equals plain greedy generate() and stock's own prompt lookup (the same call with
the patch removed), and how many verifier forwards the tokens took.
"""

import argparse

import torch

import hf_sparsekv
from hf_sparsekv.zoo import eval_documents, load_pair

DOCUMENT, PROMPT_TOKENS = 1, 1024  # the held-out file and the cut: its continuation quotes the function above

parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--lookup-tokens", type=int, default=5, help="prompt_lookup_num_tokens: drafts per round")
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
verifier, _, tokenizer = load_pair(device=device)
ids = eval_documents()[DOCUMENT][None, :PROMPT_TOKENS].to(device)
settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
# N drafts every round, as stock's prompt lookup drafts; without it the draft-length controller chooses each round,
# starting with plain steps to time them (docs/engine.md), which on this toy model and a CPU often wins
lookup = dict(prompt_lookup_num_tokens=args.lookup_tokens, num_assistant_tokens_schedule="constant")

out = verifier.generate(ids, **lookup, return_dict_in_generate=True, **settings)
greedy = verifier.generate(ids, **settings)
hf_sparsekv.unregister()  # stock's own prompt lookup, for comparison
stock = verifier.generate(ids, **lookup, **settings)
hf_sparsekv.register()

print(f"prompt: held-out document {DOCUMENT}, {ids.shape[1]} tokens; its last lines:")
print(tokenizer.decode(ids[0, -60:]))
print("--- completion:")
print(tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))
print(f"--- identical to greedy generate(): {torch.equal(out.sequences, greedy)}; "
      f"identical to stock's prompt lookup: {torch.equal(out.sequences, stock)}")
stats = out.spec_stats
print(f"--- {stats.summary()}: {stats.rounds} verifier forwards for {stats.new_tokens} tokens (speed: BENCHMARKS.md; "
      "this toy verifier on a CPU says little)")
