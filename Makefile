# Developer entry points. `make check` is the one test command: README and .ci/run call it.
VENV ?= .venv
PY := $(VENV)/bin/python
# How long bench/daemon_idle.py watches the idle daemon (the issue's 10 minutes; shorten with
# `make bench IDLE_SECONDS=120`).
IDLE_SECONDS ?= 600

.PHONY: check lint test unit venv fakenvml bench hardware-check clean deps real-engine e2e-real

check: lint test

# Everything the whole suite needs from apt, for a fresh Debian 12 or 13 (root): gcc/make/libc6-dev
# build the fake libnvidia-ml, python3-venv makes the venv, psmisc and lsof are the benchmark's
# baselines (fuser, lsof), debootstrap, systemd-container (systemd-nspawn), systemd-journal-remote,
# util-linux and coreutils boot the end-to-end tests' containers and build the Debian package,
# ca-certificates and git fetch its build inputs, reprepro and gnupg make its apt repository,
# prometheus gives promtool (the alert rules' tests), tmux is the terminal `status --watch` is
# tested on, docker.io gives dockerd and docker (tests/integration/test_container_dockerd.py:
# the gate, reap and status stop and name a unit's left-over container of a real dockerd, one the
# test starts on a private socket, whatever the system's does). Without them (or
# without root) those tests are skipped, and `make check` says how many. .ci/run installs
# through this target too.
DEPS := gcc make libc6-dev python3 python3-venv psmisc lsof debootstrap systemd-container \
	systemd-journal-remote util-linux coreutils ca-certificates git reprepro gnupg prometheus tmux \
	docker.io

deps:
	@if [ "$$(id -u)" != 0 ]; then echo "make deps installs apt packages: run it as root (sudo make deps)" >&2; exit 1; fi
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEPS) >/dev/null
	@echo "make deps: installed $(DEPS)"

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache

# The whole suite, with the core's coverage floor ([tool.coverage] in pyproject.toml): measured
# in the test process only, it fails the run below the floor and prints the total. PYTEST_ARGS
# (below) reach it too: `make check PYTEST_ARGS=-rs` lists every skipped test's reason.
test: venv fakenvml
	$(PY) -m pytest --cov --cov-report= $(PYTEST_ARGS)

# The edit-test loop: the unit tests alone, quiet, with hypothesis's "dev" profile (10 examples a
# property; tests/conftest.py). `make unit HYPOTHESIS_PROFILE=gpuguard` for CI's 100, and
# `make unit PYTEST_ARGS='-x -k gate'` to narrow it. No coverage floor here: `make check` has it.
HYPOTHESIS_PROFILE ?= dev
PYTEST_ARGS ?=
unit: venv fakenvml
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

# Built where gpuguard run by this user will load it (tests/fakenvml/fakestate.py build_dir:
# tests/fakenvml/build, or for root in another user's checkout a private directory in /tmp).
fakenvml:
	python3 tests/fakenvml/fakestate.py

bench: venv fakenvml
	$(PY) bench/holder_scan.py
	$(PY) bench/gate.py
	$(PY) bench/journal_throughput.py
	$(PY) bench/daemon_idle.py --seconds $(IDLE_SECONDS)

# The fake NVML against this host's GPU (bench/README.md); against the fake where none is.
# HWCHECK_ARGS: e.g. --backend real --gpu 3 --report /tmp/hw.json
hardware-check: venv fakenvml
	$(PY) bench/hardware_check.py $(HWCHECK_ARGS)

clean:
	rm -rf $(VENV) tests/fakenvml/build .pytest_cache .mypy_cache .ruff_cache .coverage

# The Debian package, one for Debian 12/13 and Ubuntu 22.04/24.04, built in a clean Debian 12
# tree (root, debootstrap, systemd-nspawn; docs/packaging.md). Output in dist/.
# `make repo`: a signed apt repository of it in dist/repo (reprepro, gnupg; docs/install.md),
# under a throw-away key unless GPUGUARD_REPO_KEY names the operator's.
.PHONY: deb repo
deb:
	packaging/build-deb

repo:
	@test -n "$(wildcard dist/gpuguard_*_amd64.deb)" || packaging/build-deb
	packaging/build-repo

# The real vLLM (0.32, CPU build) of the e2e tests, in the Debian 12 test tree (root,
# debootstrap, systemd-nspawn, network for pip): its venv (3.5 GB), the wheels (0.9 GB) and a
# tiny Llama, cached in /var/cache/gpuguard-e2e/engine (tests/e2e/real_engine.py, docs/e2e.md).
# Once cached: nothing to do. `make e2e-real` then runs the tests that boot it, and fails (never
# skips) when it cannot be installed.
real-engine: venv fakenvml
	@if [ "$$(id -u)" != 0 ]; then echo "make real-engine builds in the e2e tree: run it as root" >&2; exit 1; fi
	PYTHONPATH=tests:tests/fakenvml $(PY) -m e2e.real_engine

e2e-real: real-engine
	GPUGUARD_REQUIRE_REAL_ENGINE=1 $(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_real_vllm.py \
		tests/e2e/test_real_vllm_crash.py tests/e2e/test_real_vllm_engine_death.py \
		tests/e2e/test_real_vllm_stop.py

# `make demo` (as root, no GPU needed): the incident README.md opens with, on a real systemd in
# a container with fake GPUs - without gpuguard, with the gate drop-in, with the daemon - then each
# timeline and the results table (docs/e2e.md). About two minutes once the caches are warm.
.PHONY: demo
demo: venv fakenvml
	@if [ "$$(id -u)" != 0 ]; then echo "make demo boots containers: run it as root" >&2; exit 1; fi
	GPUGUARD_E2E_SUMMARY=0 GPUGUARD_E2E_WINDOW_S=$${GPUGUARD_E2E_WINDOW_S:-60} \
	$(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_incident.py \
		tests/e2e/test_incident_daemon.py -k 'test_a_ or test_b_ or test_c_daemon_alone'; \
	status=$$?; \
	$(PY) tests/e2e/report.py --scenarios a,b,c; exit $$status
