# `make demo` and `make test` do all set-up themselves on a fresh machine.
VENV ?= .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# Pinned so pip takes the local CPU wheel and never pulls CUDA wheels.
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[test,docs]'
	touch $@

.PHONY: demo test bench docs
demo: $(BIN)/.installed  ## every stage, compute-only and torch DDP on 2 CPU Gloo ranks
	$(BIN)/torchrun --standalone --nproc-per-node 2 -m stages --model cnn --steps 10

test: $(BIN)/.installed  ## lint, the whole suite, and the strict docs build
	$(BIN)/ruff check .
	$(BIN)/pytest
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$(mktemp -d)"

docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a 127.0.0.1:8000
