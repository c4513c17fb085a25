"""Repair with real processes (cluster.Cluster: own process groups, ephemeral ports,
SIGKILLed at the end): a replacement started with `pshard server --join` takes a dead
server's id, copies its chains' rows from their tails while the job runs, and holds
real copies from then on.

Driven by once_worker (a counter table: async, sum mode, sgd lr 1, every push adds 1 to
every key), so each key's value after the run is the number of pushes applied, to
compare with the pushes the workers saw acknowledged.

1. S = 3, R = 2: a server SIGKILLed mid-run, a replacement joins and syncs, then one of
   the two original survivors is SIGKILLed: the job finishes and every count is exact,
   so the replacement held real copies (some chains have no other member left); its
   STATS show its rows. The same with a table that aggregates pushes.
2. S = 4, R = 3: a server SIGKILLed, a replacement joins, and a server streaming rows to
   it is SIGKILLed while its copy is in flight (each copy frame the replacement receives
   is held 1.5 s by fault injection): the replacement takes those chains from their new
   tails, syncs, and is the only copy left of some chains after a third death; every
   count is exact.
3. S = R = 3: the scheduler SIGKILLed while it writes the state that says a replacement
   holds its copies (slow state writes by fault injection) and started again from its
   state: no member had heard of it, the replacement says so again, and every count is
   exact on the replacement alone.
4. S = 3, R = 2: a worker declares its table only after a server died: it is created on
   the live servers, the replacement takes it from them, and after a second death every
   count is exact.
5. --join when no server is dead, or in a job without replicas: a clear refusal.
Every wait is bounded; under ASan (PSHARD_SANITIZED=1) time limits are scaled.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from cluster import Cluster, binary
from test_once import RUN, SCALE
from test_repl import AGG, counted, outcome, start_workers
from test_once import server_port


def stats(addr):
    """`pshard stats HOST:PORT`: a node's counters as text."""
    r = subprocess.run([binary("pshard"), "stats", addr], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    return r.stdout


def sched_nodes(c):
    """{node id: {field: value}} from the scheduler's STATS."""
    out = {}
    for m in re.finditer(r"^node (\d+) (.*)$", stats(c.addr), re.M):
        out[int(m.group(1))] = dict(kv.split("=", 1) for kv in m.group(2).split())
    return out


def wait_for(cond, what, timeout, logs):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"{what} within {timeout}s\n" + logs()
        time.sleep(0.05)


def join(c, name="joiner", env=None):
    e = dict(c.env)
    e.update(env or {})
    return c._spawn([binary("pshard"), "server", "--scheduler", c.addr, "--join", "--verbose"], name, e)


def kill_one(c, ps, victim, n, logs, pause, dead_after=1):
    """SIGKILL server index victim (kill number n) after `pause` s, while the workers ps
    still run; wait until the scheduler lists exactly dead_after dead servers; the
    lowest id among them."""
    time.sleep(pause)  # not scaled: the workers must still be running
    assert all(p.poll() is None for p in ps), "the workers finished before kill %d: " % n + logs()
    os.killpg(c.server_procs[victim].pid, signal.SIGKILL)
    dead = []

    def removed():
        dead[:] = [i for i, f in sched_nodes(c).items() if f["role"] == "server" and f["alive"] == "0"]
        return len(dead) == dead_after
    wait_for(removed, "the scheduler removes the dead server", 10 * SCALE, logs)
    return min(dead)


def wait_synced(c, node, what, timeout, logs, late=False):
    """Wait until the scheduler lists replacement `node` alive and done copying (and, with
    late, as a replacement)."""
    def synced():
        f = sched_nodes(c).get(node, {})
        return f.get("alive") == "1" and f.get("syncing") == "0" and (not late or f.get("late") == "1")
    wait_for(synced, what, timeout, logs)


def stat_of(addr, name):
    m = re.search(rf"^{name} (\d+)$", stats(addr), re.M)
    assert m, name
    return int(m.group(1))


# The third case loses the first aggregated buffer forwarded to the replacement while it
# copies (its pushes reach it again, each on its own, when their workers send them
# again): the pushes of that buffer were not in the cut's rows, so the windows the
# replacement takes must not count them as applied.
LOST_AGG = {"PSHARD_FAULT": ",".join([f"drop:type=forward-agg:n={i}" for i in (1, 2, 3, 4)] + ["delay=400ms:type=sync-rows:n=1+"])}


@pytest.mark.parametrize("extra,joiner_env", [([], None), (AGG, None), (AGG, LOST_AGG)],
                         ids=["each-push", "aggregated", "aggregated-forward-lost"])
def test_a_replacement_syncs_and_holds_real_copies(extra, joiner_env):
    pushes = 400
    with Cluster(3, 2, replicas=2, extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        # (pushes without aggregation pause longer: the workers must outlast the copy)
        ps = start_workers(c, 2, pushes, 10 if extra else 25, extra)
        c.wait_started()
        time.sleep(0.4)  # not scaled: the workers must still be pushing
        assert all(p.poll() is None for p in ps), "the workers finished before the kill"
        victim = c.server_procs[1]
        os.killpg(victim.pid, signal.SIGKILL)
        wait_for(lambda: "removed" in c.log("scheduler"), "the scheduler removes the dead server", 10 * SCALE, logs)
        dead = [n for n, f in sched_nodes(c).items() if f["role"] == "server" and f["alive"] == "0"]
        assert len(dead) == 1, sched_nodes(c)
        x = join(c, env=joiner_env)

        wait_synced(c, dead[0], "the replacement copies its rows", 20 * SCALE, logs, late=True)
        assert all(p.poll() is None for p in ps), "the workers finished before the second kill: " + logs()
        assert "copied" in c.log("joiner"), c.log("joiner")
        # One of the two original survivors dies: the chains it shared with the dead
        # server now have the replacement as their only copy.
        os.killpg(c.server_procs[0].pid, signal.SIGKILL)
        assert c.wait(ps, RUN) == [0, 0], logs()
        if joiner_env:
            assert "fault: dropped received forward-agg" in c.log("joiner"), c.log("joiner")
        counted(c, 2, pushes)
        addr = sched_nodes(c)[dead[0]]["addr"]
        assert stat_of(addr, "rows") > 0
        assert stat_of(addr, "repair_rows_in") > 0
        assert stat_of(addr, "syncing") == 0
        # It headed the chains it was left alone in: the workers' pushes came to it.
        m = re.search(r"^table \d+ name=count .* pushes=(\d+) ", stats(addr), re.M)
        assert m and int(m.group(1)) > 0, stats(addr)
        assert x.poll() is None, c.log("joiner")


def test_a_source_dying_mid_copy_restarts_the_copy_from_the_new_tails():
    pushes = 1200
    slow = {"PSHARD_FAULT": "delay=1500ms:type=sync-rows:n=1+"}
    with Cluster(4, 2, replicas=3, extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        ps = start_workers(c, 2, pushes, 10)
        c.wait_started()
        time.sleep(0.4)  # not scaled: the workers must still be pushing
        assert all(p.poll() is None for p in ps), "the workers finished before the kill"
        os.killpg(c.server_procs[1].pid, signal.SIGKILL)
        wait_for(lambda: "removed" in c.log("scheduler"), "the scheduler removes the dead server", 10 * SCALE, logs)
        dead = [n for n, f in sched_nodes(c).items() if f["role"] == "server" and f["alive"] == "0"]
        assert len(dead) == 1, sched_nodes(c)
        x = join(c, env=slow)
        # Every source streams rows to the replacement, whose first frame of each is held
        # there 1.5 s: one of them dies meanwhile.
        wait_for(lambda: "delayed received sync-rows" in c.log("joiner"), "the copies start", 10 * SCALE, logs)
        time.sleep(0.3)
        assert "copied" not in c.log("joiner"), c.log("joiner")
        os.killpg(c.server_procs[2].pid, signal.SIGKILL)

        wait_synced(c, dead[0], "the replacement copies its rows again", 40 * SCALE, logs)
        j = c.log("joiner")
        assert "before its rows were copied here" in j, j
        assert "copying again from" in j, j
        assert x.poll() is None, j
        addr = sched_nodes(c)[dead[0]]["addr"]
        assert stat_of(addr, "repair_restarts") >= 1
        assert all(p.poll() is None for p in ps), "the workers finished before the third kill: " + logs()
        # A third death: some chains (those of servers 1, 2 and 0) have only the replacement left.
        os.killpg(c.server_procs[0].pid, signal.SIGKILL)
        assert c.wait(ps, 2 * RUN) == [0, 0], logs()
        counted(c, 2, pushes)
        assert x.poll() is None, c.log("joiner")


# Buffers that fill by time: a worker's push waits in one until it is applied, so a
# head nearly always holds one when a membership comes.
SLOW_AGG = ["--opts", "agg_n=64 agg_ms=100"]


@pytest.mark.parametrize("extra,pushes,sleep_ms", [([], 500, 25), (SLOW_AGG, 120, 0)], ids=["each-push", "aggregated"])
def test_two_replacements_in_turn_where_the_later_one_comes_to_head_a_chain(extra, pushes, sleep_ms):
    # Servers 0 and then 2 die, each replaced: the chains both were in now hold two
    # replacements, the second first in ring order. When it is done copying, the first
    # keeps the head (the head rule orders replacements by admission) and the buffers
    # pending at that membership are applied down the chains: every count is exact.
    with Cluster(3, 2, replicas=2, extra_env={"PSHARD_RETRY_MS": "300"}) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        ps = start_workers(c, 2, pushes, sleep_ms, extra)
        for n, victim in enumerate((0, 2)):
            dead = kill_one(c, ps, victim, n, logs, 0.5)
            join(c, name=f"joiner{n}")

            wait_synced(c, dead, "the replacement copies its rows", 20 * SCALE, logs, late=True)
        assert all(p.poll() is None for p in ps), "the workers finished before the second copy was in: " + logs()
        assert c.wait(ps, RUN) == [0, 0], logs()
        counted(c, 2, pushes)


# Every 25th forward a server sends is lost: the push waits, applied on the head, for
# its worker to send it again.
DROPPED = "drop:type=forward:dir=out:every=25:node=server"


@pytest.mark.parametrize("extra,pushes,sleep_ms,fault", [([], 300, 10, DROPPED), (SLOW_AGG, 150, 0, "")],
                         ids=["forwards-dropped", "aggregated"])
def test_r3_replacement_left_alone_holds_every_acknowledged_push(extra, pushes, sleep_ms, fault):
    # S = R = 3: a server dies and a replacement copies every chain from the two left,
    # each the tail of some chains and the head of others. A push a head has applied
    # and its chain's tail not yet when the copy is cut (a buffer flushed at that
    # membership and refused at its epoch, then sent again; a forward on its way) must
    # reach the replacement through that tail: the head's windows of those chains do
    # not go with its copy. Then both survivors die, the replacement is every chain's
    # only copy, and every count is exact.
    env = {"PSHARD_RETRY_MS": "200"}
    if fault:
        env["PSHARD_FAULT"] = fault
    with Cluster(3, 2, replicas=3, extra_env=env) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        ps = start_workers(c, 2, pushes, sleep_ms, extra)
        dead = kill_one(c, ps, 1, 0, logs, 0.5)
        x = join(c)

        wait_synced(c, dead, "the replacement copies its rows", 20 * SCALE, logs)
        assert "copied" in c.log("joiner"), c.log("joiner")
        for n, victim in enumerate((0, 2)):
            kill_one(c, ps, victim, n + 1, logs, 0.3, dead_after=n + 1)
        assert c.wait(ps, RUN) == [0, 0], logs()
        counted(c, 2, pushes)
        assert x.poll() is None, c.log("joiner")


def test_a_scheduler_killed_while_it_saves_a_finished_copy_loses_no_push():
    # The scheduler keeps each change in its state before any node hears of it. Here it
    # is SIGKILLed while it writes the state that says the replacement holds its copies
    # (each state write waits 400 ms: slowdisk), and comes back from the state before,
    # with the replacement still copying, which is what every node still believes. Had
    # the members been told first, they would have taken the replacement as holding its
    # copies, the restarted scheduler would have set it copying again, and the pushes of
    # that window would never have reached it. Then both survivors die: every count is
    # exact on the replacement alone.
    env = {"PSHARD_RETRY_MS": "200", "PSHARD_FAULT": "slowdisk=400ms:n=1+:node=scheduler"}
    pushes = 700
    with Cluster(3, 2, replicas=3, extra_env=env, sched_state=True, verbose=True) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        ps = start_workers(c, 2, pushes, 10)
        wait_for(lambda: "job started" in c.log("scheduler"), "the job starts", 20 * SCALE, logs)
        dead = kill_one(c, ps, 1, 0, logs, 1.5)  # past the declaration (each state write is slow)
        x = join(c)
        wait_for(lambda: "has copied its rows" in c.log("scheduler"), "the replacement copies its rows",
                 20 * SCALE, logs)
        c.restart_scheduler()

        wait_synced(c, dead, "the replacement holds its copies again", 30 * SCALE, logs)
        for n, victim in enumerate((0, 2)):
            kill_one(c, ps, victim, n + 1, logs, 0.3, dead_after=n + 1)
        assert c.wait(ps, RUN) == [0, 0], logs()
        counted(c, 2, pushes)
        assert x.poll() is None, c.log("joiner")


def test_a_table_declared_after_a_death_is_created_on_the_live_servers_and_the_replacement():
    # A worker declares its table (the same one) only after a server died: under
    # replicas it is created on the live servers, not refused for the dead one; the
    # replacement takes it from the servers it copies from, and after a second death
    # every count is exact.
    pushes, late = 800, 400
    with Cluster(3, 2, replicas=2, extra_env={"PSHARD_RETRY_MS": "200"}) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        go = os.path.join(c.dir, "go")
        ps = [c.worker([binary("once_worker"), "--mode", "async", "--pushes", str(pushes), "--keys", "8",
                        "--sleep-ms", "10"], "w0"),
              c.worker([binary("once_worker"), "--mode", "async", "--pushes", str(late), "--keys", "8",
                        "--sleep-ms", "10", "--start-file", go], "w1")]
        dead = kill_one(c, ps, 1, 0, logs, 0.5)
        open(go, "w").close()
        x = join(c)

        wait_synced(c, dead, "the replacement copies its rows", 20 * SCALE, logs)
        kill_one(c, ps, 0, 1, logs, 0.3, dead_after=1)
        assert c.wait(ps, RUN) == [0, 0], logs()
        for i, n in enumerate((pushes, late)):
            acked, vals, failed = outcome(c.log(f"w{i}"))
            assert failed == [] and acked == n and vals == [float(pushes + late)] * 8, logs()
        assert x.poll() is None, c.log("joiner")


def test_join_without_a_dead_server_is_refused():
    with Cluster(3, 1, replicas=2) as c:
        w = start_workers(c, 1, 5, 0)
        assert c.wait(w, RUN) == [0], c.log("w0")
        x = join(c)
        assert x.wait(timeout=20 * SCALE) == 1
        assert "no server of the job is dead" in c.log("joiner"), c.log("joiner")


def test_join_without_replicas_is_refused():
    with Cluster(2, 1, replicas=1) as c:
        w = start_workers(c, 1, 5, 0)
        assert c.wait(w, RUN) == [0], c.log("w0")
        os.killpg(c.server_procs[1].pid, signal.SIGKILL)
        x = join(c)
        assert x.wait(timeout=20 * SCALE) == 1
        assert "replicas 1" in c.log("joiner"), c.log("joiner")


def alive_ranks(c, role):
    return sorted(int(n["rank"]) for n in sched_nodes(c).values() if n["role"] == role and n["alive"] == "1")


@pytest.mark.parametrize("how", ["plain", "join"])
def test_a_server_dead_before_the_start_leaves_its_rank_to_a_new_one(how):
    # A server registers, then dies before the job starts (the workers are not there
    # yet). It held nothing, so a new server, started as a first one or with --join,
    # takes its rank, and the job starts and counts every push, with two copies.
    with Cluster(3, 2, replicas=2, extra_env={"PSHARD_RETRY_MS": "300"}, verbose=True) as c:
        logs = lambda: c.log("scheduler") + c.log("joiner")  # noqa: E731
        wait_for(lambda: alive_ranks(c, "server") == [0, 1, 2], "three servers registered", 10 * SCALE, logs)
        os.killpg(c.server_procs[1].pid, signal.SIGKILL)
        wait_for(lambda: len(alive_ranks(c, "server")) == 2, "the dead server removed", 10 * SCALE, logs)
        rank = ({0, 1, 2} - set(alive_ranks(c, "server"))).pop()  # the order they registered in decides
        if how == "join":
            x = join(c)
        else:
            x = c._spawn([binary("pshard"), "server", "--scheduler", c.addr], "joiner")
        wait_for(lambda: alive_ranks(c, "server") == [0, 1, 2], "a new server in the dead one's rank", 10 * SCALE, logs)
        assert re.search(rf"server \d+ died before the job started: a new one takes its rank {rank}", logs()), logs()
        ps = start_workers(c, 2, 40, 0)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1") + logs()
        counted(c, 2, 40)
        assert x.poll() is None, c.log("joiner")
        assert "job started" in c.log("scheduler")


def test_a_worker_dead_before_the_start_leaves_its_rank_to_a_new_one():
    # The first worker dies while it waits for the second: the next one to register takes
    # rank 0 again, so the job's ranks are 0 and 1 (not 1 and 2), and both finish.
    with Cluster(2, 2, verbose=True) as c:
        logs = lambda: c.log("scheduler")  # noqa: E731
        early = start_workers(c, 1, 20, 0)[0]
        wait_for(lambda: alive_ranks(c, "worker") == [0], "the first worker registered", 10 * SCALE, logs)
        os.killpg(early.pid, signal.SIGKILL)
        wait_for(lambda: alive_ranks(c, "worker") == [], "the worker removed", 10 * SCALE, logs)
        ps = start_workers(c, 2, 20, 0)
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1") + logs()
        counted(c, 2, 20)
        assert re.search(r"worker \d+ died before the job started: a new one takes its rank 0", logs()), logs()
        ranks = sorted(int(n["rank"]) for n in sched_nodes(c).values() if n["role"] == "worker")
        assert ranks == [0, 1], sched_nodes(c)


def test_rounds_refused_at_another_epoch_reach_every_copy():
    # Servers hear of memberships at different times (each second one a server receives
    # waits 300 ms) and the scheduler is restarted twice mid-run, so the epoch changes
    # again and again while sync rounds flow: members refuse rounds sent at another epoch
    # (STATS forwards_refused), and their heads send them again. Two servers then die in
    # turn: every count is exact on the last one, so no copy missed a round.
    env = {"PSHARD_RETRY_MS": "200", "PSHARD_FAULT": "delay=300ms:type=membership:every=2:node=server"}
    pushes = 500
    with Cluster(3, 2, replicas=3, extra_env=env, sched_state=True, verbose=True) as c:
        def logs():
            return "".join(f"--- {p.name}\n{c.log(p.name)[-3000:]}" for p in c.procs)
        ps = start_workers(c, 2, pushes, 4, ["--mode", "sync", "--dense"])
        wait_for(lambda: "job started" in c.log("scheduler"), "the job starts", 20 * SCALE, logs)
        for _ in range(2):
            time.sleep(0.4)
            assert all(p.poll() is None for p in ps), "the workers finished before the restarts"
            c.restart_scheduler()
        wait_for(lambda: c.log(c.sched_log).count("came back") >= 5, "every node back", 30 * SCALE, logs)
        assert sum(stat_of(f"127.0.0.1:{server_port(c, i)}", "forwards_refused") for i in range(3)) > 0
        for n, victim in enumerate((0, 2)):
            kill_one(c, ps, victim, n + 1, logs, 0.3, dead_after=n + 1)
        assert c.wait(ps, RUN) == [0, 0], logs()
        counted(c, 2, pushes)
