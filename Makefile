# The two commands that do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The gpu extra (tensorflow[and-cuda]) when the driver lists a GPU, the CPU-only wheel otherwise.
EXTRA := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo gpu || echo cpu)
# ray: the TaskPool's Ray backend is tested, not skipped (tests/tasks/test_taskpool_ray.py).
EXTRAS := $(EXTRA),dev,ray

.PHONY: demo test check quick lint unit venv clean bench

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

venv: $(BIN)/.installed

# The main job: the doctor's table (a failed check does not stop the demo, it is the point
# of showing it), training on every device, then a short scaling benchmark with its report.
demo: venv
	-$(BIN)/tfscale doctor
	$(BIN)/tfscale demo
	$(BIN)/tfscale bench --model cnn --replicas 1,2 --steps 10 --trace-steps 2 --out tfscale-bench

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# The fast tier: lint and every test that needs no TensorFlow runtime and no child process
# (tests/README.md). Test modules marked `tf` as a whole are not even imported.
check: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not tf and not multiprocess"

# The middle tier: everything but the slow tests (launched jobs, worker processes, the
# parity suite, benchmarks' harness), on both cores.
quick: venv
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow"

# Two pytest processes (both cores), tests handed out one by one as a process frees up
# (--dist loadgroup): TensorFlow starts once per process, and a module whose tests share a
# module fixture (launched jobs, the Slurm cluster) says so with xdist_group and stays in one.
unit: venv
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

test: lint unit

bench: venv
	$(BIN)/python benchmarks/fit_vs_keras.py
	$(BIN)/python benchmarks/pipeline_overlap.py
	$(BIN)/python benchmarks/taskpool_balance.py
	$(BIN)/python benchmarks/taskpool_overhead.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache tfscale-bench
