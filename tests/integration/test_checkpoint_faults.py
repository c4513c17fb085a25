"""Checkpoints and liveness under failure, with real `pshard run` jobs on loopback
(tests/integration/ckpt_worker.c):

- a scheduler stopped (SIGSTOP) for longer than the heartbeat timeout evicts nobody
  when it continues, while a worker stopped as long is evicted;
- a SIGKILL of one server, or of every process of the job, while checkpoint 2 is being
  written leaves checkpoint 2 without a MANIFEST and checkpoint 1 intact, and
  `pshard run --restore` resumes from checkpoint 1 with its parameters;
- a restore whose tables conflict with the program's declarations fails with a message
  naming the table and both declarations;
- a checkpoint with a flipped byte in a server's data file is refused with a message
  naming the file and the block, and the job does not start.

Each job runs in its own process group; `pshard run` puts every child in a group of
its own, so the helpers find the children through /proc and kill them by pid.
"""
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
from cluster import binary  # noqa: E402

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1

HB_TIMEOUT_MS = 1000  # the heartbeat timeout of the liveness tests
PAUSE_S = 3.0         # how long a process is stopped: three timeouts
FILL_MB = 96          # state of the fill table: about 48 MB per server file with two servers


def children(pid):
    """(pid, argv) of the live children of pid."""
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{e}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0") if a]
        except (OSError, ValueError):
            continue
        if argv:
            out.append((int(e), argv))
    return out


class Job:
    """A `pshard run` in the background: output into a file, every process killed at
    close (the launcher's group and each child's)."""

    def __init__(self, tmp, name, argv, env=None):
        self.log_path = os.path.join(tmp, name + ".log")
        self.log_file = open(self.log_path, "w")
        self.p = subprocess.Popen(argv, stdout=self.log_file, stderr=subprocess.STDOUT,
                                  start_new_session=True, env=dict(os.environ, **(env or {})))
        self.seen = set()

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def procs(self, role):
        """pids of the live children in role: 'scheduler', 'server' or 'worker'."""
        got = []
        for pid, argv in children(self.p.pid):
            self.seen.add(pid)
            r = argv[1] if len(argv) > 1 and argv[1] in ("scheduler", "server") else "worker"
            if r == role:
                got.append(pid)
        return sorted(got)

    def wait_for(self, text, timeout):
        deadline = time.time() + timeout * SLOW
        while text not in self.log():
            assert self.p.poll() is None, f"the job ended before '{text}':\n{self.log()}"
            assert time.time() < deadline, f"no '{text}' within {timeout * SLOW}s:\n{self.log()}"
            time.sleep(0.02)

    def wait(self, timeout):
        try:
            return self.p.wait(timeout=timeout * SLOW)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not finish within {timeout * SLOW}s:\n{self.log()}")

    def close(self):
        for pid, _ in children(self.p.pid):
            self.seen.add(pid)
        for pid in [self.p.pid] + sorted(self.seen):
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGCONT)
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.log_file.close()


def run_argv(servers, workers, worker_args, hbt=None, ckpt_dir=None, restore=None, full_every=None):
    argv = [binary("pshard"), "run", "-s", str(servers), "-w", str(workers), "--mode", "sync",
            "--progress-ms", "0"]
    if full_every:
        argv += ["--checkpoint-full-every", str(full_every)]
    if hbt:
        argv += ["--heartbeat-timeout-ms", str(hbt)]
    if ckpt_dir:
        argv += ["--checkpoint-dir", ckpt_dir]
    if restore:
        argv += ["--restore", restore]
    return argv + ["--", binary("ckpt_worker")] + worker_args


def run(tmp, name, argv, timeout=60):
    """Run a job to its end: (exit code, its output)."""
    j = Job(tmp, name, argv)
    try:
        rc = j.wait(timeout)
        return rc, j.log()
    finally:
        j.close()


def params(path):
    with open(path) as f:
        return f.read().splitlines()


