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

.PHONY: setup demo test test-fast test-matrix test-big lint docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: on these machines it is a local CPU wheel; a range would pull CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet deepspeed==0.19.8
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

test: setup
	$(BYTECODE)
	$(PY) -m pytest -q -m "not bigmodel and not matrix" --durations=40

# The rest of every engine matrix beyond make test's slice; must pass before an issue is resolved.
test-matrix: setup
	$(BYTECODE)
	$(PY) -m pytest -q -m matrix

# Memory checks on a ~200M-parameter model (about 4 minutes on 2 cores); must pass before a release.
test-big: setup
	$(BYTECODE)
	$(PY) -m pytest -q -m bigmodel

test-fast: setup
	$(PY) -m pytest -q -m "not distributed and not e2e"

lint: setup
	$(PY) -m ruff check src tests scripts
	$(PY) -m mypy

docs: setup
	$(PY) -m shardtune keys --markdown > docs/config.md

clean:
	rm -rf outputs models
