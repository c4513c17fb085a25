"""The scheduler stays live: a worker that registered and heartbeats but never clocks
cannot hold a sync round longer than the heartbeat timeout, and heartbeats are handled
on time while the scheduler serves large STATS replies without pause.

1. A phantom worker (a raw client: HELLO as a worker, then HEARTBEAT every 100 ms,
   nothing else) registers beside two real sync workers. The servers report that
   their rounds wait for it; once a round has waited longer than the heartbeat timeout
   the scheduler removes it ("stalled"), tells it why (an ERROR frame, then the close),
   and the real workers finish with the parameters of the same job in which the third
   worker left at once (LEAVE). Its later requests are refused with a clear error: a
   rejoin at the scheduler, a push at the server.
2. While four connections keep asking for STATS replies of about 100 KB (1024 metric
   lines), a heartbeating node is never removed, a node that falls silent is removed
   one heartbeat timeout later (not later than 0.6 s after that), and a STATS request on
   a fresh connection is answered within a second.
Every process is started by cluster.Cluster; every wait and socket read is bounded.
"""
import struct
import threading
import time

from cluster import Cluster, binary
from test_core import (DENSE_SGD, REPLY, RUN_TIMEOUT, SCALE, SPARSE_ADAGRAD, T_HELLO, T_METRIC, T_STATS, Raw, frame,
                       load_params, server_port, stats, worst)

T_MEMBERSHIP, T_HEARTBEAT, T_LEAVE, T_PUSH, T_ERROR = 2, 3, 8, 9, 14
E_UNAVAILABLE = 15
ROLE_WORKER = 3
SPARSE_DIM = 4
TRAIN = ["--batch", "4", "--steps", "12", "--sparse-dim", str(SPARSE_DIM), "--dense-opt", DENSE_SGD,
         "--sparse-opt", SPARSE_ADAGRAD]


def hello_body(role=ROLE_WORKER):
    """ps__hello: u8 role, u32 port, u32 pid, str host, str unix path, str hostid, u8 caps."""
    def s(x):
        return struct.pack("<I", len(x)) + x
    return bytes([role]) + struct.pack("<II", 0, 0) + s(b"127.0.0.1") + s(b"") + s(b"phantom") + b"\0"


class Phantom:
    """A raw node: registers, then heartbeats from a thread until stopped or closed."""

    def __init__(self, port, role=ROLE_WORKER):
        self.r = Raw(port, timeout=10.0)
        self.r.send(frame(T_HELLO, hello_body(role), req_id=1))
        h, _ = self.r.read_frame()
        assert h["type"] == T_HELLO | REPLY and h["status"] == 0, h
        self.id = h["table"]
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._beat, daemon=True)
        self.t.start()

    def _beat(self):
        while not self.stop.wait(0.1):
            try:
                self.r.send(frame(T_HEARTBEAT, sender=self.id))
            except OSError:
                return

    def silence(self):
        self.stop.set()
        self.t.join(timeout=5)

    def close(self):
        self.silence()
        self.r.s.close()


def sched_port(c):
    return int(c.addr.rsplit(":", 1)[1])


def run_with_third(tmp_path, name, third):
    """Two sync workers (started first) beside a raw third one that `third(c, phantom)` deals with; the
    real workers' parameters and the cluster's logs."""
    out = str(tmp_path / f"{name}.txt")
    hb_ms = 1000
    with Cluster(1, 3, heartbeat_timeout_ms=hb_ms) as c:
        procs = [c.worker([binary("sync_worker"), *TRAIN, "--out", out], f"worker{i}") for i in range(2)]
        # The phantom registers last (rank 2), so the real workers hold ranks 0 and 1 in both runs.
        deadline = time.time() + 10 * SCALE
        while stats(sched_port(c)).count("role=worker") < 2:
            assert time.time() < deadline, c.log("scheduler")
            time.sleep(0.01)
        ph = Phantom(sched_port(c))
        try:
            t0 = time.monotonic()
            extra = third(c, ph, procs)
            codes = c.wait(procs, RUN_TIMEOUT)
            elapsed = time.monotonic() - t0
            assert codes == [0, 0], "\n".join(c.log(p.name) for p in procs) + c.log("scheduler")
        finally:
            ph.close()
        return load_params(out), elapsed, c.log("scheduler"), extra