def train(tmp, name, worker_args, **kw):
    """A job that must succeed; rank 0's parameters and the job's output."""
    out = os.path.join(tmp, name + ".params")
    rc, log = run(tmp, name, run_argv(2, 2, worker_args + ["--out", out], **kw))
    assert rc == 0, f"{name}: exit {rc}\n{log}"
    return params(out), log


def complete_checkpoints(d):
    return sorted(int(e[5:]) for e in os.listdir(d)
                  if e.startswith("ckpt-") and os.path.exists(os.path.join(d, e, "MANIFEST")))


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="pshard-ckfault-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- a paused process

STEPS, STEP_MS = 50, 100  # a job of about five seconds, paused three of them


def paused_job(tmp, name, role):
    """A job with a 1 s heartbeat timeout whose `role` process (the scheduler, or the
    worker of index 1) is stopped for three seconds soon after training starts.
    Returns (exit code, output, the --out file)."""
    out = os.path.join(tmp, name + ".params")
    j = Job(tmp, name, run_argv(2, 2, ["--steps", str(STEPS), "--step-ms", str(STEP_MS), "--out", out],
                                hbt=HB_TIMEOUT_MS))
    try:
        j.wait_for("rank 1 starts at clock 0", 20)
        j.wait_for("rank 0 starts at clock 0", 20)
        if role == "scheduler":
            (victim,) = j.procs("scheduler")
        else:
            victim = max(j.procs("worker"))  # the one started last: index 1
        os.kill(victim, signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)
        finally:
            os.kill(victim, signal.SIGCONT)
        rc = j.wait(60)
        return rc, j.log(), out
    finally:
        j.close()


def test_a_paused_scheduler_evicts_nobody_on_resume(tmp):
    base, _ = train(tmp, "base", ["--steps", str(STEPS)], hbt=HB_TIMEOUT_MS)
    rc, log, out = paused_job(tmp, "paused", "scheduler")
    assert rc == 0, f"exit {rc}\n{log}"
    assert "the scheduler was paused for" in log and "liveness is judged afresh" in log, log
    assert "missed heartbeats" not in log, log
    assert "rank 0 done at clock %d" % STEPS in log and "rank 1 done at clock %d" % STEPS in log, log
    assert params(out) == base


def test_a_paused_worker_is_evicted(tmp):
    rc, log, _ = paused_job(tmp, "wpaused", "worker")
    # Whichever notices first: the scheduler (no heartbeat) or a server (a round waited
    # longer than the heartbeat timeout for the worker's clock, reported as a stall).
    assert re.search(r"worker \d+ \(rank \d+\) removed: (missed heartbeats|stalled)", log), log
    assert "liveness is judged afresh" not in log, log
    assert rc != 0, f"the job went on as if nothing happened:\n{log}"


# ---------------------------------------------------------------- kill -9 during a write

C1, C2 = 2, 4  # the clocks of checkpoints 1 and 2
FILL = ["--fill", str(FILL_MB)]


def digest(path):
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def snapshot(d):
    """name -> sha256 of every file in checkpoint directory d."""
    return {e: digest(os.path.join(d, e)) for e in sorted(os.listdir(d))}


def writer_of(job, path):
    """The server process that has path open, or None."""
    for pid in job.procs("server"):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    return pid
            except OSError:
                pass
    return None


@pytest.fixture(scope="module")
def at_c1():
    """Rank 0's parameters after C1 clocks of the fill job, without any checkpoint."""
    d = tempfile.mkdtemp(prefix="pshard-ckfault-ref-")
    try:
        got, _ = train(d, "ref", ["--steps", str(C1)] + FILL)
        yield got
    finally:
        shutil.rmtree(d, ignore_errors=True)


