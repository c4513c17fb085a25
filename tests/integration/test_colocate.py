"""Servers colocated in the workers (colocate=1): each worker process runs one of the
job's servers as a thread, registered with the job's scheduler like any other server.

Same training, same results: a colocated job ends where the same job with server
processes ends. A worker that finishes first keeps serving until the last worker has
left. A colocated worker's death takes its shard with it, and the others fail loudly
instead of waiting. A job that never starts does not keep the worker waiting.
"""
import os
import re
import signal
import time

from cluster import Cluster, binary
from test_core import DENSE_SGD, RUN_TIMEOUT, SCALE, SPARSE_ADAGRAD, alive
from test_peer_mem import run_pm

DENSE = "200000"

def test_colocated_servers_train_as_server_processes(tmp_path):
    """pm_worker (dyadic gradients, exact in any order) with 2 workers that each run one
    of the job's 2 servers: every dense part goes by peer memory, to the worker's own
    server (memcpy) or to the other worker's (process_vm_*), and the tables end exactly
    as with 2 server processes and values in the frames (PSHARD_PEER_MEM=0), also with
    rank 1 late to every clock (rank 0's pulls are then written by the fused update)."""
    steps, n = 3, 1536 << 10
    colo, parts, _ = run_pm(tmp_path, {}, steps, n, colocate=True)
    lagged, _, fused = run_pm(tmp_path, {}, steps, n, lag_ms=150, colocate=True)
    sock, sock_parts, _ = run_pm(tmp_path, {"PSHARD_PEER_MEM": "0"}, steps, n)
    assert all(p > 0 for p in parts) and sock_parts == [0, 0], (parts, sock_parts)
    assert fused >= 2 * steps, fused
    assert colo == sock, f"colocated {colo} vs server processes {sock}"
    assert lagged == sock, f"colocated, fused rounds {lagged} vs server processes {sock}"


def test_a_finished_colocated_worker_serves_until_the_last_one_leaves(tmp_path):
    """Async tables: one worker runs 3 steps, the other 60 with 10 ms sleeps. The short
    one's ps_ctx_close keeps its server (which holds part of every table) up until the
    long one has left, so the long one succeeds; the short one's process ends after it."""
    opt = "opt=sgd lr=0.01 mode=async"
    with Cluster(2, 2, colocate=True) as c:
        short = c.worker([binary("sync_worker"), "--batch", "4", "--steps", "3", "--dense", DENSE,
                          "--dense-opt", opt, "--sparse-opt", opt], "short")
        long_ = c.worker([binary("sync_worker"), "--batch", "4", "--steps", "60", "--sleep-ms", "10",
                          "--dense", DENSE, "--dense-opt", opt, "--sparse-opt", opt, "--progress", "1"], "long")
        codes = c.wait([long_], RUN_TIMEOUT)
        assert codes == [0], f"--- long\n{c.log('long')}\n--- short\n{c.log('short')}"
        assert "rank" in c.log("long") and "step 59" in c.log("long")
        codes = c.wait([short], 5 * SCALE)
        assert codes == [0], c.log("short")


def test_a_killed_colocated_worker_fails_the_others_loudly(tmp_path):
    """SIGKILL of a colocated worker mid-round kills its server too: its shard is lost.
    The survivor's call fails with PS_ERR_UNAVAILABLE naming the lost server, within
    seconds, instead of waiting for the round."""
    with Cluster(2, 2, colocate=True, heartbeat_timeout_ms=1000) as c:
        procs = [c.worker([binary("sync_worker"), "--batch", "4", "--steps", "40", "--hang-at", "5",
                           "--dense", "1000", "--dense-opt", DENSE_SGD, "--sparse-opt", SPARSE_ADAGRAD], f"worker{i}")
                 for i in range(2)]
        deadline = time.time() + RUN_TIMEOUT
        victim = None
        while victim is None and time.time() < deadline:
            victim = next((p for p in procs if "hanging at step" in c.log(p.name)), None)
            time.sleep(0.01)
        assert victim is not None, "\n".join(c.log(p.name) for p in procs)
        survivor = next(p for p in procs if p is not victim)
        time.sleep(0.2)
        assert alive(survivor), c.log(survivor.name)
        t0 = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)
        codes = c.wait([survivor], 10 * SCALE)
        elapsed = time.monotonic() - t0
        log = c.log(survivor.name)
        assert codes == [1], log
        assert "PS_ERR_UNAVAILABLE" in log and re.search(r"server \d+.*(closed|left the job)", log), log
        assert elapsed <= 3 * SCALE, f"the survivor took {elapsed:.2f}s to fail"


def test_a_colocated_job_that_never_starts_does_not_linger(tmp_path):
    """The scheduler waits for 3 servers and 1 worker, but only one colocated worker
    comes: ps_ctx_open fails at connect_timeout_ms (1 s) with PS_ERR_TIMEOUT, and the
    process ends at once (its server is stopped, not kept for other workers)."""
    with Cluster(3, 1, colocate=True) as c:
        t0 = time.monotonic()
        p = c.worker([binary("sync_worker"), "--steps", "1"], "worker0", env={"PSHARD_CONNECT_TIMEOUT_MS": "1000"})
        codes = c.wait([p], 10 * SCALE)
        elapsed = time.monotonic() - t0
        assert codes == [1], c.log("worker0")
        assert "PS_ERR_TIMEOUT" in c.log("worker0"), c.log("worker0")
        assert elapsed <= 1 + 2 * SCALE, f"the worker took {elapsed:.2f}s to give up"
