"""Exactly-once pushes with real processes (cluster.Cluster: own process groups,
ephemeral ports, SIGKILLed at the end), driven by once_worker: counter tables (sum
mode, sgd, lr 1) where every push adds exactly 1 to every key, so after a barrier each
key's value is the number of pushes the servers applied, to compare with the number
the workers saw acknowledged.

1. Servers handed every 3rd push frame twice (fault injection): each push counts once.
2. Servers whose push replies are lost now and then: the worker sends the push again
   after retry_ms, the server answers the copy as applied, and each counts once.
3. A server stopped (SIGSTOP) for seconds while pushes are in flight, then continued:
   nothing lost, nothing applied twice.
Each in async and in sync mode. Every wait is bounded; under ASan (PSHARD_SANITIZED=1)
time limits are scaled.
"""
import os
import re
import signal
import time

import pytest

from cluster import Cluster, binary
from test_core import server_port, stats

SCALE = 3.0 if os.environ.get("PSHARD_SANITIZED") else 1.0
RUN = 60 * SCALE
KEYS = 8


def outcome(log):
    """(acked, values, failed push lines) from once_worker's output."""
    m = re.search(r"^acked (\d+)$", log, re.M)
    v = re.search(r"^values (\S+)$", log, re.M)
    assert m and v, log
    return int(m.group(1)), [float(x) for x in v.group(1).split(",")], re.findall(r"^(?:push|pull|clock) \d+ rc=.*$", log, re.M)


def server_stat(c, index, name):
    m = re.search(rf"^{name} (\d+)$", stats(server_port(c, index)), re.M)
    assert m, name
    return int(m.group(1))


def run_counting(c, mode, pushes, workers=2, extra=()):
    ps = [c.worker([binary("once_worker"), "--mode", mode, "--pushes", str(pushes), "--keys", str(KEYS)] + list(extra),
                   f"w{i}") for i in range(workers)]
    assert c.wait(ps, RUN) == [0] * workers, "\n".join(c.log(f"w{i}") for i in range(workers))
    total = 0
    values = None
    for i in range(workers):
        acked, vals, failed = outcome(c.log(f"w{i}"))
        assert failed == [], failed
        assert acked == pushes, c.log(f"w{i}")
        total += acked
        assert values is None or vals == values, (vals, values)  # every worker sees the same table
        values = vals
    # Exactly once: every key was raised by 1 per acknowledged push, no more, no less.
    assert values == [float(total)] * KEYS, (values, total)
    return total


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_duplicated_push_frames_are_applied_once(mode):
    env = {"PSHARD_FAULT": "dup:type=push:every=3:node=server"}
    with Cluster(2, 2, extra_env=env) as c:
        run_counting(c, mode, 30)
        dups = [server_stat(c, i, "duplicate_pushes") for i in range(2)]
        fired = [len([l for l in c.log(f"server{i}").splitlines() if "duplicated received push frame" in l])
                 for i in range(2)]
        # Each push reaches both servers (one part each), so each server got 60 pushes
        # and handed every third of them twice; every copy was told apart.
        assert fired == [20, 20], fired
        assert dups == fired, (dups, fired)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_lost_push_replies_are_sent_again_and_applied_once(mode):
    env = {"PSHARD_FAULT": "drop:type=push-reply:n=2:every=5:dir=out:node=server", "PSHARD_RETRY_MS": "150"}
    with Cluster(2, 2, extra_env=env) as c:
        t0 = time.time()
        run_counting(c, mode, 20)
        dropped = [len([l for l in c.log(f"server{i}").splitlines() if "dropped sent push-reply frame" in l])
                   for i in range(2)]
        dups = [server_stat(c, i, "duplicate_pushes") for i in range(2)]
        # 40 pushes per server; replies 2, 7, 12, ... are dropped, replies to the copies
        # too when their number comes up, so at least 8 per server, and a copy of each
        # push whose reply was lost came back as a duplicate.
        assert all(d >= 8 for d in dropped), dropped
        assert all(d >= x for d, x in zip(dups, dropped)), (dups, dropped)
        assert time.time() - t0 < RUN


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_server_stopped_with_pushes_in_flight_loses_nothing_and_applies_nothing_twice(mode):
    env = {"PSHARD_RETRY_MS": "200"}
    # The scheduler must not declare the stopped server dead meanwhile.
    with Cluster(2, 2, heartbeat_timeout_ms=int(20000 * SCALE), extra_env=env) as c:
        ps = [c.worker([binary("once_worker"), "--mode", mode, "--pushes", "100", "--keys", str(KEYS), "--sleep-ms",
                        "25"], f"w{i}") for i in range(2)]
        c.wait_started()
        time.sleep(0.3)  # not scaled: the workers must still be pushing
        victim = c.server_procs[0]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            time.sleep(2.5)
            assert all(p.poll() is None for p in ps), "a worker finished while a server was stopped"
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        total = 0
        values = None
        for i in range(2):
            acked, vals, failed = outcome(c.log(f"w{i}"))
            assert failed == [] and acked == 100, c.log(f"w{i}")
            total += acked
            values = vals
        assert values == [float(total)] * KEYS, (values, total)
        # The pushes held up were sent again, and the stopped server told the copies apart.
        assert server_stat(c, 0, "duplicate_pushes") > 0
        assert server_stat(c, 1, "refused_pushes") == 0
