# Two commands do all setup on a fresh machine (see README.md):
#   make demo   the whole job offline on the demo model
#   make test   lint and the full test suite (what CI runs)
PYTHON ?= python3

.PHONY: setup demo test lint bench

setup:
	$(PYTHON) scripts/bootstrap.py

demo: setup
	.venv/bin/kvcalib demo

lint: setup
	.venv/bin/ruff check kvcalib tests scripts

test: setup
	.venv/bin/ruff check kvcalib tests scripts
	.venv/bin/kvcalib demo-model
	.venv/bin/python -m pytest -v --durations=15

bench: setup
	.venv/bin/python scripts/bench_calibrate.py
	.venv/bin/python scripts/bench_verify.py
	.venv/bin/python scripts/bench_eval.py
