"""The click-through example under `pshard run -s 3 -w 2 --replicas 2` with one server
SIGKILLed mid-run: the job goes on, finishes, and its test AUC is within 0.005 of the
same job without the kill (sync mode: the next copy rebuilds the rounds the dead server
had not handed on). Bounded in time; every process is in the run's own session and is
killed at the end."""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import binary  # noqa: E402
from test_ctr_train import GEN, SLOW, WORKER, last_epoch, run  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ctr_data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ctr-failover"))
    r = run([binary(GEN), "--rows", "60000", "--test-rows", "10000", "--parts", "8", "--signal-top", "100",
             "--out", d, "--quiet"], 60)
    assert r.returncode == 0, r.stderr
    return d


def servers_of(run_pid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    kids = {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3:
            kids.setdefault(int(parts[1]), []).append((int(parts[0]), parts[2]))
    found, todo = [], [run_pid]
    while todo:
        p = todo.pop()
        for pid, args in kids.get(p, []):
            todo.append(pid)
            if " server" in args and "pshard" in args:
                found.append(pid)
    return found


def ctr_job(data, kill_after=None):
    argv = [binary("pshard"), "run", "-s", "3", "-w", "2", "--replicas", "2", "--mode", "sync", "--progress-ms", "0",
            "--", binary(WORKER), "--data", data, "--epochs", "3", "--batch", "100"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        killed = None
        if kill_after is not None:
            deadline = time.time() + 20 * SLOW
            while len(servers_of(p.pid)) < 3:
                assert time.time() < deadline and p.poll() is None, "the servers did not start"
                time.sleep(0.05)
            time.sleep(kill_after)
            assert p.poll() is None, "the job finished before the kill"
            killed = servers_of(p.pid)[1]
            os.kill(killed, signal.SIGKILL)
        out, err = p.communicate(timeout=180 * SLOW)
        return p.returncode, out, err, killed
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_ctr_with_a_server_killed_mid_run_finishes_with_the_same_auc(ctr_data):
    rc, out, err, _ = ctr_job(ctr_data)
    assert rc == 0, out + err
    _, ref_auc, _ = last_epoch(out)
    rc, out, err, killed = ctr_job(ctr_data, kill_after=1.0)
    assert rc == 0, out + err
    assert re.search(r"server \d+ exited with status", out + err), out + err
    _, auc, _ = last_epoch(out)
    print(f"test AUC: {auc:.4f} with server pid {killed} killed, {ref_auc:.4f} without")
    assert abs(auc - ref_auc) <= 0.005, (auc, ref_auc)
