"""Consistency models end to end (issue 4): real scheduler, server and worker processes
on loopback, driven by modes_worker (tests/integration/modes_worker.c).

1. ssp:s with one slowed worker: no pull is answered more than s clocks ahead of the
   slowest worker (the servers' recorded maximum pull staleness), and the fast workers
   really waited for their pulls.
2. sync:M (K=4, M=3) with a straggler: every round completes without it, its late
   pushes are dropped and counted (servers and worker), the job is faster than plain
   sync with the same straggler, and the update is normalised by the accepted batches
   only (the straggler's huge gradient never reaches the parameters).
3. Server-side aggregation (async and ssp): agg_n=3 applies exactly the batch-weighted
   mean of the three buffered pushes in one optimiser step; agg_ms flushes after the
   time with fewer than agg_n pushes.
4. Layer-wise frequencies: a sync table with every=2 changes only on even clocks,
   beside an every=1 table that changes every clock.
5. A worker SIGKILLed under async, ssp:1 and sync:2 (K=3) does not stop the others.
6. Bad input: unknown modes and negative staleness bounds (pshard run, PSHARD_MODE,
   table options), agg_n/every on the wrong kind of table, and pushes whose clock is from
   the future or more than 10000 clocks in the past (PS_ERR_CLOCK, counted).

Every process is started by cluster.Cluster (own process group, SIGKILLed at the end)
or by subprocess with its own session and killed in a finally block; ports are
ephemeral and every wait is bounded. Under ASan (PSHARD_SANITIZED=1) the time limits are
scaled by SCALE; no assertion depends on a tight timing.
"""
import os
import signal
import struct
import subprocess
import time

import pytest

from cluster import Cluster, binary, data_ports

SCALE = 3.0 if os.environ.get("PSHARD_SANITIZED") else 1.0
RUN_TIMEOUT = 25 * SCALE  # seconds for one whole job

E_CLOCK = 13

# ------------------------------------------------------------------ helpers


def parse_server_stats(text):
    """ps_server_stats text -> {"tables": {name: {key: value}}, key: value, ...}.
    Histogram lines ("push_staleness 3 1 0") become lists of ints."""
    out = {"tables": {}}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "table":
            fields = dict(p.split("=", 1) for p in parts[2:])
            tab = {k: number(v) if k not in ("name", "mode") else v for k, v in fields.items()}
            tab["id"] = int(parts[1])
            out["tables"][fields["name"]] = tab
        elif len(parts) == 2:
            out[parts[0]] = number(parts[1])
        else:
            out[parts[0]] = [number(x) for x in parts[1:]]
    return out


def number(v):
    """int, else float, else the string itself (stats lines may grow new fields)."""
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def parse_worker_log(text):
    """A modes_worker log -> dict(wstats, servers, params, traces, polls)."""
    res = {"wstats": None, "servers": [], "params": {}, "traces": [], "polls": []}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        parts = line.split()
        if line.startswith("wstats "):
            res["wstats"] = {k: float(v) for k, v in (p.split("=", 1) for p in parts[1:])}
        elif line.startswith("server-stats ") and parts[2] == "begin":
            j = i + 1
            while j < len(lines) and lines[j] != f"server-stats {parts[1]} end":
                j += 1
            res["servers"].append(parse_server_stats("\n".join(lines[i + 1:j])))
            i = j
        elif line.startswith("param "):
            res["params"][tuple(parts[1:-1])] = float(parts[-1])
        elif line.startswith("trace "):
            res["traces"].append({"clock": int(parts[4]), "dense0": float(parts[6]), "sparse0": float(parts[8])})
        elif line.startswith("poll "):
            kv = dict(p.split("=", 1) for p in parts[1:])
            res["polls"].append((float(kv["t"]), float(kv["dense0"])))
        i += 1
    return res


class Job:
    """Results of one run: per worker index, its parsed log; rank 0's server stats."""

    def __init__(self, logs, elapsed):
        self.logs = logs
        self.elapsed = elapsed
        self.workers = {i: parse_worker_log(t) for i, t in logs.items()}
        for i, w in self.workers.items():
            assert w["wstats"] is not None, f"worker {i} printed no wstats:\n{logs[i]}"
        rank0 = [w for w in self.workers.values() if w["wstats"]["rank"] == 0 and w["servers"]]
        self.rank0 = rank0[0] if rank0 else None
        self.servers = self.rank0["servers"] if self.rank0 else []
        self.params = self.rank0["params"] if self.rank0 else {}

    def stat(self, index, name):
        return self.workers[index]["wstats"][name]

    def server_sum(self, key):
        return sum(s[key] for s in self.servers)

    def table_sum(self, table, key):
        return sum(s["tables"][table][key] for s in self.servers)

    def dump(self):
        return "\n".join(f"--- worker{i}\n{t}" for i, t in sorted(self.logs.items()))


