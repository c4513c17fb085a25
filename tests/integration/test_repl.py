"""Chain replication with real processes (cluster.Cluster: own process groups,
ephemeral ports, SIGKILLed at the end), driven by once_worker: a counter table (sum
mode, sgd, lr 1, async) where every push adds exactly 1 to every key, so after a
barrier each key's value is the number of pushes applied, to compare with the number
the workers saw acknowledged.

1. S = 3, R = 2: a server SIGKILLed while the workers push; the job finishes, every
   push is acknowledged and counted exactly once on the surviving copies.
2. A head stopped (SIGSTOP) past the heartbeat timeout, then continued: the scheduler
   removed it, its chains' next members took over, and it applies nothing afterwards
   (it fences itself, and forwards of its old epoch are refused): counts are exact.
3. Forwards dropped or duplicated by fault injection: nothing lost, nothing applied twice.
4. R > S is refused with a clear error.
4c. Replication lag is seen: with the next copy stopped, the forwards it does not answer
   show in STATS and /metrics (count, bytes, the oldest one's wait), and drain after.
4b. Large dense pushes on one host go by peer memory under R = 2 too (the head reads
   the worker's buffers and forwards the values): counts exact, with a head SIGKILLed.
4a. The tail answers the worker itself (one hop fewer): with R = 3 on three servers
   nearly every push part is answered by its tail, and counts stay exact, also with a
   middle member SIGKILLed.
5. Tables that aggregate pushes (agg_n, agg_ms), sparse and dense: each applied buffer
   is forwarded, not each push (fewer forwards than pushes), a push is acknowledged
   once its buffer reached the tail, and a server SIGKILLed mid-run, or forwards of
   buffers dropped and duplicated, lose and double nothing.
Every wait is bounded; under ASan (PSHARD_SANITIZED=1) time limits are scaled.
"""
import os
import pytest
import re
import signal
import subprocess
import time

from cluster import Cluster, binary
from test_once import KEYS, RUN, SCALE, outcome, server_port, server_stat, stats


AGG = ["--opts", "agg_n=4 agg_ms=25"]  # tables that aggregate pushes (once_worker --opts)


def counted(c, workers, pushes):
    total = 0
    values = None
    for i in range(workers):
        acked, vals, failed = outcome(c.log(f"w{i}"))
        assert failed == [] and acked == pushes, c.log(f"w{i}")
        total += acked
        assert values is None or vals == values, (vals, values)
        values = vals
    assert values == [float(total)] * KEYS, (values, total)
    return total


def applied(c, index):
    """Pushes the server has applied, over its tables (STATS table lines)."""
    return sum(int(n) for n in re.findall(r"^table .* applied=(\d+)", stats(server_port(c, index)), re.M))


def start_workers(c, workers, pushes, sleep_ms, extra=()):
    return [c.worker([binary("once_worker"), "--mode", "async", "--pushes", str(pushes), "--keys", str(KEYS),
                      "--sleep-ms", str(sleep_ms)] + list(extra), f"w{i}") for i in range(workers)]


