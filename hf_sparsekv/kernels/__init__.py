"""Numerical building blocks of the caches. Each has a PyTorch reference (the spec) and, beside it, a CUDA Triton
kernel with the same signature:

* :mod:`.quant_reference` / :mod:`.quantize`: hierarchical INT4/INT8 quantize + pack (prefill, buffer flush);
* :mod:`.chunk_attention`: decode attention over a small stored cache (chunk budget, sink + window);
* :mod:`.window_attention`: decode attention over a sink + window ring buffer (slots in any order, masked by the
  positions they hold; the static path's window drafter);
* :mod:`.quant_attention`: decode attention reading the packed INT4 (draft) or INT4+INT4 (INT8 verify) codes;
* :mod:`.verify_attention`: LongSpec's hybrid verification attention (dense prefix + masked block, LSE merge);
* :mod:`.rope_attention`: a step's rotary embedding, cache write and decode attention in one launch (the compiled
  steps' ``static_rope_decode``);
* :mod:`.decode_core`: the split-KV kernel the two decode attentions share; :mod:`.reference`: float32 attention;
* :mod:`.runtime`: when kernels run (CUDA + Triton, or forced under ``TRITON_INTERPRET=1``).

Importing any of these needs neither Triton nor CUDA; Triton is imported when a kernel is first launched.
"""
