# tierrec — the two commands a newcomer needs are `make train` and `make test`.
#
# Every target (re)creates .venv when it is missing or pyproject.toml changed. On a CPU machine the
# install never pulls CUDA wheels: constraints-cpu.txt pins the CPU builds and the metadata-only shim in
# tools/fbgemm-gpu-cpu-shim satisfies torchrec's `fbgemm-gpu` requirement with `fbgemm-gpu-cpu`.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/quickstart.toml
OUT ?= runs/quickstart

.PHONY: train test test-slow crash-test lint format venv clean

$(STAMP): pyproject.toml constraints-cpu.txt tools/fbgemm-gpu-cpu-shim/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints-cpu.txt ./tools/fbgemm-gpu-cpu-shim -e '.[cpu,dev]'
	$(BIN)/python -m pip check
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/recsys train --config $(CONFIG) --out $(OUT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# Kill anywhere: SIGKILL a 2-rank tiered run at 5 random moments, resume, compare digests (~3 min on 2 cores);
# then SIGKILL a log-layout store 18 times inside compactions and check each reopened store (~1 min).
crash-test: $(STAMP)
	$(BIN)/python -m pytest -m slow -s tests/recsys/test_crash.py \
		tests/embedding_store/test_lmdb_log.py::test_sigkill_inside_compaction_many_times

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
