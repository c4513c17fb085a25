"""Replicated sync rounds with real processes (cluster.Cluster: own process groups,
ephemeral ports, SIGKILLed at the end), driven by repl_sync_worker: a sync job (Adam on a
dense table, Adagrad on a sparse one, gradients that depend on the values pulled) whose
final model, printed in hex, shows any difference bit for bit.

1. The model under R = 2 is the model under R = 1 (replication changes no number).
2. S = 3, R = 2: any one server SIGKILLed mid-run, the job finishes and its model is
   the no-fault model bit for bit; the survivors caught up the rounds the dead head had
   not handed on.
3. A head stopped (SIGSTOP) past the heartbeat timeout and continued: the same.
4. Replica traffic is one combined update per round, about 1/K of the push traffic.
Every wait is bounded; under ASan (PSHARD_SANITIZED=1) time limits are scaled.
"""
import os
import re
import signal
import time

import pytest

from cluster import Cluster, binary
from test_once import RUN, SCALE, server_stat

ROUNDS = 40


def run(replicas, workers=2, kill=None, stop=None, sleep_ms=20):
    """The model lines of a job, after killing (or stopping) server index kill/stop."""
    hbt = int(1000 * SCALE)
    with Cluster(3, workers, replicas=replicas, heartbeat_timeout_ms=hbt, extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        ps = [c.worker([binary("repl_sync_worker"), "--rounds", str(ROUNDS), "--sleep-ms", str(sleep_ms)], f"w{i}")
              for i in range(workers)]
        victim = kill if kill is not None else stop
        if victim is not None:
            time.sleep(0.7)  # not scaled: the workers must still be training
            assert all(p.poll() is None for p in ps), "the workers finished before the fault"
            proc = c.server_procs[victim]
            if kill is not None:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    deadline = time.time() + 10 * SCALE
                    while "removed: missed heartbeats" not in c.log("scheduler"):
                        assert time.time() < deadline, c.log("scheduler")
                        time.sleep(0.05)
                    time.sleep(0.3)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
        logs = "".join(c.log(f"w{i}") for i in range(workers))
        assert c.wait(ps, RUN) == [0] * workers, logs + c.log("scheduler")
        models = []
        for i in range(workers):
            log = c.log(f"w{i}")
            assert not re.findall(r"^fail .*$", log, re.M), log
            models.append(re.findall(r"^model .*$", log, re.M))
            assert len(models[-1]) == 2, log
        assert all(m == models[0] for m in models), "the workers pulled different models"
        alive = [i for i in range(3) if i != victim]
        stats = {name: [server_stat(c, i, name) for i in alive] for name in ("catchups", "forwards", "forward_bytes")}
        return models[0], stats


@pytest.fixture(scope="module")
def reference():
    return run(1)[0]


def test_a_replicated_sync_model_is_the_unreplicated_one_bit_for_bit(reference):
    model, stats = run(2)
    assert model == reference
    assert sum(stats["forwards"]) > 0


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_server_killed_mid_run_leaves_the_sync_model_bit_for_bit_unchanged(reference, victim):
    model, stats = run(2, kill=victim)
    assert model == reference
    # The dead server headed chains of both tables: their next members took them over.
    assert sum(stats["catchups"]) >= 2, stats


def test_a_head_stopped_past_the_heartbeat_timeout_leaves_the_sync_model_unchanged(reference):
    model, stats = run(2, stop=1)
    assert model == reference
    assert sum(stats["catchups"]) >= 2, stats


def test_replica_traffic_is_one_update_per_round_not_one_per_push():
    # Each of K workers pushes the whole model every round (48 dense floats with their
    # segments, 40 sparse rows of 4 floats with their keys): the push traffic grows with
    # K, the replica traffic (a round's combined update, plus the frames' prefixes and
    # chain lists) does not.
    fwd = {}
    for workers in (2, 4):
        _, stats = run(2, workers=workers, sleep_ms=0)
        fwd[workers] = sum(stats["forward_bytes"])
    pushed4 = ROUNDS * 4 * (48 * 4 + 3 * 16 + 40 * (8 + 16))
    assert fwd[4] <= 1.05 * fwd[2], fwd
    assert fwd[4] < 0.5 * pushed4, (fwd, pushed4)
