# pshard - top-level entry points. `make test` and `make demo` work on a fresh Debian 12
# machine: they install what they need with apt-get, then build from scratch. `make demo`
# installs only what building needs; `make test` adds what the tests and examples need.

BUILD       ?= build
BUILD_ASAN  ?= build-asan
JOBS        ?= $(shell nproc)
PYTHON      := /usr/bin/python3
# What building (and so `make demo`) needs.
APT_PACKAGES := build-essential cmake pkg-config libuv1-dev libxxhash-dev libssl-dev libcriterion-dev \
                zlib1g-dev libzstd-dev libmicrohttpd-dev nodejs
# What `make test`, the Python examples and the benchmarks add.
APT_TEST_PACKAGES := python3-pytest python3-yaml zstd python3-numpy python3-cffi python3-pip python3-setuptools liblinear-tools openmpi-bin libopenmpi-dev \
                python3-torch libopenblas0-pthread dataset-fashion-mnist r-cran-dslabs redis-server \
                python3-prometheus-client chromium
# What `make fuzz` adds: clang with libFuzzer, and llvm-profdata and llvm-cov.
APT_FUZZ_PACKAGES := clang llvm libclang-rt-dev
# A one-host Slurm for tests/integration/test_slurm.py (`make deps-slurm`; `make test`
# tries it too, and the test skips, saying why, where it cannot be installed or started).
APT_SLURM_PACKAGES := slurmctld slurmd slurm-client munge
# apt-get waits this long (seconds) for another apt or dpkg to release its lock.
APT_LOCK_TIMEOUT ?= 600

DEMO_DATA   ?= data/ctr
DEMO_ROWS   ?= 1000000
DEMO_EPOCHS ?= 2

PREFIX      ?= /usr/local
# The ASan runtime must be loaded first when Python loads the sanitized libpshard.so.
ASAN_PRELOAD = LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0

.PHONY: all deps deps-test deps-slurm build build-asan test test-unit test-asan test-integration test-python test-python-slow \
        example-fashion-mnist example-movielens install demo demo-data bench fuzz clean

all: build

# Install missing Debian packages (only those not yet installed; needs root or sudo),
# showing apt's progress; waits up to APT_LOCK_TIMEOUT s for another apt to finish.
# $(1): the packages, $(2): more apt-get install options.
APT_GET = DEBIAN_FRONTEND=noninteractive $$SUDO apt-get -o DPkg::Lock::Timeout=$(APT_LOCK_TIMEOUT)
define apt_install
	@missing=""; for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "== installing with apt-get:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $(APT_GET) update && $(APT_GET) install -y $(2) $$missing; \
	fi
endef

# The dashboard's chart library (web/package-lock.json), embedded into the binary; npm
# comes with nodejs on some machines and as Debian's npm package on others.
NPM_CI = npm ci --no-audit --no-fund --ignore-scripts
define npm_ci
	@command -v npm >/dev/null || $(call apt_install_cmd,npm)
	@if [ ! -f $(1)/node_modules/.package-lock.json ] || [ $(1)/package-lock.json -nt $(1)/node_modules/.package-lock.json ]; then \
	  echo "== npm ci in $(1)"; cd $(1) && $(NPM_CI); \
	fi
endef
apt_install_cmd = { SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; $(APT_GET) update && $(APT_GET) install -y --no-install-recommends $(1); }

deps:
	$(call apt_install,$(APT_PACKAGES),--no-install-recommends)
	$(call npm_ci,web)

# The browser test drives Debian's chromium with playwright-core (tests/integration/browser).
deps-test: deps
	$(call apt_install,$(APT_TEST_PACKAGES),)
	$(call npm_ci,tests/integration/browser)
	-@$(MAKE) --no-print-directory deps-slurm || echo "Slurm could not be installed: tests/integration/test_slurm.py will skip"

deps-slurm:
	$(call apt_install,$(APT_SLURM_PACKAGES),--no-install-recommends)

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

