# make train: train the default CoLA model on the embedded corpus (needs requirements.txt only).
# make test: the whole test suite; make test-fast: the tests not marked slow (a forker's edit loop);
# make test-docs: every command of docs/'s pages, run as shown (the README's are in make test);
# all three also install requirements-dev.txt (the file-format libraries the tests cover).
# Each creates .venv first (once; again when a requirements file changes). --no-compile: pip skips
# byte-compiling every file of torch (33 s -> 19 s on 2 idle cores); Python compiles what it imports.
PY := .venv/bin/python

.PHONY: train test test-fast test-docs
train: .venv/.installed
	$(PY) train.py

test: .venv/.installed-dev
	$(PY) -m pytest -q

test-fast: .venv/.installed-dev
	$(PY) -m pytest -q -m "not slow and not docs"

test-docs: .venv/.installed-dev
	$(PY) -m pytest -q -m docs

.venv/.installed: requirements.txt
	python3 -m venv .venv
	.venv/bin/pip install -q --no-compile -r requirements.txt
	touch $@

.venv/.installed-dev: .venv/.installed requirements-dev.txt
	.venv/bin/pip install -q --no-compile -r requirements-dev.txt
	touch $@
