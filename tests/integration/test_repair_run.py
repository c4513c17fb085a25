"""`pshard run --respawn-servers` with real processes: under R = 2, a server SIGKILLed
mid-run is replaced by a `pshard server --join` that run starts itself; the replacement
copies its rows (the scheduler's STATS show it `late=1 syncing=0 admission=1`), and a second server
SIGKILLed later still leaves every count exact (once_worker's counter table: each push
adds 1 to every key, so the values are the number of pushes applied).

Also: a server killed before the job starts is replaced the same way (nothing to copy);
two servers keep two copies without --replicas (a kill does not stop the job);
--respawn-servers with one copy is refused with the reason.
Every process is in the run's process group or its children's, killed at the end; every
wait is bounded; under ASan (PSHARD_SANITIZED=1) time limits are scaled.
"""
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from cluster import binary
from test_once import KEYS, RUN, SCALE
SECRET, JOB = "5e" * 32, "0123456789abcdef"  # the job's secret and id, so that `pshard stats` may ask


def stats(addr):
    """`pshard stats HOST:PORT` of a node of the job: its counters as text."""
    r = subprocess.run([binary("pshard"), "stats", addr], capture_output=True, text=True, timeout=20,
                       env=dict(os.environ, PSHARD_SECRET=SECRET, PSHARD_JOB_ID=JOB))
    assert r.returncode == 0, r.stderr
    return r.stdout


