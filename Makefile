# The README's two commands are `make demo` and `make test`; each installs what it needs first.
# On a GPU host the virtual environment sees the host's CUDA build of torch (system site
# packages); only where no torch is importable does `make install` pin the CPU build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-slow lint diagrams bench gpu-test gpu-check gpu-slime-prepare gpu-vllm-prepare demo clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# Two workers (pytest-xdist) by default, what CI's two cores run; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --config-file scripts/mypy_unrun.ini -p benchmarks \
		$(patsubst %.py,-m %,$(subst /,.,$(wildcard tests/gpu/*.py)))

diagrams: $(STAMP)
	$(PY) -m lifecycle.diagram diagrams README.md

demo: $(STAMP)
	$(VENV)/bin/lifecycle demo $(DEMO_ARGS)

# One report (out/bench.json): FSM overhead and host RSS during a sync everywhere; sleep/wake and
# weight-sync bandwidth on a GPU host. Each figure is printed next to its ceiling or baseline.
bench: $(STAMP)
	$(PY) benchmarks/report.py --out out/bench.json

# One pytest process per GPU test file: torch_memory_saver's hook mode and Megatron's state are process-wide.
gpu-test: $(STAMP)
	PY=$(PY) bash scripts/gpu_suite.sh tests

# The GPU regression command (scripts/gpu_check.sh) on a GPU host of your own with SGLang installed:
# the SGLang GPU tests, the weight-sync GPU tests (the copy and read-back kernels), the real-engine
# demo with and without its flags, the kill demo, the sync
# bench and the slime and miles rollout tests, then one summary table. On the lent device machine,
# `scripts/gpu_check.sh prepare` here and the device calls it prints.
gpu-check: $(STAMP)
	GPU_CHECK_INSTALLED=1 GPU_CHECK_BUDGET_S=$${GPU_CHECK_BUDGET_S:-86400} PY=$(PY) bash scripts/gpu_check.sh

# slime's own GRPO job on the lent GPU machine (scripts/slime_e2e.sh): lays out the wheel and source
# parts .gpuw/slime/p1..pN here and prints the device calls (scripts/gpu_slime.sh). SGLANG_GPU,
# RL_LIFECYCLE_SLIME_SOURCE and RL_LIFECYCLE_MEGATRON_SOURCE name the inputs (scripts/gpu_slime_wheels.sh);
# SLIME_SGLANG=set lays out the same job on SGLang 0.5.17 in .gpuw/slime-sglang-set/ instead.
gpu-slime-prepare:
	bash scripts/gpu_slime_wheels.sh

# VLLM_WHEEL=/path/to/vllm-0.26.0-...whl (else downloaded) PY312=a Python 3.12 with pip (default python3.12)
gpu-vllm-prepare:
	bash scripts/gpu_vllm_wheels.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