def test_a_server_killed_mid_run_loses_no_acknowledged_push():
    with Cluster(3, 2, replicas=2, extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        ps = start_workers(c, 2, 150, 10)
        c.wait_started()
        time.sleep(0.4)  # not scaled: the workers must still be pushing
        assert all(p.poll() is None for p in ps), "the workers finished before the kill"
        victim = c.server_procs[1]
        os.killpg(victim.pid, signal.SIGKILL)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1") + c.log("scheduler")
        counted(c, 2, 150)
        # The survivors took the dead server's chains over and forwarded to each other.
        assert "removed" in c.log("scheduler")
        assert sum(server_stat(c, i, "forwards") for i in (0, 2)) > 0


@pytest.mark.parametrize("extra", [[], AGG], ids=["each-push", "aggregated"])
def test_a_head_stopped_past_the_heartbeat_timeout_applies_nothing_afterwards(extra):
    hbt = int(1000 * SCALE)
    with Cluster(3, 2, replicas=2, heartbeat_timeout_ms=hbt, extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        ps = start_workers(c, 2, 150, 10, extra)
        c.wait_started()
        time.sleep(0.4)  # not scaled: the workers must still be pushing
        victim = c.server_procs[0]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            deadline = time.time() + 10 * SCALE
            while "removed: missed heartbeats" not in c.log("scheduler"):
                assert time.time() < deadline, c.log("scheduler")
                time.sleep(0.05)
            time.sleep(0.3)  # the survivors serve the stopped server's chains meanwhile
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        counted(c, 2, 150)
        # Continued, it knew it had stood still and served nothing; the scheduler, which
        # removed it, refuses it, and it stops.
        assert victim.wait(timeout=15 * SCALE) != 0
        log = c.log("server0")
        assert "stood still" in log, log


def test_dropped_and_duplicated_forwards_lose_nothing_and_apply_nothing_twice():
    env = {"PSHARD_FAULT": "drop:type=forward:every=7:dir=out:node=server;dup:type=forward:every=5:node=server",
           "PSHARD_RETRY_MS": "150"}
    with Cluster(3, 2, replicas=2, extra_env=env) as c:
        ps = start_workers(c, 2, 40, 0)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        counted(c, 2, 40)
        logs = "".join(c.log(f"server{i}") for i in range(3))
        assert "dropped sent forward frame" in logs and "duplicated received forward frame" in logs, logs[-3000:]
        assert sum(server_stat(c, i, "duplicate_pushes") for i in range(3)) > 0


@pytest.mark.parametrize("direct", ["0", "1"], ids=["io-thread", "caller-thread"])
def test_the_tail_answers_the_worker_and_counts_stay_exact(direct):
    # Blocking calls through the I/O thread, or on the caller's thread (which claims the
    # links of every member of the chains it pushes to, to read the tails' answers).
    with Cluster(3, 2, replicas=3, extra_env={"PSHARD_RETRY_MS": "300", "PSHARD_DIRECT": direct}) as c:
        ps = start_workers(c, 2, 120, 5)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        counted(c, 2, 120)
        # Each part goes head -> middle -> tail: two forwards, one answer by the tail. A
        # tail that has not yet read a frame of the worker's leaves it to the head.
        fwd = sum(server_stat(c, i, "forwards") for i in range(3))
        tail = sum(server_stat(c, i, "tail_answers") for i in range(3))
        assert fwd > 0 and 0.9 * fwd / 2 <= tail <= fwd / 2, (fwd, tail)
        direct_calls = [int(re.search(r"^direct_calls (\d+)$", c.log(f"w{i}"), re.M).group(1)) for i in range(2)]
        # on the caller's thread: most pushes (the first go through the loop, which then
        # lends the links)
        assert all(d > (100 if direct == "1" else -1) for d in direct_calls) and (direct == "1" or direct_calls == [0, 0])


@pytest.mark.parametrize("direct", ["0", "1"], ids=["io-thread", "caller-thread"])
def test_a_middle_killed_while_tails_answer_loses_nothing(direct):
    with Cluster(3, 2, replicas=3, extra_env={"PSHARD_RETRY_MS": "300", "PSHARD_DIRECT": direct}) as c:
        ps = start_workers(c, 2, 150, 10)
        c.wait_started()
        time.sleep(0.4)  # not scaled: the workers must still be pushing
        assert all(p.poll() is None for p in ps), "the workers finished before the kill"
        os.killpg(c.server_procs[1].pid, signal.SIGKILL)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1") + c.log("scheduler")
        counted(c, 2, 150)
        assert direct == "1" or sum(server_stat(c, i, "tail_answers") for i in (0, 2)) > 0


def test_lost_tail_answers_are_sent_again_and_applied_once():
    # Push answers from the servers (the tails' own among them) dropped: the worker sends
    # the push again to the head, which forwards it again; the windows apply it once.
    env = {"PSHARD_FAULT": "drop:type=push-reply:n=2:every=5:dir=out:node=server", "PSHARD_RETRY_MS": "150"}
    with Cluster(3, 2, replicas=2, extra_env=env) as c:
        ps = start_workers(c, 2, 40, 0)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        counted(c, 2, 40)
        logs = "".join(c.log(f"server{i}") for i in range(3))
        assert "dropped sent push-reply frame" in logs, logs[-3000:]
        assert sum(server_stat(c, i, "tail_answers") for i in range(3)) > 0
        assert sum(server_stat(c, i, "duplicate_pushes") for i in range(3)) > 0


BIG = ["--dense", "--floats", str(1 << 18)]  # 1 MiB in 16 runs of 64 KiB: peer-memory parts


def buffers_given_back(c, alive, within=6.0):
    # Each shared forward buffer has two holders, the forward and the engine's apply:
    # both let go once the pushes are done (a body given up with its frame is kept until
    # its expiry, 1 s, and 2 s more).
    deadline = time.monotonic() + within
    while True:
        busy = [server_stat(c, i, "forward_buffers_busy") for i in alive]
        if not any(busy) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not any(busy), busy
    assert sum(server_stat(c, i, "forward_buffers") for i in alive) > 0


def pushed_big(c, workers=2, pushes=20):
    # Each worker's large pushes, run to the end and counted exactly.
    ps = start_workers(c, workers, pushes, 0, BIG)
    assert c.wait(ps, RUN) == [0] * workers, "".join(c.log(f"w{i}") for i in range(workers))
    counted_big(c, workers, pushes)


def stats_of(c, names, servers=range(3)):
    return {k: [server_stat(c, i, k) for i in servers] for k in names}


def counted_big(c, workers, pushes):
    for i in range(workers):
        acked, vals, failed = outcome(c.log(f"w{i}"))
        assert failed == [] and acked == pushes, c.log(f"w{i}")
        assert vals == [float(workers * pushes)] * 16, vals


@pytest.mark.parametrize("kill,replicas", [(False, 2), (True, 2), (False, 3), (True, 3)],
                         ids=["no-fault", "head-killed", "r3-no-fault", "r3-head-killed"])
def test_same_host_dense_pushes_go_by_peer_memory_under_replicas(kill, replicas):
    # The heads read each push into a shared buffer and name its values to the next
    # copy, which applies them where they lie; under R = 3 the middle member forwards
    # them on with the values.
    with Cluster(3, 2, replicas=replicas, extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        ps = start_workers(c, 2, 60 if kill else 30, 10 if kill else 0, BIG)
        if kill:
            c.wait_started()
            time.sleep(0.4)
            assert all(p.poll() is None for p in ps), "the workers finished before the kill"
            os.killpg(c.server_procs[0].pid, signal.SIGKILL)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1") + c.log("scheduler")
        counted_big(c, 2, 60 if kill else 30)
        alive = (1, 2) if kill else (0, 1, 2)
        assert sum(server_stat(c, i, "peer_mem_pushes") for i in alive) > 0
        assert sum(server_stat(c, i, "forwards") for i in alive) > 0
        # The heads' forwards named their values, and the next copies read them in place
        # (the workers' own buffers are not shared: every shared request is a forward's).
        assert sum(server_stat(c, i, "peer_mem_forwards_out") for i in alive) > 0
        assert sum(server_stat(c, i, "peer_mem_forwards_in") for i in alive) > 0
        assert sum(server_stat(c, i, "shared_requests") for i in alive) > 0
        buffers_given_back(c, alive)


def test_a_member_that_reads_a_forward_past_its_expiry_gets_the_values_from_the_head():
    # The third forward server 1 receives reaches it past its expiry (1 s: held 1.5 s
    # on the way in), and so do those queued behind it on that connection: it reads
    # nothing of them and answers so, and the head sends them again with their values.
    # It read the others in place. No push fails or is lost.
    env = {"PSHARD_RETRY_MS": "300", "PSHARD_FAULT": "delay=1500ms:type=forward-dense:n=3:dir=in:node=server.1"}
    with Cluster(3, 2, replicas=2, extra_env=env) as c:
        pushed_big(c)
        logs = "".join(c.log(f"server{i}") for i in range(3))
        stat = stats_of(c, ("peer_mem_forwards_in", "peer_mem_forwards_resent", "shared_requests"))
        assert "delayed received forward-dense frame #3 by 1500 ms" in logs, logs[-3000:]
        assert 1 <= sum(stat["peer_mem_forwards_resent"]) <= 10, stat
        assert sum(stat["peer_mem_forwards_in"]) > 3 * 20 and sum(stat["shared_requests"]) > 3 * 20, stat
        buffers_given_back(c, range(3))


def test_heads_without_shared_forward_buffers_forward_with_the_values():
    # PSHARD_FORWARD_BUFFERS=0: the heads still read the pushes by peer memory, but have
    # no shared buffer to name to the next copy, so their forwards carry the values.
    env = {"PSHARD_RETRY_MS": "300", "PSHARD_FORWARD_BUFFERS": "0"}
    with Cluster(3, 2, replicas=2, extra_env=env) as c:
        pushed_big(c)
        stat = stats_of(c, ("peer_mem_pushes", "forwards", "peer_mem_forwards_out", "forward_buffers"))
        assert sum(stat["peer_mem_pushes"]) > 0 and sum(stat["forwards"]) > 0, stat
        assert stat["peer_mem_forwards_out"] == [0, 0, 0] and stat["forward_buffers"] == [0, 0, 0], stat


def test_a_member_without_peer_memory_gets_its_chains_pushes_with_their_values():
    # Server 1 has peer memory off: the workers push inline to every chain it is in, and
    # its heads forward with the values; the chain of the other two goes by peer memory.
    env = {"PSHARD_RETRY_MS": "300"}
    with Cluster(3, 2, replicas=2, extra_env=env, server_env={1: {"PSHARD_PEER_MEM": "0"}}) as c:
        pushed_big(c)
        fin = stats_of(c, ("peer_mem_forwards_in",))["peer_mem_forwards_in"]
        assert fin[1] == 0 and fin[0] + fin[2] > 0, fin


@pytest.mark.parametrize("n", [1, 3])
def test_a_member_out_of_memory_has_the_push_sent_again(n):
    # One allocation of a member fails while it applies a forward: the head, which
    # applied the push, answers that it is to be sent again (not that it failed), and
    # the windows apply the copy once: no push fails, every count is exact.
    env = {"PSHARD_RETRY_MS": "300", "PSHARD_FAULT": f"alloc:type=forward:n={n}:node=server.1"}
    with Cluster(3, 2, replicas=2, extra_env=env) as c:
        ps = start_workers(c, 2, 30, 0)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        counted(c, 2, 30)
        logs = "".join(c.log(f"server{i}") for i in range(3))
        assert f"failed allocation #{n}" in logs, logs[-3000:]


def metric(text, name):
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_replication_lag_shows_while_the_next_copy_stands_still():
    import urllib.request
    with Cluster(3, 2, replicas=2, heartbeat_timeout_ms=int(20000 * SCALE), extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        ps = start_workers(c, 2, 400, 5)
        # Stop the next copy only once pushes flow to every server (under ASan the
        # workers take a while to start): a forward must be waiting on it.
        deadline = time.time() + 10 * SCALE
        while not all(applied(c, i) > 0 for i in range(3)) and time.time() < deadline:
            time.sleep(0.05)
        assert all(applied(c, i) > 0 for i in range(3)), [applied(c, i) for i in range(3)]
        assert all(p.poll() is None for p in ps), "the workers finished before the stop"
        # A push goes to every head at once: a stop that lands after the forwards to
        # server 1 were answered, but before its own part was, leaves no forward waiting
        # on it (the workers wait on server 1 alone). Resume and stop again until one does.
        for attempt in range(20):
            os.kill(c.server_procs[1].pid, signal.SIGSTOP)
            time.sleep(0.3)
            if any(server_stat(c, i, "forwards_inflight") > 0 for i in (0, 2)):
                break
            os.kill(c.server_procs[1].pid, signal.SIGCONT)
            time.sleep(0.02)
        else:
            pytest.fail("no forward waited on the stopped server in 20 stops")
        try:
            # The server whose chain has server 1 next (the ring decides which): its
            # forwards wait, and the oldest one's wait grows past a second.
            deadline = time.time() + 1.5 + 5 * SCALE
            while True:
                time.sleep(0.2)
                lag = {i: server_stat(c, i, "replication_lag_ms") for i in (0, 2)}
                if max(lag.values()) >= 1000 or time.time() > deadline:
                    break
            w = max(lag, key=lag.get)
            assert lag[w] >= 1000, lag
            assert server_stat(c, w, "forwards_inflight") > 0
            assert server_stat(c, w, "forward_inflight_bytes") > 0
            url = re.search(r"metrics on (http://\S+/metrics)", c.log(f"server{w}")).group(1)
            # /metrics is rendered once a second: the page read may be from before the
            # lag passed 1 s, and the next one shows it (it only grows while the copy stands).
            deadline = time.time() + 5 * SCALE
            while True:
                text = urllib.request.urlopen(url, timeout=10).read().decode()
                if metric(text, "ps_server_replication_lag_seconds") >= 1.0 or time.time() > deadline:
                    break
                time.sleep(0.2)
            assert metric(text, "ps_server_replication_lag_seconds") >= 1.0, text[-2000:]
            assert metric(text, "ps_server_replication_inflight_forwards") > 0
        finally:
            os.kill(c.server_procs[1].pid, signal.SIGCONT)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        counted(c, 2, 400)
        assert all(server_stat(c, i, "forwards_inflight") == 0 for i in range(3))
        assert all(server_stat(c, i, "replication_lag_ms") == 0 for i in range(3))


def test_more_replicas_than_servers_is_refused():
    r = subprocess.run([binary("pshard"), "scheduler", "--servers", "2", "--workers", "1", "--replicas", "3"],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "replicas 3" in r.stderr, r.stderr
    r = subprocess.run([binary("pshard"), "run", "-s", "1", "-w", "1", "--replicas", "2", "--", "true"],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "--replicas 2" in r.stderr, r.stderr


# ---------------------------------------------------------------- checkpoints with replicas

def ckpt_run(tmp, name, servers, steps, replicas=1, env=None, kill_after=None, **worker):
    """ckpt_worker (one worker, async, sgd and adagrad tables: bit-for-bit repeatable)
    to clock `steps` on `servers` servers; with kill_after, server 1 is SIGKILLed that
    many seconds after the worker started. Returns rank 0's parameter lines."""
    out = os.path.join(tmp, name + ".params")
    e = {"PSHARD_MODE": "async", "PSHARD_RETRY_MS": "300"}
    e.update(env or {})
    with Cluster(servers, 1, replicas=replicas, extra_env=e) as c:
        argv = [binary("ckpt_worker"), "--first-opt", "sgd", "--steps", str(steps), "--out", out]
        for k, v in worker.items():
            argv += ["--" + k.replace("_", "-"), str(v)]
        w = c.worker(argv, "w0")
        if kill_after is not None:
            time.sleep(kill_after)
            assert w.poll() is None, "the worker finished before the kill: " + c.log("w0")
            os.killpg(c.server_procs[1].pid, signal.SIGKILL)
        assert c.wait([w], RUN) == [0], c.log("w0") + c.log("scheduler")
        if kill_after is not None:
            assert "removed" in c.log("scheduler"), c.log("scheduler")
    with open(out) as f:
        return f.read().splitlines()


def test_a_checkpoint_after_a_failover_holds_every_range(tmp_path):
    """S = 3, R = 2: a server is SIGKILLed, then a checkpoint is taken; the survivors
    write the ranges they head, the dead server's among them, each row once. Restored
    onto S = 2 (R = 1), every parameter equals the no-fault model at that clock; restored
    onto S = 3 with R = 2, every member loads its chains' rows, so a server killed after
    the restore loses nothing either."""
    tmp = str(tmp_path)
    steps, more = 12, 14
    ref = ckpt_run(tmp, "ref", 2, steps)
    ref_more = ckpt_run(tmp, "ref-more", 2, more)
    ckpt = os.path.join(tmp, "ckpt")
    got = ckpt_run(tmp, "fault", 3, steps, replicas=2, env={"PSHARD_CHECKPOINT_DIR": ckpt}, kill_after=0.5,
                   step_ms=80, ckpt_at=steps)
    assert got == ref  # the failover itself lost nothing
    restored = ckpt_run(tmp, "restored", 2, steps, env={"PSHARD_RESTORE": ckpt})
    assert len(restored) == len(ref) > 0
    assert restored == ref
    # Each row was written once: the data files together hold the rows of one copy.
    nrows = 0
    for d in os.listdir(ckpt):
        path = os.path.join(ckpt, d)
        if not os.path.isdir(path):
            continue
        r = subprocess.run([binary("pshard"), "checkpoint", "inspect", path], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        nrows += sum(int(m) for m in re.findall(r"(\d+) rows", r.stdout))
    one = ckpt_run(tmp, "one-copy", 2, steps, env={"PSHARD_CHECKPOINT_DIR": os.path.join(tmp, "ckpt1")},
                   ckpt_at=steps)
    assert one == ref
    nrows1 = 0
    for d in os.listdir(os.path.join(tmp, "ckpt1")):
        path = os.path.join(tmp, "ckpt1", d)
        if os.path.isdir(path):
            r = subprocess.run([binary("pshard"), "checkpoint", "inspect", path], capture_output=True, text=True,
                               timeout=30)
            nrows1 += sum(int(m) for m in re.findall(r"(\d+) rows", r.stdout))
    assert nrows == nrows1 > 0, (nrows, nrows1)
    # Restored with R = 2, then a server killed: the next members had loaded its rows.
    again = ckpt_run(tmp, "restored-r2", 3, more, replicas=2, env={"PSHARD_RESTORE": ckpt}, kill_after=0.4,
                     step_ms=400)
    assert again == ref_more



def forwards(c, alive):
    return sum(server_stat(c, i, "forwards") for i in alive)


# Every third buffer frame a server receives comes twice: the copy must change nothing.
# The workers' final pull reads the heads, so a buffer applied twice on a tail shows
# only once that tail heads: after the kill, for the dead server's chains.
DUP_AGG = {"PSHARD_FAULT": "dup:type=forward-agg:every=3:node=server"}


@pytest.mark.parametrize("dense,fault", [(False, None), (True, None), (False, DUP_AGG), (True, DUP_AGG)],
                         ids=["sparse", "dense", "sparse-frames-twice", "dense-frames-twice"])
def test_aggregated_buffers_are_forwarded_and_survive_a_server_kill(dense, fault):
    extra = AGG + (["--dense"] if dense else [])
    with Cluster(3, 2, replicas=2, extra_env={"PSHARD_RETRY_MS": "300", **(fault or {})}) as c:
        ps = start_workers(c, 2, 150, 10, extra)
        c.wait_started()
        time.sleep(0.4)  # not scaled: the workers must still be pushing
        assert all(p.poll() is None for p in ps), "the workers finished before the kill"
        os.killpg(c.server_procs[1].pid, signal.SIGKILL)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1") + c.log("scheduler")
        counted(c, 2, 150)
        assert "removed" in c.log("scheduler")
        assert forwards(c, (0, 2)) > 0
        if fault:
            assert sum(server_stat(c, i, "duplicate_pushes") for i in (0, 2)) > 0


def test_an_aggregated_buffer_is_one_forward_not_one_per_push():
    # Four workers push every key 40 times; a head answers a buffer's pushes only once
    # the buffer reached the tail, so the workers' next pushes arrive together and fill
    # the next buffer of 4 by count. Each head forwards one frame per buffer: about a
    # quarter of the pushes it took. The table's push count sums the pushes the heads
    # took and the identities the tails recorded (twice the pushes, under R = 2).
    with Cluster(3, 4, replicas=2) as c:
        ps = start_workers(c, 4, 40, 0, ["--opts", "agg_n=4 agg_ms=100"])
        assert c.wait(ps, RUN) == [0] * 4, "".join(c.log(f"w{i}") for i in range(4))
        counted(c, 4, 40)
        taken = sum(int(re.search(r"^table \d+ name=count .*? pushes=(\d+)", stats(server_port(c, i)), re.M).group(1))
                    for i in range(3))
        sent = forwards(c, range(3))
        # One forward a push would be taken / 2; this run is about taken / 4. A buffer
        # that its 100 ms closes before 4 pushes came (a slow machine, ASan) is one
        # forward too: taken / 3 leaves room for those, and none for one per push.
        assert 0 < sent and sent * 3 <= taken, (sent, taken)


def test_dropped_and_duplicated_buffer_forwards_lose_nothing_and_apply_nothing_twice():
    env = {"PSHARD_FAULT": "drop:type=forward-agg:every=5:dir=out:node=server;dup:type=forward-agg:every=3:node=server",
           "PSHARD_RETRY_MS": "150"}
    with Cluster(3, 2, replicas=2, extra_env=env) as c:
        ps = start_workers(c, 2, 40, 0, AGG)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        counted(c, 2, 40)
        logs = "".join(c.log(f"server{i}") for i in range(3))
        assert "dropped sent forward-agg frame" in logs and "duplicated received forward-agg frame" in logs, logs[-3000:]


@pytest.mark.parametrize("servers,want", [(1, 1), (2, 2), (3, 2)])
def test_the_scheduler_keeps_two_copies_by_default_from_two_servers_on(servers, want):
    # (The test environment sets no PSHARD_REPLICAS.)
    with Cluster(servers, 1, replicas=None) as c:
        ps = start_workers(c, 1, 5, 0)
        assert c.wait(ps, RUN) == [0], c.log("w0")
        assert [server_stat(c, i, "replicas") for i in range(servers)] == [want] * servers
