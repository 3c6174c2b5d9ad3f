# The two commands: `make run` starts the playground, `make test` runs the tests. Both set themselves up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install whenever the dependency list changes.
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-10)

.PHONY: run dev test setup system-deps lint format gpu-check clean

# `make run MODEL=/path/to/checkpoint` serves that folder instead of the default model (several: separated by
# spaces or commas; preset names too), passed on as playground.run's --model; MODEL counts only on make's command
# line, not from the environment, where the name may mean something else. RUN_ARGS takes playground.run's other
# options: make run RUN_ARGS='--port 8080 --host 0.0.0.0'.
comma := ,
RUN_MODELS := $(if $(filter command line,$(origin MODEL)),$(subst $(comma), ,$(MODEL)))

# `make run` serves as a public demo would (DEBUG off, the enforced Content-Security-Policy); `make dev` is the same
# with Django's debug pages (DJANGO_DEBUG=1), on loopback only, since they show the settings.
run: setup
	$(PY) -m playground.run $(strip $(foreach m,$(RUN_MODELS),--model '$(m)') $(RUN_ARGS))

dev: setup
	DJANGO_DEBUG=1 $(PY) -m playground.run $(strip $(foreach m,$(RUN_MODELS),--model '$(m)') $(RUN_ARGS))

test: setup system-deps
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch lies on disk here; an unpinned torch would pull gigabytes of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	# Both roles on one machine (`make run` starts the web process and a worker), and the tests' tools.
	$(PY) -m pip install -q -e '.[web,worker,test]'
	rm -f $(VENV)/.installed-*
	touch $@

# Chromium for the browser tests (Debian's package, driven by playwright; never `playwright install`).
system-deps:
	@bash scripts/system_deps.sh

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# On a GPU machine: GPU kernel tests in bf16, correctness against the reference, the benchmark.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
