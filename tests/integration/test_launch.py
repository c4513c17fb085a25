"""Launching and data-partition tasks: `pshard run`, `pshard exec` under Open MPI,
tasks processed exactly once per epoch, a dead worker's partitions re-queued."""
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, binary  # noqa: E402

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1


def run(argv, timeout=60, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout * SLOW, **kw)


def records(paths):
    done = collections.Counter()
    started = collections.Counter()
    for p in paths:
        if not os.path.exists(p):
            continue
        for line in open(p):
            what, e, part = line.split()
            (done if what == "done" else started)[(int(e), int(part))] += 1
    return started, done


def run_dirs(tmp):
    """The temporary directories of `pshard run` jobs in tmp, their TMPDIR (removed when
    a job ends)."""
    return {d for d in os.listdir(tmp) if d.startswith("pshard-run-")}


def test_run_prefixes_output_and_succeeds(tmp_path):
    r = run([binary("pshard"), "run", "-s", "2", "-w", "3", "--progress-ms", "0", "--",
             binary("sync_worker"), "--steps", "5"], env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert not run_dirs(tmp_path), "the job's directory (scheduler address and state) was left in TMPDIR"
    lines = [l for l in r.stdout.splitlines() if l.startswith("[worker ")]
    assert len(lines) == 3, r.stdout
    for i in range(3):
        assert any(l.startswith(f"[worker {i}] ") for l in lines)
    assert "all 3 workers finished" in r.stderr


def test_run_colocate_starts_no_server_processes(tmp_path):
    """`pshard run --colocate -w 3`: the scheduler expects 3 servers, which the 3 workers
    bring (PSHARD_COLOCATE=1); the job trains and ends. -s other than -w is refused."""
    out = str(tmp_path / "colo.txt")
    r = run([binary("pshard"), "run", "-w", "3", "--colocate", "--progress-ms", "0", "--",
             binary("sync_worker"), "--steps", "5", "--out", out])
    assert r.returncode == 0, r.stderr
    assert "all 3 workers finished" in r.stderr
    assert not any(l.startswith("[server") for l in r.stdout.splitlines() + r.stderr.splitlines()), r.stdout
    with open(out) as f:
        assert len(f.read().splitlines()) == 32 + 1000 * 4
    r = run([binary("pshard"), "run", "-s", "2", "-w", "3", "--colocate", "--", "true"])
    assert r.returncode == 2 and "-s must equal -w" in r.stderr, r.stderr


def test_run_propagates_first_failure_status():
    r = run([binary("pshard"), "run", "-s", "1", "-w", "2", "--progress-ms", "0", "--", "sh", "-c", "exit 7"])
    assert r.returncode == 7
    assert "exited with status 7" in r.stderr


def test_run_bad_flags_exit_2():
    for argv in (["run", "--bogus"], ["run", "-s", "x", "--", "true"], ["run", "-s", "1"],
                 ["run", "--mode", "nonsense", "--", "true"], ["run", "--mode", "ssp:-2", "--", "true"]):
        r = run([binary("pshard")] + argv)
        assert r.returncode == 2, (argv, r.stderr)
        assert "usage" in r.stderr or "mode" in r.stderr


def test_run_bad_counts_name_their_limit_and_an_exported_mode_holds():
    r = run([binary("pshard"), "run", "-s", "300", "--", "true"])
    assert r.returncode == 2 and "bad value '300' for -s (an integer from 0 to 256)" in r.stderr, r.stderr
    show = ["sh", "-c", "echo mode=$PSHARD_MODE"]
    r = run([binary("pshard"), "run", "--progress-ms", "0", "--"] + show, env=dict(os.environ, PSHARD_MODE="async"))
    assert r.returncode == 0 and "[worker 0] mode=async" in r.stdout, (r.stdout, r.stderr)
    r = run([binary("pshard"), "run", "--progress-ms", "0", "--mode", "ssp:2", "--"] + show,
            env=dict(os.environ, PSHARD_MODE="async"))
    assert r.returncode == 0 and "[worker 0] mode=ssp:2" in r.stdout, "--mode wins over the environment"
    r = run([binary("pshard"), "run", "--"] + show, env=dict(os.environ, PSHARD_MODE="bogus"))
    assert r.returncode == 2 and "PSHARD_MODE: unknown consistency mode 'bogus'" in r.stderr, r.stderr


def test_run_says_what_a_job_that_has_not_started_waits_for():
    # one worker of two never comes: the progress line says who is missing
    show = ["sh", "-c", 'if [ "$PSHARD_WORKER_INDEX" = 1 ]; then sleep 1.5; exit 4; fi; sleep 3']
    r = run([binary("pshard"), "run", "-s", "1", "-w", "2", "--progress-ms", "200", "--"] + show)
    assert r.returncode == 4, r.stderr
    assert re.search(r"waiting: [01] of 1 servers, 0 of 2 workers registered", r.stderr), r.stderr
    assert re.search(r"the job had not started: [01] of 1 servers, 0 of 2 workers registered", r.stderr), r.stderr


def test_run_ctrl_c_stops_everything(tmp_path):
    p = subprocess.Popen([binary("pshard"), "run", "-s", "1", "-w", "2", "--progress-ms", "0", "--",
                          binary("sync_worker"), "--steps", "100000", "--sleep-ms", "5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        time.sleep(1.0 * SLOW)
        assert run_dirs(tmp_path), "the job keeps its directory in TMPDIR while it runs"
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=20 * SLOW)
        assert p.returncode == 128 + signal.SIGINT
        assert "interrupted" in err
        assert not run_dirs(tmp_path), "an interrupted job left its directory in TMPDIR"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    # no process of the job survives (they ran in their own process groups)
    r = run(["pgrep", "-f", "sync_worker --steps 100000"])
    assert r.stdout.strip() == ""


def test_tasks_exactly_once_per_epoch():
    d = tempfile.mkdtemp(prefix="pshard-tasks-")
    try:
        with Cluster(1, 3) as c:
            recs = [os.path.join(d, f"w{i}") for i in range(3)]
            ws = [c.worker([binary("task_worker"), "13", "3", recs[i], "2"], f"w{i}") for i in range(3)]
            assert c.wait(ws, 60 * SLOW) == [0, 0, 0], [c.log(f"w{i}") for i in range(3)]
        started, done = records(recs)
        expected = {(e, p) for e in range(3) for p in range(13)}
        assert set(done) == expected
        assert all(n == 1 for n in done.values()), done
        assert all(n == 1 for n in started.values()), started
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_dead_workers_partitions_are_requeued():
    d = tempfile.mkdtemp(prefix="pshard-tasks-")
    try:
        with Cluster(1, 3, heartbeat_timeout_ms=1000) as c:
            recs = [os.path.join(d, f"w{i}") for i in range(3)]
            ws = [c.worker([binary("task_worker"), "20", "2", recs[i], "50"], f"w{i}") for i in range(3)]
            # kill worker 0 while it holds a partition (after its second start line)
            deadline = time.time() + 20 * SLOW
            while time.time() < deadline:
                started, _ = records([recs[0]])
                if sum(started.values()) >= 2:
                    break
                time.sleep(0.01)
            os.killpg(ws[0].pid, signal.SIGKILL)
            ws[0].wait()
            assert c.wait(ws[1:], 60 * SLOW) == [0, 0], [c.log(f"w{i}") for i in range(3)]
        started, done = records(recs)
        expected = {(e, p) for e in range(2) for p in range(20)}
        assert set(done) == expected, expected - set(done)
        assert all(n == 1 for n in done.values()), done
        # the partition the dead worker held was started twice: once by it, once again
        killed_started, killed_done = records([recs[0]])
        interrupted = set(killed_started) - set(killed_done)
        assert interrupted, "worker 0 was not holding a partition when killed"
        for k in interrupted:
            assert started[k] == 2
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI (openmpi-bin) is not installed")
@pytest.mark.parametrize("layout", ["servers", "colocate"])
def test_exec_under_mpirun(layout):
    """5 ranks: a scheduler, 2 servers and 2 workers; or (--colocate) a scheduler and 4
    workers that each run one of the 4 servers."""
    d = tempfile.mkdtemp(prefix="pshard-mpi-")
    try:
        out = os.path.join(d, "params.txt")
        roles = ["-s", "2"] if layout == "servers" else ["--colocate"]
        workers = 2 if layout == "servers" else 4
        # In its own session, so that a timeout kills every rank, not only mpirun.
        p = subprocess.Popen(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "5",
                              binary("pshard"), "exec", *roles, "--addr-file", os.path.join(d, "addr"), "--",
                              binary("sync_worker"), "--steps", "10", "--out", out],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env=dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe="1"))
        try:
            stdout, stderr = p.communicate(timeout=120 * SLOW)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        r = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        # the scheduler and servers do not exit by themselves: mpirun returns when they
        # are stopped, so the workers' success is read from their output
        assert r.stdout.count("done after 10 steps") == workers, r.stdout + r.stderr
        assert f"of {workers} done" in r.stdout, r.stdout
        assert os.path.getsize(out) > 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_exec_colocate_checks_the_rank_count():
    """--colocate with -s other than N-1, or with one rank, is refused (exit 2) before
    any role starts."""
    for size, extra in (("5", ["-s", "3"]), ("1", [])):
        env = dict(os.environ, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE=size)
        r = run([binary("pshard"), "exec", "--colocate", *extra, "--addr-file", "/nonexistent/x", "--", "true"],
                env=env)
        assert r.returncode == 2, (size, r.stderr)
        assert "--colocate" in r.stderr, r.stderr


