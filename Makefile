# Two entry points (see README.md): `make run` and `make test`. Both create or reuse .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nereus-installed

.PHONY: venv run whatif test lint typecheck bench mutate clean

$(STAMP): pyproject.toml etc/constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q -e '.[dev,vllm]'; \
	else \
	  $(BIN)/python -m pip install -q -c etc/constraints-cpu.txt -e '.[dev]'; \
	fi
	touch $(STAMP)

venv: $(STAMP)

# The main job on the embedded default (no Slurm, no GPU): the live elastic job under nereusd.
run: $(STAMP)
	$(BIN)/python -m nereusd.live

# The planner's what-if table on a drifting 8B PPO job (no processes, a second).
whatif: $(STAMP)
	$(BIN)/python -m nereusd.demo

lint: $(STAMP)
	$(BIN)/ruff check planner transitions agent nereusd tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# Every benchmark, JSON into runs/bench/ (each compares its own figures side by side as ratios).
# `make bench QUICK=1`: each one's --quick form (each under 50 s on 2 cores; the 1,024-GPU sizes kept).
QUICK_FLAG := $(if $(QUICK),--quick,)
bench: $(STAMP)
	mkdir -p runs/bench
	$(BIN)/python bench/decisions.py --quick > runs/bench/decisions.json
	$(BIN)/python bench/transition_dag.py --quick > runs/bench/transition_dag.json
	$(BIN)/python bench/executor.py $(QUICK_FLAG) > runs/bench/executor.json
	$(BIN)/python bench/rl_step.py $(QUICK_FLAG) > runs/bench/rl_step.json
	$(BIN)/python bench/daemon.py $(if $(QUICK),--quick,--seconds 15) > runs/bench/daemon.json
	$(BIN)/python bench/slurm_poll.py $(QUICK_FLAG) > runs/bench/slurm_poll.json
	$(BIN)/python bench/live_job.py $(QUICK_FLAG) > runs/bench/live_job.json
	$(BIN)/python bench/fidelity.py $(QUICK_FLAG) > runs/bench/fidelity.json
	@echo "JSON in runs/bench/"

# Mutation testing of planner/, the pure transitions/ modules and the controller (slow: hours on 2 cores;
# resumable). JSON summary per module in runs/mutate/summary.json.
mutate: $(STAMP)
	$(BIN)/python -m pip install -q -c etc/constraints-cpu.txt -e '.[mutate]'
	$(BIN)/python tests/mutate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache mutants