def kill_during_second_write(tmp, whole_job, full_every=None):
    """Checkpoint 1 at clock C1, then SIGKILL while checkpoint 2 (with full_every, an
    increment on 1) is being written: the server writing its data file (or, with
    whole_job, every process of the job) as soon as it has the file's temporary open.
    Returns (ck dir, checkpoint 1's file digests)."""
    ck = os.path.join(tmp, "ck")
    # The servers' disks are slow from the second checkpoint's writes on (each 8 MiB
    # waits 150 ms), so that the write lasts long enough to be caught and killed.
    slow = "slowdisk=150ms:n=1+:node=server"
    j = Job(tmp, "killed", run_argv(2, 2, ["--steps", "40", "--ckpt-at", f"{C1},{C2}",
                                           "--step-ms", "20"] + FILL, ckpt_dir=ck, full_every=full_every),
            env={"PSHARD_FAULT": slow})
    try:
        j.wait_for(f"checkpoint 1 at clock {C1}", 60)
        before = snapshot(os.path.join(ck, "ckpt-1"))
        d2 = os.path.join(ck, "ckpt-2")
        tmps = [os.path.join(d2, f"server-{r}.psck.tmp") for r in (0, 1)]
        deadline = time.time() + 30 * SLOW
        victim = None
        while victim is None:
            assert j.p.poll() is None, f"the job ended before checkpoint 2 was written:\n{j.log()}"
            assert time.time() < deadline, f"never saw checkpoint 2 being written:\n{j.log()}"
            for t in tmps:
                pid = writer_of(j, t) if os.path.exists(t) else None
                if pid:
                    victim, victim_tmp = pid, t
                    break
            else:
                time.sleep(0.001)
        # The writer first, at once: finding the job's other processes takes long enough
        # on a loaded machine for the write to end meanwhile.
        os.kill(victim, signal.SIGKILL)
        if whole_job:
            for pid in [j.p.pid] + j.procs("scheduler") + j.procs("server") + j.procs("worker"):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        rc = j.wait(30)
        assert rc != 0, j.log()
        assert os.path.exists(victim_tmp) and not os.path.exists(victim_tmp[:-4]), (
            "the kill did not land during the write", os.listdir(d2))
        assert not os.path.exists(os.path.join(d2, "MANIFEST")), os.listdir(d2)
        return ck, before
    finally:
        j.close()


@pytest.mark.parametrize("whole_job,full_every", [(False, None), (True, None), (False, 4), (True, 4)],
                         ids=["one-server", "every-process", "one-server-increment", "every-process-increment"])
def test_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp, at_c1, whole_job, full_every):
    ck, before = kill_during_second_write(tmp, whole_job, full_every)
    assert complete_checkpoints(ck) == [1]
    assert snapshot(os.path.join(ck, "ckpt-1")) == before, "checkpoint 1 changed"
    # The newest complete checkpoint of the directory is 1: the job resumes there.
    got, log = train(tmp, "restored", ["--steps", str(C1)] + FILL, restore=ck)
    assert f"rank 0 starts at clock {C1}" in log and f"rank 1 starts at clock {C1}" in log, log
    assert len(got) == len(at_c1) > 0
    diff = [(a, b) for a, b in zip(at_c1, got) if a != b]
    assert not diff, f"{len(diff)} parameters differ, first: {diff[:3]}"


# ---------------------------------------------------------------- a long write

CK_TIMEOUT_MS = 4000  # the scheduler's checkpoint timeout in these tests


def slow_checkpoint(tmp, name, slowdisk_ms):
    """A job whose servers' disks make each 8 MiB of a checkpoint file wait slowdisk_ms
    (about 48 MB a server: six waits), one checkpoint at clock C1, a checkpoint timeout
    of CK_TIMEOUT_MS: (exit code, output, checkpoint directory)."""
    ck = os.path.join(tmp, "ck")
    env = {"PSHARD_FAULT": f"slowdisk={slowdisk_ms}ms:n=1+:node=server",
           "PSHARD_CHECKPOINT_TIMEOUT_MS": str(CK_TIMEOUT_MS)}
    j = Job(tmp, name, run_argv(2, 2, ["--steps", str(C2), "--ckpt-at", str(C1)] + FILL, ckpt_dir=ck), env=env)
    try:
        rc = j.wait(90 * SLOW)
        return rc, j.log(), ck
    finally:
        j.close()


