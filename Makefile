# make train: train the default CoLA model on the embedded corpus; make test: the test suite.
# Both create .venv from requirements.txt first (once; again when requirements.txt changes).
PY := .venv/bin/python
SHARED_CACHE := $(wildcard ../shared/tiktoken_cache)
ifneq ($(SHARED_CACHE),)
export TIKTOKEN_CACHE_DIR ?= $(abspath $(SHARED_CACHE))
endif

.PHONY: train test bench
train: .venv/.installed
	$(PY) train.py

test: .venv/.installed
	$(PY) -m pytest -q

.venv/.installed: requirements.txt
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements.txt
	touch $@
