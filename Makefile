# pshard - top-level entry points. `make test` and `make demo` work on a fresh Debian 12
# machine: they install what they need with apt-get, then build from scratch.

BUILD       ?= build
BUILD_ASAN  ?= build-asan
JOBS        ?= $(shell nproc)
PYTHON      := /usr/bin/python3
APT_PACKAGES := build-essential cmake pkg-config libuv1-dev libxxhash-dev libssl-dev libcriterion-dev \
                python3-pytest python3-numpy python3-cffi python3-pip python3-setuptools liblinear-tools openmpi-bin libopenmpi-dev \
                python3-torch libopenblas0-pthread dataset-fashion-mnist r-cran-dslabs redis-server

DEMO_DATA   ?= data/ctr
DEMO_ROWS   ?= 1000000
DEMO_EPOCHS ?= 2

PREFIX      ?= /usr/local
# The ASan runtime must be loaded first when Python loads the sanitized libpshard.so.
ASAN_PRELOAD = LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0

.PHONY: all deps build build-asan test test-unit test-asan test-integration test-python test-python-slow \
        example-fashion-mnist example-movielens install demo demo-data bench clean

all: build

# Install missing Debian packages (only those not yet installed; needs root or sudo).
deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

build-asan: deps
	cmake -S . -B $(BUILD_ASAN) -DCMAKE_BUILD_TYPE=Debug -DPSHARD_SANITIZE=ON >/dev/null
	cmake --build $(BUILD_ASAN) -j $(JOBS)

# Unit tests (ctest), then integration tests (pytest, real processes on loopback),
# first on the release build, then the whole suite again under ASan/UBSan.
test: build build-asan
	cd $(BUILD) && ctest --output-on-failure -j 2
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider python/tests
	cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j 2
	PSHARD_BUILD=$(CURDIR)/$(BUILD_ASAN) PSHARD_SANITIZED=1 $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration
	PSHARD_BUILD=$(CURDIR)/$(BUILD_ASAN) PSHARD_SANITIZED=1 $(ASAN_PRELOAD) $(PYTHON) -m pytest -q -p no:cacheprovider \
	  python/tests/test_binding.py python/tests/test_cluster.py python/tests/test_torch.py

test-unit: build
	cd $(BUILD) && ctest --output-on-failure -j 2

test-integration: build
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration

# The Python binding's tests alone; the -slow variant adds the full example runs.
test-python: build
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider python/tests

test-python-slow: build
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider python/tests --slow

# The Python examples on real data, each beside its reference run (docs/python.md).
example-fashion-mnist: build
	PYTHONPATH=$(CURDIR)/$(BUILD)/python $(PYTHON) examples/python/fashion_mnist.py --compare --workers 2 --epochs 10

example-movielens: build
	PYTHONPATH=$(CURDIR)/$(BUILD)/python $(PYTHON) examples/python/movielens.py --compare --workers 2 --mode async

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# The main job: a click-through model on a generated Criteo-like log, 2 servers, 2 workers.
demo: build demo-data
	$(BUILD)/pshard run -s 2 -w 2 -- $(BUILD)/examples/ctr/ctr_worker --data $(DEMO_DATA) --epochs $(DEMO_EPOCHS)

# Generated once and cached: meta.txt is written last, so its presence means complete.
demo-data: build
	@if [ ! -f $(DEMO_DATA)/meta.txt ]; then \
	  $(BUILD)/examples/ctr/ctr_gen --rows $(DEMO_ROWS) --test-rows 100000 --parts 16 \
	    --signal-top 300 --format bin --out $(DEMO_DATA); \
	else echo "using cached data in $(DEMO_DATA) (delete it to regenerate)"; fi

# Benchmarks against raw TCP/AF_UNIX, memcpy, Redis and Open MPI (not part of make test);
# docs/benchmarks.md records the figures. QUICK=1 for a one-minute smoke run.
bench: build
	bash bench/run.sh $(CURDIR)/$(BUILD)
	$(PYTHON) bench/modes.py

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
