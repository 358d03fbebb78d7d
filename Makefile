# llm-supervisor: `make run` to serve the demo model, `make test` to check everything.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 11435
DEMO_MODEL := models/demo.gguf
# Re-install whenever the pins change.
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck unit bench check clean install demo-model

run: install demo-model
	$(BIN)/llm-supervisor serve --host $(HOST) --port $(PORT) --manifests manifests

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

demo-model: $(DEMO_MODEL)

$(DEMO_MODEL): supervisor/demo_model.py | $(STAMP)
	$(BIN)/python -m supervisor.demo_model $@ --force

check: install demo-model
	$(BIN)/llm-supervisor check manifests

lint: install
	$(BIN)/ruff check supervisor workers tests bench
	$(BIN)/ruff format --check supervisor workers tests bench

typecheck: install
	$(BIN)/mypy

test: lint typecheck demo-model
	$(BIN)/python -m pytest

bench: install demo-model
	$(BIN)/python -m bench.proxy_overhead
	$(BIN)/python -m bench.scheduling

clean:
	rm -rf $(VENV) models .state .mypy_cache .ruff_cache .pytest_cache