def test_exec_without_launcher_fails_cleanly():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))}
    r = run([binary("pshard"), "exec", "-s", "1", "--addr-file", "/nonexistent/x", "--", "true"], env=env)
    assert r.returncode == 2
    assert "rank" in r.stderr


def test_scaled_learning_rate_follows_the_global_batch():
    # 2 workers x batch 32 = 64 = ref_batch: lr 0.1; after one leaves, 32: lr 0.05.
    with Cluster(1, 2) as c:
        ws = [c.worker([binary("lr_worker"), "6", "3", "32", "opt=sgd lr=0.1 ref_batch=64 mode=sync"], f"w{i}")
              for i in range(2)]
        assert c.wait(ws, 60 * SLOW) == [0, 0], [c.log("w0"), c.log("w1")]
        out = c.log("w0") + c.log("w1")
    rows = {}
    for line in out.splitlines():
        if line.startswith("step "):
            f = line.split()
            rows[int(f[1])] = (float(f[3]), float(f[5]))
    assert sorted(rows) == [1, 2, 3, 4, 5, 6], out
    for s in (1, 2, 3):
        assert rows[s] == (pytest.approx(0.1), 64.0), (s, rows[s])
    for s in (4, 5, 6):
        assert rows[s] == (pytest.approx(0.05), 32.0), (s, rows[s])


