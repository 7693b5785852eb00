# The two commands of the README: `make demo` and `make test`. Both create .venv on first use;
# `make test` first runs `make services`, which installs the system programs the tests' real services need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Overrides that make the ResNet-50 demo finish in a few minutes on a 2-core CPU.
# On a GPU machine run `make demo DEMO_ARGS=` to train the example as written.
DEMO_ARGS ?= --set trainer.data.image_size=96 --set trainer.batch_size=16 --set trainer.steps_per_epoch=12 --set trainer.epochs=2

.PHONY: demo test services venv clean

venv: $(STAMP)

# Python writes the bytecode of each module the first time a process imports it. Where PYTHONDONTWRITEBYTECODE
# is set (it is on the machines docs/testing.md measures), every process would compile again all it imports, so
# make's commands run without it.
unexport PYTHONDONTWRITEBYTECODE

# uv installs the versions pip would choose, in a fraction of its time (the CUDA build of torch alone is some
# 4 GB). Neither compiles the bytecode of all 23,000 modules up front (40 s of the install): the demo and the
# tests import a fraction of them, and Python compiles those on first import. uv does not read pip's
# configuration, so where only pip's configured index answers, pip installs instead.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	($(BIN)/pip install --quiet uv && $(BIN)/uv pip install --python $(BIN)/python --quiet -e ".[test]") \
		|| $(BIN)/pip install --quiet --no-compile -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/clusterfit run examples/resnet50-synthetic.yaml $(DEMO_ARGS)

# Installs what is missing (root + apt-get), else prints one line naming it and the tests that skip; silent
# and fast when everything is there.
services:
	@$(PYTHON) tests/services.py

# Most tests wait on real processes (jobs, services, timeouts) more than they compute, so they run three at a
# time; tests that share one Ray or Slurm cluster are grouped onto one worker (xdist_group).
TEST_WORKERS ?= 3

# Some tests run jobs as accounts that cannot write into this checkout: compileall writes clusterfit's own bytecode
# for them first (a fraction of a second, then only for changed files).
test: $(STAMP) services
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
