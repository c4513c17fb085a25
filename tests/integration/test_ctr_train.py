"""The click-through worker end to end: it learns on generated data, it matches
liblinear on the real heart_scale data set, and bad data stops the run cleanly."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import binary  # noqa: E402

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1
HEART = "/usr/share/doc/liblinear-tools/examples/heart_scale"
WORKER = os.path.join("examples", "ctr", "ctr_worker")
GEN = os.path.join("examples", "ctr", "ctr_gen")


def run(argv, timeout):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout * SLOW)


def pshard_run(workers, args, timeout=120, servers=1):
    return run([binary("pshard"), "run", "-s", str(servers), "-w", str(workers), "--progress-ms", "0", "--",
                binary(WORKER)] + args, timeout)


def last_epoch(stdout):
    m = re.findall(r"epoch \d+: test logloss ([0-9.]+)\s+auc ([0-9.na]+)\s+accuracy ([0-9.]+)", stdout)
    assert m, stdout
    return tuple(float(x) for x in m[-1])


@pytest.fixture(scope="module")
def small_ctr():
    d = tempfile.mkdtemp(prefix="pshard-ctr-")
    r = run([binary(GEN), "--rows", "60000", "--test-rows", "10000", "--parts", "6", "--signal-top", "100",
             "--out", d, "--quiet"], 60)
    assert r.returncode == 0, r.stderr
    yield d
    shutil.rmtree(d, ignore_errors=True)


def meta(d, key):
    for line in open(os.path.join(d, "meta.txt")):
        if line.startswith(key + "="):
            return float(line.split("=", 1)[1])
    raise KeyError(key)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctr_learns_on_generated_data(small_ctr, mode):
    r = run([binary("pshard"), "run", "-s", "2", "-w", "2", "--progress-ms", "0", "--mode", mode, "--",
             binary(WORKER), "--data", small_ctr, "--epochs", "2", "--batch", "200"], 120)
    assert r.returncode == 0, r.stdout + r.stderr
    logloss, auc, acc = last_epoch(r.stdout)
    planted_auc = meta(small_ctr, "planted_test_auc")
    constant = meta(small_ctr, "constant_test_logloss")
    assert logloss < constant - 0.02, (logloss, constant)
    assert auc > planted_auc - 0.05, (auc, planted_auc)
    assert "planted model" in r.stdout


def test_ctr_learns_on_data_with_crosses(tmp_path):
    # crosses of two fields: more features per example and many more distinct ids, each
    # seen less often (so 60k examples teach less of the planted model than without
    # crosses: 0.09 below its AUC here, against 0.07); the worker learns on them
    d = str(tmp_path / "crossed")
    r = run([binary(GEN), "--rows", "60000", "--test-rows", "10000", "--parts", "4", "--signal-top", "100",
             "--crosses", "20", "--format", "bin", "--out", d, "--quiet"], 60)
    assert r.returncode == 0, r.stderr
    r = pshard_run(2, ["--data", d, "--epochs", "2", "--batch", "200", "--opt", "adagrad", "--id-bits", "40"])
    assert r.returncode == 0, r.stdout + r.stderr
    logloss, auc, acc = last_epoch(r.stdout)
    assert logloss < meta(d, "constant_test_logloss") - 0.02, logloss
    assert auc > meta(d, "planted_test_auc") - 0.12, (auc, meta(d, "planted_test_auc"))


@pytest.mark.skipif(not os.path.exists(HEART), reason="liblinear-tools is not installed")
def test_heart_scale_matches_liblinear():
    d = tempfile.mkdtemp(prefix="pshard-heart-")
    try:
        lines = [l for l in open(HEART) if l.strip()]
        assert len(lines) == 270
        test = [l for i, l in enumerate(lines) if i % 4 == 0]
        train = [l for i, l in enumerate(lines) if i % 4 != 0]
        for p in range(2):
            with open(os.path.join(d, f"train-{p:05d}.txt"), "w") as f:
                f.writelines(train[p::2])
        with open(os.path.join(d, "test.txt"), "w") as f:
            f.writelines(test)
        with open(os.path.join(d, "train-all.txt.liblinear"), "w") as f:
            f.writelines(train)
        model = os.path.join(d, "model")
        r = run(["liblinear-train", "-s", "0", "-c", "1", "-q", os.path.join(d, "train-all.txt.liblinear"), model], 60)
        assert r.returncode == 0, r.stderr
        r = run(["liblinear-predict", os.path.join(d, "test.txt"), model, os.path.join(d, "pred")], 60)
        assert r.returncode == 0, r.stderr
        ref = float(re.search(r"Accuracy = ([0-9.]+)%", r.stdout).group(1))
        r = pshard_run(2, ["--data", d, "--epochs", "40", "--batch", "8", "--opt", "adagrad", "--lr", "0.1"])
        assert r.returncode == 0, r.stdout + r.stderr
        _, _, acc = last_epoch(r.stdout)
        print(f"heart_scale test accuracy: pshard {100 * acc:.1f}%, liblinear {ref:.1f}%")
        assert abs(100 * acc - ref) <= 2.0, (100 * acc, ref)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_bad_data_stops_the_run_with_file_and_line():
    d = tempfile.mkdtemp(prefix="pshard-bad-")
    try:
        with open(os.path.join(d, "train-00000.txt"), "w") as f:
            f.write("1 3:1 7:0.5\n0 2:1\n2 5:1\n")
        with open(os.path.join(d, "test.txt"), "w") as f:
            f.write("1 3:1\n0 2:1\n")
        r = pshard_run(1, ["--data", d], timeout=60)
        assert r.returncode == 1, r.stdout + r.stderr
        assert re.search(r"train-00000\.txt:3: label '2'", r.stdout + r.stderr), r.stdout + r.stderr
        with open(os.path.join(d, "train-00000.txt"), "w") as f:
            f.write("1 3:1\n0 x7:1\n")
        r = pshard_run(1, ["--data", d], timeout=60)
        assert r.returncode == 1
        assert re.search(r"train-00000\.txt:2: .*'x7'", r.stdout + r.stderr), r.stdout + r.stderr
        r = pshard_run(1, ["--data", os.path.join(d, "missing")], timeout=60)
        assert r.returncode == 1
        assert "missing" in r.stdout + r.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)
