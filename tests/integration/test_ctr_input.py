"""Bringing your own data to the click-through worker: one libsvm file under any name
cut into byte-range partitions for several workers, a glob of files, a gzip file, a zstd
file (several frames, found by its magic whatever its name),
--predict output in liblinear's format, epoch lines computed at each epoch's end, and
the warning when there are fewer partitions than workers."""
import gzip
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
WORKER = os.path.join("examples", "ctr", "ctr_worker")
GEN = os.path.join("examples", "ctr", "ctr_gen")
ROWS = 40000
EPOCH = re.compile(r"epoch (\d+): test logloss ([0-9.]+)\s+auc ([0-9.na]+)\s+accuracy ([0-9.]+)")


def run(argv, timeout):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout * SLOW)


def pshard_run(workers, args, timeout=120, mode="sync"):
    return run([binary("pshard"), "run", "-s", "2", "-w", str(workers), "--progress-ms", "0", "--mode", mode, "--",
                binary(WORKER)] + args, timeout)


def trained(out):
    """Examples each worker trained on, by worker index."""
    return {int(w): int(n) for w, n in re.findall(r"\[worker (\d+)\] trained on (\d+) examples", out)}


@pytest.fixture(scope="module")
def data():
    d = tempfile.mkdtemp(prefix="pshard-ctr-in-")
    r = run([binary(GEN), "--rows", str(ROWS), "--test-rows", "5000", "--parts", "3", "--signal-top", "100",
             "--out", d, "--quiet"], 60)
    assert r.returncode == 0, r.stderr
    parts = sorted(f for f in os.listdir(d) if f.startswith("train-"))
    assert len(parts) == 3
    with open(os.path.join(d, "all.svm"), "wb") as out:
        for p in parts:
            with open(os.path.join(d, p), "rb") as f:
                shutil.copyfileobj(f, out)
    meta = dict(l.strip().split("=", 1) for l in open(os.path.join(d, "meta.txt")) if "=" in l)
    yield d, meta
    shutil.rmtree(d, ignore_errors=True)


