"""pytest setup for the Python binding's tests.

Which pshard is tested: with PSHARD_BUILD=<build dir> (as `make test` sets it), the
package copied into <build>/python by the build if present, else python/ of this
checkout with <build>/libpshard.so; without it, python/ and <repo>/build. Worker
processes started by the tests get the same PYTHONPATH.

The full example runs (minutes) are marked `slow` and skipped unless pytest gets
--slow or PSHARD_SLOW=1. Against a sanitizer build (PSHARD_SANITIZED=1) the tests run
only when the ASan runtime is preloaded (LD_PRELOAD), since a Python process cannot
load an ASan-instrumented library otherwise.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build"))
_built = os.path.join(BUILD, "python")
PYDIR = _built if os.path.exists(os.path.join(_built, "pshard", "__init__.py")) else os.path.join(ROOT, "python")
if PYDIR == os.path.join(ROOT, "python"):
    os.environ.setdefault("PSHARD_LIB", os.path.join(BUILD, "libpshard.so"))
os.environ.setdefault("PSHARD_BIN", os.path.join(BUILD, "pshard"))
sys.path.insert(0, PYDIR)
os.environ["PYTHONPATH"] = PYDIR + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests start their own jobs: a launcher's variables must not leak into them.
for _k in [k for k in os.environ if k.startswith("PSHARD_") and k not in
           ("PSHARD_BUILD", "PSHARD_LIB", "PSHARD_BIN", "PSHARD_SANITIZED", "PSHARD_SLOW", "PSHARD_DATA_DIR")]:
    del os.environ[_k]

SANITIZED = os.environ.get("PSHARD_SANITIZED") == "1"
ASAN_PRELOADED = "libasan" in os.environ.get("LD_PRELOAD", "")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="also run the full example runs (minutes)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: full example runs on real data (minutes); run with --slow")


def pytest_collection_modifyitems(config, items):
    slow = config.getoption("--slow") or os.environ.get("PSHARD_SLOW") == "1"
    for item in items:
        if SANITIZED and not ASAN_PRELOADED:
            item.add_marker(pytest.mark.skip(reason="sanitizer build: run with LD_PRELOAD=$(gcc -print-file-name=libasan.so)"))
        elif "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --slow or PSHARD_SLOW=1"))
