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

# uv installs the versions pip would choose, in a fraction of its time (the CUDA build of torch alone is some
# 4 GB), compiling the bytecode as pip does. uv does not read pip's configuration, so where only pip's
# configured index answers, pip installs instead.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	($(BIN)/pip install --quiet uv && $(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode -e ".[test]") \
		|| $(BIN)/pip install --quiet -e ".[test]"
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

# The tests start hundreds of Python processes that import clusterfit from src/, which an editable install
# leaves uncompiled; where PYTHONDONTWRITEBYTECODE is set (it is on the machines docs/testing.md measures), each
# process compiled every module it imported. compileall writes their bytecode once, then only for changed files.
test: $(STAMP) services
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
