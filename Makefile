# Two commands for a newcomer: `make demo` and `make test`. Both create .venv/ when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardtune-installed
# DeepSpeed compiles its ops on first use; keep them inside this environment.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export OMP_NUM_THREADS ?= 1
# shardtune is installed editable, so nothing compiles its modules ahead: where PYTHONDONTWRITEBYTECODE is set, every
# process (the CLI, each rank, each test's run) compiled them again (0.1-0.3 s each). Refreshed before each target.
BYTECODE := $(PY) -m compileall -q src > /dev/null

.PHONY: setup demo test test-fast test-matrix test-big test-oldest test-install lint docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, alone, at the lock's version: on these machines it is a local CPU wheel; a range would pull CUDA.
	$(PY) -m pip install --quiet $$(grep -E '^torch==' requirements.txt)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: setup
	$(BYTECODE)
	$(PY) -m shardtune train examples/tiny/sft_lora.yaml
	@echo ""
	@echo "Demo finished. Results in outputs/tiny-sft-lora/:"
	@echo "  adapter_model.safetensors  LoRA adapter (load with PeftModel.from_pretrained)"
	@echo "  trainer_log.jsonl          one line per logging step"
	@echo "  train_results.json         loss, runtime, tokens/s"
	@echo "  training_loss.png          loss curve"

# Tests run on every core (pytest-xdist: one worker per core, a file's tests on one worker); each holds the cores it
# keeps busy while it runs (tests/cores.py), so 2-process cells and 1-process cells share the machine, never crowd it.
PARALLEL := -n auto --dist loadfile

test: setup
	$(BYTECODE)
	$(PY) -m pytest -q $(PARALLEL) -m "not bigmodel and not matrix and not install" --durations=40

# The rest of every engine matrix beyond make test's slice; must pass before an issue is resolved.
test-matrix: setup
	$(BYTECODE)
	$(PY) -m pytest -q $(PARALLEL) -m matrix

# Memory checks on a ~200M-parameter model (about 4 minutes on 2 cores); must pass before a release.
test-big: setup
	$(BYTECODE)
	$(PY) -m pytest -q -m bigmodel

# The oldest supported versions: pyproject.toml's lower bounds (scripts/oldest_requirements.py) with the lock's torch
# (the one CPU build here), in build/oldest-venv (made anew each time, about 2 minutes); then the unit tier and a
# 2-process slice (DDP, FSDP2 LoRA, ZeRO-3). Not part of make test; docs/development.md, "Supported versions".
OLDEST := build/oldest-venv
OLDEST_EXTRAS := deepspeed,metrics,optimizers,web,wandb,mlflow,ray
OLDEST_SLICE := "tests/distributed/test_engines_cli.py::test_engine_matches_single_process[ddp-full]" \
	"tests/distributed/test_engines_cli.py::test_engine_matches_single_process[fsdp2-full_shard-lora]" \
	"tests/distributed/test_deepspeed_engine.py::test_losses_match_single_process[z3_lora]"
test-oldest:
	rm -rf $(OLDEST) && mkdir -p build && $(PYTHON) -m venv $(OLDEST)
	$(PYTHON) scripts/oldest_requirements.py --extras $(OLDEST_EXTRAS) > build/oldest-requirements.txt
	$(OLDEST)/bin/python -m pip install --quiet $$(grep -E '^torch==' requirements.txt)
	DS_BUILD_OPS=0 $(OLDEST)/bin/python -m pip install --quiet -r build/oldest-requirements.txt \
		$$(grep -E '^(pytest|pytest-timeout|hypothesis)==' requirements.txt)
	$(OLDEST)/bin/python -m pip install --quiet -e ".[$(OLDEST_EXTRAS)]"
	$(PYTHON) scripts/oldest_requirements.py --extras $(OLDEST_EXTRAS) --check $(OLDEST)/bin/python
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(OLDEST)/torch_extensions $(OLDEST)/bin/python -m pytest -q -p no:cacheprovider \
		-m "not distributed and not e2e and not matrix and not bigmodel and not gpu" tests/unit
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(OLDEST)/torch_extensions $(OLDEST)/bin/python -m pytest -q -p no:cacheprovider \
		$(OLDEST_SLICE)

# Build the wheel, install it with scripts/install_wheel.sh (docker/Dockerfile's commands) into a fresh venv holding
# the lock's torch, check no torch file changed and train the tiny example outside the checkout (a few minutes).
test-install: setup
	$(PY) -m pytest -q -m install tests/e2e/test_wheel_install.py

test-fast: setup
	$(PY) -m pytest -q $(PARALLEL) -m "not distributed and not e2e"

lint: setup
	$(PY) -m ruff check src tests scripts
	$(PY) -m mypy

docs: setup
	$(PY) -m shardtune keys --markdown > docs/config.md

clean:
	rm -rf outputs models
