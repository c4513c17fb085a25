"""Peer memory (src/net/peermem.c): a same-host server copies a large dense push's values
straight from the worker's buffers, and a pull's values straight into them.

1. Training results do not depend on it: the same run with PSHARD_PEER_MEM=0 (values in
   the frames) and without (values by peer memory) ends with identical tables, and the
   closed form, for sync sum and mean tables (streamed pushes) and an async table
   (staged pushes), with ranges that start and end inside slices.
2. Bad peer-memory frames get an error reply and change nothing: addresses the sender
   does not have, regions that do not match the segments, peer-memory frames over TCP;
   and a raw client's own valid buffers are read and written as the protocol says.
"""
import ctypes
import os
import re
import signal
import socket
import struct
import time

import pytest

from cluster import Cluster, binary
from test_core import (DENSE_SGD, HDR, RUN_TIMEOUT, SCALE, SPARSE_ADAGRAD, T_PULL_DENSE, T_PUSH_DENSE,
                       frame, load_params, run_sync, server_port, stats, wait_for_line, worst)

XPORT_PEER_MEM = 1  # src/proto/frame.h: the value transport, bits 4-5 of the flags byte
E_TIMEOUT, E_IO, E_PROTO, E_SIZE = 3, 5, 6, 9


def run_pm(tmp_path, env, steps=3, floats=1536 << 10, lag_ms=0, colocate=False, shared=False, counts=None):
    """shared: False, True (ps_alloc buffers) or 2 (new ps_alloc buffers for every call)."""
    out = str(tmp_path / f"pm-{env.get('PSHARD_PEER_MEM', 'on')}-{lag_ms}-{int(colocate)}-{int(shared)}.txt")
    with Cluster(2, 2, extra_env=env, colocate=colocate) as c:
        procs = [c.worker([binary("pm_worker"), "--floats", str(floats), "--steps", str(steps), "--out", out,
                           "--lag-ms", str(lag_ms), "--shared", str(int(shared))], f"worker{i}") for i in range(2)]
        codes = c.wait(procs, RUN_TIMEOUT)
        assert codes == [0, 0], "\n".join(c.log(f"worker{i}") for i in range(2))
        parts = [int(re.search(r"peer_mem_parts (\d+)", c.log(f"worker{i}")).group(1)) for i in range(2)]
        # rank 0 prints the servers' counts; it is either process
        logs = "".join(c.log(f"worker{i}") for i in range(2))
        fused = sum(int(x) for x in re.findall(r"fused_pulls (-?\d+)", logs))
        if counts is not None:
            counts["shared"] = [int(x) for x in re.findall(r"shared_requests (-?\d+)", logs)]
            counts["shared_parts"] = [int(re.search(r"shared_parts (\d+)", c.log(f"worker{i}")).group(1))
                                      for i in range(2)]
    rows = {}
    with open(out) as f:
        for line in f:
            name, h, *vals = line.split()
            rows[name] = (h, [float(v) for v in vals])
    return rows, parts, fused


