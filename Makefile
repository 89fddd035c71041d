# Two commands: `make demo` runs the main job, `make test` runs the suite. Each builds .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

.PHONY: install test demo bench
install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

# A tiny Llama learns 2-digit addition with GRPO on the rollout engine (CPU, a few minutes).
demo: $(VENV)/.installed
	$(PY) -m recipes.demo

bench: $(VENV)/.installed
	$(PY) bench/engine_vs_hf.py