def run_job(K, S, args, per_index=None, env=None, hb_ms=3000, timeout=RUN_TIMEOUT):
    """Run K modes_worker processes (PSHARD_WORKER_INDEX = 0..K-1) against S servers.
    per_index: {index: extra args}. Returns a Job; fails unless every worker exits 0."""
    with Cluster(S, K, heartbeat_timeout_ms=hb_ms, extra_env=env) as c:
        t0 = time.monotonic()
        procs = [c.worker([binary("modes_worker"), *args, *(per_index or {}).get(i, [])], f"worker{i}",
                          env={"PSHARD_WORKER_INDEX": str(i)}) for i in range(K)]
        codes = c.wait(procs, timeout)
        elapsed = time.monotonic() - t0
        logs = {i: c.log(f"worker{i}") for i in range(K)}
        assert codes == [0] * K, "\n".join(f"--- worker{i} ({codes[i]})\n{logs[i]}" for i in range(K)) + \
            "\n--- scheduler\n" + c.log("scheduler")
    return Job(logs, elapsed)


def sgd(lr):
    return f"opt=sgd lr={lr} init=zero"


def wait_for_line(c, name, needle, timeout, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in c.log(name).splitlines():
            if needle in line:
                return line
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.name} exited ({p.returncode}) before '{needle}' appeared in {name}:\n"
                                     + c.log(p.name))
        time.sleep(0.01)
    raise AssertionError(f"'{needle}' did not appear in the log of {name} within {timeout}s:\n{c.log(name)}")


