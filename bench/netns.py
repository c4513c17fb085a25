"""netns.py - links shaped like a cluster's on one machine: each node of a job in its
own network namespace, each node's link limited by tc tbf.

Layout: one bridge namespace holds a bridge br0; every node namespace holds eth0, one
end of a veth pair whose other end (v<i>) is a port of br0. Addresses are 10.77.0.<i+1>/24
and exist only inside the node namespaces, so nothing is visible from the machine's own
network. A node's link is shaped both ways: a tbf qdisc on eth0 (what the node sends)
and one on v<i> (what it receives). Node processes run under `ip netns exec`.

Namespaces are named <PREFIX><pid>b (bridge) and <PREFIX><pid>n<i> (nodes); a Links
created removes the namespaces of earlier runs whose process is gone (a run killed
before it could clean up), and its own on close, whatever happened (use it in a `with`
block or try/finally; SIGTERM is turned into an exception by install_sigterm()).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), `ip` and `tc` with the tbf qdisc:
Links() raises Unavailable with the reason otherwise.

    with Links(rate_gbit=1) as net:
        a = net.add_node("scheduler"); b = net.add_node("server0")
        p = net.popen(b, ["pshard", "server", ...], log="server0")
"""
import os
import re
import signal
import shutil
import subprocess
import tempfile
import time

PREFIX = "psl"
SUBNET = "10.77.0"


class Unavailable(RuntimeError):
    """This machine cannot build the namespaces (not root, no ip/tc, no tbf)."""


def _run(argv, check=True):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or 'exit %d' % r.returncode}")
    return r


def _namespaces():
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def cleanup_stale():
    """Delete namespaces of this harness whose creating process no longer runs."""
    pat = re.compile(rf"^{PREFIX}(\d+)(b|n\d+)$")
    for ns in _namespaces():
        m = pat.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # still running: another run's
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _run(["ip", "netns", "del", ns], check=False)


def check_available():
    """Raise Unavailable unless namespaces and tbf can be used here."""
    if os.geteuid() != 0:
        raise Unavailable("network namespaces and tc need root (run as root)")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise Unavailable(f"'{tool}' is not installed (package iproute2)")


def burst_bytes(rate_bit):
    """tbf's bucket: 1 ms at the rate, at least 64 KiB (a GSO segment and some)."""
    return max(int(rate_bit / 8 / 1000), 64 * 1024)


class Node:
    def __init__(self, name, ns, ip, index):
        self.name, self.ns, self.ip, self.index = name, ns, ip, index

    def __repr__(self):
        return f"Node({self.name} {self.ip} in {self.ns})"


