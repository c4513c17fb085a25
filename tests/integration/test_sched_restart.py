"""A scheduler that goes away and comes back (src/sched/state.c, agent/agent.h rejoin):
SIGKILL it in the middle of a sync job and start it again with the same --state-dir and
--port; the servers keep their tables and serve on meanwhile, every node is taken back
with its id and rank, and the job ends with exactly the model of a run without the
fault. A scheduler killed while it writes its state (slow writes by fault injection)
has answered nothing of what it was writing: a task handed out then is handed out once.
Real processes on loopback; every process is killed at the end.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from cluster import Cluster, binary

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1
STEPS = 2000  # about 6 s of sync rounds: the scheduler is killed and back within the first second


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Job:
    """A scheduler, 2 servers and 2 ckpt_worker processes started by hand (not pshard
    run), so that the scheduler alone can be killed and started again."""

    def __init__(self, tmp, state_dir=None, sched_env=None, servers_first=False, server_env=None):
        self.tmp, self.procs, self.port = tmp, [], free_port()
        self.state_dir = state_dir
        self.env = dict(os.environ, PSHARD_SCHEDULER=f"127.0.0.1:{self.port}", PSHARD_MODE="sync",
                        PSHARD_REJOIN_MS=str(20000 * SLOW))
        self.sched = self.start_scheduler("scheduler", sched_env)
        self.servers = [self.spawn([binary("pshard"), "server", "--rejoin-ms", str(20000 * SLOW)], f"server{i}",
                                   server_env) for i in range(2)]
        deadline = time.time() + 10 * SLOW
        while servers_first and self.log("scheduler").count("registered as rank") < 2:  # before the workers
            assert time.time() < deadline, self.logs()
            time.sleep(0.02)
        self.out = os.path.join(tmp, "params")
        self.workers = [self.spawn([binary("ckpt_worker"), "--steps", str(STEPS), "--out", self.out], f"worker{i}")
                        for i in range(2)]

    def spawn(self, argv, name, env=None):
        log = open(os.path.join(self.tmp, name + ".log"), "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(self.env, **(env or {})),
                             start_new_session=True)
        p.name = name
        self.procs.append(p)
        return p

    def start_scheduler(self, name, env=None):
        argv = [binary("pshard"), "scheduler", "--servers", "2", "--workers", "2", "--port", str(self.port),
                "--exit-when-done", "--heartbeat-timeout-ms", str(3000 * SLOW), "--verbose"]
        if self.state_dir:
            argv += ["--state-dir", self.state_dir]
        p = self.spawn(argv, name, env)
        deadline = time.time() + 10 * SLOW
        while True:  # listening?
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return p
            except OSError:
                assert p.poll() is None and time.time() < deadline, self.log(name)
                time.sleep(0.02)

    def log(self, name):
        try:
            with open(os.path.join(self.tmp, name + ".log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def logs(self):
        return "\n".join(f"--- {p.name}\n{self.log(p.name)}" for p in self.procs)

    def wait_workers(self, timeout):
        deadline = time.time() + timeout * SLOW
        for w in self.workers:
            try:
                rc = w.wait(timeout=max(deadline - time.time(), 0.01))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{w.name} did not finish\n{self.logs()}")
            assert rc == 0, f"{w.name} exited {rc}\n{self.logs()}"
        with open(self.out) as f:
            return f.read().splitlines()

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="pshard-restart-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def reference_model(tmp):
    """The model of the job run without a fault, in tmp/ref."""
    ref_dir = os.path.join(tmp, "ref")
    os.mkdir(ref_dir)
    ref = Job(ref_dir, state_dir=os.path.join(ref_dir, "state"))
    try:
        return ref.wait_workers(60)
    finally:
        ref.close()


def test_a_killed_scheduler_started_again_takes_the_job_back(tmp):
    want = reference_model(tmp)
    run_dir = os.path.join(tmp, "run")
    os.mkdir(run_dir)
    job = Job(run_dir, state_dir=os.path.join(run_dir, "state"))
    try:
        deadline = time.time() + 20 * SLOW
        while "job started" not in job.log("scheduler"):  # every node registered, its answer sent
            assert time.time() < deadline, job.logs()
            time.sleep(0.02)
        time.sleep(0.3)  # the job is running: the workers are in their sync rounds
        assert all(w.poll() is None for w in job.workers), job.logs()
        os.killpg(job.sched.pid, signal.SIGKILL)
        job.sched.wait()
        time.sleep(0.5)  # the job goes on without it
        assert all(p.poll() is None for p in job.workers + job.servers), job.logs()
        job.sched = job.start_scheduler("scheduler2")
        got = job.wait_workers(90)
        assert got == want, f"the model differs from the run without the fault\n{job.logs()}"
        for s in job.servers:
            assert s.wait(timeout=15 * SLOW) == 0, job.logs()
        log2 = job.log("scheduler2")
        assert "restarted from" in log2 and log2.count("came back") == 4, log2
        for w in ("server0", "server1"):  # (a worker's library logs only through its hook)
            assert "serving on, waiting up to" in job.log(w), job.log(w)
    finally:
        job.close()


def test_a_barrier_called_while_the_scheduler_is_away_waits_for_it(tmp):
    # Both workers finish their pushes and call the final barrier while the scheduler is
    # dead: the call waits (not an error naming an empty address) and passes once a
    # scheduler started again from its state takes them back; the pull after it reads
    # every push.
    pushes = 40
    with Cluster(2, 2, sched_state=True, verbose=True, extra_env={"PSHARD_REJOIN_MS": "20000"}) as c:
        ps = [c.worker([binary("once_worker"), "--pushes", str(pushes), "--sleep-ms", "25"], f"w{i}") for i in range(2)]
        deadline = time.time() + 20 * SLOW
        while "job started" not in c.log("scheduler"):  # every node registered, its answer sent
            assert time.time() < deadline, c.log("scheduler")
            time.sleep(0.02)
        time.sleep(0.3)

        def away():
            deadline = time.time() + 20 * SLOW
            while not all("acked" in c.log(f"w{i}") for i in range(2)):
                assert time.time() < deadline and all(p.poll() is None for p in ps), c.log("w0") + c.log("w1")
                time.sleep(0.05)
            time.sleep(1.0)  # they are in ps_barrier, with no scheduler
            assert all(p.poll() is None for p in ps), c.log("w0") + c.log("w1")
        c.restart_scheduler(away)
        assert c.wait(ps, 60 * SLOW) == [0, 0], c.log("w0") + c.log("w1") + c.log(c.sched_log)
        for i in range(2):
            out = c.log(f"w{i}")
            assert f"acked {pushes}" in out and f"values {2 * pushes}," in out, out
        assert c.log(c.sched_log).count("came back") == 4, c.log(c.sched_log)


def test_a_node_whose_registration_was_saved_but_not_answered_keeps_its_place(tmp):
    """The scheduler takes a node's registration and saves it, then dies before the
    answer reaches the node (here the first server's answer is dropped, and the
    scheduler killed a second later). The node registers again with the restarted
    scheduler, which knows it by its registration's token: it keeps its id and rank (no
    second node, no place waiting for one that never comes), and the job ends with the
    model of a run without the fault. Meanwhile the server, which knows no key of its
    own, answers requests with "send again" (not MOVED), and the workers wait.
    The workers created their tables on that server while it had no id. Once answered,
    it gets the new scheduler's membership 1.5 s late (a fault on rank 0, the first to
    register, whose answer was dropped): it serves meanwhile under the ring it had, as
    what its id owns there, not as the nothing it owned without an id."""
    want = reference_model(tmp)
    run_dir = os.path.join(tmp, "run")
    os.mkdir(run_dir)
    job = Job(run_dir, state_dir=os.path.join(run_dir, "state"),
              sched_env={"PSHARD_FAULT": "drop:type=hello-reply:n=1:dir=out"}, servers_first=True,
              server_env={"PSHARD_FAULT": "delay=1500ms:type=membership:node=server.0:n=1:dir=in"})
    try:
        deadline = time.time() + 10 * SLOW
        while job.log("scheduler").count("registered as rank") < 4:
            assert time.time() < deadline, job.logs()
            time.sleep(0.05)
        time.sleep(1)  # the other three run (or wait for the fourth), the first waits for its answer
        assert "fault: drop" in job.log("scheduler"), job.log("scheduler")
        os.killpg(job.sched.pid, signal.SIGKILL)
        job.sched.wait()
        job.sched = job.start_scheduler("scheduler2")
        got = job.wait_workers(90)
        assert got == want, f"the model differs from the run without the fault\n{job.logs()}"
        for s in job.servers:
            assert s.wait(timeout=15 * SLOW) == 0, job.logs()
        log2 = job.log("scheduler2")
        assert "the answer to its registration was lost; it keeps its id and rank" in log2, log2
        assert log2.count("came back") == 3, log2
        assert "registered as rank" not in log2, log2
    finally:
        job.close()


def test_a_task_handed_out_is_kept_before_its_worker_hears_of_it(tmp):
    # The scheduler keeps a task hand-out in its state before it answers. Killed while it
    # writes the state for the worker's second task (each state write waits 400 ms:
    # slowdisk), it has not answered: the worker's call fails with PS_ERR_UNAVAILABLE and
    # is made again, and the scheduler started again from its state hands the partition
    # out once. (Answered first, the worker would have worked on a partition the
    # restarted scheduler still had to hand out.) Every partition is done exactly once.
    rec = os.path.join(tmp, "tasks")
    env = {"PSHARD_FAULT": "slowdisk=400ms:n=1+:node=scheduler", "PSHARD_REJOIN_MS": "20000"}
    with Cluster(1, 1, sched_state=True, verbose=True, extra_env=env) as c:
        w = c.worker([binary("task_worker"), "4", "1", rec, "300"], "w0")

        def writes():
            return c.log("scheduler").count("fault: state write #")
        deadline = time.time() + 30 * SLOW
        while not (os.path.exists(rec) and "done 0" in open(rec).read()):
            assert time.time() < deadline and w.poll() is None, c.log("w0") + c.log("scheduler")
            time.sleep(0.01)
        n = writes()  # the done's write is over (answered); the next one is the hand-out's
        while writes() == n:
            assert time.time() < deadline and w.poll() is None, c.log("w0") + c.log("scheduler")
            time.sleep(0.01)
        c.restart_scheduler()
        assert c.wait([w], 60 * SLOW) == [0], c.log("w0") + c.log("scheduler") + c.log(c.sched_log)
        with open(rec) as f:
            lines = f.read().split()
        done = sorted(int(p) for k, e, p in zip(lines[0::3], lines[1::3], lines[2::3]) if k == "done")
        started = sorted(int(p) for k, e, p in zip(lines[0::3], lines[1::3], lines[2::3]) if k == "start")
        assert done == [0, 1, 2, 3] and started == [0, 1, 2, 3], lines


def test_without_its_state_a_new_scheduler_refuses_the_old_nodes(tmp):
    job = Job(tmp, state_dir=None)
    try:
        time.sleep(0.5)
        os.killpg(job.sched.pid, signal.SIGKILL)
        job.sched.wait()
        job.sched = job.start_scheduler("scheduler2")
        for p in job.workers + job.servers:
            assert p.wait(timeout=30 * SLOW) != 0, job.logs()
        # The nodes it does not know are refused by name, and the job ends loudly. Which
        # ones it refuses depends on who asks first (ids follow the registrations: the
        # workers may be 1 and 2, or the servers); a worker whose server stopped first
        # fails on that server instead.
        assert re.search(r"node \d+ is not a member of this job", job.logs()), job.logs()
    finally:
        job.close()


def test_pshard_run_starts_a_killed_scheduler_again(tmp):
    """The local launcher restarts a scheduler that dies while workers run, and the job
    ends as if nothing had happened."""
    def run(name, kill_scheduler):
        out = os.path.join(tmp, name)
        p = subprocess.Popen([binary("pshard"), "run", "-s", "2", "-w", "2", "--mode", "sync", "--progress-ms", "0",
                              "--", binary("ckpt_worker"), "--steps", str(STEPS), "--out", out],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            if kill_scheduler:
                time.sleep(0.6)
                pids = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "pshard scheduler"], capture_output=True,
                                      text=True).stdout.split()
                assert len(pids) == 1, pids
                os.kill(int(pids[0]), signal.SIGKILL)
            log, _ = p.communicate(timeout=90 * SLOW)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert p.returncode == 0, log
        with open(out) as f:
            return f.read().splitlines(), log

    want, _ = run("ref", False)
    got, log = run("fault", True)
    assert "the scheduler exited with status 137; starting it again" in log, log
    assert got == want, log
