"""bench/bench_quality.py in its smoke-test form (--quick --no-shape, int8 only): both
workloads train under `pshard run` on loopback, and the tables it prints hold what the
runs did: int8 pushes move fewer bytes per step than none, int8 both ways fewer still,
the qualities are those of models that learned, and none reaches its own target."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "bench_quality.py")
BUILD = os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build"))
ROW = re.compile(r"^(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%?\s+([+-][\d.]+)(?:pt)?\s+(not reached|[\d.]+)\s")


def tables(out):
    """{workload: {codec: (KB/step, x none, quality, time to T or None)}}"""
    res, cur = {}, None
    for line in out.splitlines():
        m = re.match(r"^(ctr|fmnist): test", line)
        if m:
            cur = res.setdefault(m.group(1), {})
            continue
        m = ROW.match(line)
        if m and cur is not None:
            t = None if m.group(6) == "not reached" else float(m.group(6))
            cur[m.group(1)] = (float(m.group(2)), float(m.group(3)), float(m.group(4)), t)
    return res


def test_quick_unshaped_run_prints_both_tables(tmp_path):
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        pytest.skip("Fashion-MNIST missing: apt-get install dataset-fashion-mnist")
    for p in ("pshard", os.path.join("examples", "ctr", "ctr_worker")):
        if not os.path.exists(os.path.join(BUILD, p)):
            pytest.skip(f"{p} not built")
    r = subprocess.run([sys.executable, BENCH, "--quick", "--no-shape", "--codecs", "int8", "--evals", "4", "--no-seed-run",
                        "--data-dir", str(tmp_path), "--build", BUILD, "--timeout", "150"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
                       start_new_session=True)
    assert r.returncode == 0, r.stdout[-4000:]
    t = tables(r.stdout)
    assert set(t) == {"ctr", "fmnist"}, r.stdout
    assert set(t["ctr"]) == {"none", "int8", "int8/int8"} and set(t["fmnist"]) == {"none", "int8"}, t
    for w in t:
        none, int8 = t[w]["none"], t[w]["int8"]
        assert none[1] == 1.0 and int8[1] < 0.95, (w, t[w])   # int8 values take ~a quarter of f32's
        assert none[3] is not None, (w, t[w])                 # none reaches its own final - margin
    assert t["ctr"]["int8/int8"][0] < t["ctr"]["int8"][0], t["ctr"]
    assert t["ctr"]["none"][2] > 0.65 and t["fmnist"]["none"][2] > 60, t
    assert "quality targets missed" in r.stdout and "load average" in r.stdout