def run_cmd(argv, env=None, timeout=10 * SCALE):
    """Run a command in its own session; kill its group if it outlives the timeout."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ------------------------------------------------------------------ 1. bounded staleness


@pytest.mark.parametrize("s", [1, 3])
def test_ssp_bounds_pull_staleness(s):
    """K=4, S=2, ssp:s; worker 1 sleeps 30 ms per step, the others do not. The fast
    workers run ahead exactly to the bound and no further: the largest recorded pull
    staleness (pull clock - slowest live worker's clock) is s. Pushes are applied on
    arrival, so a push can be at most s+1 clocks behind the fastest worker. The fast
    workers spend most of the run blocked in pulls; the slow one hardly waits."""
    K, steps, slow_ms = 4, 30, 30
    job = run_job(K, 2, ["--steps", str(steps), "--slow-index", "1", "--slow-ms", str(slow_ms)],
                  env={"PSHARD_MODE": f"ssp:{s}"})
    for i in range(K):
        assert job.stat(i, "clock") == steps and job.stat(i, "steps") == steps, job.dump()
    assert len(job.servers) == 2
    for srv in job.servers:
        assert srv["tables"]["w"]["mode"] == "ssp" and srv["tables"]["w"]["param"] == s
    pull_max = max(srv["pull_staleness_max"] for srv in job.servers)
    push_max = max(srv["push_staleness_max"] for srv in job.servers)
    hist = [srv["pull_staleness"] for srv in job.servers]
    print(f"ssp:{s}: pull staleness max {pull_max} hist {hist}; push staleness max {push_max}")
    assert pull_max <= s, f"a pull was answered {pull_max} clocks ahead of the slowest worker under ssp:{s}"
    # Not vacuous: the fast workers did reach the bound.
    assert pull_max == s, f"the fast workers never got {s} clocks ahead (max {pull_max}): the test proves nothing"
    assert all(len(h) <= s + 1 for h in hist), hist
    assert push_max <= s + 1, f"a push was applied {push_max} clocks behind the fastest worker under ssp:{s}"
    fast = [i for i in range(K) if i != 1]
    # The slow worker alone needs steps * slow_ms; a fast worker cannot finish before
    # the slow one reached steps - s - 1, and it spent that time mostly in pulls.
    floor = 0.3 * (steps - s - 1) * slow_ms / 1000
    for i in fast:
        assert job.stat(i, "pull_wait_s") > floor, \
            f"fast worker {i} waited only {job.stat(i, 'pull_wait_s'):.3f}s for pulls (floor {floor:.3f}s)"
    assert job.stat(1, "pull_wait_s") < min(job.stat(i, "pull_wait_s") for i in fast), job.dump()
    print("pull_wait_s: " + ", ".join(f"worker{i} {job.stat(i, 'pull_wait_s'):.3f}" for i in range(K)))


def test_async_pulls_do_not_wait():
    """The same run under async: pulls are answered at once, so the fast workers do not
    wait for the slow one, and they end many clocks ahead (staleness is recorded)."""
    K, steps, slow_ms = 4, 30, 30
    job = run_job(K, 2, ["--steps", str(steps), "--slow-index", "1", "--slow-ms", str(slow_ms)],
                  env={"PSHARD_MODE": "async"})
    pull_max = max(srv["pull_staleness_max"] for srv in job.servers)
    push_max = max(srv["push_staleness_max"] for srv in job.servers)
    print(f"async: pull staleness max {pull_max}, push staleness max {push_max}")
    assert pull_max > 3 and push_max > 3, job.dump()
    slow_total = steps * slow_ms / 1000
    for i in (0, 2, 3):
        assert job.stat(i, "pull_wait_s") < 0.5 * slow_total, job.dump()


# ------------------------------------------------------------------ 2. sync:M with a straggler

SYNC_M_ARGS = ["--steps", "30", "--sleep-ms", "5", "--slow-index", "1", "--slow-ms", "40", "--slow-grad", "1e6",
               "--batch", "1,100,2,5", "--dense-opt", sgd(1), "--sparse-opt", sgd(1), "--print-params", "1"]


def test_sync_m_straggler_dropped_and_normalised():
    """K=4, S=2. Worker 1 is a straggler (40 ms per step against 5 ms) with batch 100 and
    a gradient 10^6 times the others'; the others push gradient 1 with batches 1, 2, 5;
    sgd lr=1 from zero, update=mean.

    sync:3: the straggler waits before each push until the servers applied the round of
    its clock (--slow-late), so every one of its pushes is late: dropped, counted on the
    servers and in its dropped_pushes; its pulls fast-forward it. Every round completes
    without it, and each is normalised by the accepted batches only: after 30 rounds the
    parameters are exactly -30 * (1 + j % 4) (dense) and -30 * (1 + j) (sparse). Counting
    the straggler's batch (or gradient) would give something else entirely.

    sync (BSP) with the same straggler: the control. Its gradient is in every round, and
    the fast workers run at the straggler's pace. The sync:3 job is faster."""
    steps = 30
    m = run_job(4, 2, SYNC_M_ARGS + ["--slow-late", "1"], env={"PSHARD_MODE": "sync:3"})
    for i in (0, 2, 3):
        assert m.stat(i, "clock") == steps and m.stat(i, "steps") == steps, m.dump()
        assert m.stat(i, "dropped_pushes") == 0 and m.stat(i, "fast_forwards") == 0, m.dump()
    assert m.stat(1, "clock") == steps, m.dump()
    assert 1 <= m.stat(1, "steps") < steps and m.stat(1, "fast_forwards") >= 1, m.dump()
    assert m.stat(1, "dropped_pushes") > 0, m.dump()
    for srv in m.servers:
        for t in ("w", "emb"):
            tab = srv["tables"][t]
            assert tab["mode"] == "sync:M" and tab["param"] == 3
            assert tab["version"] == steps, f"table {t}: {tab['version']} of {steps} rounds applied"
            assert tab["rejected"] == 0, tab
        assert srv["dropped_pushes"] == sum(srv["tables"][t]["dropped"] for t in ("w", "emb"))
        assert srv["rejected_clock"] == 0
    assert m.server_sum("dropped_pushes") > 0
    # Every straggler step pushed both tables to both servers, and each part was dropped.
    assert m.table_sum("w", "dropped") == 2 * m.stat(1, "steps"), m.dump()
    assert m.table_sum("emb", "dropped") == 2 * m.stat(1, "steps"), m.dump()
    p = m.params
    assert len(p) == 8 + 16 * 2
    for j in range(8):
        assert p[("w", str(j))] == -steps * (1 + j % 4), f"w[{j}] = {p[('w', str(j))]}"
    for k in range(16):
        for j in range(2):
            assert p[("emb", str(k), str(j))] == -steps * (1 + j), f"emb[{k}][{j}] = {p[('emb', str(k), str(j))]}"

    bsp = run_job(4, 2, SYNC_M_ARGS, env={"PSHARD_MODE": "sync"})
    for i in range(4):
        assert bsp.stat(i, "clock") == steps and bsp.stat(i, "steps") == steps
        assert bsp.stat(i, "dropped_pushes") == 0
    assert bsp.server_sum("dropped_pushes") == 0
    # The straggler's gradient is in every round: (1*1 + 2*1 + 5*1 + 100*1e6) / 108.
    per_round = (8 + 100 * 1e6) / 108
    assert bsp.params[("w", "0")] == pytest.approx(-steps * per_round, rel=1e-4)
    t_m = max(m.stat(i, "elapsed_s") for i in (0, 2, 3))
    t_bsp = max(bsp.stat(i, "elapsed_s") for i in (0, 2, 3))
    print(f"fast workers' step loop: sync:3 {t_m:.3f}s, sync {t_bsp:.3f}s "
          f"(straggler alone: {steps * 0.040:.2f}s of sleep); jobs {m.elapsed:.2f}s vs {bsp.elapsed:.2f}s")
    # Physics: under BSP the fast workers cannot beat the straggler's sleeps.
    assert t_bsp >= 0.9 * (steps - 1) * 0.040
    assert t_m < t_bsp, f"sync:3 ({t_m:.3f}s) was not faster than sync ({t_bsp:.3f}s) with a straggler"


def test_dropped_pushes_counted_per_push():
    """(Was /tmp/modes-bugs/02-dropped-pushes-counted-per-part.diff: one count per server.)
    ps_ctx_stat: dropped_pushes is 'pushes acknowledged but not applied' and pushes is
    'requests started': a straggler whose every push was dropped has dropped == pushes."""
    m = run_job(4, 2, SYNC_M_ARGS + ["--slow-late", "1"], env={"PSHARD_MODE": "sync:3"})
    assert m.stat(1, "pushes") == 2 * m.stat(1, "steps")
    assert m.stat(1, "dropped_pushes") == m.stat(1, "pushes"), m.workers[1]["wstats"]


# ------------------------------------------------------------------ 3. server-side aggregation


@pytest.mark.parametrize("mode", ["async", "ssp:2"])
def test_aggregation_applies_exact_batch_weighted_mean(mode):
    """K=3, S=2, agg_n=3, sgd lr=0.5 from zero. Each worker pushes once: batches 1, 2, 5
    and gradient scales 1, -3, 7. The servers apply exactly one sgd step with
    (1*1 + 2*(-3) + 5*7) / 8 = 3.75 times the element pattern: parameters -1.875 * p.
    (The plain mean would give 5/3, the sum 5, three separate steps -2.5.)"""
    opts = sgd(0.5) + " agg_n=3"
    job = run_job(3, 2, ["--steps", "1", "--batch", "1,2,5", "--grad", "1,-3,7", "--dense-opt", opts,
                         "--sparse-opt", opts, "--print-params", "1", "--mode", mode])
    mean = (1 * 1 + 2 * -3 + 5 * 7) / 8
    p = job.params
    for j in range(8):
        assert p[("w", str(j))] == pytest.approx(-0.5 * mean * (1 + j % 4), rel=1e-6, abs=1e-7), p
    for k in range(16):
        for j in range(2):
            assert p[("emb", str(k), str(j))] == pytest.approx(-0.5 * mean * (1 + j), rel=1e-6, abs=1e-7), p
    # One optimiser step per server that holds rows of the table, after three pushes.
    for t in ("w", "emb"):
        holders = [srv["tables"][t] for srv in job.servers if srv["tables"][t]["rows"] > 0]
        assert holders, job.dump()
        for tab in holders:
            assert tab["pushes"] == 3 and tab["applied"] == 1 and tab["step"] == 1, tab


def test_aggregation_flushes_after_agg_ms():
    """K=1, agg_n=100 agg_ms=800: one push (batch 2, gradient 3) stays buffered; a pull
    right after it sees the initial value; after about 800 ms the buffer is applied on its
    own: -0.5 * 3 = -1.5."""
    agg_ms = 800
    opts = sgd(0.5) + f" agg_n=100 agg_ms={agg_ms}"
    job = run_job(1, 1, ["--steps", "1", "--batch", "2", "--grad", "3", "--dense-opt", opts, "--sparse-opt", opts,
                         "--poll-ms", str(int(agg_ms + 2000 * SCALE)), "--mode", "async"])
    polls = job.workers[0]["polls"]
    assert polls, job.dump()
    t_first, v_first = polls[0]
    if t_first < 0.5 * agg_ms / 1000:
        assert v_first == 0, f"the push was applied {t_first:.3f}s after it, before agg_ms: {polls}"
    changed = [(t, v) for t, v in polls if v != 0]
    assert changed, f"the buffered push was never applied: {polls}"
    t_applied, v_applied = changed[0]
    print(f"agg_ms={agg_ms}: applied {t_applied:.3f}s after the push")
    assert v_applied == -1.5 and polls[-1][1] == -1.5, polls
    assert t_applied >= 0.5 * agg_ms / 1000, f"applied after {t_applied:.3f}s, long before agg_ms={agg_ms}"
    tab = job.servers[0]["tables"]["w"]
    assert tab["pushes"] == 1 and tab["applied"] == 1, tab


# ------------------------------------------------------------------ 4. layer-wise frequencies


def test_layerwise_every_2():
    """K=2, S=2, sgd lr=0.5 from zero; at clock c each worker pushes gradient (c+1) * p
    with the same batch. Table "w" is sync every=2 (round r covers clocks 2r and 2r+1 and
    is applied once both are done), table "emb" is sync every clock. A pull at clock c
    sees w = -0.5 * sum of (c'+1) over the clocks of the completed rounds, so w changes
    only on even clocks (clock 1 still sees the initial value, clock 2 both clocks'
    gradients); emb changes at every clock."""
    steps = 6
    job = run_job(2, 2, ["--steps", str(steps), "--clock-grad", "1", "--trace", "1",
                         "--dense-opt", sgd(0.5) + " mode=sync every=2", "--sparse-opt", sgd(0.5) + " mode=sync"])
    for i in range(2):
        traces = job.workers[i]["traces"]
        assert [t["clock"] for t in traces] == list(range(steps)), traces
        for t in traces:
            c = t["clock"]
            exp_w = -0.5 * sum(k + 1 for k in range(2 * (c // 2)))
            exp_e = -0.5 * sum(k + 1 for k in range(c))
            assert t["dense0"] == exp_w, f"worker {i} clock {c}: w[0] = {t['dense0']}, expected {exp_w}"
            assert t["sparse0"] == exp_e, f"worker {i} clock {c}: emb[0][0] = {t['sparse0']}, expected {exp_e}"
        assert traces[1]["dense0"] == 0 and traces[2]["dense0"] == -1.5
    for srv in job.servers:
        assert srv["tables"]["w"]["version"] == steps // 2
        assert srv["tables"]["emb"]["version"] == steps
    assert max(srv["tables"]["w"]["applied"] for srv in job.servers) == steps // 2


def test_layerwise_every_2_unequal_batches():
    """As above but the batch at clock c is 4(c+1). A round of an every=2 table should be
    N times the batch-weighted mean over all its examples (with equal batches: the sum of
    the clocks' means, which is what the test above checks): round 0 is
    2 * (4*1 + 8*2) / 12 = 10/3, so w[0] = -0.5 * 10/3 after clock 2. (Was
    /tmp/modes-bugs/03-every-n-batch-per-clock.diff: the server counted only the first
    clock's batch and gave (4*1 + 8*2) / 4 = 5.)"""
    job = run_job(2, 1, ["--steps", "3", "--clock-grad", "1", "--clock-batch", "1", "--trace", "1",
                         "--dense-opt", sgd(0.5) + " mode=sync every=2", "--sparse-opt", sgd(0.5) + " mode=sync"])
    t = job.workers[0]["traces"][2]
    assert t["dense0"] == pytest.approx(-0.5 * 10 / 3, rel=1e-6), t


# ------------------------------------------------------------------ 5. a worker dies


@pytest.mark.parametrize("mode", ["async", "ssp:1", "sync:2"])
def test_killed_worker_does_not_block(mode):
    """K=3, S=2, every worker sleeps 10 ms per step for 80 steps. Worker 2 is SIGKILLed
    after its 5th step; the other two finish all their steps (nothing waits on the dead
    worker: under ssp:1 they block until the scheduler removes it, which the closed
    connection triggers at once; under sync:2 two workers are a quorum anyway)."""
    hb_ms, K, steps, sleep_ms = 1000, 3, 80, 10
    with Cluster(2, K, heartbeat_timeout_ms=hb_ms, extra_env={"PSHARD_MODE": mode}) as c:
        procs = [c.worker([binary("modes_worker"), "--steps", str(steps), "--sleep-ms", str(sleep_ms),
                           "--progress", "1"], f"worker{i}", env={"PSHARD_WORKER_INDEX": str(i)})
                 for i in range(K)]
        victim = procs[2]
        wait_for_line(c, "worker2", "index 2 step 5", RUN_TIMEOUT, procs)
        assert victim.poll() is None, "the victim finished before it could be killed"
        t0 = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)
        codes = c.wait(procs[:2], RUN_TIMEOUT)
        elapsed = time.monotonic() - t0
        logs = {i: c.log(f"worker{i}") for i in range(2)}
        assert codes == [0, 0], "\n".join(logs.values())
        bound = hb_ms / 1000 + 2.0 * SCALE + steps * sleep_ms / 1000 * SCALE
        assert elapsed <= bound, f"survivors took {elapsed:.2f}s after the kill (bound {bound:.1f}s)"
        for i in range(2):
            w = parse_worker_log(logs[i])["wstats"]
            # Under sync:2 a survivor that was third to clock may be fast-forwarded.
            assert w["clock"] == steps, logs[i]
            assert w["steps"] == steps or mode.startswith("sync:"), logs[i]
        assert "removed" in c.log("scheduler"), c.log("scheduler")
        assert all(s.poll() is None for s in c.server_procs) and c.scheduler.poll() is None


# ------------------------------------------------------------------ 6. bad input


@pytest.mark.parametrize("mode,message", [("bogus", "unknown consistency mode 'bogus'"),
                                          ("ssp:-1", "negative staleness bound"),
                                          ("ssp", "ssp needs a staleness bound"),
                                          ("sync:0", "sync:M needs M >= 1"),
                                          ("async:3", "unknown consistency mode")])
def test_run_rejects_bad_mode(mode, message):
    """`pshard run --mode X` with a bad X exits 2 at once with a clear message."""
    rc, out, err = run_cmd([binary("pshard"), "run", "-s", "1", "-w", "1", "--mode", mode, "--", "true"])
    assert rc == 2, (rc, out, err)
    assert message in err and "--mode" in err, err


@pytest.mark.parametrize("mode", ["ssp:-1", "bogus"])
def test_env_mode_rejected_by_ps_ctx_open(mode):
    """PSHARD_MODE with a bad value: ps_ctx_open fails with PS_ERR_CONFIG before it
    contacts anything (the scheduler address here is unreachable)."""
    env = dict(os.environ, PSHARD_MODE=mode, PSHARD_SCHEDULER="127.0.0.1:1", PSHARD_CONNECT_TIMEOUT_MS="2000")
    rc, out, err = run_cmd([binary("modes_worker")], env=env)
    assert rc == 1, (rc, out, err)
    assert "ps_ctx_open_env" in err and "PS_ERR_CONFIG" in err and "PSHARD_MODE" in err, err


def test_env_mode_error_message_is_clear():
    """(Was /tmp/modes-bugs/01-config-env-errmsg-overlap.diff: an overlapping vsnprintf
    printed 'PSHARD_MODE: PSHARD_MODE: eness bound -1 in ...'.)"""
    env = dict(os.environ, PSHARD_MODE="ssp:-1", PSHARD_SCHEDULER="127.0.0.1:1")
    rc, out, err = run_cmd([binary("modes_worker")], env=env)
    assert rc == 1
    assert "PSHARD_MODE: negative staleness bound -1 in 'ssp:-1'" in err, err


@pytest.mark.parametrize("opts,message", [
    ("mode=xyz", "unknown consistency mode 'xyz'"),
    ("mode=ssp:-2", "negative staleness bound"),
    ("mode=sync agg_n=3", "'agg_n' and 'agg_ms' apply to async and ssp"),
    ("mode=sync:2 agg_ms=10", "'agg_n' and 'agg_ms' apply to async and ssp"),
    ("mode=async every=2", "'every' applies to sync"),
    ("mode=sync every=0", "every"),
], ids=["unknown-mode", "negative-ssp", "agg_n-on-sync", "agg_ms-on-sync_m", "every-on-async", "every-0"])
def test_bad_table_options(opts, message):
    """A table declared with a bad mode, or with options that do not fit its mode, fails
    with PS_ERR_CONFIG and says why."""
    with Cluster(1, 1) as c:
        p = c.worker([binary("modes_worker"), "--steps", "1", "--dense-opt", opts], "worker0")
        codes = c.wait([p], RUN_TIMEOUT)
        log = c.log("worker0")
        assert codes == [1], log
        assert "ps_table_declare" in log and "PS_ERR_CONFIG" in log and message in log, log


def test_table_option_agg_n_under_job_mode_sync():
    """agg_n on a table that gets its mode from the job (sync by default): PS_ERR_CONFIG."""
    with Cluster(1, 1, extra_env={"PSHARD_MODE": "sync"}) as c:
        p = c.worker([binary("modes_worker"), "--steps", "1", "--sparse-opt", "opt=sgd agg_n=4"], "worker0")
        assert c.wait([p], RUN_TIMEOUT) == [1]
        assert "PS_ERR_CONFIG" in c.log("worker0") and "agg_n" in c.log("worker0"), c.log("worker0")


def test_push_far_in_the_past_is_rejected():
    """async, K=2: worker 0 advances its clock 10005 times (without pushing), then both
    pass a barrier; worker 1, still at clock 0 and 1, is more than 10000 clocks behind
    the fastest worker: each of its pushes fails with PS_ERR_CLOCK and every server counts
    it in rejected_clock. Worker 0's own pushes are fine."""
    job = run_job(2, 2, ["--steps", "2", "--start-barrier", "1", "--allow-clock-errors", "1", "--mode", "async"],
                  per_index={0: ["--skip-clocks", "10005"]})
    assert job.stat(0, "push_rejected") == 0 and job.stat(0, "clock") == 10007, job.dump()
    assert job.stat(1, "push_rejected") == 4, job.dump()  # 2 steps x 2 tables
    # Each push reaches both servers (the one without keys gets an empty part).
    assert job.server_sum("rejected_clock") == 8, [s["rejected_clock"] for s in job.servers]
    assert job.table_sum("w", "rejected") + job.table_sum("emb", "rejected") == 8


# ---- raw frames (the wire format of src/proto/frame.c; see test_core.py)

MAGIC, VERSION = 0x44485350, 3
HDR = struct.Struct("<IBBBBiIQIIqQIfQ")
T_PUSH_DENSE, T_CLOCK, T_STATS = 11, 13, 15
PS_FLAG_DROPPED = 1  # src/proto/frame.h: push reply, acknowledged but not applied


def frame(type_, payload=b"", *, sender=0, req_id=0, table=0, batch=0, clock=0, nkeys=0, lr=-1.0):
    return HDR.pack(MAGIC, VERSION, type_, 0, 0, 0, sender, req_id, table, batch, clock, 0, nkeys, lr,
                    len(payload)) + payload


class Raw:
    def __init__(self, port):
        import socket
        self.s = socket.create_connection(("127.0.0.1", port), timeout=5 * SCALE)
        self.buf = b""

    def request(self, data):
        """Send one frame and read the next whole frame: (status, req_id, body)."""
        self.s.sendall(data)
        while True:
            if len(self.buf) >= 64:
                h = HDR.unpack(self.buf[:64])
                if len(self.buf) >= 64 + h[-1]:
                    body, self.buf = self.buf[64:64 + h[-1]], self.buf[64 + h[-1]:]
                    return h[5], h[7], body
            chunk = self.s.recv(65536)
            assert chunk, "the peer closed the connection"
            self.buf += chunk

    def send(self, data):
        self.s.sendall(data)

    def close(self):
        self.s.close()


def tcp_listen_ports(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except FileNotFoundError:
            pass
    return sorted(ports)


def raw_session(c):
    """Start one idle worker (2 steps, then it holds), find its node id (through its
    worker_index metric in the scheduler's stats) and the server's port; return an open
    Raw connection to the server, the worker id, the id of table "w" and a stats
    function."""
    w = c.worker([binary("modes_worker"), "--steps", "2", "--hold-ms", str(int(20000 * SCALE))], "worker0",
                 env={"PSHARD_WORKER_INDEX": "0"})
    wait_for_line(c, "worker0", "wstats", RUN_TIMEOUT, [w])
    r = Raw(int(c.addr.rsplit(":", 1)[1]))
    try:
        st, _, body = r.request(frame(T_STATS, req_id=1))
    finally:
        r.close()
    assert st == 0
    ids = [int(line.split("node=")[1].split()[0]) for line in body.decode().splitlines()
           if "name=worker_index" in line]
    assert len(ids) == 1, body
    ports = []
    deadline = time.time() + 10 * SCALE
    while not ports and time.time() < deadline:
        ports = data_ports(tcp_listen_ports(c.server_procs[0].pid), c.log("server0"))
        time.sleep(0.02)
    assert len(ports) == 1, ports
    r = Raw(ports[0])

    def server_stats():
        st, _, body = r.request(frame(T_STATS, req_id=2))
        assert st == 0
        return parse_server_stats(body.decode())

    return w, r, ids[0], server_stats()["tables"]["w"]["id"], server_stats


def raw_push(r, wid, table, clock, req_id):
    """A one-element dense push from worker wid: (status, flags, message)."""
    r.s.sendall(frame(T_PUSH_DENSE, sender=wid, req_id=req_id, table=table, batch=1, clock=clock, nkeys=2,
                      payload=struct.pack("<QQf", 0, 1, 0.0)))
    while True:
        if len(r.buf) >= 64:
            h = HDR.unpack(r.buf[:64])
            if len(r.buf) >= 64 + h[-1]:
                body, r.buf = r.buf[64:64 + h[-1]], r.buf[64 + h[-1]:]
                assert h[7] == req_id, h
                return h[5], h[3], body.decode(errors="replace")
        chunk = r.s.recv(65536)
        assert chunk, "the server closed the connection"
        r.buf += chunk


def test_raw_push_clock_from_the_future_and_far_past():
    """Raw frames to a server of an async job (the worker is alive, idle after 2 steps):
    a push whose clock is ahead of every live worker's, and one more than 10000 clocks
    behind the fastest (after a CLOCK frame moved the worker's clock to 20000), are
    answered with status 13 (PS_ERR_CLOCK) and counted in rejected_clock; a push 5000
    clocks behind is accepted. The frames use the real worker's sender id."""
    with Cluster(1, 1, extra_env={"PSHARD_MODE": "async"}) as c:
        w, r, wid, table, server_stats = raw_session(c)
        try:
            s0 = server_stats()
            assert s0["max_clock"] == 2 and s0["rejected_clock"] == 0, s0
            st, _, msg = raw_push(r, wid, table, s0["max_clock"] + 5, 10)
            assert st == E_CLOCK and "future" in msg, (st, msg)
            assert server_stats()["rejected_clock"] == 1
            r.send(frame(T_CLOCK, sender=wid, clock=20000))
            st, _, msg = raw_push(r, wid, table, 0, 11)
            assert st == E_CLOCK and "10000" in msg, (st, msg)
            s1 = server_stats()
            assert s1["max_clock"] == 20000 and s1["rejected_clock"] == 2, s1
            st, _, msg = raw_push(r, wid, table, 15000, 12)  # 5000 behind: accepted
            assert st == 0, msg
            s2 = server_stats()
            assert s2["rejected_clock"] == 2 and s2["tables"]["w"]["rejected"] == 2, s2
            assert s2["push_staleness_max"] >= 5000
        finally:
            r.close()
        assert w.poll() is None, "the worker exited early: " + c.log("worker0")


def test_raw_push_far_in_the_past_under_sync_m():
    """The same under sync:3 (one worker, so the quorum is 1): after CLOCK 20000 the
    servers applied 20000 rounds; a push for round 19990 is a late push (dropped, status
    0, counted in dropped=), but a push for clock 0 is more than 10000 clocks behind:
    PS_ERR_CLOCK, counted in rejected_clock, like in every other mode. (Was
    /tmp/modes-bugs/05-sync-m-far-past-push-dropped-not-rejected.diff: the push was
    dropped with a success reply.)"""
    with Cluster(1, 1, extra_env={"PSHARD_MODE": "sync:3"}) as c:
        w, r, wid, table, server_stats = raw_session(c)
        try:
            r.send(frame(T_CLOCK, sender=wid, clock=20000))
            s1 = server_stats()
            assert s1["max_clock"] == 20000 and s1["tables"]["w"]["version"] == 20000, s1
            st, flags, msg = raw_push(r, wid, table, 19990, 11)
            assert st == 0 and flags & PS_FLAG_DROPPED, (st, flags, msg)
            assert server_stats()["tables"]["w"]["dropped"] == 1
            st, flags, msg = raw_push(r, wid, table, 0, 12)
            assert st == E_CLOCK, (st, flags, msg)
            assert server_stats()["rejected_clock"] == 1
        finally:
            r.close()
