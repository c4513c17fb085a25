"""A server's limits against a hostile or broken peer on the same host: each attack is
refused or bounded, the server's memory stays bounded, and a well-behaved worker beside
it finishes with the right model.

1. NaN and Inf gradients and an infinite header rate are refused with PS_ERR_INVALID
   (from a C worker through the library, and as raw frames beside a training worker),
   nothing of them is applied, and STATS and the log report them.
2. A header announcing a payload of 2 GiB - 64 reserves nothing: eight of them leave
   the server's virtual size and resident memory where they were.
3. Partial frames: a per-server budget of their bytes refuses a frame past it
   (PS_ERR_NOMEM, connection closed), and a frame not complete within its deadline
   has its connection closed with a log line. 10,000 connections opened and closed
   leave resident memory where it was.
4. The memory budget: CREATE of a dense table of 2^40 floats is refused, and sparse
   rows past the budget are refused (push and pull) while existing rows are served.
5. The scheduler keeps at most 256 metric names per node; its STATS stays small.

Every process is started by cluster.Cluster (own process group, SIGKILLed at the end),
ports are ephemeral, and every wait is bounded.
"""
import math
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cluster import Cluster, binary  # noqa: E402
from test_core import (DENSE_SGD, RUN_TIMEOUT, SCALE, SPARSE_ADAGRAD, T_PUSH_DENSE, T_STATS,  # noqa: E402
                       Raw, frame, load_params, rss_kb, run_sync, server_port, stats, wait_for_line, worst)

E_INVALID, E_NOMEM = 1, 2
# Under ASan freed memory waits in the allocator's quarantine (up to 256 MB) before it is
# reused, so resident-memory bounds say nothing there: they are checked in release builds.
SANITIZED = bool(os.environ.get("PSHARD_SANITIZED"))


