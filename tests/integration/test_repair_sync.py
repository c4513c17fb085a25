"""Repair of sync tables with real processes (cluster.Cluster: own process groups,
ephemeral ports, SIGKILLed at the end), driven by repl_sync_worker: a sync job (Adam on a
dense table, Adagrad on a sparse one, gradients that depend on the values pulled) whose
final model, printed in hex, shows any difference bit for bit.

S = 3, R = 2: a server SIGKILLed mid-run, a replacement joins (`pshard server --join`)
and copies its rows, with the rounds each chain holds, from the chains' tails; once it
is synced (and the survivors' catch-ups of the first death are over: STATS
`catchups_running 0`), one of the two original survivors is SIGKILLed, so the replacement is the
only copy of some chains and their head: it catches up the rounds the dead head had not
handed on, and the final model is the no-fault model bit for bit.
Every wait is bounded; under ASan (PSHARD_SANITIZED=1) time limits are scaled.
"""
import os
import re
import signal
import time

import pytest

from cluster import Cluster, binary
from test_once import RUN, SCALE, server_stat
from test_repair import join, kill_one, sched_nodes, stat_of, wait_for

ROUNDS = 150


def workers_model(c, ps, timeout, logs):
    """The model lines both workers printed once they exit (the same, or it fails)."""
    assert c.wait(ps, timeout) == [0, 0], logs()
    models = []
    for i in range(2):
        log = c.log(f"w{i}")
        assert not re.findall(r"^fail .*$", log, re.M), log
        models.append(re.findall(r"^model .*$", log, re.M))
        assert len(models[-1]) == 2, log
    assert models[0] == models[1], "the workers pulled different models"
    return models[0]


def run(replicas, first=None, second=None):
    """The model lines of a job; with R = 2, server index `first` is killed, a
    replacement joins and syncs, then server index `second` is killed."""
    hbt = int(1000 * SCALE)
    with Cluster(3, 2, replicas=replicas, heartbeat_timeout_ms=hbt, extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        ps = [c.worker([binary("repl_sync_worker"), "--rounds", str(ROUNDS), "--sleep-ms", "20"], f"w{i}")
              for i in range(2)]
        x = None
        if first is not None:
            c.wait_started()
            time.sleep(0.5)  # not scaled: the workers must still be training
            assert all(p.poll() is None for p in ps), "the workers finished before the fault"
            os.killpg(c.server_procs[first].pid, signal.SIGKILL)
            wait_for(lambda: "removed" in c.log("scheduler"), "the scheduler removes the dead server", 10 * SCALE, logs)
            dead = [n for n, f in sched_nodes(c).items() if f["role"] == "server" and f["alive"] == "0"]
            assert len(dead) == 1, sched_nodes(c)
            # The survivors' catch-ups of the first death end first: a second death while
            # one runs ends it with what came (docs/design.md, section 8c, limits).
            alive = [i for i in range(3) if i != first]

            def caught_up():
                return all(server_stat(c, i, "catchups_running") == 0 for i in alive)
            wait_for(caught_up, "the survivors catch up", 20 * SCALE, logs)
            x = join(c)

            def synced():
                f = sched_nodes(c).get(dead[0], {})
                return f.get("alive") == "1" and f.get("syncing") == "0"
            wait_for(synced, "the replacement copies its rows", 20 * SCALE, logs)
            wait_for(caught_up, "the survivors catch up", 20 * SCALE, logs)
            assert all(p.poll() is None for p in ps), "the workers finished before the second kill: " + logs()
            os.killpg(c.server_procs[second].pid, signal.SIGKILL)
        model = workers_model(c, ps, RUN, logs)
        if x is not None:
            assert x.poll() is None, c.log("joiner")
            addr = sched_nodes(c)[dead[0]]["addr"]
            assert stat_of(addr, "repair_rows_in") > 0
            # It took over chains of both tables from the second server killed.
            assert stat_of(addr, "catchups") >= 1, c.log("joiner")
        return model


@pytest.fixture(scope="module")
def reference():
    return run(1)


def run_two_replacements(rounds, victims, restart=False):
    """The model lines of a job with R = 2 in which servers victims[0] and then
    victims[1] are SIGKILLed, each replaced, the second kill once the first replacement
    holds its copy (and, with restart, once the scheduler was SIGKILLed and started
    again from its state); with no victims, the no-fault job (R = 1)."""
    hbt = int(1000 * SCALE)
    with Cluster(3, 2, replicas=2 if victims else 1, heartbeat_timeout_ms=hbt, sched_state=restart,
                 extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        ps = [c.worker([binary("repl_sync_worker"), "--rounds", str(rounds), "--sleep-ms", "20"], f"w{i}")
              for i in range(2)]
        joined = []
        for n, victim in enumerate(victims):
            dead = kill_one(c, ps, victim, n, logs, 0.7)
            alive = [i for i, f in sched_nodes(c).items() if f["role"] == "server" and f["alive"] == "1"]

            def caught_up():
                return all(stat_of(sched_nodes(c)[i]["addr"], "catchups_running") == 0 for i in alive)
            wait_for(caught_up, "the survivors catch up", 20 * SCALE, logs)
            join(c, name=f"joiner{n}")

            def synced():
                f = sched_nodes(c).get(dead, {})
                return f.get("alive") == "1" and f.get("syncing") == "0"
            wait_for(synced, "the replacement copies its rows", 30 * SCALE, logs)
            joined.append(sched_nodes(c)[dead]["addr"])
            check_admission = sched_nodes(c)[dead].get("admission")
            assert check_admission == str(n + 1), sched_nodes(c)
            if restart and n == 0:
                c.restart_scheduler()

                def back():  # every node taken back: three servers and two workers
                    return len(re.findall(r"^info: (?:server|worker) \d+ .*came back", c.log(c.sched_log), re.M)) == 5
                wait_for(back, "the scheduler takes its nodes back", 20 * SCALE, logs)
                assert sched_nodes(c)[dead].get("admission") == "1", sched_nodes(c)
        assert all(p.poll() is None for p in ps), "the workers finished before the second copy was in: " + logs()
        model = workers_model(c, ps, 2 * RUN, logs)
        if joined:
            # Nobody died after the second replacement joined: the chains the two
            # replacements hold keep the first as their head (the head rule orders
            # replacements by admission), so the second never takes a head over.
            assert stat_of(joined[1], "catchups") == 0, logs()
            assert "ends at its deadline" not in "".join(c.log(p.name) for p in c.procs), logs()
        return model


@pytest.fixture(scope="module")
def reference_long():
    return run_two_replacements(300, ())


@pytest.mark.parametrize("restart", [False, True], ids=["plain", "scheduler-restarted-between"])
def test_two_replacements_in_turn_of_sync_tables(reference_long, restart):
    # Servers 0 and then 2 die, each replaced: some chains are then held by the two
    # replacements only, the second of them first in ring order. The order of the
    # replacements survives a scheduler restart (its state file keeps it).
    assert run_two_replacements(300, (0, 2), restart) == reference_long


@pytest.mark.parametrize("first,second", [(1, 0), (0, 2)], ids=["kill-1-then-0", "kill-0-then-2"])
def test_a_replacement_holds_real_copies_of_sync_tables(reference, first, second):
    assert run(2, first, second) == reference