class Links:
    def __init__(self, rate_gbit, latency_ms=20, logdir=None):
        """rate_gbit: every node's link rate in Gbit/s (both directions)."""
        check_available()
        if not rate_gbit > 0:
            raise ValueError("rate_gbit must be > 0")
        self.rate_bit = int(rate_gbit * 1e9)
        self.latency_ms = latency_ms
        self.nodes = []
        self.procs = []
        self.jobs = 0
        self.own_dir = logdir is None
        self.dir = logdir or tempfile.mkdtemp(prefix="pshard-netns-")
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = self.tag + "b"
        cleanup_stale()
        for ns in _namespaces():  # a namespace of ours left by an earlier Links of this process
            if ns.startswith(self.tag) and re.match(rf"^{self.tag}(b|n\d+)$", ns):
                _run(["ip", "netns", "del", ns], check=False)
        r = _run(["ip", "netns", "add", self.bridge], check=False)
        if r.returncode != 0:
            raise Unavailable(f"cannot create a network namespace: {r.stderr.strip()}")
        try:
            self._ip(self.bridge, "link", "add", "br0", "type", "bridge")
            self._ip(self.bridge, "link", "set", "br0", "up")
            self._ip(self.bridge, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def _ip(self, ns, *args):
        return _run(["ip", "-n", ns] + list(args))

    def _tbf(self, ns, dev):
        rate = str(self.rate_bit)
        argv = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate + "bit",
                "burst", str(burst_bytes(self.rate_bit)), "latency", f"{self.latency_ms}ms"]
        r = _run(argv, check=False)
        if r.returncode != 0:
            raise Unavailable(f"tc tbf on {dev}: {r.stderr.strip()} (is sch_tbf available?)")

    def add_node(self, name):
        """A node namespace with its shaped link to the bridge; its address is node.ip."""
        i = len(self.nodes)
        if i >= 250:
            raise ValueError("at most 250 nodes")
        ns, ip = f"{self.tag}n{i}", f"{SUBNET}.{i + 1}"
        try:
            _run(["ip", "netns", "add", ns])
            node = Node(name, ns, ip, i)
            self.nodes.append(node)
            port = f"v{i}"
            self._ip(self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip(self.bridge, "link", "set", port, "master", "br0")
            self._ip(self.bridge, "link", "set", port, "up")
            self._ip(ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            self._ip(ns, "link", "set", "eth0", "up")
            self._ip(ns, "link", "set", "lo", "up")
            self._tbf(ns, "eth0")
            self._tbf(self.bridge, port)
        except Exception:
            self.close()
            raise
        return node

    def popen(self, node, argv, log, env=None):
        """Start argv inside node's namespace, in its own process group, output to
        <dir>/<log>.log; killed by close()."""
        out = open(os.path.join(self.dir, log + ".log"), "wb")
        p = subprocess.Popen(["ip", "netns", "exec", node.ns] + list(argv), stdout=out, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        out.close()
        p.log = os.path.join(self.dir, log + ".log")
        self.procs.append(p)
        return p

    def log(self, p):
        try:
            with open(p.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait(self, procs, timeout):
        """Wait for every process of procs; raise (with their logs) if one fails or the
        timeout passes."""
        deadline = time.time() + timeout
        for p in procs:
            left = deadline - time.time()
            try:
                rc = p.wait(timeout=max(left, 0.01))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"timed out after {timeout:.0f} s; log of {p.args[-1]!r}...:\n{self.log(p)[-2000:]}")
            if rc != 0:
                raise RuntimeError(f"{' '.join(p.args[4:6])} exited {rc}:\n{self.log(p)[-2000:]}")

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def close(self):
        """Kill the processes and delete every namespace (links and qdiscs go with them)."""
        self.kill_all()
        for ns in [n.ns for n in self.nodes] + [self.bridge]:
            _run(["ip", "netns", "del", ns], check=False)
        self.nodes = []
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def install_sigterm():
    """Turn SIGTERM into SystemExit, so that `with Links(...)` cleans up on kill."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


class Job:
    """A pshard job over Links: a scheduler node, S server nodes and K worker nodes,
    every connection over TCP on the shaped links, authenticated with a fresh secret."""

    def __init__(self, net, pshard, servers, workers, start_timeout=30, nodes=None):
        """nodes: (scheduler node, [server nodes], [worker nodes]) of an earlier Job on
        the same Links to run on again (that job finished); new nodes otherwise."""
        self.net, self.pshard = net, pshard
        self.env = dict(os.environ)
        self.env.update({"PSHARD_SECRET": os.urandom(16).hex(), "PSHARD_TRANSPORT": "tcp", "PSHARD_PEER_MEM": "0"})
        for k in ("PSHARD_SCHEDULER", "PSHARD_HOST", "PSHARD_PORT", "PSHARD_ROLE", "PSHARD_COLOCATE",
                  "PSHARD_EMBEDDED", "PSHARD_SECRET_FILE"):
            self.env.pop(k, None)
        if nodes:
            self.sched_node, self.server_nodes, self.worker_nodes = nodes[0], list(nodes[1]), list(nodes[2])
            if len(self.server_nodes) != servers or len(self.worker_nodes) != workers:
                raise ValueError("nodes do not match servers and workers")
        else:
            self.sched_node = net.add_node("scheduler")
            self.server_nodes = [net.add_node(f"server{i}") for i in range(servers)]
            self.worker_nodes = [net.add_node(f"worker{i}") for i in range(workers)]
        net.jobs += 1
        addr_file = os.path.join(net.dir, f"addr-{net.jobs}")
        self.scheduler = net.popen(self.sched_node, [pshard, "scheduler", "--servers", str(servers), "--workers",
                                                     str(workers), "--host", self.sched_node.ip, "--addr-file",
                                                     addr_file, "--exit-when-done"], "scheduler", self.env)
        deadline = time.time() + start_timeout
        while not os.path.exists(addr_file) or not open(addr_file).read().strip():
            if time.time() > deadline or self.scheduler.poll() is not None:
                raise RuntimeError("scheduler did not start:\n" + net.log(self.scheduler))
            time.sleep(0.02)
        with open(addr_file) as f:
            self.addr = f.read().strip()
        self.env["PSHARD_SCHEDULER"] = self.addr
        self.servers = [net.popen(n, [pshard, "server", "--scheduler", self.addr, "--host", n.ip, "--transport", "tcp"],
                                  n.name, self.env) for n in self.server_nodes]

    def workers(self, argv):
        """Start one worker per worker node running argv (PSHARD_* environment set)."""
        ps = []
        for n in self.worker_nodes:
            env = dict(self.env)
            env.update({"PSHARD_ROLE": "worker", "PSHARD_HOST": n.ip})
            ps.append(self.net.popen(n, argv, n.name, env))
        return ps

    @property
    def nodes(self):
        return (self.sched_node, self.server_nodes, self.worker_nodes)

    def finish(self, timeout=30):
        """Wait for the scheduler and servers to stop (the scheduler stops once every
        worker left); kill what is still running after timeout."""
        deadline = time.time() + timeout
        for p in [self.scheduler] + self.servers:
            try:
                p.wait(timeout=max(deadline - time.time(), 0.01))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
