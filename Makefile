# Targets the README promises. `make demo` and `make test` each set up a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; a GPU user sets TORCH_SPEC=torch (or their CUDA build) instead.
TORCH_SPEC ?= torch==2.13.0
# The versions the suite last passed with (CI installs these); `make setup PINS=` takes the newest
# releases pyproject.toml's ranges admit instead.
PINS ?= .ci/constraints.txt
EXTRAS := .[test,ray,tensorboard,wandb]

.PHONY: setup demo test test-slow test-latest pins lint bench bench-gpu train-gpu gpu-wheels clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(PINS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e "$(EXTRAS)" $(if $(PINS),-c $(PINS))
	touch $@

# The main job: GRPO on the tiny built-in model (about 1.5 minutes on 2 CPU cores).
demo: setup
	$(PY) -m recipes.run recipes/configs/grpo_tiny.yaml

# Copied code fails lint: pylint's duplicate-code checker (symilar) over the packages, on runs of
# DUPLICATE_LINES identical lines or more, comments, docstrings and signatures aside (.ci/duplicate_code.py
# says why and how, in about a second). A family copied into a new folder and renamed keeps runs far
# longer than this.
DUPLICATE_LINES := 8
PACKAGES := rollout executors trainers_adapters recipes benchmarks

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) .ci/duplicate_code.py --lines $(DUPLICATE_LINES) $(PACKAGES)

test: lint
	$(PY) -m pytest -q

# Tests marked slow; pytest exits 5 when none are collected, which is fine here. The slowest 30
# are listed, to keep CI's run within its limit.
test-slow: setup
	$(PY) -m pytest -q -m slow --durations=30 || [ $$? -eq 5 ]

# The default suite against the newest release of every dependency (torch stays TORCH_SPEC), in a
# venv of its own: first what moved from the pins, then lint and tests. When it passes,
# `make pins VENV=.venv-latest` records its versions as the new pins.
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip
	$(LATEST)/bin/pip install -q "$(TORCH_SPEC)"
	$(LATEST)/bin/pip install -q -e "$(EXTRAS)"
	$(LATEST)/bin/python .ci/versions_moved.py $(PINS)
	status=0; $(LATEST)/bin/python -m ruff check . || status=1; \
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider || status=1; exit $$status

# Record the versions of a venv whose suite passed as the pins (VENV=.venv-latest after test-latest).
pins:
	{ sed -n '/^#/p' .ci/constraints.txt; $(VENV)/bin/pip freeze --exclude-editable --exclude torch; } > $(PINS).new
	mv $(PINS).new $(PINS)

# Every benchmark writes its JSON report under benchmarks/results/; docs/benchmarks.md is rendered
# from them, so the page's numbers are the ones this run measured.
RESULTS := benchmarks/results
BENCH = $(PY) -m benchmarks.$(1) $(2) --json $(RESULTS)/$(3).json
# One BENCH per line of a recipe, for $(foreach) (each line its own command, as if written out).
define BENCH_LINE
$(call BENCH,$(1),$(2),$(3))

endef
# rollout_throughput at each family's defaults (rollout_throughput_<family>.json); sd3's variants
# and HunyuanVideo 1.5's smaller runs are listed apart.
THROUGHPUT_FAMILIES := flux qwen_image flux_kontext qwen_image_edit qwen_image_edit_plus flux2_klein wan wan22 wan_i2v
# The benchmarks that run with their defaults, one report each (<name>.json).
PLAIN_BENCHES := output_memory faults executor_overhead weight_sync lora_swap serve_load http_weight_push \
	serve_probes branching expert_update request_table reward_models reward_overlap train_memory train_scaling

bench: setup
	rm -rf $(RESULTS) && mkdir -p $(RESULTS)
	$(call BENCH,rollout_throughput,--family sd3,rollout_throughput_sd3)
	$(call BENCH,rollout_throughput,--family sd3 --compile both,rollout_throughput_sd3_compiled)
	$(call BENCH,rollout_throughput,--family sd3 --compile both --also-on mp ray --no-breakdown,rollout_throughput_sd3_executors)
	$(foreach f,$(THROUGHPUT_FAMILIES),$(call BENCH_LINE,rollout_throughput,--family $(f),rollout_throughput_$(f)))
	$(call BENCH,rollout_throughput,--family hunyuan_video15 --batch-size 4 --repeats 2,rollout_throughput_hunyuan_video15)
	$(call BENCH,rollout_throughput,--family hunyuan_video15_i2v --batch-size 4 --repeats 2,rollout_throughput_hunyuan_video15_i2v)
	$(call BENCH,rollout_throughput,--family zimage,rollout_throughput_zimage)
	$(call BENCH,lora_rollout,--family sd3 --merge-at-real-size sd35_medium,lora_rollout_sd3)
	$(call BENCH,lora_rollout,--family flux --cfg off,lora_rollout_flux)
	$(call BENCH,rescore_batches,--family sd3,rescore_batches_sd3)
	$(call BENCH,rescore_batches,--family flux,rescore_batches_flux)
	$(foreach name,$(PLAIN_BENCHES),$(call BENCH_LINE,$(name),,$(name)))
	$(call BENCH,async_training,--plot $(RESULTS)/async_training.png,async_training)
	$(call BENCH,parallel,,parallel)
	$(call BENCH,parallel,--mode measure,parallel_measure)
	$(PY) -m benchmarks.render

# The GPU suite (benchmarks/gpu_suite.py): the engine eager and compiled vs. diffusers vs. the forwards
# alone for SD3.5 Medium (on uni and on mp), FLUX.1-dev, Wan 2.1 1.3B and Qwen-Image, MFU, memory
# peaks, merged vs. unmerged LoRA on uni and mp (and compiled), and bf16 re-scoring, in at most 8 minutes on one GPU. It runs on the
# GPU machine's own Python and torch (no venv): where that Python lacks diffusers, run
# `make gpu-wheels` where pip reaches PyPI, bring $(WHEELS)/ along, and bench-gpu installs them
# into $(GPU_SITE), leaving that Python's packages as they are.
GPU_PY ?= python3
WHEELS ?= .whl
GPU_SITE ?= /tmp/rollout-gpu-site
GPU_WHEEL_PINS := diffusers peft importlib_metadata zipp
GPU_RESULTS := $(RESULTS)/gpu

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d $(WHEELS) \
		$(foreach name,$(GPU_WHEEL_PINS),$(shell grep -i '^$(name)==' $(PINS)))

bench-gpu:
	if [ -d $(WHEELS) ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade \
		--target $(GPU_SITE) $(WHEELS)/*.whl; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(GPU_PY) -m benchmarks.gpu_suite --results $(GPU_RESULTS)
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(GPU_PY) -m benchmarks.render --results $(GPU_RESULTS) \
		--out docs/benchmarks_gpu.md --no-readme

# Two training steps of the SD3.5 Medium and FLUX.1-dev LoRA recipes on one GPU with the published
# transformers at random weights (benchmarks/train_gpu.py): peak memory against the memory plan, and the
# step split (rollout, reward, train, push), in at most 8 minutes; the same Python and wheels as bench-gpu.
train-gpu:
	if [ -d $(WHEELS) ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade \
		--target $(GPU_SITE) $(WHEELS)/*.whl; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(GPU_PY) -m benchmarks.train_gpu --json $(GPU_RESULTS)/train_gpu.json

clean:
	rm -rf $(VENV) $(LATEST) outputs .cache .pytest_cache .ruff_cache