def children(pid):
    """[(pid, argv)] of the live children of process pid."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append((int(d), argv))
    return out


def wait_for(cond, what, timeout, log):
    deadline = time.time() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.time() < deadline, f"{what} within {timeout}s\n" + log()
        time.sleep(0.05)


def start_run(cmd, env, path):
    """pshard run cmd, its output in path; (the run, a reader of its output)."""
    with open(path, "wb") as out:
        run = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log():
        with open(path, errors="replace") as f:
            return f.read()
    return run, log


def stop_run(run, servers):
    """Kill the run and the servers it started (pids), whatever is left of them."""
    if run.poll() is None:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    for pid in servers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_servers(run, log, n=3):
    """The run's n servers [(pid, argv)], once started, and its scheduler's address."""
    def servers():
        s = [(p, a) for p, a in children(run.pid) if len(a) > 1 and a[1] == "server"]
        return s if len(s) == n else None
    originals = wait_for(servers, f"{n} servers", 10 * SCALE, log)
    sched = [a for _, a in children(run.pid) if len(a) > 1 and a[1] == "scheduler"][0]
    with open(sched[sched.index("--addr-file") + 1]) as f:
        return originals, f.read().strip()


def test_pshard_run_starts_a_replacement_that_syncs_and_holds_real_copies():
    pushes = 900
    d = tempfile.mkdtemp(prefix="pshard-test-")
    path = os.path.join(d, "run.log")
    env = dict(os.environ, PSHARD_RETRY_MS="300", PSHARD_SECRET=SECRET, PSHARD_JOB_ID=JOB)
    cmd = [binary("pshard"), "run", "-s", "3", "-w", "2", "--replicas", "2", "--respawn-servers", "--progress-ms", "0",
           "--", binary("once_worker"), "--mode", "async", "--pushes", str(pushes), "--keys", str(KEYS),
           "--sleep-ms", "10"]
    run, log = start_run(cmd, env, path)
    started = []
    try:
        originals, addr = run_servers(run, log)
        started = [p for p, _ in originals]
        wait_for(lambda: re.search(r"^started 1$", stats(addr), re.M), "the job starts", 10 * SCALE, log)
        time.sleep(0.6)  # not scaled: the workers must still be pushing
        assert run.poll() is None, log()
        os.killpg(originals[1][0], signal.SIGKILL)
        wait_for(lambda: "[pshard] starting server r1 (pshard server --join" in log(), "run starts a replacement",
                 20 * SCALE, log)

        def synced():
            return re.search(r"^node \d+ role=server .* alive=1 late=1 syncing=0 admission=\d+$", stats(addr), re.M)
        wait_for(synced, "the replacement copies its rows", 20 * SCALE, log)
        wait_for(lambda: "[pshard] server r1 has copied its rows" in log(), "run says so", 10 * SCALE, log)
        assert run.poll() is None, "the job ended before the second kill:\n" + log()
        # A second original server dies: the chains it shared with the first now have
        # the replacement as their only copy.
        os.killpg(originals[0][0], signal.SIGKILL)
        assert run.wait(timeout=2 * RUN) == 0, log()
        text = log()
        total = 0
        values = None
        for i in range(2):
            m = re.search(rf"^\[worker {i}\] acked (\d+)$", text, re.M)
            v = re.search(rf"^\[worker {i}\] values (\S+)$", text, re.M)
            assert m and v, text
            assert int(m.group(1)) == pushes, text
            assert not re.search(rf"^\[worker {i}\] push \d+ rc=", text, re.M), text
            total += int(m.group(1))
            vals = [float(x) for x in v.group(1).split(",")]
            assert values is None or vals == values, text
            values = vals
        assert values == [float(total)] * KEYS, text
        assert "its keys are served by their other copies" in text
    finally:
        stop_run(run, started)


def test_respawn_servers_needs_replicas():
    r = subprocess.run([binary("pshard"), "run", "-s", "2", "-w", "1", "--replicas", "1", "--respawn-servers", "--",
                        "true"], capture_output=True, text=True, timeout=20)
    assert r.returncode == 2
    assert "--respawn-servers needs --replicas 2 or 3" in r.stderr, r.stderr


def test_pshard_run_replaces_a_server_dead_before_the_start():
    # The workers wait for a file before they connect: a server killed meanwhile dies
    # before the job starts. The replacement run starts (--join) takes its rank with
    # nothing to copy, and the job then runs with two copies of every key.
    d = tempfile.mkdtemp(prefix="pshard-test-")
    path, go = os.path.join(d, "run.log"), os.path.join(d, "go")
    env = dict(os.environ, PSHARD_RETRY_MS="300", PSHARD_SECRET=SECRET, PSHARD_JOB_ID=JOB)
    worker = (f"i=0; while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; "
              f"exec {binary('once_worker')} --mode async --pushes 30 --keys {KEYS}")
    cmd = [binary("pshard"), "run", "-s", "3", "-w", "2", "--replicas", "2", "--respawn-servers", "--progress-ms", "0",
           "--", "sh", "-c", worker]
    run, log = start_run(cmd, env, path)
    started = []
    try:
        originals, addr = run_servers(run, log)
        started = [p for p, _ in originals]
        wait_for(lambda: re.search(r"^servers_alive 3$", stats(addr), re.M), "three servers registered", 10 * SCALE, log)
        os.killpg(originals[1][0], signal.SIGKILL)
        wait_for(lambda: "[pshard] server r1 has taken the dead server's place before the job started" in log(),
                 "the replacement takes the dead server's rank", 20 * SCALE, log)
        assert re.search(r"^started 0$", stats(addr), re.M), stats(addr)
        open(go, "w").close()
        assert run.wait(timeout=RUN) == 0, log()
        text = log()
        for i in range(2):
            assert re.search(rf"^\[worker {i}\] acked 30$", text, re.M), text
            assert re.search(rf"^\[worker {i}\] values {','.join(['60'] * KEYS)}$", text, re.M), text
    finally:
        stop_run(run, started)
        shutil.rmtree(d, ignore_errors=True)


def test_two_servers_keep_two_copies_by_default():
    # No --replicas: with two servers every key range has two copies, so a server
    # killed mid-run does not stop the job, and every push is counted once.
    pushes = 300
    d = tempfile.mkdtemp(prefix="pshard-test-")
    env = dict(os.environ, PSHARD_RETRY_MS="300", PSHARD_SECRET=SECRET, PSHARD_JOB_ID=JOB)
    env.pop("PSHARD_REPLICAS", None)
    cmd = [binary("pshard"), "run", "-s", "2", "-w", "2", "--progress-ms", "0", "--",
           binary("once_worker"), "--mode", "async", "--pushes", str(pushes), "--keys", str(KEYS), "--sleep-ms", "10"]
    run, log = start_run(cmd, env, os.path.join(d, "run.log"))
    started = []
    try:
        originals, addr = run_servers(run, log, 2)
        started = [p for p, _ in originals]
        wait_for(lambda: re.search(r"^started 1$", stats(addr), re.M), "the job starts", 10 * SCALE, log)
        time.sleep(0.4)  # not scaled: the workers must still be pushing
        assert run.poll() is None, log()
        os.killpg(originals[1][0], signal.SIGKILL)
        assert run.wait(timeout=2 * RUN) == 0, log()
        text = log()
        assert "its keys are served by their other copies (replicas 2)" in text, text
        for i in range(2):
            assert re.search(rf"^\[worker {i}\] acked {pushes}$", text, re.M), text
            assert re.search(rf"^\[worker {i}\] values {','.join([str(2 * pushes)] * KEYS)}$", text, re.M), text
    finally:
        stop_run(run, started)
        shutil.rmtree(d, ignore_errors=True)


def test_replicas_from_the_environment_and_their_limits():
    env = dict(os.environ)
    env.pop("PSHARD_REPLICAS", None)
    r = subprocess.run([binary("pshard"), "run", "-s", "1", "--respawn-servers", "--", "true"],
                       capture_output=True, text=True, timeout=20, env=env)
    assert r.returncode == 2 and "--respawn-servers needs --replicas 2 or 3" in r.stderr, r.stderr
    r = subprocess.run([binary("pshard"), "run", "-s", "2", "--", "true"], capture_output=True, text=True, timeout=20,
                       env=dict(env, PSHARD_REPLICAS="4"))
    assert r.returncode == 2 and "PSHARD_REPLICAS must be 1 to 3, not '4'" in r.stderr, r.stderr
    r = subprocess.run([binary("pshard"), "run", "-s", "1", "--replicas", "2", "--", "true"], capture_output=True,
                       text=True, timeout=20, env=env)
    assert r.returncode == 2 and "--replicas 2 needs at least that many servers (-s 1)" in r.stderr, r.stderr
    r = subprocess.run([binary("pshard"), "scheduler", "--servers", "2", "--workers", "1"], capture_output=True,
                       text=True, timeout=20, env=dict(env, PSHARD_REPLICAS="0"))
    assert r.returncode == 2 and "PSHARD_REPLICAS must be 1 to 3" in r.stderr, r.stderr
    # --replicas 1 on the command line wins over the environment; a one-copy job with
    # two servers runs.
    r = subprocess.run([binary("pshard"), "run", "-s", "2", "--replicas", "1", "--progress-ms", "0", "--", "true"],
                       capture_output=True, text=True, timeout=60, env=dict(env, PSHARD_REPLICAS="3"))
    assert r.returncode == 0, r.stderr
