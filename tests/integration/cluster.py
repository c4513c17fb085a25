"""Start real pshard processes on loopback for integration tests.

Every process gets its own process group and is killed (SIGKILL to the group) when the
cluster is closed, whatever happened. Ports are ephemeral: the scheduler binds port 0
and writes its address to a file. Each cluster's logs are in a directory under /tmp,
removed at the end of the test run unless the cluster closed on an exception.
Servers and the scheduler run with --verbose (catch-ups, table creation and membership
changes in their logs) when a test asks (verbose=True) or PSHARD_TEST_VERBOSE=1 is set.
"""
import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build"))


# Directories of clusters closed without an exception: removed when the test process
# exits (a test may read a log after its cluster closed). A cluster closed by an
# exception keeps its directory, as does every one with PSHARD_KEEP_TEST_DIRS=1.
_done_dirs = []


@atexit.register
def _remove_done_dirs():
    if os.environ.get("PSHARD_KEEP_TEST_DIRS") == "1":
        return
    for d in _done_dirs:
        shutil.rmtree(d, ignore_errors=True)


def binary(name):
    path = os.path.join(BUILD, name)
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing: build first (make build) or set PSHARD_BUILD")
    return path


def data_ports(ports, log):
    """A server's TCP listening ports less its HTTP one (the port its log names in
    `metrics on http://HOST:PORT/metrics`), or None while that line is not there yet.
    The data port is bound first, so a single port is always it."""
    if len(ports) <= 1:
        return ports
    m = re.search(r"metrics on http://\S+:(\d+)/metrics", log)
    return [p for p in ports if p != int(m.group(1))] if m else None


class Cluster:
    def __init__(self, servers, workers, heartbeat_timeout_ms=3000, extra_env=None, colocate=False, replicas=1,
                 server_env=None, verbose=False, sched_state=False):
        """server_env: {index: environment} for single servers, on top of extra_env. colocate: the job's `servers` servers run inside the workers (PSHARD_COLOCATE=1,
        one each), so no server process is started. replicas: copies of every key range
        (the scheduler's --replicas; None: its default, 2 from two servers on). sched_state: the scheduler keeps its state in the
        cluster's directory (--state-dir), so restart_scheduler() can kill it and start
        it again on the same port."""
        self.dir = tempfile.mkdtemp(prefix="pshard-test-")
        self.procs = []
        self.restarts = 0  # restart_scheduler() calls
        self.servers = servers
        self.workers = workers
        self.env = dict(os.environ)
        self.env.update(extra_env or {})
        addr_file = os.path.join(self.dir, "addr")
        self.sched_argv = [binary("pshard"), "scheduler", "--servers", str(servers), "--workers", str(workers),
                           "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)]
        if replicas is not None:  # None: the scheduler's default
            self.sched_argv += ["--replicas", str(replicas)]
        if sched_state:
            self.sched_argv += ["--state-dir", os.path.join(self.dir, "sched-state")]
        loud = ["--verbose"] if verbose or os.environ.get("PSHARD_TEST_VERBOSE") else []
        self.scheduler = self._spawn(self.sched_argv + ["--addr-file", addr_file] + loud, "scheduler")
        deadline = time.time() + 10
        while not os.path.exists(addr_file):
            if time.time() > deadline or self.scheduler.poll() is not None:
                self.close()
                raise RuntimeError("scheduler did not start: " + self.log("scheduler"))
            time.sleep(0.02)
        with open(addr_file) as f:
            self.addr = f.read().strip()
        self.env["PSHARD_SCHEDULER"] = self.addr
        if colocate:
            self.env["PSHARD_COLOCATE"] = "1"
        self.server_procs = [self._spawn([binary("pshard"), "server", "--scheduler", self.addr] + (["--verbose"] if verbose or os.environ.get("PSHARD_TEST_VERBOSE") else []), f"server{i}",
                                         {**self.env, **(server_env or {}).get(i, {})})
                             for i in range(0 if colocate else servers)]

    def restart_scheduler(self, away=None):
        """SIGKILL the scheduler and start it again with its state, on its port (nodes
        reconnect within their rejoin_ms, each logged `... came back` in the log
        self.sched_log, scheduler-againN for the Nth restart); returns once it listens.
        away: called between the two (what the job does without its scheduler)."""
        os.killpg(self.scheduler.pid, signal.SIGKILL)
        self.scheduler.wait(timeout=5)
        if away:
            away()
        port = self.addr.rsplit(":", 1)[1]
        self.restarts += 1
        self.sched_log = f"scheduler-again{self.restarts}"
        self.scheduler = self._spawn(self.sched_argv + ["--port", port, "--verbose"], self.sched_log)
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                return
            except OSError:
                if time.time() > deadline or self.scheduler.poll() is not None:
                    raise RuntimeError("scheduler did not start again: " + self.log(self.sched_log))
                time.sleep(0.02)

    def wait_started(self, timeout=None):
        """Return once the scheduler's STATS say the job started (every node registered);
        a kill meant for a running job then cannot come before its start."""
        timeout = timeout or (30 if os.environ.get("PSHARD_SANITIZED") else 10)
        deadline = time.time() + timeout
        while True:
            r = subprocess.run([binary("pshard"), "stats", self.addr], capture_output=True, text=True, timeout=10,
                               env=self.env)
            if r.returncode == 0 and re.search(r"^started [12]$", r.stdout, re.M):
                return
            if time.time() > deadline:
                raise AssertionError(f"the job did not start within {timeout}s: " + self.log("scheduler"))
            time.sleep(0.02)

    def _spawn(self, argv, name, env=None):
        out = open(os.path.join(self.dir, name + ".log"), "wb")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or self.env,
                             start_new_session=True)
        p.name = name
        self.procs.append(p)
        return p

    def worker(self, argv, name, env=None):
        e = dict(self.env)
        e.update(env or {})
        return self._spawn(argv, name, e)

    def log(self, name):
        try:
            with open(os.path.join(self.dir, name + ".log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait(self, procs, timeout):
        """Wait for procs; return their exit codes. Kills everything on timeout."""
        deadline = time.time() + timeout
        codes = []
        for p in procs:
            left = deadline - time.time()
            try:
                codes.append(p.wait(timeout=max(left, 0.01)))
            except subprocess.TimeoutExpired:
                logs = "\n".join(f"--- {q.name}\n{self.log(q.name)}" for q in self.procs)
                self.close()
                raise AssertionError(f"{p.name} did not finish within {timeout}s\n{logs}")
        return codes

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

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        if exc_type is None:
            _done_dirs.append(self.dir)