def vm_kb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def stat_value(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return int(line.split()[1])
    raise AssertionError(f"no '{name}' line in STATS:\n{text}")


def run_budget_worker(args, env=None, servers=1, timeout=RUN_TIMEOUT):
    with Cluster(servers, 1, extra_env=env) as c:
        w = c.worker([binary("budget_worker"), *args], "worker0")
        code = c.wait([w], timeout)[0]
        return code, c.log("worker0"), c.log("server0"), c.log("scheduler")


TRAIN = ["--batch", "4", "--steps", "60", "--sleep-ms", "40", "--dense-opt", DENSE_SGD, "--sparse-opt", SPARSE_ADAGRAD]


# ------------------------------------------------------------------ 1. non-finite numbers

def test_a_worker_pushing_nan_and_an_infinite_rate_is_refused_and_the_model_stays_finite():
    code, log, slog, _ = run_budget_worker(["nan", "20"])
    assert code == 0, log + slog
    refused = [line for line in log.splitlines() if line.startswith("refused: ")]
    assert len(refused) == 2, log
    assert "table 'w'" in refused[0] and "NaN at value 3 (element 3)" in refused[0], refused[0]
    assert "nothing was applied" in refused[0], refused[0]
    assert "learning rate (inf)" in refused[1], refused[1]
    w = [float(line.split()[1]) for line in log.splitlines() if line.startswith("w ")]
    assert len(w) == 8 and all(math.isfinite(x) for x in w), log
    # 18 of the 20 pushes of ones applied with lr 0.1 from 1: every element is -0.8.
    assert all(abs(x + 0.8) < 1e-5 for x in w), w
    assert "nonfinite_refused 2" in log, log
    assert "holds NaN" in slog, slog


def test_a_nan_in_a_replicated_sync_push_read_where_the_workers_copy_lies_is_refused():
    # R = 2: each slice's head adds a worker's push to the round from the copy the
    # worker keeps for a failover (peer_mem_kept_in_place), so the check runs there.
    with Cluster(2, 1, replicas=2) as c:
        w = c.worker([binary("budget_worker"), "nan-sync", "8"], "worker0")
        code = c.wait([w], RUN_TIMEOUT)[0]
        log = c.log("worker0") + c.log("server0") + c.log("server1")
    assert code == 0, log
    refused = [line for line in log.splitlines() if line.startswith("refused: ")]
    assert len(refused) == 1 and "NaN" in refused[0] and "nothing was applied" in refused[0], log
    # 7 of the 8 rounds applied a gradient of ones with lr 0.1 from 1: every value is 0.3.
    lo, hi = [float(x) for x in next(line for line in log.splitlines() if line.startswith("s ")).split()[1:]]
    assert abs(lo - 0.3) < 1e-5 and abs(hi - 0.3) < 1e-5, log
    for i in range(2):
        assert f"server {i} nonfinite_refused 1" in log, log
        in_place = int(next(line for line in log.splitlines()
                            if line.startswith(f"server {i} peer_mem_kept_in_place ")).split()[-1])
        assert in_place >= 8, log  # each head's part of every push, the refused one too


def test_raw_nan_beside_a_training_worker_and_huge_announced_payloads_change_nothing(tmp_path):
    ref = run_sync(1, 1, 4, 60, str(tmp_path / "ref.txt"), DENSE_SGD, SPARSE_ADAGRAD)
    out = str(tmp_path / "out.txt")
    with Cluster(1, 1) as c:
        w = c.worker([binary("sync_worker"), *TRAIN, "--progress", "1", "--out", out], "worker0")
        wait_for_line(c, "worker0", "step 1", RUN_TIMEOUT, [w])
        sport = server_port(c)
        pid = c.server_procs[0].pid
        # Table 1 is the dense "w" (32 floats): a NaN, an infinity, and an infinite rate.
        r = Raw(sport)
        try:
            for req, vals, lr in ((5, (0.0, math.nan), -1.0), (6, (math.inf, 0.0), -1.0), (7, (0.0, 0.0), math.inf)):
                r.send(frame(T_PUSH_DENSE, sender=99998, req_id=req, table=1, batch=1, clock=0, nkeys=2, lr=lr,
                             payload=struct.pack("<QQff", 0, 2, *vals)))
                h, body = r.read_frame()
                assert h["req_id"] == req and h["status"] == E_INVALID, (h, body)
                assert b"not finite" in body and b"nothing was applied" in body, body
        finally:
            r.close()
        # Eight headers announcing 2 GiB - 64 each, with a few bytes of body.
        vm0, rss0 = vm_kb(pid, "VmSize"), rss_kb(pid)
        socks = []
        for i in range(8):
            s = socket.create_connection(("127.0.0.1", sport), timeout=5 * SCALE)
            s.sendall(frame(T_PUSH_DENSE, req_id=100 + i, table=1, batch=1, nkeys=2, payload_len=(2 << 30) - 64)
                      + struct.pack("<QQ", 0, 32) + b"\0" * 1000)
            socks.append(s)
        time.sleep(0.3)
        vm1, rss1 = vm_kb(pid, "VmSize"), rss_kb(pid)
        for s in socks:
            s.close()
        assert vm1 - vm0 < 256 * 1024, f"8 announced payloads grew the server by {(vm1 - vm0) >> 10} MiB virtual"
        assert SANITIZED or rss1 - rss0 < 32 * 1024, f"8 announced payloads grew the server by {(rss1 - rss0) >> 10} MiB resident"
        text = stats(sport)
        assert stat_value(text, "nonfinite_refused") == 3, text
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0")
    got = load_params(out)
    assert all(math.isfinite(v) for v in got.values())
    d, key, x, y = worst(got, ref)
    assert d == 0, f"the hostile frames changed training: {key} {x} vs {y}"


# ------------------------------------------------------------------ 3. partial frames

def test_partial_frames_are_bounded_by_the_budget_and_the_deadline(tmp_path):
    deadline_ms = int(2000 * SCALE)
    env = {"PSHARD_FRAME_BUDGET_MB": "64", "PSHARD_FRAME_DEADLINE_MS": str(deadline_ms)}
    ref = run_sync(1, 1, 4, 60, str(tmp_path / "ref.txt"), DENSE_SGD, SPARSE_ADAGRAD)
    out = str(tmp_path / "out.txt")
    with Cluster(1, 1, extra_env=env) as c:
        w = c.worker([binary("sync_worker"), *TRAIN, "--progress", "1", "--out", out], "worker0")
        wait_for_line(c, "worker0", "step 1", RUN_TIMEOUT, [w])
        sport = server_port(c)
        pid = c.server_procs[0].pid
        rss0 = rss_kb(pid)
        # Two frames of 32 MiB, 24 MiB of each sent: their bodies hold 32 MiB each.
        body = 32 << 20
        held = []
        for i in range(2):
            s = socket.create_connection(("127.0.0.1", sport), timeout=10 * SCALE)
            s.sendall(frame(T_PUSH_DENSE, req_id=200 + i, table=1, batch=1, nkeys=2, payload_len=body)
                      + struct.pack("<QQ", 0, 32) + b"\0" * (24 << 20))
            held.append(s)
        t0 = time.monotonic()
        until = t0 + 5 * SCALE
        while stat_value(stats(sport), "frame_bytes") < 64 << 20 and time.monotonic() < until:
            time.sleep(0.02)
        assert stat_value(stats(sport), "frame_bytes") == 64 << 20, stats(sport)
        # A third frame does not fit: refused with a clear error, its connection closed.
        r = Raw(sport)
        try:
            r.send(frame(T_PUSH_DENSE, req_id=300, table=1, batch=1, nkeys=2, payload_len=body)
                   + struct.pack("<QQ", 0, 32) + b"\0" * 4096)
            frames, how = r.read_to_close()
        finally:
            r.close()
        assert frames and frames[0][0]["status"] == E_NOMEM and frames[0][0]["req_id"] == 300, frames
        assert b"frame_budget_mb" in frames[0][1], frames
        if not SANITIZED:
            assert rss_kb(pid) - rss0 < (64 + 48) * 1024, "partial frames took more than their budget"
        # The two partial frames pass their deadline: the server closes them.
        for s in held:
            s.settimeout(deadline_ms / 1000 + 5 * SCALE)
            try:
                assert s.recv(65536) == b"", "a partial frame's connection got data instead of a close"
            except ConnectionResetError:
                pass
            s.close()
        assert time.monotonic() - t0 >= deadline_ms / 1000 * 0.9, "closed before the deadline"
        text = stats(sport)
        assert stat_value(text, "frames_expired") == 2 and stat_value(text, "frames_refused") == 1, text
        assert stat_value(text, "frame_bytes") == 0, text
        assert "is not complete" in c.log("server0"), c.log("server0")
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0")
    d, key, x, y = worst(load_params(out), ref)
    assert d == 0, f"the partial frames changed training: {key} {x} vs {y}"


def test_ten_thousand_connections_opened_and_closed_leave_the_heap_where_it_was():
    with Cluster(1, 1) as c:
        sport = server_port(c)
        part = frame(T_STATS, req_id=1)[:30]
        def burst(n):
            for _ in range(n // 100):
                socks = [socket.create_connection(("127.0.0.1", sport), timeout=5 * SCALE) for _ in range(100)]
                for s in socks:
                    s.sendall(part)
                for s in socks:
                    s.close()
        def settled():
            # the server has closed every one of them (its own STATS connection is open)
            deadline = time.monotonic() + 10 * SCALE
            while True:
                text = stats(sport)
                if stat_value(text, "connections") <= conns0 or time.monotonic() > deadline:
                    return text
                time.sleep(0.05)
        conns0 = stat_value(stats(sport), "connections")
        burst(10000)  # the loop's own structures, and the allocator's heaps, reach their size
        text = settled()
        heap0 = stat_value(text, "heap_in_use")
        for _ in range(2):
            burst(10000)
        text = settled()
        assert "\nrows " in text
        assert stat_value(text, "connections") == conns0, text
        if not SANITIZED:
            # Exact: what the allocator has handed out (measured: 4 to 31 KiB, the loop's
            # arrays growing with the most connections open at once, and closed-peer
            # counters). A leak of 13 bytes per connection would pass the bound.
            # (Resident memory is no measure of a leak here: it also holds the allocator's
            # free pages, as many as the connections open at once needed, which depends
            # on how far the server fell behind the test; 20 to 55 MiB were seen.)
            grown = stat_value(text, "heap_in_use") - heap0
            assert grown < 256 * 1024, f"20,000 connections left {grown} bytes of heap behind"


# ------------------------------------------------------------------ 4. the memory budget

def test_a_dense_table_of_2_40_floats_is_refused():
    code, log, slog, _ = run_budget_worker(["create", str(1 << 40)], env={"PSHARD_SERVER_MEMORY_MB": "1024"})
    assert code == 0, log + slog
    assert "PS_ERR_NOMEM" in log and "server_memory_mb" in log and "'huge'" in log, log


def test_sparse_rows_past_the_memory_budget_are_refused_and_existing_rows_served():
    with Cluster(1, 1, extra_env={"PSHARD_SERVER_MEMORY_MB": "16"}) as c:
        pid = c.server_procs[0].pid
        rss0 = rss_kb(pid)
        w = c.worker([binary("budget_worker"), "grow", "16"], "worker0")
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0") + c.log("server0")
        log = c.log("worker0")
        assert "refused after" in log and "PS_ERR_NOMEM" in log and "memory budget of 16 MiB" in log, log
        assert "key 0: -1.000" in log, log
        assert "pull of a new key: PS_ERR_NOMEM" in log, log
        keys = int(log.split("refused after ")[1].split()[0])
        assert 50000 <= keys <= 300000, log  # 16 MiB of 64-byte rows and their index
        assert SANITIZED or rss_kb(pid) - rss0 < 96 * 1024
        text = stats(server_port(c))
        assert stat_value(text, "memory_refused") >= 2, text
        assert stat_value(text, "memory_used") < (16 << 20) * 2, text


# ------------------------------------------------------------------ 5. the scheduler's metrics

def test_metric_names_are_capped_per_node_and_stats_stays_small():
    with Cluster(1, 1) as c:
        w = c.worker([binary("budget_worker"), "metrics", "3000"], "worker0")
        assert c.wait([w], RUN_TIMEOUT) == [0], c.log("worker0")
        cport = int(c.addr.rsplit(":", 1)[1])
        t0 = time.monotonic()
        text = stats(cport)
        assert time.monotonic() - t0 < 2 * SCALE
        assert stat_value(text, "metrics") == 256, text[-500:]
        assert stat_value(text, "metrics_refused") >= 3000 - 256, text[-500:]  # and the library's own
        assert len(text) < 64 * 1024
        assert "at most 256 metric names per node" in c.log("scheduler"), c.log("scheduler")
        assert "workers_alive" in text
