# Two entry points (see README.md): `make run` and `make test`. Both create or reuse .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nereus-installed

.PHONY: venv run test lint typecheck unit clean

$(STAMP): pyproject.toml etc/constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q -e '.[dev]'; \
	else \
	  $(BIN)/python -m pip install -q -c etc/constraints-cpu.txt -e '.[dev]'; \
	fi
	touch $(STAMP)

venv: $(STAMP)

# The main job on the embedded default (no Slurm, no GPU).
run: $(STAMP)
	$(BIN)/python -m nereusd.demo

lint: $(STAMP)
	$(BIN)/ruff check planner transitions agent nereusd tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