def test_peer_memory_matches_the_socket_path(tmp_path):
    """Also with rank 1 late to every clock: rank 0's pulls of the sync tables then wait
    at the servers and are written by the round's fused update (fused_pulls)."""
    steps, n = 3, 1536 << 10
    counts = {}
    pm, pm_parts, _ = run_pm(tmp_path, {}, steps, n, counts=counts)
    assert counts["shared_parts"] == [0, 0], counts  # malloc buffers: no hint
    lagged, _, fused = run_pm(tmp_path, {}, steps, n, lag_ms=150)
    sock, sock_parts, sock_fused = run_pm(tmp_path, {"PSHARD_PEER_MEM": "0"}, steps, n, lag_ms=150)
    # The comparison means something only if one run used peer memory and the other not.
    assert all(p > 0 for p in pm_parts), pm_parts
    assert sock_parts == [0, 0] and sock_fused == 0, (sock_parts, sock_fused)
    # Each round, rank 0's first pull (table "sum") waits at both servers for rank 1's
    # clock and is written by the fused update; by its next pull the round is applied.
    assert fused >= 2 * steps, fused
    assert pm == sock, f"peer memory {pm} vs socket {sock}"
    assert lagged == sock, f"fused rounds {lagged} vs socket {sock}"
    # And both are the closed form (see pm_worker.c): elements 0, lo, n/2, n-1.
    lo, cnt = 1000, n - 100000
    for name, (_, vals) in pm.items():
        for j, got in zip((0, lo, n // 2, n - 1), vals):
            g = (j % 7 + 1) / 16  # worker r pushes (r+1) g; K = 2
            if name == "sum":
                exp = -0.5 * steps * 3 * g * (2 if lo <= j < lo + cnt else 1)
            elif name == "mean":
                exp = -0.5 * steps * (4 * 1 + 8 * 2) / 12 * g
            else:
                exp = -0.5 * steps * 3 * g
            assert got == pytest.approx(exp, rel=1e-6), f"{name}[{j}] = {got}, expected {exp}"


@pytest.mark.parametrize("colocate", [False, True], ids=["servers", "colocated"])
def test_shared_buffers_give_the_socket_paths_results(tmp_path, colocate):
    """Buffers from ps_alloc (net/shared.c): the servers map them and add the pushes and
    write the pulls in place. With rank 1 late to every clock (fused pulls) and without,
    the tables end as with values in the frames. Every server served requests from a
    mapping (with colocated servers, each serves the other worker's buffers so)."""
    steps, n = 3, 1536 << 10
    sock, _, _ = run_pm(tmp_path, {"PSHARD_PEER_MEM": "0"}, steps, n)
    counts = {}
    shared, parts, _ = run_pm(tmp_path, {}, steps, n, colocate=colocate, shared=True, counts=counts)
    assert all(p > 0 for p in parts), parts
    assert counts["shared_parts"] == parts, counts  # every part names its ps_alloc buffer
    assert len(counts["shared"]) == 2 and all(x > 0 for x in counts["shared"]), counts
    assert shared == sock, f"shared buffers {shared} vs socket {sock}"
    lagged, _, fused = run_pm(tmp_path, {}, steps, n, lag_ms=150, colocate=colocate, shared=True, counts=counts)
    assert fused >= 2 * steps if not colocate else fused > 0, fused
    assert all(x > 0 for x in counts["shared"]), counts
    assert lagged == sock, f"shared buffers, fused rounds {lagged} vs socket {sock}"


def test_shared_buffers_freed_and_renewed_at_every_call(tmp_path):
    """Every push and pull from a new ps_alloc buffer (the previous one freed): 80 files
    per worker over the run, more than the 64 mappings a connection keeps, and freed
    while the servers still hold them. The tables end as with values in the frames."""
    steps, n = 16, 300000
    sock, _, _ = run_pm(tmp_path, {"PSHARD_PEER_MEM": "0"}, steps, n)
    counts = {}
    churn, parts, _ = run_pm(tmp_path, {}, steps, n, shared=2, counts=counts)
    assert all(p > 0 for p in parts), parts
    assert all(x > 0 for x in counts["shared"]), counts
    assert churn == sock, f"renewed shared buffers {churn} vs socket {sock}"


def test_a_freed_peer_memory_request_keeps_its_buffer_until_the_deadline(tmp_path):
    """A pull freed while its server is stopped: ps_req_free returns only at the
    request's deadline (the server could still write into the buffer until then), and
    the server, resumed later, finds the request expired and leaves the buffer alone."""
    flag = str(tmp_path / "go")
    with Cluster(1, 1, extra_env={"PSHARD_TIMEOUT_MS": "5000"}) as c:
        w = c.worker([binary("pm_worker"), "--hold", flag], "worker0")
        wait_for_line(c, "worker0", "ready", RUN_TIMEOUT, [w])
        server = c.server_procs[0]
        server.send_signal(signal.SIGSTOP)
        try:
            open(flag, "w").close()
            wait_for_line(c, "worker0", "released", RUN_TIMEOUT, [w])
        finally:
            server.send_signal(signal.SIGCONT)
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0")
        log = c.log("worker0")
        freed_ms = float(re.search(r"freed after (\d+) ms", log).group(1))
        assert 4000 <= freed_ms <= 5000 + 3000 * SCALE, log
        assert "intact" in log and "overwritten" not in log, log
        assert int(re.search(r"peer_mem_parts (\d+)", log).group(1)) == 2, log


def test_a_freed_peer_memory_request_is_released_when_its_server_dies(tmp_path):
    """The same, but the stopped server is then killed: nothing can write into the
    buffer any more, so ps_req_free returns within a second of the kill instead of
    at the deadline (whether the worker hears of the death from the closed socket or
    first from the scheduler, which test_server_killed_workers_fail_loudly also runs
    into: a bug that held such parts for the whole timeout showed there)."""
    flag = str(tmp_path / "go")
    with Cluster(1, 1, extra_env={"PSHARD_TIMEOUT_MS": "20000"}) as c:
        w = c.worker([binary("pm_worker"), "--hold", flag], "worker0")
        wait_for_line(c, "worker0", "ready", RUN_TIMEOUT, [w])
        server = c.server_procs[0]
        server.send_signal(signal.SIGSTOP)
        open(flag, "w").close()
        time.sleep(0.5)
        os.killpg(server.pid, signal.SIGKILL)
        wait_for_line(c, "worker0", "released", RUN_TIMEOUT, [w])
        c.wait([w], RUN_TIMEOUT)
        log = c.log("worker0")
        freed_ms = float(re.search(r"freed after (\d+) ms", log).group(1))
        assert 400 <= freed_ms <= 500 + 1500 * SCALE, log
        assert "intact" in log, log


# ------------------------------------------------------------------ 2. bad input


class Conn:
    """A raw connection (TCP or AF_UNIX) that reads whole frames, value transport included."""

    def __init__(self, sock):
        self.s = sock
        self.s.settimeout(5 * SCALE)
        self.buf = b""

    def request(self, data):
        self.s.sendall(data)
        while True:
            if len(self.buf) >= 64:
                f = HDR.unpack(self.buf[:64])
                plen = f[-1]
                if len(self.buf) >= 64 + plen:
                    body, self.buf = self.buf[64:64 + plen], self.buf[64 + plen:]
                    return dict(type=f[2], xport=(f[3] >> 4) & 3, status=f[5], req_id=f[7]), body
            chunk = self.s.recv(65536)
            assert chunk, "the server closed the connection"
            self.buf += chunk

    def close(self):
        self.s.close()


def unix_conn(c):
    pid, port = c.server_procs[0].pid, server_port(c)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(f"/tmp/pshard-{pid}-{port}-0.sock")
    return Conn(s)


def pm_frame(type_, req_id, segs, regions, table=1, expires_in=30.0, hint=0):
    """A peer-memory request: segments (offset, count), the expiry (CLOCK_MONOTONIC ms,
    after which the sender lets go of its buffers) and the shared-buffer hint (1 + a
    descriptor of the sender, or 0), then (address, length) pairs."""
    until = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1000 + expires_in * 1000)
    body = (b"".join(struct.pack("<QQ", o, n) for o, n in segs) + struct.pack("<QQ", max(until, 1), hint) +
            b"".join(struct.pack("<QQ", a, n) for a, n in regions))
    return frame(type_, body, flags=XPORT_PEER_MEM << 4, req_id=req_id, table=table, batch=1, nkeys=2 * len(segs))


def test_bad_peer_memory_frames_change_nothing(tmp_path):
    """Table 1 of sync_worker is the dense "w" of 32 floats. Bad peer-memory requests
    beside a training worker get error replies on connections that stay usable, and the
    worker ends with exactly the parameters of an undisturbed run."""
    args = ["--batch", "4", "--steps", "60", "--sleep-ms", "40", "--dense-opt", DENSE_SGD,
            "--sparse-opt", SPARSE_ADAGRAD]
    ref = run_sync(1, 1, 4, 60, str(tmp_path / "ref.txt"), DENSE_SGD, SPARSE_ADAGRAD)
    out = str(tmp_path / "out.txt")
    with Cluster(1, 1) as c:
        w = c.worker([binary("sync_worker"), *args, "--progress", "1", "--out", out], "worker0")
        wait_for_line(c, "worker0", "step 1", RUN_TIMEOUT, [w])
        buf = (ctypes.c_float * 32)(*([7.0] * 32))
        addr = ctypes.addressof(buf)
        u = unix_conn(c)
        try:
            # Addresses this process does not have: an i/o error, nothing applied.
            h, body = u.request(pm_frame(T_PUSH_DENSE, 1, [(0, 32)], [(0x1000, 128)]))
            assert (h["req_id"], h["status"]) == (1, E_IO), (h, body)
            h, body = u.request(pm_frame(T_PUSH_DENSE, 2, [(0, 32)], [(addr, 64), (0x2000, 64)]))
            assert (h["req_id"], h["status"]) == (2, E_IO), (h, body)
            # Regions that do not hold the segments' values.
            h, body = u.request(pm_frame(T_PUSH_DENSE, 3, [(0, 32)], [(addr, 64)]))
            assert (h["req_id"], h["status"]) == (3, E_SIZE), (h, body)
            h, body = u.request(pm_frame(T_PULL_DENSE, 4, [(0, 32)], [(addr, 124)]))
            assert (h["req_id"], h["status"]) == (4, E_SIZE), (h, body)
            # An empty region and a null address: malformed.
            h, body = u.request(pm_frame(T_PUSH_DENSE, 5, [(0, 32)], [(addr, 0), (addr, 128)]))
            assert (h["req_id"], h["status"]) == (5, E_PROTO), (h, body)
            h, body = u.request(pm_frame(T_PULL_DENSE, 6, [(0, 32)], [(0, 128)]))
            assert (h["req_id"], h["status"]) == (6, E_PROTO), (h, body)
            # A pull into addresses this process does not have.
            h, body = u.request(pm_frame(T_PULL_DENSE, 7, [(0, 32)], [(0x1000, 128)]))
            assert (h["req_id"], h["status"]) == (7, E_IO), (h, body)
            # Expired requests: the sender may have let go of these buffers.
            h, body = u.request(pm_frame(T_PUSH_DENSE, 12, [(0, 32)], [(addr, 128)], expires_in=-1))
            assert (h["req_id"], h["status"]) == (12, E_TIMEOUT) and b"expired" in body, (h, body)
            # An expired pull is answered with its values instead.
            h, body = u.request(pm_frame(T_PULL_DENSE, 13, [(0, 32)], [(addr, 128)], expires_in=-1))
            assert (h["req_id"], h["status"], len(body)) == (13, 0, 128), (h, body)

            assert list(buf) == [7.0] * 32, "a failed request wrote into the client's buffer"
        finally:
            u.close()
        # No room for the expiry: a malformed frame, answered with an error, then a close.
        u = unix_conn(c)
        try:
            h, body = u.request(frame(T_PUSH_DENSE, struct.pack("<QQ", 0, 32), flags=XPORT_PEER_MEM << 4, req_id=14,
                                      table=1, nkeys=2))
            assert h["status"] == E_PROTO and b"peer-memory" in body, (h, body)
            assert u.s.recv(1) == b"", "the connection stayed open after a malformed frame"
        finally:
            u.close()
        # Over TCP the server cannot know the sender's process: a push is refused, a
        # pull answered with the values in the reply.
        sport = server_port(c)
        t = Conn(socket.create_connection(("127.0.0.1", sport)))
        try:
            h, body = t.request(pm_frame(T_PUSH_DENSE, 8, [(0, 32)], [(addr, 128)]))
            assert (h["req_id"], h["status"]) == (8, E_PROTO) and b"AF_UNIX" in body, (h, body)
            h, body = t.request(pm_frame(T_PULL_DENSE, 9, [(0, 32)], [(addr, 128)]))
            assert (h["req_id"], h["status"], h["xport"], len(body)) == (9, 0, 0, 128), (h, body)
        finally:
            t.close()
        assert list(buf) == [7.0] * 32
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0")
        assert "\nrows " in stats(sport)
        # With the training over, a peer-memory pull writes the very values an inline
        # pull returns, and answers with an empty peer-memory reply.
        u = unix_conn(c)
        try:
            h, body = u.request(pm_frame(T_PULL_DENSE, 10, [(0, 16), (16, 16)], [(addr, 40), (addr + 40, 88)]))
            assert (h["req_id"], h["status"], h["xport"], body) == (10, 0, XPORT_PEER_MEM, b""), (h, body)
            h, body = u.request(frame(T_PULL_DENSE, struct.pack("<QQ", 0, 32), req_id=11, table=1, nkeys=2))
            assert (h["req_id"], h["status"], len(body)) == (11, 0, 128), (h, body)
            assert bytes(buf) == body, "peer-memory pull and inline pull differ"
        finally:
            u.close()
    got = load_params(out)
    d, key, x, y = worst(got, ref)
    assert d == 0, f"the bad frames changed training: {key} {x} vs {y}"


def shared_requests(port):
    return int(re.search(r"\nshared_requests (\d+)", "\n" + stats(port)).group(1))


def memfd_buffer(nbytes, seal=True, shared=True):
    """A memfd of nbytes mapped into this process (what ps_alloc makes when seal and
    shared): (fd, mmap, address)."""
    import fcntl
    import mmap
    fd = os.memfd_create("test-buffer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE)
    return fd, m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_shared_buffer_hints_are_checked_and_bad_ones_ignored(tmp_path):
    """The hint of a peer-memory request (1 + a descriptor of the sender) lets the server
    map the sender's buffer (net/shared.c). A raw client's hints: every pull is answered
    with the table's values, written into the client's buffer, whatever the hint says;
    only a sealed memfd, mapped shared, named by its own descriptor, is used in place
    (shared_requests counts it); any other hint is ignored (process_vm_writev)."""
    out = str(tmp_path / "out.txt")
    with Cluster(1, 1) as c:
        w = c.worker([binary("sync_worker"), "--batch", "4", "--steps", "5", "--dense-opt", DENSE_SGD,
                      "--sparse-opt", SPARSE_ADAGRAD, "--out", out], "worker0")
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0")
        sport = server_port(c)
        u = unix_conn(c)
        good_fd, good, good_addr = memfd_buffer(8192)
        other_fd, other, other_addr = memfd_buffer(8192)
        loose_fd, loose, loose_addr = memfd_buffer(8192, seal=False)
        priv_fd, priv, priv_addr = memfd_buffer(8192, shared=False)
        plain = (ctypes.c_float * 32)()
        try:
            h, want = u.request(frame(T_PULL_DENSE, struct.pack("<QQ", 0, 32), req_id=1, table=1, nkeys=2))
            assert (h["status"], len(want)) == (0, 128), (h, want)
            base = shared_requests(sport)
            cases = [  # (buffer to read back, address, hint, used in place)
                ("plain, hint of the socket", lambda: bytes(plain), ctypes.addressof(plain), 1 + u.s.fileno(), False),
                ("plain, huge hint", lambda: bytes(plain), ctypes.addressof(plain), 1 << 40, False),
                ("sealed memfd, another memfd's hint", lambda: good[100:228], good_addr + 100, 1 + other_fd, False),
                ("unsealed memfd", lambda: loose[0:128], loose_addr, 1 + loose_fd, False),
                ("private mapping of a sealed memfd", lambda: priv[0:128], priv_addr, 1 + priv_fd, False),
                ("sealed memfd, its own hint", lambda: good[100:228], good_addr + 100, 1 + good_fd, True),
                ("the same again (mapped once)", lambda: other[4096:4224], other_addr + 4096, 1 + other_fd, True),
            ]
            used = 0
            for i, (name, read, addr, hint, in_place) in enumerate(cases):
                ctypes.memset(addr, 0, 128)
                h, body = u.request(pm_frame(T_PULL_DENSE, 10 + i, [(0, 32)], [(addr, 128)], hint=hint))
                assert (h["status"], h["xport"], body) == (0, XPORT_PEER_MEM, b""), (name, h, body)
                assert read() == want, f"{name}: wrong values written"
                used += in_place
                assert shared_requests(sport) == base + used, name
            assert "shared_mapped 2" in stats(sport), stats(sport)
        finally:
            u.close()
            for m in (good, other, loose, priv):
                m.close()
            for fd in (good_fd, other_fd, loose_fd, priv_fd):
                os.close(fd)
