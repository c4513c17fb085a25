"""A job restored from a checkpoint resumes its data-partition tasks mid-epoch.

A job of one worker (tests/integration/task_ckpt_worker.c) over 5 partitions and 3
epochs takes a checkpoint after 7 tasks (all of epoch 0, two of epoch 1), while it holds
an eighth one it has not processed; then every process of the job is killed with
SIGKILL. The job restored with `pshard run --restore` (other numbers of servers and
workers) hands out only the partitions of epoch 1 not done at the checkpoint (the held
one among them), then epoch 2 whole: over both runs each partition is done exactly once
per epoch, and the restored table, which counts the pushes of each task, agrees.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import binary  # noqa: E402

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1
PARTS, EPOCHS, AFTER = 5, 3, 7


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="pshard-resume-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def children(pid):
    """Every descendant of pid (from /proc), deepest last."""
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return out
    for k in kids:
        out.append(k)
        out += children(k)
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def records(prefix):
    """The (kind, epoch, partition) lines of every worker's record file of a run."""
    d, base = os.path.split(prefix)
    out = {}
    for name in sorted(os.listdir(d)):
        if name.startswith(base + "."):
            with open(os.path.join(d, name)) as f:
                out[name] = [(k, int(e), int(p)) for k, e, p in (line.split() for line in f)]
    return out


def test_restored_job_hands_out_only_what_was_not_done(tmp):
    ck = os.path.join(tmp, "ck")
    rec1, rec2 = os.path.join(tmp, "run1"), os.path.join(tmp, "run2")
    log1 = os.path.join(tmp, "first.log")
    worker = [binary("task_ckpt_worker"), "--parts", str(PARTS), "--epochs", str(EPOCHS)]
    with open(log1, "w") as out:
        p = subprocess.Popen([binary("pshard"), "run", "-s", "2", "-w", "1", "--progress-ms", "0",
                              "--checkpoint-dir", ck, "--"] + worker + ["--record", rec1, "--ckpt-after", str(AFTER)],
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pids = []
    try:
        deadline = time.time() + 60 * SLOW
        while "checkpoint 1 after" not in open(log1).read():
            assert p.poll() is None, "the first run ended before its checkpoint:\n" + open(log1).read()
            assert time.time() < deadline, "no checkpoint within 60 s:\n" + open(log1).read()
            time.sleep(0.05)
        # Every process of the job, SIGKILLed: the processes it started, then itself.
        # The launcher is stopped first, so that it neither reacts nor reaps: a killed
        # child stays a zombie, its pid not reused, until the launcher is gone.
        os.kill(p.pid, signal.SIGSTOP)
        pids = children(p.pid)
        assert len(pids) >= 4, f"scheduler, 2 servers and a worker expected, found {pids}"
        for q in pids:
            os.kill(q, signal.SIGKILL)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.time() + 10
        while any(alive(q) for q in pids):
            assert time.time() < deadline, [q for q in pids if alive(q)]
            time.sleep(0.05)
    finally:
        # The launcher's children die with it (they ask for SIGKILL when it goes).
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    first = records(rec1)
    assert list(first) == ["run1.0"], first
    first = first["run1.0"]
    done1 = [(e, q) for k, e, q in first if k == "done"]
    held = [(e, q) for k, e, q in first if k == "held"]
    assert len(done1) == AFTER and len(held) == 1, first
    assert sorted(done1) == sorted([(0, q) for q in range(PARTS)] + [(1, q) for q in range(AFTER - PARTS)])
    assert held[0][0] == 1 and held[0] not in done1

    r = subprocess.run([binary("pshard"), "run", "-s", "3", "-w", "2", "--progress-ms", "0", "--restore", ck,
                        "--"] + worker + ["--record", rec2, "--sleep-ms", "20"],
                       capture_output=True, text=True, timeout=90 * SLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    second = records(rec2)
    assert len(second) == 2, second
    done2 = [(e, q) for lines in second.values() for k, e, q in lines if k == "done"]
    # The restored job starts at the saved epoch with only what was not done there.
    assert min(e for e, _ in done2) == 1
    assert sorted(q for e, q in done2 if e == 1) == sorted(set(range(PARTS)) - {q for e, q in done1 if e == 1})
    assert held[0] in done2, "a partition handed out but not done at the checkpoint is handed out again"
    # Both runs together: every partition exactly once per epoch.
    both = sorted(done1 + done2)
    assert both == sorted((e, q) for e in range(EPOCHS) for q in range(PARTS)), both
    # The table came back with the first run's pushes: each (epoch, partition) once.
    counts = [line for line in r.stdout.splitlines() if "counts" in line]
    assert counts, r.stdout
    values = [float(x) for x in counts[0].split("counts", 1)[1].split()]
    assert values == [1.0] * (PARTS * EPOCHS), values
