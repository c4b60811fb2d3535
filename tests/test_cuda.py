"""The same losslessness on a CUDA GPU (run on the GPU machine; skipped on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_sparsekv import HierarchicalQuantCache

from .conftest import ARCHS, prompt, tiny_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["chunk", "window", "int4"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_lossless_on_cuda_float32(arch, mode, gamma):
    torch.backends.cuda.matmul.allow_tf32 = False
    verifier = copy.deepcopy(tiny_model(arch)).to("cuda", torch.float32)
    drafter = copy.deepcopy(tiny_model(arch, role="drafter")).to("cuda", torch.float32)
    for seed, length in enumerate((5, 140, 400)):
        ids = prompt(length, seed).cuda()
        kwargs = dict(max_new_tokens=32, do_sample=False)
        if mode == "int4":
            reference = verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), **kwargs)
            spec = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32))
        else:
            reference = verifier.generate(ids, **kwargs)
            spec = dict(assistant_model=drafter, draft_cache=mode, kv_budget=64)
        out = verifier.generate(ids, num_assistant_tokens=gamma, **spec, **kwargs)
        assert torch.equal(out, reference)
