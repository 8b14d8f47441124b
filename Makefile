# Quick start: `make demo` and `make test`. Both create .venv and install into it.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DEMO_ROUNDS ?= 5
DEMO_AGGREGATORS ?= 2
DEMO_CLIENTS ?= 6
DEMO_TASK ?= digits
DEMO_OUT ?= demo-out
# The suite runs in this many pytest-xdist workers, a test file to a worker (2: the CI
# machine's cores; torch takes one thread in each).
TEST_WORKERS ?= 2

.PHONY: install test test-all demo lint typecheck proto clean device device-sanitize fuzz fuzz-corpus

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	# torch first, from the constraints file: the CPU build (see constraints.txt).
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m '' -n $(TEST_WORKERS) --dist loadfile

demo: $(STAMP)
	$(BIN)/orchard demo --rounds $(DEMO_ROUNDS) --aggregators $(DEMO_AGGREGATORS) \
		--clients $(DEMO_CLIENTS) --task $(DEMO_TASK) --out $(DEMO_OUT)

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy orchard server client aggregation compression secure_agg edge_runtime simulation pretrain tasks

proto: $(STAMP)
	$(BIN)/python -m orchard.protogen

# The native device client (device/): build it and run its tests with ctest. `make test`
# runs the same through tests/device/test_native.py (skipped without the toolchain).
DEVICE_BUILD ?= device/build/default
device: $(STAMP)
	cmake -S device -B $(DEVICE_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-Dexecutorch_DIR=$$($(BIN)/python -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("executorch").submodule_search_locations[0]) / "share" / "cmake")')
	cmake --build $(DEVICE_BUILD) -j 2
	$(BIN)/python tests/device/device_vectors.py $(DEVICE_BUILD)/vectors
	ORCHARD_DEVICE_VECTORS=$(CURDIR)/$(DEVICE_BUILD)/vectors ctest --test-dir $(DEVICE_BUILD) --output-on-failure

# The same under AddressSanitizer and UndefinedBehaviorSanitizer (a Debug build in
# device/build/sanitize): ctest, then the tests that run `orchard-device` against live
# servers (its connection and refusals, the mixed and secure federations, DP and 64-bit
# masks included) with the sanitized command. Any report fails the process and the test.
device-sanitize: $(STAMP)
	ORCHARD_DEVICE_VARIANT=sanitize $(BIN)/python -m pytest -q -m "" \
		tests/device/test_native.py::test_ctest_under_sanitizers tests/device/test_native_link.py \
		tests/device/test_native_mixed.py

# Fuzzing (docs/fuzzing.md): every target in fuzz/targets.py, one at a time, FUZZ_RUNS
# executions each, an input over FUZZ_TIMEOUT seconds counted as a hang. `make test` runs
# a short budget of each (tests/test_fuzz.py). FUZZ_RECORD=--record appends the figures to
# benchmarks/results/fuzz.json.
FUZZ_RUNS ?= 1000000
FUZZ_TIMEOUT ?= 1
FUZZ_TARGETS ?=
FUZZ_RECORD ?=
fuzz: $(STAMP)
	$(BIN)/python fuzz/campaign.py --runs $(FUZZ_RUNS) --timeout $(FUZZ_TIMEOUT) \
		$(if $(FUZZ_TARGETS),--targets $(FUZZ_TARGETS)) $(FUZZ_RECORD)

# Rewrite the seed corpus (fuzz/corpus/) from real messages.
fuzz-corpus: $(STAMP)
	$(BIN)/python fuzz/make_corpus.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache device/build
