"""Soak run of the failure paths: jobs with real processes on loopback, each with
faults drawn at random from a seed, checked for lost or doubled updates. Not part of
`make test` (it runs for minutes): `make soak` (SOAK_MINUTES, default 10), or

    /usr/bin/python3 tests/soak/soak.py --minutes 30 [--seed N] [--only counter|sync|sync-repair]

Every job is one of three kinds, drawn from the seed with its faults:

counter  S = 3, R = 2 or 3, two or three once_worker processes (async, or sync; sum mode, sgd
         lr 1: every push adds exactly 1 to every key) on a sparse, a dense or a large dense
         table (pushes by peer memory), each push alone or aggregated on the servers
         (agg_n, agg_ms). Faults, at random times while the workers push: a server
         SIGKILLed (with R = 3, now and then two at once), then a replacement (`pshard
         server --join`) for each, in turn, that must copy its rows;
         a server SIGSTOPped for a random time, shorter or longer than the heartbeat
         timeout (a longer stop fences it: it exits and is replaced too); the scheduler
         SIGKILLed and started again from its state (--state-dir, same port); chain
         frames dropped, duplicated or delayed by fault injection. Checked: every push is
         acknowledged, every key's value is the number of acknowledged pushes (nothing
         lost, nothing applied twice), and at the end every server slot is alive and
         done copying (every range has its two copies again). In async jobs a reader
         worker then pulls once R - 1 servers were killed: the copies left (tails and
         middles of some chains) hold the same counts.
sync     S = 3, R = 2 or 3, two repl_sync_worker processes (Adam on a dense table, Adagrad on a
         sparse one, gradients that depend on the values pulled), with or without a
         large dense table. One server SIGKILLed, or SIGSTOPped past the heartbeat
         timeout and continued, at a random round. Checked: the final model is the
         no-fault model of the same configuration, bit for bit, and no catch-up of a
         dead head's rounds ended at its deadline (without pushes it waited for).
sync-repair  the same sync job (R = 2 or 3), longer: two servers SIGKILLed in turn, each replaced
         (the survivors' catch-ups and the replacement's copy done before the next), so
         that some chains are held by two replacements only; half of the jobs also
         restart the scheduler between the two. Checked: the same.

Each job prints one line: its number, seed, kind, faults and outcome. A failed job keeps
its directory of logs (its path is printed) and the run goes on; the exit status is 1 if
any job failed. `--seed N` replays one job exactly as far as the seed decides (timings
of the machine still vary). Every wait is bounded; every process is killed at the end.
"""
import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import cluster  # noqa: E402
from cluster import Cluster, binary  # noqa: E402

HBT_MS = 1000
RUN_S = 240
KEYS = 8
SYNC_ROUNDS = 100
SYNC_REPAIR_ROUNDS = 400  # long enough for two deaths, each with a copy to a replacement
BIG_FLOATS = 3 * 32768
EVENTS = []  # --events
REPLICAS = [0]  # --replicas (0: drawn)


