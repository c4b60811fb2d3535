"""Stock's own assisted-generation call and stock greedy decoding, served by our engine after the import
(docs/options.md, "Stock's own calls after the import"), on the bundled pair: no argument of ours.

    python examples/assisted_generation.py --max-new-tokens 48

The prompt is the start of a held-out Python file. This prints the completion, whether the routed assisted call and
``static_engine=True`` equal plain greedy generate() and stock's own assisted generation (the same call with the
patch removed), the draft widths the controller chose, and on a CUDA GPU the time of each call.
"""

import argparse
import time

import torch

import hf_sparsekv
from hf_sparsekv.zoo import eval_documents, load_pair

parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--prompt-tokens", type=int, default=1536,
                    help="prompt length; with the new tokens within the bundled drafter's 2,048 positions")
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
verifier, drafter, tokenizer = load_pair(device=device)
ids = eval_documents()[0][None, : args.prompt_tokens].to(device)
settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)


def timed(call):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


# the first call of each kind captures the engine's steps on CUDA (builds its caches, loads its kernels): time the
# second
for _ in range(2 if device == "cuda" else 1):
    routed, routed_s = timed(lambda: verifier.generate(ids, assistant_model=drafter, return_dict_in_generate=True,
                                                       **settings))
    plain, plain_s = timed(lambda: verifier.generate(ids, static_engine=True, **settings))
greedy = verifier.generate(ids, **settings)
hf_sparsekv.unregister()  # stock's own assisted generation, for comparison
stock, stock_s = timed(lambda: verifier.generate(ids, assistant_model=drafter, **settings))
hf_sparsekv.register()

print(tokenizer.decode(routed.sequences[0, ids.shape[1] :], skip_special_tokens=True))
print(f"--- routed assisted call identical to greedy generate(): {torch.equal(routed.sequences, greedy)}; "
      f"to stock's assisted generation: {torch.equal(routed.sequences, stock)}")
print(f"--- static_engine=True identical to greedy generate(): {torch.equal(plain, greedy)}")
stats = routed.spec_stats
print(f"--- {stats.summary()}")
if device == "cuda":
    n = args.max_new_tokens
    print(f"--- tokens/s: routed {n / routed_s:.0f}, static_engine {n / plain_s:.0f}, stock assisted {n / stock_s:.0f}")
else:
    print("--- on CPU the engine gives the same tokens, not speed (BENCHMARKS.md has the GPU figures)")
