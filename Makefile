# Targets the README promises. `make demo` and `make test` each set up a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; a GPU user sets TORCH_SPEC=torch (or their CUDA build) instead.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-slow lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,ray]"
	touch $@

# The main job: GRPO on the tiny built-in model (about 1.5 minutes on 2 CPU cores).
demo: setup
	$(PY) -m recipes.run recipes/configs/grpo_tiny.yaml

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q

# Tests marked slow; pytest exits 5 when none are collected, which is fine here.
test-slow: setup
	$(PY) -m pytest -q -m slow || [ $$? -eq 5 ]

bench: setup
	$(PY) -m benchmarks.rollout_throughput --family sd3
	$(PY) -m benchmarks.rollout_throughput --family flux
	$(PY) -m benchmarks.rollout_throughput --family qwen_image
	$(PY) -m benchmarks.rollout_throughput --family wan
	$(PY) -m benchmarks.rollout_throughput --family wan22
	$(PY) -m benchmarks.output_memory
	$(PY) -m benchmarks.faults
	$(PY) -m benchmarks.executor_overhead
	$(PY) -m benchmarks.weight_sync
	$(PY) -m benchmarks.lora_swap
	$(PY) -m benchmarks.serve_load
	$(PY) -m benchmarks.serve_probes
	$(PY) -m benchmarks.branching
	$(PY) -m benchmarks.expert_update
	$(PY) -m benchmarks.request_table

clean:
	rm -rf $(VENV) outputs .cache .pytest_cache .ruff_cache