class Failed(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failed(what)


def stats(addr):
    r = subprocess.run([binary("pshard"), "stats", addr], capture_output=True, text=True, timeout=20)
    check(r.returncode == 0, f"pshard stats {addr}: {r.stderr}")
    return r.stdout


def sched_servers(c):
    """{node id: fields} of the scheduler's server nodes."""
    out = {}
    for m in re.finditer(r"^node (\d+) (.*)$", stats(c.addr), re.M):
        f = dict(kv.split("=", 1) for kv in m.group(2).split())
        if f.get("role") == "server":
            out[int(m.group(1))] = f
    return out


def wait_for(cond, what, timeout):
    deadline = time.time() + timeout
    while not cond():
        check(time.time() < deadline, f"{what} within {timeout:.0f} s")
        time.sleep(0.05)


def restart_scheduler(c, ps, servers=3):
    """SIGKILL the scheduler, start it again from its state, and wait until it has taken
    back `servers` servers (those alive) and every worker of ps still running."""
    c.restart_scheduler()

    def back():  # (a worker that finished meanwhile need not come back)
        came = re.findall(r"^info: (server|worker) \d+ .*came back", c.log(c.sched_log), re.M)
        return came.count("server") == servers and came.count("worker") >= sum(p.poll() is None for p in ps)
    wait_for(back, "the restarted scheduler takes its nodes back", 20)


def no_deadline_catchup(c):
    """No catch-up ended at its deadline: in these jobs every list a catch-up waits for
    comes (an end at the deadline rebuilds a round without pushes it did not get)."""
    for p in c.procs:
        line = re.search(r"^.*ends at its deadline.*$", c.log(p.name), re.M)
        check(not line, f"{p.name}: {line.group(0) if line else ''}")


def join(c, n):
    return c._spawn([binary("pshard"), "server", "--scheduler", c.addr, "--join", "--verbose"], f"joiner{n}", c.env)


def running(ps):
    return all(p.poll() is None for p in ps)


# ------------------------------------------------------------------ counter jobs

def fault_env(rng, agg, mode):
    """Fault injection on the chain frames a job sends (pushes' forwards; buffers' and the
    pushes sent again on their own; sync rounds'), or none."""
    rules = []
    if rng.random() < 0.5:
        if mode == "sync":
            t = "forward-round"
        else:
            t = rng.choice(["forward-agg", "forward-agg", "forward"]) if agg else "forward"
        # (a round's frame is not dropped: on a stream it is lost only with its
        # connection, and the head sends it again then)
        if rng.random() < 0.5 and mode != "sync":
            rules.append(f"drop:type={t}:every={rng.randint(9, 21)}:dir=out:node=server")
        if rng.random() < 0.5:
            rules.append(f"dup:type={t}:every={rng.randint(3, 11)}:node=server")
        if rng.random() < 0.3:
            rules.append(f"delay={rng.randint(20, 300)}ms:type={t}:every={rng.randint(7, 17)}:node=server")
    return ";".join(rules)


def counter_job(rng, log):
    mode = rng.choice(["async", "async", "async", "sync"])
    table = rng.choice(["sparse", "dense", "big"])
    agg = mode == "async" and table != "big" and rng.random() < 0.5
    workers = rng.choice([2, 3])
    pushes = rng.randint(400, 700) if mode == "async" else rng.randint(200, 350)
    sleep_ms = rng.randint(15, 30)
    faults = fault_env(rng, agg, mode)
    args = ["--mode", mode, "--pushes", str(pushes), "--sleep-ms", str(sleep_ms)]
    if table == "sparse":
        args += ["--keys", str(KEYS)]
    elif table == "dense":
        args += ["--dense", "--keys", str(KEYS)]
    else:
        args += ["--dense", "--floats", str(BIG_FLOATS)]
    if agg:
        args += ["--opts", "agg_n=4 agg_ms=25"]
    # A push whose forward was dropped waits for its worker's retry: a short one, so
    # that the jobs with drops still end in a few tens of seconds.
    env = {"PSHARD_RETRY_MS": "150" if "drop" in faults else "300"}
    if faults:
        env["PSHARD_FAULT"] = faults
    # Events while the workers push: each a kill or a stop of a random live server (with
    # R = 3 also two servers killed at once).
    replicas = rng.choice([2, 2, 3])
    kinds = ["kill", "kill", "stop-short", "stop-long", "sched-restart"] + (["kill2"] if replicas == 3 else [])
    events = [rng.choice(kinds) for _ in range(rng.randint(1, 3))]
    if EVENTS:  # --events: these instead (the other draws stay those of the seed)
        events = EVENTS
    if REPLICAS[0]:  # --replicas: this R instead
        replicas = REPLICAS[0]
    if replicas == 3 and "drop" in faults and "delay" in faults:
        # (each push's parts cross two hops with frames dropped and delayed: half as many
        # pushes keep such a job within a few minutes)
        pushes //= 2
        args[args.index("--pushes") + 1] = str(pushes)
    log(f"counter R={replicas} mode={mode} table={table} agg={int(agg)} workers={workers} pushes={pushes} "
        f"sleep={sleep_ms}ms faults='{faults}' events={','.join(events)}")
    # Async jobs also start a reader: a worker that pushes nothing and pulls only at the
    # end, after R - 1 servers were killed, so that it reads copies other than the heads
    # the pushing workers read.
    readers = 1 if mode == "async" else 0
    with Cluster(3, workers + readers, replicas=replicas, heartbeat_timeout_ms=HBT_MS, extra_env=env,
                 sched_state=True) as c:
        ps = [c.worker([binary("once_worker")] + args, f"w{i}") for i in range(workers)]
        go = os.path.join(c.dir, "reader-go")
        rd = [c.worker([binary("once_worker")] + [a if args[k - 1] != "--pushes" else "0" for k, a in enumerate(args)] +
                       ["--wait-file", go], "reader") for _ in range(readers)]
        slots = list(c.server_procs)  # the live process of each server slot, by index
        joins = 0

        def dead():
            return [n for n, f in sched_servers(c).items() if f.get("alive") == "0"]
        for ev in events:
            time.sleep(rng.uniform(0.3, 1.5))
            if not running(ps):
                log(f"  (workers done before {ev})")
                break
            i = rng.randrange(3)
            victim = slots[i]
            if ev == "sched-restart":  # the scheduler SIGKILLed and started again from its state
                restart_scheduler(c, ps + rd)
                log("scheduler restarted")
                continue
            if ev == "stop-short":  # shorter than the heartbeat timeout: it stays
                os.kill(victim.pid, signal.SIGSTOP)
                time.sleep(rng.uniform(0.1, 0.7) * HBT_MS / 1000)
                os.kill(victim.pid, signal.SIGCONT)
                continue
            if ev in ("kill", "kill2"):
                victims = [i] if ev == "kill" else [i, (i + rng.randrange(1, 3)) % 3]
                for v in victims:
                    os.killpg(slots[v].pid, signal.SIGKILL)
                wait_for(lambda: len(dead()) == len(victims), "the scheduler removes the killed servers", 10)
            else:  # stopped past the heartbeat timeout: removed, and once continued it exits
                victims = [i]
                os.kill(victim.pid, signal.SIGSTOP)
                try:
                    wait_for(dead, "the scheduler removes the stopped server", 10)
                    time.sleep(rng.uniform(0, 0.5))
                finally:
                    os.kill(victim.pid, signal.SIGCONT)
                try:
                    victim.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    raise Failed(f"server slot {i}, stopped past the heartbeat timeout, did not exit")
            gone = dead()
            check(len(gone) == len(victims), f"dead servers: {gone}")
            # A replacement takes each dead server's place in turn and copies its rows;
            # now and then the scheduler is restarted while one copies.
            restart = rng.random() < 0.25
            log(f"{ev} of slot{'s' if len(victims) > 1 else ''} {','.join(map(str, victims))} "
                f"(server{'s' if len(gone) > 1 else ''} {','.join(map(str, gone))})" +
                (", the scheduler restarted during a copy" if restart else ""))
            for k, v in enumerate(victims):
                joins += 1
                slots[v] = join(c, joins)  # (it takes the id of whichever died first: any dead slot's)
                left = len(victims) - k - 1
                if restart and k == 0:
                    wait_for(lambda: len(dead()) == left, "the replacement registers", 10)
                    restart_scheduler(c, ps + rd, 3 - left)

                def synced():
                    srv = sched_servers(c)
                    return (len(srv) == 3 and sum(g.get("alive") == "1" for g in srv.values()) == 3 - left and
                            all(g.get("syncing", "0") == "0" for g in srv.values()))
                try:
                    wait_for(synced, "the replacement copies its rows", 40)
                except Failed as e:
                    raise Failed(f"{e}: servers {sched_servers(c)}")
        codes = c.wait(ps, RUN_S)
        check(codes == [0] * workers, f"worker exit codes {codes}")
        # Each live server's STATS into the job's directory, for a failure's post-mortem.
        for n, f in sched_servers(c).items():
            if f.get("alive") == "1":
                r = subprocess.run([binary("pshard"), "stats", f["addr"]], capture_output=True, text=True, timeout=20)
                with open(os.path.join(c.dir, f"stats-server{n}.txt"), "w") as out:
                    out.write(r.stdout + r.stderr)
        total, values = 0, None
        for i in range(workers):
            out = c.log(f"w{i}")
            m = re.search(r"^acked (\d+)$", out, re.M)
            v = re.search(r"^values (\S+)$", out, re.M)
            check(m and v, f"w{i} printed no outcome")
            failed = re.findall(r"^(?:push|clock|pull) \d+ rc=.*$", out, re.M)
            check(not failed, f"w{i}: {failed[:3]}")
            check(int(m.group(1)) == pushes, f"w{i} acked {m.group(1)} of {pushes}")
            total += int(m.group(1))
            vals = [float(x) for x in v.group(1).split(",")]
            check(values is None or vals == values, f"workers pulled different values: {vals} {values}")
            values = vals
        check(values == [float(total)] * len(values), f"values {values}, acknowledged pushes {total}")
        # Every range has its two copies again: all three slots alive, none copying.
        srv = sched_servers(c)
        check(len(srv) == 3 and all(f.get("alive") == "1" and f.get("syncing", "0") == "0" for f in srv.values()),
              f"server slots at the end: {srv}")
        if not rd:
            return f"ok: {total} pushes counted exactly, {joins} replacement(s) synced"
        # R - 1 servers die: the reader's pull reads the copies left, tails and middles
        # of some chains, which must hold every acknowledged push too.
        victims = rng.sample(range(3), replicas - 1)
        for v in victims:
            os.killpg(slots[v].pid, signal.SIGKILL)
        wait_for(lambda: len(dead()) == len(victims), "the scheduler removes the servers killed at the end", 10)
        with open(go, "w"):
            pass
        codes = c.wait(rd, 60)
        out = c.log("reader")
        v = re.search(r"^values (\S+)$", out, re.M)
        check(codes == [0] and v, f"reader exit {codes}: {out[-500:]}")
        vals = [float(x) for x in v.group(1).split(",")]
        check(vals == [float(total)] * len(vals),
              f"after slot{'s' if len(victims) > 1 else ''} {','.join(map(str, victims))} died at the end the copies "
              f"left hold {vals}, acknowledged pushes {total}")
        return (f"ok: {total} pushes counted exactly, {joins} replacement(s) synced; the copies left after "
                f"{len(victims)} more kill{'s' if len(victims) > 1 else ''} agree")


# ------------------------------------------------------------------ sync jobs

_references = {}


def worker_model(c, ps, lines):
    """The model both repl_sync_worker processes printed (`lines` lines), once they exit."""
    codes = c.wait(ps, RUN_S)
    check(codes == [0, 0], f"worker exit codes {codes}")
    models = []
    for i in range(2):
        out = c.log(f"w{i}")
        check(not re.findall(r"^fail .*$", out, re.M), f"w{i} failed a call")
        models.append(re.findall(r"^model .*$", out, re.M))
        check(len(models[-1]) == lines, f"w{i} printed {len(models[-1])} model lines")
    check(models[0] == models[1], "the workers pulled different models")
    return models[0]


def sync_run(big, fault=None, at=0.0, victim=0, rounds=SYNC_ROUNDS, expect=None, replicas=2):
    """The model lines of a sync job (S = 3, R = replicas), with server victim SIGKILLed
    or stopped past the heartbeat timeout `at` seconds in."""
    env = {"PSHARD_RETRY_MS": "300"}
    with Cluster(3, 2, replicas=replicas, heartbeat_timeout_ms=HBT_MS, extra_env=env) as c:
        extra = ["--big", str(BIG_FLOATS)] if big else []
        ps = [c.worker([binary("repl_sync_worker"), "--rounds", str(rounds), "--sleep-ms", "20"] + extra,
                       f"w{i}") for i in range(2)]
        if fault:
            time.sleep(at)
            if running(ps):
                proc = c.server_procs[victim]
                if fault == "kill":
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.kill(proc.pid, signal.SIGSTOP)
                    try:
                        wait_for(lambda: "removed: missed heartbeats" in c.log("scheduler"),
                                 "the scheduler removes the stopped server", 10)
                        time.sleep(0.3)
                    finally:
                        os.kill(proc.pid, signal.SIGCONT)
            else:
                fault = None
        model = worker_model(c, ps, 3 if big else 2)
        check(expect is None or model == expect, "the model differs from the no-fault model")  # (logs kept)
        no_deadline_catchup(c)
        return model, fault


def server_stat(addr, name):
    m = re.search(rf"^{name} (\d+)$", stats(addr), re.M)
    check(m, f"{name} in the STATS of {addr}")
    return int(m.group(1))


def sync_repair_run(victims, at, expect, restart=False, replicas=2):
    """The model lines of a sync job (S = 3, R = 2, SYNC_REPAIR_ROUNDS rounds) in which
    each server slot of victims in turn is SIGKILLed (the first `at` seconds in) and
    replaced, the survivors' catch-ups and the replacement's copy done before the next;
    with restart, the scheduler is SIGKILLed and started again after the first copy."""
    env = {"PSHARD_RETRY_MS": "300"}
    with Cluster(3, 2, replicas=replicas, heartbeat_timeout_ms=HBT_MS, extra_env=env, sched_state=True) as c:
        ps = [c.worker([binary("repl_sync_worker"), "--rounds", str(SYNC_REPAIR_ROUNDS), "--sleep-ms", "20"],
                       f"w{i}") for i in range(2)]
        slots = list(c.server_procs)
        done = 0
        for n, v in enumerate(victims):
            time.sleep(at if n == 0 else 0.3)
            if not running(ps):
                break
            os.killpg(slots[v].pid, signal.SIGKILL)
            dead = []

            def removed():
                dead[:] = [i for i, f in sched_servers(c).items() if f.get("alive") == "0"]
                return len(dead) == 1
            wait_for(removed, "the scheduler removes the killed server", 10)

            def caught_up():
                return all(server_stat(f["addr"], "catchups_running") == 0
                           for f in sched_servers(c).values() if f.get("alive") == "1")
            wait_for(caught_up, "the survivors catch up", 20)
            slots[v] = join(c, n + 1)

            def synced():
                f = sched_servers(c).get(dead[0], {})
                return f.get("alive") == "1" and f.get("late") == "1" and f.get("syncing", "0") == "0"
            wait_for(synced, "the replacement copies its rows", 40)
            wait_for(caught_up, "the survivors catch up", 20)
            done += 1
            if restart and n == 0 and running(ps):
                restart_scheduler(c, ps)
        model = worker_model(c, ps, 2)
        check(model == expect, "the model differs from the no-fault model")  # (logs kept)
        no_deadline_catchup(c)
        return model, done


def sync_repair_job(rng, log):
    first = rng.randrange(3)
    second = rng.choice([i for i in range(3) if i != first])
    at = rng.uniform(0.3, 1.0)
    restart = rng.random() < 0.5
    replicas = rng.choice([2, 2, 3])
    log(f"sync-repair R={replicas} kill slot {first}, then slot {second}, each replaced, from {at:.2f}s" +
        (", the scheduler restarted between" if restart else ""))
    if "repair" not in _references:
        _references["repair"] = sync_run(False, rounds=SYNC_REPAIR_ROUNDS)[0]
    model, done = sync_repair_run([first, second], at, _references["repair"], restart, replicas)
    return f"ok: model bit for bit the no-fault one, {done} replacement(s)"


def sync_job(rng, log):
    big = rng.random() < 0.5
    fault = rng.choice(["kill", "stop"])
    at = rng.uniform(0.2, 2.0)
    victim = rng.randrange(3)
    replicas = rng.choice([2, 2, 3])
    log(f"sync R={replicas} big={int(big)} fault={fault} victim={victim} at={at:.2f}s")
    if big not in _references:  # (R = 2 without a fault: the model is the same for every R)
        _references[big] = sync_run(big)[0]
    model, done = sync_run(big, fault, at, victim, expect=_references[big], replicas=replicas)
    return "ok: model bit for bit the no-fault one" + ("" if done else " (the job finished before the fault)")


# ------------------------------------------------------------------ the run

def on_term(signum, frame):
    raise KeyboardInterrupt  # the job's cluster is closed on the way out: no process left


def main():
    signal.signal(signal.SIGTERM, on_term)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--jobs", type=int, default=0, help="stop after this many jobs (0: the time decides)")
    ap.add_argument("--seed", type=int, help="run this one job")
    ap.add_argument("--only", choices=["counter", "sync", "sync-repair"])
    ap.add_argument("--events", help="counter jobs: these events (kill, kill2 (two servers at once: R = 3), stop-short, "
                    "stop-long, sched-restart; comma-separated) instead of those drawn, to narrow down a failure")
    ap.add_argument("--replicas", type=int, choices=[2, 3], help="counter jobs: this R instead of the one drawn")
    a = ap.parse_args()
    REPLICAS[0] = a.replicas or 0
    if a.events:
        EVENTS[:] = a.events.split(",")
    end = time.time() + 60 * a.minutes
    base = a.seed if a.seed is not None else int(time.time())
    failed = []
    n = 0
    while True:
        seed = base + n
        rng = random.Random(seed)
        kind = a.only or rng.choice(["counter", "counter", "sync", "sync-repair"])
        n += 1
        lines = []

        def log(s):
            lines.append(s)
        t0 = time.time()
        dirs_before = set(os.listdir("/tmp"))
        try:
            out = {"counter": counter_job, "sync": sync_job, "sync-repair": sync_repair_job}[kind](rng, log)
        except (Failed, AssertionError, RuntimeError) as e:
            out = f"FAILED: {str(e)[:2000]}"
            failed.append(seed)
            kept = sorted(d for d in set(os.listdir("/tmp")) - dirs_before if d.startswith("pshard-test-"))
            out += "\n  logs kept in " + " ".join("/tmp/" + d for d in kept)
        # a passed job's directory goes now, not when the run ends (a failed one stays;
        # with PSHARD_KEEP_TEST_DIRS=1 every one stays)
        for d in cluster._done_dirs:
            if os.environ.get("PSHARD_KEEP_TEST_DIRS") != "1":
                shutil.rmtree(d, ignore_errors=True)
        cluster._done_dirs.clear()
        print(f"job {n} seed={seed} ({time.time() - t0:.1f} s) " + " / ".join(lines) + f"\n  {out}", flush=True)
        if a.seed is not None or (a.jobs and n >= a.jobs) or time.time() >= end:
            break
    print(f"{n} jobs, {len(failed)} failed" + (f": seeds {' '.join(map(str, failed))}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
