# Quick start targets. Both install what they need on a fresh machine; when torch is missing they
# install the pinned CPU wheel (torch==2.13.0) instead of letting pip resolve a multi-GB CUDA build.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-test demo test

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .

install-test: install
	$(PIP) install -q -e '.[test]'

demo: install
	$(PYTHON) -m lightspeed.launcher.cli demo

test: install-test
	lint-imports
	$(PYTHON) -m pytest -q tests