def test_a_write_longer_than_the_checkpoint_timeout_completes_while_it_gets_on(tmp):
    # Six waits of 1 s: each server's write takes over 6 s, past the 4 s timeout, but a
    # server that gets on with its file says so every second, so the checkpoint holds.
    rc, log, ck = slow_checkpoint(tmp, "slow", 1000)
    assert rc == 0, log
    assert f"checkpoint 1 at clock {C1}" in log, log
    assert complete_checkpoints(ck) == [1]


def test_a_write_stuck_past_the_checkpoint_timeout_fails_it_naming_the_server(tmp):
    # The first 8 MiB waits 6 s: nothing moves for longer than the timeout.
    rc, log, ck = slow_checkpoint(tmp, "stuck", 6000)
    assert rc != 0, log
    assert re.search(r"server rank \d did not answer within 4\.0 s, nor say it got on with writing", log), log
    assert complete_checkpoints(ck) == []


# ---------------------------------------------------------------- a restore that cannot load

DENSE = 4096  # dense rows of the small checkpoint: most of a data file is ROWS blocks


@pytest.fixture(scope="module")
def small_ckpt():
    """A complete checkpoint (2 servers, clock 2) of ckpt_worker --dense DENSE; each test
    takes a copy."""
    d = tempfile.mkdtemp(prefix="pshard-ckfault-small-")
    try:
        ck = os.path.join(d, "ck")
        train(d, "small", ["--steps", "2", "--ckpt-at", "2", "--dense", str(DENSE)], ckpt_dir=ck)
        assert complete_checkpoints(ck) == [1]
        yield os.path.join(ck, "ckpt-1")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def copy_ckpt(src, tmp):
    dst = os.path.join(tmp, "ckpt-1")
    shutil.copytree(src, dst)
    return dst


def failed_restore(tmp, restore, worker_args):
    """A restored job that must fail before any worker trains; its output."""
    rc, log = run(tmp, "restore", run_argv(2, 2, ["--steps", "4"] + worker_args, restore=restore))
    assert rc != 0, f"the restore was accepted:\n{log}"
    assert "starts at clock" not in log and "done at clock" not in log, f"a worker trained:\n{log}"
    return log


def test_a_restore_whose_tables_conflict_with_the_declarations_fails_clearly(tmp, small_ckpt):
    ck = copy_ckpt(small_ckpt, tmp)
    log = failed_restore(tmp, ck, ["--dense", str(2 * DENSE)])
    assert "PS_ERR_CONFLICT" in log, log
    # The table, the checkpoint's declaration and the program's.
    assert (f"table 'da' already declared as dense {DENSE} 'opt=adam lr=0.01 mode=sync', "
            f"not as dense {2 * DENSE} 'opt=adam lr=0.01 mode=sync'") in log, log
    assert "a restored job declares its tables as its checkpoint has them" in log, log
    assert "[pshard] worker" in log and "exited with status 1" in log, log


# The byte flipped, and the block the loader must name for it.
FLIPS = [("header", lambda size: 10, "block 0 (HEADER) at offset 0:"),
         ("rows", lambda size: size // 2, "(ROWS) at offset"),
         ("end", lambda size: size - 1, "(END) at offset")]


@pytest.mark.parametrize("where,offset,block", FLIPS, ids=[f[0] for f in FLIPS])
def test_a_corrupt_data_file_is_refused_naming_the_file_and_block(tmp, small_ckpt, where, offset, block):
    ck = copy_ckpt(small_ckpt, tmp)
    path = os.path.join(ck, "server-1.psck")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(offset(size))
        b = f.read(1)
        f.seek(offset(size))
        f.write(bytes([b[0] ^ 0x10]))
    log = failed_restore(tmp, ck, ["--dense", str(DENSE)])
    assert "PS_ERR_CORRUPT" in log, log
    assert f"checkpoint {path}: " in log and block in log, log
    # A server refuses the file (each reads every data file for the rows it owns under
    # the new ring) and answers the workers' CREATE with the error rather than serving
    # what it loaded before the bad block; the launcher may stop the other one first.
    assert re.search(r"\[server [01]\] error: checkpoint " + re.escape(path) + ": ", log), log
