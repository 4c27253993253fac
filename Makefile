# Every target does its own set-up: a virtual environment with the CPU build of
# torch 2.13.0 (it lies on this machine's disk, so no multi-GB CUDA download).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sdcreplay-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test demo docs traces bench gpu-check lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,hf,lightning,postgres]' "$(TORCH_PIN)"
	# TorchTitan 0.3.0 pins datasets<4.8, which pins huggingface-hub<2, and transformers 5 needs
	# hub>=2.4: both cannot hold. datasets reads local JSON files with hub 2 too (all the TorchTitan
	# tests ask of it), so hub is put back at transformers' (pip warns of the conflict).
	$(PY) -m pip install -q --disable-pip-version-check -e '.[torchtitan]' "$(TORCH_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check "huggingface-hub>=2.4,<3"
	touch $(STAMP)

# One pytest-xdist worker a core: most tests are one busy process at a time. loadfile keeps a
# module's tests on one worker, so a module's costly fixture is made once; the files go out in
# their order (tests/bisect first: among the heaviest). --durations: the slowest tests of each
# run, to keep the suite under 20 minutes on 2 cores.
# compileall first: the editable install leaves the package uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set (as in these sandboxes) every process the suite starts (~400:
# commands, forkservers, ranks) would compile the modules it imports again (~0.5 s CPU each).
TEST_WORKERS ?= auto
test: lint
	$(PY) -m compileall -q sdcreplay tests examples bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The demo's verdicts (drills) go to demo-out/ledger.sqlite, its secret to demo-out/home:
# ~/.config/sdcreplay is left alone unless SDCREPLAY_LEDGER / SDCREPLAY_HOME say otherwise.
demo: $(STAMP)
	$(VENV)/bin/sdcreplay demo --out demo-out

# Every command block of README.md and docs/*.md, rewritten from a real run (docs/architecture.md,
# "Docs that cannot drift"); `make docs SESSIONS=walkthrough` runs one session.
docs: $(STAMP)
	$(PY) tests/docs/regenerate.py $(SESSIONS)

traces: $(STAMP)
	rm -rf traces/tiny.bundle
	# Kernels every machine can put in force; whether another machine computes like this one
	# is for the bundle's kernel probe to say (see docs/trust-and-comparability.md).
	ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE $(VENV)/bin/sdcreplay record builtin:tiny-llama --steps 3 --seed 0 -a dim=48 --out traces/tiny.bundle

bench: $(STAMP)
	$(PY) bench/digest.py
	$(PY) bench/record_overhead.py
	$(PY) bench/detection_campaign.py

# On a machine with one GPU: the gpu-marked tests, the benchmarks on cuda:0 and an end-to-end
# record/replay/bisect, in at most 8 minutes; one table (and logs) under $$OUT/gpu-check or
# ./gpu-check. Without a GPU it runs the parts a CPU can check, says so, and exits 0.
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

lint: $(STAMP)
	$(PY) -m ruff check sdcreplay tests bench examples
	$(PY) -m ruff format --check sdcreplay tests bench examples
	$(PY) -m mypy sdcreplay

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache gpu-check
