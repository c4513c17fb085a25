"""The click-through worker's prefetch (the next batch's rows pulled during the step
before) gives, in sync mode, exactly the model of --no-prefetch: the predictions are
the same bytes. A prefetch started before the step's clock would miss the round that
clock closes and change them."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import binary  # noqa: E402

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1
WORKER = os.path.join("examples", "ctr", "ctr_worker")
GEN = os.path.join("examples", "ctr", "ctr_gen")


def run(argv, timeout):
    """Run argv in its own process group; the whole group is killed on a timeout."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout * SLOW)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return p.returncode, out, err


@pytest.fixture(scope="module")
def data():
    d = tempfile.mkdtemp(prefix="pshard-ctr-prefetch-")
    rc, _, err = run([binary(GEN), "--rows", "12000", "--test-rows", "2000", "--parts", "2", "--signal-top", "100",
                      "--out", d, "--quiet"], 60)
    assert rc == 0, err
    yield d
    shutil.rmtree(d, ignore_errors=True)


def train(d, workers, prefetch, extra):
    out = os.path.join(d, f"scores-{workers}-{int(prefetch)}-{len(extra)}.txt")
    argv = [binary("pshard"), "run", "-s", "2", "-w", str(workers), "--progress-ms", "0", "--mode", "sync", "--",
            binary(WORKER), "--data", d, "--batch", "100", "--predict", os.path.join(d, "test.txt"), "--out", out]
    argv += extra + ([] if prefetch else ["--no-prefetch"])
    rc, stdout, stderr = run(argv, 120)
    assert rc == 0, stdout + stderr
    assert f"(prefetch {'on' if prefetch else 'off'})" in stdout, stdout
    with open(out, "rb") as f:
        return f.read(), stdout


@pytest.mark.parametrize("workers,extra", [
    (2, ["--epochs", "1", "--parts", "2"]),                      # one partition each: the same rounds every run
    (1, ["--epochs", "2", "--parts", "6", "--shuffle", "7"]),    # partitions, epochs, evaluations in between
])
def test_prefetch_trains_the_same_model_as_no_prefetch(data, workers, extra):
    ref, ref_out = train(data, workers, False, extra)
    got, out = train(data, workers, True, extra)
    assert len(ref.splitlines()) == 2001
    assert got == ref
    epochs = [l.split("]", 1)[-1] for l in out.splitlines() if "epoch" in l and "test logloss" in l]
    ref_epochs = [l.split("]", 1)[-1] for l in ref_out.splitlines() if "epoch" in l and "test logloss" in l]
    assert epochs and [e.split("(")[0] for e in epochs] == [e.split("(")[0] for e in ref_epochs]


def test_no_prefetch_is_documented_in_help():
    rc, out, _ = run([binary(WORKER), "--help"], 10)
    assert rc == 0 and "--no-prefetch" in out