build-asan: deps
	cmake -S . -B $(BUILD_ASAN) -DCMAKE_BUILD_TYPE=Debug -DPSHARD_SANITIZE=ON >/dev/null
	cmake --build $(BUILD_ASAN) -j $(JOBS)

# Unit tests (ctest), then integration tests (pytest, real processes on loopback),
# first on the release build, then the whole suite again under ASan/UBSan.
test: deps-test build build-asan
	cd $(BUILD) && ctest --output-on-failure -j 2
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider python/tests
	cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j 2
	PSHARD_BUILD=$(CURDIR)/$(BUILD_ASAN) PSHARD_SANITIZED=1 $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration
	PSHARD_BUILD=$(CURDIR)/$(BUILD_ASAN) PSHARD_SANITIZED=1 $(ASAN_PRELOAD) $(PYTHON) -m pytest -q -p no:cacheprovider \
	  python/tests/test_binding.py python/tests/test_cluster.py python/tests/test_torch.py

test-unit: deps-test build
	cd $(BUILD) && ctest --output-on-failure -j 2

test-integration: deps-test build
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration

# The Python binding's tests alone; the -slow variant adds the full example runs.
test-python: deps-test build
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider python/tests

test-python-slow: deps-test build
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) -m pytest -q -p no:cacheprovider python/tests --slow

# The Python examples on real data, each beside its reference run (docs/python.md).
example-fashion-mnist: deps-test build
	PYTHONPATH=$(CURDIR)/$(BUILD)/python $(PYTHON) examples/python/fashion_mnist.py --compare --workers 2 --epochs 10

example-movielens: deps-test build
	PYTHONPATH=$(CURDIR)/$(BUILD)/python $(PYTHON) examples/python/movielens.py --compare --workers 2 --mode async

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# The main job: a click-through model on a generated Criteo-like log, 2 servers, 2 workers.
demo: build demo-data
	@echo "== training: sparse logistic regression (FTRL) on $(DEMO_DATA), 2 servers and 2 workers, $(DEMO_EPOCHS) epochs"
	$(BUILD)/pshard run -s 2 -w 2 -- $(BUILD)/examples/ctr/ctr_worker --data $(DEMO_DATA) --epochs $(DEMO_EPOCHS)

# Generated once and cached: meta.txt is written last, so its presence means complete.
demo-data: build
	@if [ ! -f $(DEMO_DATA)/meta.txt ]; then \
	  echo "== generating a Criteo-like click log: $(DEMO_ROWS) train and 100000 test rows into $(DEMO_DATA)"; \
	  $(BUILD)/examples/ctr/ctr_gen --rows $(DEMO_ROWS) --test-rows 100000 --parts 16 \
	    --signal-top 300 --format bin --out $(DEMO_DATA); \
	else echo "using cached data in $(DEMO_DATA) (delete it to regenerate)"; fi

# Benchmarks against raw TCP/AF_UNIX, memcpy, Redis and Open MPI (not part of make test);
# docs/benchmarks.md records the figures. QUICK=1 for a one-minute smoke run.
bench: deps-test build
	bash bench/run.sh $(CURDIR)/$(BUILD)
	$(PYTHON) bench/modes.py

# Soak run of the failure paths (tests/soak/soak.py): jobs with random kills, stops,
# replacements and dropped, duplicated or delayed chain frames, each checked for lost or
# doubled updates, for SOAK_MINUTES; not part of make test.
SOAK_MINUTES ?= 10
soak: deps-test build
	PSHARD_BUILD=$(CURDIR)/$(BUILD) $(PYTHON) tests/soak/soak.py --minutes $(SOAK_MINUTES)

# libFuzzer on every fuzz target for FUZZ_SECONDS each (tests/fuzz/run.sh): new inputs
# that add coverage are merged into tests/fuzz/corpus/<target>, crashes kept in
# tests/fuzz/crashes/<target> (both replayed by make test); prints execs and coverage.
FUZZ_SECONDS ?= 60
fuzz: deps
	$(call apt_install,$(APT_FUZZ_PACKAGES),--no-install-recommends)
	FUZZ_SECONDS=$(FUZZ_SECONDS) bash tests/fuzz/run.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
