"""Installing pshard and building against it: `cmake --install` into a fresh prefix, then
a C program built with pkg-config, one with CMake's find_package (shared and static),
the Python package installed with pip from the source tree, and the versions they all
report. Real processes; everything happens in a temporary directory."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BUILD, ROOT  # noqa: E402

pytestmark = pytest.mark.skipif(bool(os.environ.get("PSHARD_SANITIZED")),
                                reason="an installed sanitized library needs the sanitizer's runtime in every consumer")

PROGRAM = r"""
#include <stdio.h>
#include <string.h>
#include "pshard.h"
int main(void) {
  ps_config *cfg = NULL;
  if (ps_config_new(&cfg)) return 1;
  int bad = ps_config_set(cfg, "no_such_key", "1");
  ps_config_free(cfg);
  printf("%s %d\n", ps_version(), bad == PS_ERR_CONFIG);
  return strcmp(ps_version(), "%d.%d.%d") != 0;
}
"""


def run(argv, env=None, cwd=None, timeout=120):
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert p.returncode == 0, f"{argv}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def prefix():
    d = tempfile.mkdtemp(prefix="pshard-install-")
    try:
        run(["cmake", "--install", BUILD, "--prefix", os.path.join(d, "prefix")])
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def version():
    with open(os.path.join(ROOT, "include", "pshard.h")) as f:
        h = f.read()
    return tuple(int(re.search(r"#define PS_VERSION_%s (\d+)" % k, h).group(1)) for k in ("MAJOR", "MINOR", "PATCH"))


def program_source():
    return PROGRAM.replace("%d.%d.%d", "%d.%d.%d" % version())


def test_the_install_has_the_library_its_soname_the_command_the_header_and_the_package_files(prefix):
    p = os.path.join(prefix, "prefix")
    major, minor, patch = version()
    lib = os.path.join(p, "lib")
    assert os.path.isfile(os.path.join(lib, f"libpshard.so.{major}.{minor}.{patch}"))
    assert os.readlink(os.path.join(lib, f"libpshard.so.{major}.{minor}")) == f"libpshard.so.{major}.{minor}.{patch}"
    assert os.readlink(os.path.join(lib, "libpshard.so")) == f"libpshard.so.{major}.{minor}"
    assert os.path.isfile(os.path.join(lib, "libpshard.a"))
    soname = run(["objdump", "-p", os.path.join(lib, "libpshard.so")])
    assert re.search(rf"SONAME\s+libpshard\.so\.{major}\.{minor}\b", soname), soname
    assert os.path.isfile(os.path.join(p, "include", "pshard.h"))
    assert os.path.isfile(os.path.join(lib, "pkgconfig", "pshard.pc"))
    assert os.path.isfile(os.path.join(lib, "cmake", "pshard", "pshardConfig.cmake"))
    out = run([os.path.join(p, "bin", "pshard"), "--version"])
    assert out.startswith("pshard %d.%d.%d " % version()), out


def test_a_program_builds_with_pkg_config_and_runs(prefix):
    p = os.path.join(prefix, "prefix")
    src = os.path.join(prefix, "pc.c")
    with open(src, "w") as f:
        f.write(program_source())
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(p, "lib", "pkgconfig"))
    flags = run(["pkg-config", "--cflags", "--libs", "pshard"], env=env).split()
    assert run(["pkg-config", "--modversion", "pshard"], env=env).strip() == "%d.%d.%d" % version()
    exe = os.path.join(prefix, "pc")
    run(["cc", "-o", exe, src] + flags)
    out = run([exe], env=dict(os.environ, LD_LIBRARY_PATH=os.path.join(p, "lib")))
    assert out.split() == ["%d.%d.%d" % version(), "1"], out


@pytest.mark.parametrize("target", ["pshard::pshard", "pshard::pshard_static"])
def test_a_program_builds_with_cmake_find_package_and_runs(prefix, target):
    p = os.path.join(prefix, "prefix")
    proj = os.path.join(prefix, "cm-" + target.split("::")[1])
    os.makedirs(proj)
    with open(os.path.join(proj, "main.c"), "w") as f:
        f.write(program_source())
    with open(os.path.join(proj, "CMakeLists.txt"), "w") as f:
        f.write("cmake_minimum_required(VERSION 3.18)\nproject(consumer C)\nfind_package(pshard REQUIRED)\n"
                "add_executable(consumer main.c)\ntarget_link_libraries(consumer %s)\n" % target)
    b = os.path.join(proj, "build")
    run(["cmake", "-S", proj, "-B", b, "-DCMAKE_PREFIX_PATH=" + p])
    run(["cmake", "--build", b])
    out = run([os.path.join(b, "consumer")], env=dict(os.environ, LD_LIBRARY_PATH=os.path.join(p, "lib")))
    assert out.split() == ["%d.%d.%d" % version(), "1"], out


def test_pip_installs_the_python_package_and_it_finds_the_installed_library(prefix):
    p = os.path.join(prefix, "prefix")
    src = os.path.join(prefix, "pysrc")
    shutil.copytree(os.path.join(ROOT, "python"), src, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    target = os.path.join(prefix, "site")
    run(["/usr/bin/python3", "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", "--quiet",
         "--target", target, src])
    assert os.path.isfile(os.path.join(target, "pshard", "__init__.py"))
    assert not os.path.exists(os.path.join(target, "pshard", "_config.py")), "the build tree's paths stay out"
    env = {k: v for k, v in os.environ.items() if k not in ("PSHARD_LIB", "PSHARD_BUILD", "PYTHONPATH")}
    env.update(PYTHONPATH=target, PSHARD_LIB=os.path.join(p, "lib", "libpshard.so"))
    code = "import pshard, pshard._lib as l; print(pshard.__version__, l.LIBRARY_PATH)"
    out = run(["/usr/bin/python3", "-c", code], env=env, cwd=prefix).split()
    assert out == ["%d.%d.%d" % version(), os.path.join(p, "lib", "libpshard.so")], out
    with open(os.path.join(ROOT, "python", "pyproject.toml")) as f:
        assert re.search(r'^version = "%d\.%d\.%d"$' % version(), f.read(), re.M), "pyproject.toml's version"
