"""The AF_UNIX socket files of servers (/tmp/pshard-PID-PORT-N.sock): a server removes
the files that killed servers left behind, and nothing else.

A server SIGKILLed cannot remove its file. The next server started on the host removes
every such file of this user whose process is gone, on which nobody listens, and made
10 s ago or more; a file on which something still listens (a server of another pid
namespace sharing /tmp), a younger one (such a server between its bind and its listen),
a file that is not a socket, and the files of live servers stay. Files are aged by
setting their times back. Real processes (cluster.Cluster); the files the test plants
are removed at the end whatever happens.
"""
import glob
import os
import signal
import socket
import subprocess
import time

import pytest

from cluster import Cluster

SCALE = 3 if os.environ.get("PSHARD_SANITIZED") else 1


def dead_pid():
    """A pid no process has now (the child's, reaped)."""
    for _ in range(20):
        p = subprocess.Popen(["true"])
        p.wait()
        try:
            os.kill(p.pid, 0)
        except ProcessLookupError:
            return p.pid
    pytest.skip("no pid stayed free")


def socket_of(pid):
    """The socket file of the server with this pid, once it listens."""
    deadline = time.time() + 10 * SCALE
    while time.time() < deadline:
        found = glob.glob(f"/tmp/pshard-{pid}-*.sock")
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"server {pid} made no socket file")


def age(path):
    old = time.time() - 60
    os.utime(path, (old, old))


@pytest.fixture
def planted():
    """Four files of a process that is gone, a minute old but the third: a socket nobody
    listens on, a socket something listens on, a socket nobody listens on made now,
    and a plain file."""
    pid = dead_pid()
    stale, live, young, plain = (f"/tmp/pshard-{pid}-{port}-0.sock" for port in (1, 2, 3, 4))
    for path in (stale, young):
        s1 = socket.socket(socket.AF_UNIX)
        s1.bind(path)
        s1.close()  # the file stays; a connection to it is refused
    s2 = socket.socket(socket.AF_UNIX)
    s2.bind(live)
    s2.listen(4)
    with open(plain, "w") as f:
        f.write("not a socket\n")
    for path in (stale, live, plain):
        age(path)
    try:
        yield stale, live, young, plain
    finally:
        s2.close()
        for path in (stale, live, young, plain):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def test_a_server_removes_the_files_killed_servers_left_and_nothing_else(planted):
    stale, live, young, plain = planted
    with Cluster(1, 1, verbose=True) as first:
        pid = first.server_procs[0].pid
        mine = socket_of(pid)
        assert not os.path.exists(stale), first.log("server0")
        assert "removed" in first.log("server0") and "socket file" in first.log("server0"), first.log("server0")
        assert os.path.exists(live) and os.path.exists(young) and os.path.exists(plain)
        os.killpg(pid, signal.SIGKILL)
        first.server_procs[0].wait(timeout=10)
        assert os.path.exists(mine), "a SIGKILLed server cannot remove its file"
        age(mine)
        with Cluster(1, 1) as second:
            theirs = socket_of(second.server_procs[0].pid)
            deadline = time.time() + 10 * SCALE
            while os.path.exists(mine):
                assert time.time() < deadline, second.log("server0")
                time.sleep(0.02)
            assert os.path.exists(theirs)
        assert os.path.exists(live) and os.path.exists(young) and os.path.exists(plain)