def test_one_svm_file_feeds_two_workers(data):
    d, meta = data
    r = pshard_run(2, ["--data", os.path.join(d, "all.svm"), "--test", os.path.join(d, "test.txt"),
                       "--epochs", "2", "--batch", "200"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert re.search(r"data: 1 file \([0-9.]+ MB\), 8 partitions for 2 workers", out), out
    n = trained(out)
    assert sorted(n) == [0, 1] and all(v > 0 for v in n.values()), n
    assert sum(n.values()) == 2 * ROWS, n
    lines = EPOCH.findall(out)
    assert [int(e[0]) for e in lines] == [1, 2], out
    ll, auc = float(lines[-1][1]), float(lines[-1][2])
    assert ll < float(meta["constant_test_logloss"]) - 0.02, (ll, meta["constant_test_logloss"])
    assert auc > float(meta["planted_test_auc"]) - 0.05, (auc, meta["planted_test_auc"])
    assert "warning" not in out


def test_glob_of_files_and_explicit_parts(data):
    d, _ = data
    r = pshard_run(2, ["--data", os.path.join(d, "train-*.txt"), "--test", os.path.join(d, "test.txt"),
                       "--parts", "6", "--batch", "500"], mode="async")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert re.search(r"data: 3 files .*, 6 partitions for 2 workers", out), out
    assert sum(trained(out).values()) == ROWS, out
    r = pshard_run(1, ["--data", os.path.join(d, "nothing-*.svm"), "--test", os.path.join(d, "test.txt")], 60)
    assert r.returncode != 0
    assert "matches no file" in r.stdout + r.stderr


def test_gzip_file_and_predict_output(data):
    d, _ = data
    gz = os.path.join(d, "train.data.gz")
    with open(os.path.join(d, "all.svm"), "rb") as f, gzip.open(gz, "wb") as g:
        shutil.copyfileobj(f, g)
    test_gz = os.path.join(d, "test.gz")
    with open(os.path.join(d, "test.txt"), "rb") as f, gzip.open(test_gz, "wb") as g:
        shutil.copyfileobj(f, g)
    pred = os.path.join(d, "pred.txt")
    r = pshard_run(1, ["--data", gz, "--test", test_gz, "--batch", "200", "--predict", os.path.join(d, "test.txt"),
                       "--out", pred])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert sum(trained(out).values()) == ROWS, out
    acc = float(EPOCH.findall(out)[-1][3])
    lines = open(pred).read().splitlines()
    assert lines[0] == "labels 1 0"
    assert len(lines) == 5001, len(lines)
    labels = [int(l.split()[0]) for l in open(os.path.join(d, "test.txt")) if l.strip()]
    right = 0
    for line, y in zip(lines[1:], labels):
        f = line.split()
        assert len(f) == 3, line
        pred_label, p1, p0 = int(f[0]), float(f[1]), float(f[2])
        assert 0 <= p1 <= 1 and abs(p1 + p0 - 1) < 1e-5, line
        assert pred_label == (1 if p1 >= 0.5 else 0), line
        right += pred_label == y
    assert abs(right / 5000 - acc) < 1e-3, (right, acc)
    assert re.search(r"predictions: 5000 examples of .* \(accuracy [0-9.]+ against its labels\)", out), out
    # a missing file for --predict is refused before training
    r = pshard_run(1, ["--data", gz, "--test", test_gz, "--predict", os.path.join(d, "missing"), "--out", pred], 60)
    assert r.returncode == 2 and "--predict" in r.stdout + r.stderr


def zstd_cli():
    z = shutil.which("zstd")
    if not z:
        pytest.fail("no zstd command (Debian package zstd, in the Makefile's APT_TEST_PACKAGES)")
    return z


def test_zstd_file_trains_like_the_text(data):
    """The training parts compressed one by one and concatenated (a zstd file of three
    frames), the test set compressed under a name without .zst: one worker in sync mode
    learns exactly what it learns from the uncompressed text read as one partition."""
    d, _ = data
    z = zstd_cli()
    zst = os.path.join(d, "train.data.zst")
    with open(zst, "wb") as out:
        for p in sorted(f for f in os.listdir(d) if f.startswith("train-")):
            out.write(subprocess.run([z, "-q", "-c", os.path.join(d, p)], capture_output=True, check=True,
                                     timeout=60).stdout)
    test_z = os.path.join(d, "test-set")
    with open(test_z, "wb") as out:
        out.write(subprocess.run([z, "-q", "-c", os.path.join(d, "test.txt")], capture_output=True, check=True,
                                 timeout=60).stdout)
    assert open(zst, "rb").read(4) == b"\x28\xb5\x2f\xfd"
    r = pshard_run(1, ["--data", zst, "--test", test_z, "--epochs", "2", "--batch", "200"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert sum(trained(out).values()) == 2 * ROWS, out
    plain = pshard_run(1, ["--data", os.path.join(d, "all.svm"), "--test", os.path.join(d, "test.txt"),
                           "--epochs", "2", "--batch", "200", "--parts", "1"])  # one partition, as a .zst
    assert plain.returncode == 0, plain.stdout + plain.stderr
    got = [e[:4] for e in EPOCH.findall(out)]
    assert len(got) == 2 and got == [e[:4] for e in EPOCH.findall(plain.stdout + plain.stderr)], (got, plain.stdout)
    assert float(got[-1][2]) > 0.6, got  # it learned the planted model

    # A truncated file and a damaged frame header are clear errors, not crashes.
    blob = open(zst, "rb").read()
    cut = os.path.join(d, "cut.zst")
    open(cut, "wb").write(blob[: len(blob) // 2])
    r = pshard_run(1, ["--data", cut, "--test", test_z], 60)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert re.search(re.escape(cut) + r":\d+: read error: truncated zstd stream", out), out
    bad = os.path.join(d, "bad.zst")
    open(bad, "wb").write(blob[:4] + b"\xff" * 8 + blob[12:])
    r = pshard_run(1, ["--data", bad, "--test", test_z], 60)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "ctr_worker: cannot read %s: " % bad in out, out
    assert "Aborted" not in out and "Sanitizer" not in out, out


def test_epoch_lines_carry_their_own_figures_and_fewer_parts_warn(data):
    """One partition for two workers: a worker idles (and a warning says so). In sync mode
    the model after each epoch is then the same whoever trains, so the first epoch line
    of a 3-epoch run must equal the line of a 1-epoch run, and the epochs must differ."""
    d, _ = data
    args = ["--data", os.path.join(d, "all.svm"), "--test", os.path.join(d, "test.txt"), "--parts", "1",
            "--batch", "500"]
    r1 = pshard_run(2, args + ["--epochs", "1"])
    out1 = r1.stdout + r1.stderr
    assert r1.returncode == 0, out1
    assert re.search(r"warning: 1 partition for 2 workers: 1 worker will have nothing to train on", out1), out1
    r3 = pshard_run(2, args + ["--epochs", "3"])
    out3 = r3.stdout + r3.stderr
    assert r3.returncode == 0, out3
    one = EPOCH.findall(out1)
    three = EPOCH.findall(out3)
    assert [int(e[0]) for e in one] == [1] and [int(e[0]) for e in three] == [1, 2, 3], out3
    assert three[0][1:] == one[0][1:], (three[0], one[0])
    assert len({e[1] for e in three}) == 3, three
    assert sum(trained(out3).values()) == 3 * ROWS, out3
