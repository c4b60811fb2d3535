"""``make demo``: speculative generation with the bundled trained pair on a held-out document (CPU or CUDA).

The verifier (12 layers, 16K context) continues a held-out Python source file; the 2-layer drafter (trained at 2K)
drafts on a compressed cache. Each mode prints the completion, whether it equals greedy AR token for token,
acceptance and tau; on a CUDA GPU also the speedup against AR measured here (on CPU, timings of these tiny models
swing between identical runs and say nothing about speculation: speed is measured on the GPU).
"""

from __future__ import annotations

import torch

from .caches import SinkWindowCache
from .compare import SPEED_ON_CPU, compare, greedy_reference, report
from .zoo import eval_documents, load_pair

PROMPT_TOKENS = 3072
NEW_TOKENS = 64


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    verifier, drafter, tokenizer = load_pair(device=device)
    ids = eval_documents()[0][None, :PROMPT_TOKENS].to(device)
    print(f"hf_sparsekv demo on {device}: bundled pair, held-out document, {PROMPT_TOKENS}-token prompt, "
          f"{NEW_TOKENS} new tokens, greedy.\n--- end of the prompt ---")
    print(tokenizer.decode(ids[0, -60:]))
    print("---")
    reference = greedy_reference(verifier, ids, NEW_TOKENS)
    ok = True
    # The drafter never saw distances beyond 2K in training, so its window cache keeps no far-away sink tokens.
    modes = (
        ("drafter on a 1024-token window cache", SinkWindowCache(sink=0, window=1024), None),
        ("drafter on a chunk-budget cache, kv_budget=512", "chunk", 512),
    )
    for name, draft_cache, budget in modes:
        result = compare(verifier, drafter, ids, draft_cache, budget, gamma=4, max_new_tokens=NEW_TOKENS,
                         reference=reference)
        report(name, result, tokenizer, ids.shape[1], show_speed=device == "cuda")
        ok &= result["identical_to_ar"]
    if device != "cuda":
        print(SPEED_ON_CPU)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
