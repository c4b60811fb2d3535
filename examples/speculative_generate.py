"""Speculative generation with a compressed-cache drafter: the whole change to a stock HF script is the import and
the `kv_budget` (or `draft_cache`) argument.

    python examples/speculative_generate.py --verifier PATH_OR_ID --drafter PATH_OR_ID [--tokenizer PATH_OR_ID] \
        --budget 256 --gamma 5 --prompt-file long_prompt.txt
    python examples/speculative_generate.py --pair          # the bundled trained pair (hf_sparsekv/zoo/pair)

Without --prompt-file the prompt is the start of a held-out Python source document of the bundled pair
(--prompt-tokens long, 1024 by default), so that it is longer than the budget and the drafter's cache compresses it;
a prompt that fits the budget is named as such (the drafter then keeps all of it). Prints the completion, whether it
equals greedy AR, acceptance, tau and (on a GPU) the speedup over AR.
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_sparsekv  # noqa: F401  (teaches generate() kv_budget / draft_cache)
from hf_sparsekv.zoo import PAIR_DIR, eval_documents

parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--pair", action="store_true", help="use the bundled pair: sets --verifier, --drafter, --tokenizer")
parser.add_argument("--verifier", help="path or Hub id")
parser.add_argument("--drafter", help="path or Hub id (same tokenizer as the verifier)")
parser.add_argument("--tokenizer", help="path or Hub id; unset: the verifier's")
parser.add_argument("--budget", type=int, default=256, help="kv_budget of the drafter's chunk-budget cache")
parser.add_argument("--gamma", type=int, default=5, help="draft tokens per round")
parser.add_argument("--prompt-file", help="the prompt (unset: a held-out document of the bundled pair)")
parser.add_argument("--prompt-tokens", type=int, default=1024,
                    help="without --prompt-file: length of the default prompt, in tokens of the bundled pair")
parser.add_argument("--max-new-tokens", type=int, default=256)
args = parser.parse_args()
if args.pair:
    args.verifier = args.verifier or str(PAIR_DIR / "verifier")
    args.drafter = args.drafter or str(PAIR_DIR / "drafter-budgetdraft")
    args.tokenizer = args.tokenizer or str(PAIR_DIR / "tokenizer")
if not (args.verifier and args.drafter):
    parser.error("pass --verifier and --drafter (or --pair)")

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.verifier)
verifier = AutoModelForCausalLM.from_pretrained(args.verifier, dtype=dtype).to(device).eval()
drafter = AutoModelForCausalLM.from_pretrained(args.drafter, dtype=dtype).to(device).eval()
if args.prompt_file:
    text = open(args.prompt_file).read()
else:  # Python source the pair never trained on, as text (any tokenizer can read it)
    text = AutoTokenizer.from_pretrained(PAIR_DIR / "tokenizer").decode(eval_documents()[0][: args.prompt_tokens])
input_ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
print(f"prompt: {input_ids.shape[1]} tokens, kv_budget {args.budget}")
if input_ids.shape[1] <= args.budget:
    print("(the prompt fits the budget: the drafter's cache keeps all of it and nothing is compressed; give a longer "
          "--prompt-file or a smaller --budget)")


def timed(**kwargs):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = verifier.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


ar, ar_s = timed()
spec, spec_s = timed(
    assistant_model=drafter, kv_budget=args.budget, num_assistant_tokens=args.gamma, return_dict_in_generate=True
)
print(tokenizer.decode(spec.sequences[0, input_ids.shape[1] :]))
stats = spec.spec_stats
print(f"identical to greedy AR: {torch.equal(spec.sequences, ar)}")
print(stats.summary(), end="")
print(f", speedup {ar_s / spec_s:.2f}x" if device == "cuda" else " (speed is measured on the GPU: see BENCHMARKS.md)")