def test_plan_measured_predicts_the_measured_configuration():
    import json
    d = tempfile.mkdtemp(prefix="pshard-plan-")
    try:
        stats = os.path.join(d, "stats.txt")
        r = run([binary("pshard"), "run", "-s", "2", "-w", "2", "--progress-ms", "0", "--stats-out", stats, "--",
                 binary("sync_worker"), "--steps", "200", "--batch", "16", "--dense", "20000", "--sleep-ms", "2"],
                timeout=120)
        assert r.returncode == 0, r.stderr
        r = run([binary("pshard"), "plan", "--measured", stats, "--json"])
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        m = out["measured"]
        assert m["workers"] == 2 and m["servers"] == 2
        assert m["batch"] == pytest.approx(16)
        assert m["bytes_per_step"] > 2 * 20000 * 4  # the dense push and pull at least
        assert abs(m["predicted_examples_per_s"] / m["examples_per_s"] - 1) <= 0.25
        assert {(p["workers"], p["servers"]) for p in out["predictions"]} >= {(1, 1), (4, 2), (16, 4)}
        r = run([binary("pshard"), "plan", "--measured", stats])
        assert r.returncode == 0 and "bottleneck" in r.stdout
        r = run([binary("pshard"), "plan", "--measured", os.path.join(d, "missing.txt")])
        assert r.returncode == 1 and "cannot read measurements" in r.stderr
        r = run([binary("pshard"), "plan", "--measured", stats, "--cores", "zero"])
        assert r.returncode == 2
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_joining_worker_changes_k_for_the_next_round():
    # K=2 at the start (global batch 64); one leaves (32); a new worker joins the running
    # sync job and takes part in the next rounds (64 again).
    with Cluster(1, 2) as c:
        opts = "opt=sgd lr=0.1 ref_batch=64 mode=sync"
        ws = [c.worker([binary("lr_worker"), "100", "3", "32", opts, "40"], f"w{i}") for i in range(2)]
        deadline = time.time() + 30 * SLOW
        while ws[0].poll() is None and ws[1].poll() is None and time.time() < deadline:
            time.sleep(0.02)
        leaver = ws[0] if ws[0].poll() is not None else ws[1]
        assert leaver.wait(timeout=10) == 0, c.log("w0") + c.log("w1")
        joiner = c.worker([binary("lr_worker"), "10", "1000", "32", opts, "40"], "joiner")
        stayer = ws[1] if leaver is ws[0] else ws[0]
        assert c.wait([stayer, joiner], 60 * SLOW) == [0, 0], c.log("w0") + c.log("w1") + c.log("joiner")
        out = c.log("w0") + c.log("w1") + c.log("joiner")
    batches = [float(l.split()[5]) for l in out.splitlines() if l.startswith("step ")]
    assert batches and batches[0] == 64.0, out
    assert 32.0 in batches, out
    first32 = batches.index(32.0)
    assert 64.0 in batches[first32:], out