def test_a_worker_that_never_clocks_is_removed_and_the_sync_job_finishes(tmp_path):
    def leaves(c, ph, procs):
        time.sleep(0.3)  # registered and started; then a clean exit
        ph.r.send(frame(T_LEAVE, sender=ph.id))
        return None

    ref, _, _, _ = run_with_third(tmp_path, "ref", leaves)

    def stalls(c, ph, procs):
        # The phantom hears why it was removed (after the memberships), then the close.
        while True:
            f = ph.r.read_frame()
            assert f is not None, "closed without a reason:\n" + c.log("scheduler")
            h, body = f
            if h["type"] != T_MEMBERSHIP:
                break
        got = time.monotonic()
        assert h["type"] == T_ERROR and h["status"] == E_UNAVAILABLE, (h, body)
        assert b"removed from the job" in body and b"stalled" in body, body
        assert ph.r.read_frame() is None, "the connection stays open after the removal"
        ph.silence()
        # Later requests are refused: a rejoin under its id, a push to the server.
        r = Raw(sched_port(c))
        r.send(frame(T_HELLO, hello_body(), sender=ph.id, req_id=2))
        h, body = r.read_frame()
        assert h["type"] == T_ERROR | REPLY or h["type"] == T_ERROR or h["status"] == E_UNAVAILABLE, (h, body)
        assert h["status"] == E_UNAVAILABLE and b"was removed from the job" in body, (h, body)
        r.s.close()
        sp = Raw(server_port(c))
        sp.send(frame(T_PUSH, struct.pack("<Q", 7) + struct.pack("<4f", 1, 1, 1, 1), sender=ph.id, req_id=3, table=2,
                      batch=1, clock=0, nkeys=1))
        h, body = sp.read_frame()
        sp.s.close()
        return got, h, body

    got, elapsed, log, (removed_at, h, body) = run_with_third(tmp_path, "stall", stalls)
    assert "stalled" in log and "missed heartbeats" not in log, log
    assert h["status"] == E_UNAVAILABLE and b"was removed from the job" in body, (h, body)
    # The round waited about the heartbeat timeout, not much longer.
    assert elapsed < RUN_TIMEOUT
    d, key, x, y = worst(got, ref)
    assert d < 1e-5, f"parameter {key}: {x} with the phantom removed, {y} with the third worker gone at once"


def test_heartbeats_are_handled_on_time_while_the_scheduler_serves_large_stats():
    hb_ms = 800
    with Cluster(1, 1, heartbeat_timeout_ms=hb_ms) as c:
        port = sched_port(c)
        # 8 nodes x 256 metric names: STATS shows 1024 metric lines.
        fillers = [Phantom(port) for _ in range(8)]
        for f in fillers:
            f.r.send(b"".join(frame(T_METRIC, struct.pack("<I", 13) + b"metric-%06d" % i + struct.pack("<d", i),
                                    sender=f.id) for i in range(256)))
        keeper, quitter = Phantom(port), Phantom(port)
        deadline = time.time() + 10 * SCALE
        while "metrics 2048\n" not in (text := stats(port)):
            assert time.time() < deadline, text[-300:]
            time.sleep(0.02)
        assert "metrics_omitted 1024\n" in text, text[-300:]
        size = len(text)
        assert size > 60000, size

        stop = threading.Event()
        served = [0] * 4

        def flood(k):
            f = Raw(port, timeout=10.0)
            try:
                while not stop.is_set():
                    f.send(frame(T_STATS, req_id=1) * 16)
                    for _ in range(16):
                        h, _ = f.read_frame()
                        assert h["type"] == T_STATS | REPLY
                        served[k] += 1
            finally:
                f.s.close()

        threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            quitter.silence()
            t_quiet = time.monotonic()
            # The silent node is removed one timeout after its last heartbeat (+ a check period).
            deadline = t_quiet + (hb_ms / 1000 + 3) * SCALE
            removed = None
            while time.monotonic() < deadline:
                if f"worker {quitter.id} " in c.log("scheduler") and "missed heartbeats" in c.log("scheduler"):
                    removed = time.monotonic() - t_quiet
                    break
                time.sleep(0.02)
            assert removed is not None, c.log("scheduler")
            assert removed < (hb_ms / 1000 + 0.6) * SCALE, f"removed {removed:.2f}s after it fell silent"
            # A fresh STATS is answered promptly in the middle of the flood.
            t1 = time.monotonic()
            r2 = Raw(port)
            r2.send(frame(T_STATS, req_id=9))
            h, body = r2.read_frame()
            latency = time.monotonic() - t1
            r2.s.close()
            assert latency < 1.0 * SCALE, f"a STATS took {latency:.2f}s during the flood"
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
        # The heartbeating node lived through it all.
        text = body.decode()
        line = [l for l in text.splitlines() if l.startswith(f"node {keeper.id} ")]
        assert line and line[0].endswith("alive=1"), line
        assert not [l for l in c.log("scheduler").splitlines() if f"worker {keeper.id} " in l and "removed" in l]
        assert min(served) > 16, served  # every flooding connection was served throughout
        for f in fillers + [keeper, quitter]:
            f.close()


def test_a_slow_worker_that_clocks_is_waited_for_not_removed():
    # A straggler is not a phantom: a worker whose steps take longer than the heartbeat
    # timeout (it clocked before) holds its rounds back, and the others wait for it, up
    # to the stall timeout (60 s by default).
    from test_once import outcome
    with Cluster(1, 2, heartbeat_timeout_ms=1000) as c:
        procs = [c.worker([binary("once_worker"), "--mode", "sync", "--pushes", "3", "--keys", "4",
                           "--sleep-ms", str(ms)], f"w{i}") for i, ms in enumerate((2500, 0))]
        assert c.wait(procs, RUN_TIMEOUT) == [0, 0], c.log("w0") + c.log("w1") + c.log("scheduler")
        for i in range(2):
            acked, values, failed = outcome(c.log(f"w{i}"))
            assert failed == [] and acked == 3 and values == [6.0] * 4, c.log(f"w{i}")
        assert "stalled" not in c.log("scheduler"), c.log("scheduler")
