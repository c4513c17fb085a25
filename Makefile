# pshard - top-level entry points. `make test` and `make demo` work on a fresh Debian 12
# machine: they install what they need with apt-get, then build from scratch.

BUILD       ?= build
BUILD_ASAN  ?= build-asan
JOBS        ?= $(shell nproc)
PYTHON      := /usr/bin/python3
APT_PACKAGES := build-essential cmake pkg-config libuv1-dev libxxhash-dev libcriterion-dev \
                python3-pytest python3-numpy python3-cffi liblinear-tools openmpi-bin libopenmpi-dev

DEMO_DATA   ?= data/ctr
DEMO_ROWS   ?= 1000000
DEMO_EPOCHS ?= 2

.PHONY: all deps build build-asan test test-unit test-asan test-integration demo demo-data bench clean

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
	cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j 2
	PSHARD_BUILD=$(CURDIR)/$(BUILD_ASAN) PSHARD_SANITIZED=1 $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration

test-unit: build
	cd $(BUILD) && ctest --output-on-failure -j 2

test-integration: build
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration

# The main job: a click-through model on a generated Criteo-like log, 2 servers, 2 workers.
demo: build demo-data
	$(BUILD)/pshard run -s 2 -w 2 -- $(BUILD)/examples/ctr/ctr_worker --data $(DEMO_DATA) --epochs $(DEMO_EPOCHS)

# Generated once and cached: meta.txt is written last, so its presence means complete.
demo-data: build
	@if [ ! -f $(DEMO_DATA)/meta.txt ]; then \
	  $(BUILD)/examples/ctr/ctr_gen --rows $(DEMO_ROWS) --test-rows 100000 --parts 16 \
	    --signal-top 300 --format bin --out $(DEMO_DATA); \
	else echo "using cached data in $(DEMO_DATA) (delete it to regenerate)"; fi

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
