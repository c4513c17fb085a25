"""Fault injection with real processes: PSHARD_FAULT rules in a scheduler, servers and
workers started by cluster.Cluster (own process groups, ephemeral ports, SIGKILLed at
the end), driven by fault_worker (a scripted worker that prints what each call returned).

Each kind of rule is used at least once, each test asserts what a user would see:
1. A bad spec stops the scheduler, a server or a worker at startup with a clear error.
2. drop: a dropped PUSH is sent again after retry_ms and applied once; with re-sending
   off it fails at its deadline with PS_ERR_TIMEOUT, the server keeps serving, and only
   the pushes it received are applied.
3. delay: a delayed PULL reply arrives late and holds the right values.
4. dup: a duplicated CLOCK leaves sync training exactly as without it.
5. alloc: a failed allocation on the server answers that push with PS_ERR_NOMEM, and
   later pushes and pulls are served.
6. Rules naming a worker, in and out: only that node acts, after it has registered.
Every wait is bounded; under ASan (PSHARD_SANITIZED=1) time limits are scaled.
"""
import os
import re
import subprocess

from cluster import Cluster, binary

SCALE = 3.0 if os.environ.get("PSHARD_SANITIZED") else 1.0
RUN = 20 * SCALE


def run_worker(c, args, name="w0", env=None):
    p = c.worker([binary("fault_worker")] + args, name, env)
    assert c.wait([p], RUN) == [0], c.log(name)
    return c.log(name)


def results(log):
    """fault_worker's lines as (op, rc, ms, values or None, msg or '')."""
    out = []
    for line in log.splitlines():
        m = re.match(r"^(push|pull|clock) rc=(\S+) ms=(\d+)(?: v=(\S+))?(?: msg=(.*))?$", line)
        if m:
            vals = [float(x) for x in m.group(4).split(",")] if m.group(4) else None
            out.append((m.group(1), m.group(2), int(m.group(3)), vals, m.group(5) or ""))
    return out


def fault_lines(log):
    return [l for l in log.splitlines() if "fault: " in l]


def test_bad_spec_is_an_error_at_startup():
    bad = {"PSHARD_FAULT": "drop:type=pussh:n=2"}
    env = dict(os.environ, **bad)
    for argv in (["scheduler", "--servers", "1", "--workers", "1"], ["server", "--scheduler", "127.0.0.1:9"]):
        p = subprocess.run([binary("pshard")] + argv, env=env, capture_output=True, text=True, timeout=10 * SCALE,
                           start_new_session=True)
        assert p.returncode == 1, (argv, p.returncode, p.stderr)
        assert "PSHARD_FAULT: fault rule 1 'drop:type=pussh:n=2': unknown frame type 'pussh'" in p.stderr, p.stderr
    # A worker refuses it too; the job is not harmed: a worker without it runs after.
    with Cluster(1, 1) as c:
        p = c.worker([binary("fault_worker"), "push"], "bad", dict(bad))
        assert c.wait([p], RUN) == [1]
        log = c.log("bad")
        assert "PS_ERR_CONFIG" in log and "PSHARD_FAULT" in log and "unknown frame type" in log, log
        r = results(run_worker(c, ["push", "pull"]))
        assert [x[1] for x in r] == ["PS_OK", "PS_OK"], r
        assert r[1][3] == [-1.0] * 4


def test_dropped_push_is_sent_again_and_applied_once():
    env = {"PSHARD_FAULT": "drop:type=push:n=2:node=server.0", "PSHARD_RETRY_MS": "200"}
    with Cluster(1, 1, extra_env=env) as c:
        r = results(run_worker(c, ["push", "push", "push", "pull"]))
        assert [x[:2] for x in r] == [("push", "PS_OK")] * 3 + [("pull", "PS_OK")], r
        assert r[1][2] >= 190, r             # the second one waited for its attempt
        assert r[3][3] == [-3.0] * 4, r      # and all three were applied, once each
        lines = fault_lines(c.log("server0"))
        assert len(lines) == 1 and "dropped received push frame #2 on server.0" in lines[0], lines


def test_dropped_push_fails_at_its_deadline_and_the_server_keeps_serving():
    # With re-sending off (retry_ms=0) a lost push is lost.
    env = {"PSHARD_FAULT": "drop:type=push:n=2:node=server.0", "PSHARD_TIMEOUT_MS": "1000", "PSHARD_RETRY_MS": "0"}
    with Cluster(1, 1, extra_env=env) as c:
        r = results(run_worker(c, ["push", "push", "push", "pull"]))
        assert [x[:2] for x in r] == [("push", "PS_OK"), ("push", "PS_ERR_TIMEOUT"), ("push", "PS_OK"),
                                      ("pull", "PS_OK")], r
        assert r[1][2] >= 900, r            # it waited for its deadline
        assert "deadline" in r[1][4], r      # and says why
        assert r[3][3] == [-2.0] * 4, r      # pushes 1 and 3 were applied, 2 was lost
        lines = fault_lines(c.log("server0"))
        assert len(lines) == 1 and "dropped received push frame #2 on server.0" in lines[0], lines
        assert fault_lines(c.log("scheduler")) == []


def test_delayed_pull_reply_arrives_late_but_correct():
    env = {"PSHARD_FAULT": "delay=400ms:type=pull-reply:n=1:dir=out:node=server"}
    with Cluster(1, 1, extra_env=env) as c:
        r = results(run_worker(c, ["push", "pull", "push", "pull"]))
        assert [x[1] for x in r] == ["PS_OK"] * 4, r
        assert r[1][2] >= 390, r             # the first pull waited for its reply
        assert r[1][3] == [-1.0] * 4, r      # which holds the first push
        assert r[3][2] < 390 and r[3][3] == [-2.0] * 4, r
        lines = fault_lines(c.log("server0"))
        assert len(lines) == 1 and "delayed sent pull-reply frame #1 by 400 ms on server.0" in lines[0], lines


def test_duplicated_clock_is_harmless():
    script = ["--mode", "sync", "push", "clock", "pull", "push", "clock", "pull", "push", "clock", "pull"]
    env = {"PSHARD_FAULT": "dup:type=clock:n=1:every=2:node=server.0"}
    with Cluster(1, 2, extra_env=env) as c:
        ps = [c.worker([binary("fault_worker")] + script, f"w{i}") for i in range(2)]
        assert c.wait(ps, RUN) == [0, 0], c.log("w0") + c.log("w1")
        for i in range(2):
            r = results(c.log(f"w{i}"))
            assert [x[1] for x in r] == ["PS_OK"] * 9, r
            # Each round is the mean of both workers' gradients: exactly -1 per round.
            assert [x[3] for x in r if x[0] == "pull"] == [[-1.0] * 4, [-2.0] * 4, [-3.0] * 4], r
        lines = fault_lines(c.log("server0"))
        assert len(lines) == 3 and all("duplicated received clock frame" in l for l in lines), lines


def test_failed_allocation_on_the_server_answers_nomem():
    env = {"PSHARD_FAULT": "alloc:type=push:n=1:node=server.0"}
    with Cluster(1, 1, extra_env=env) as c:
        r = results(run_worker(c, ["push", "push", "pull", "push", "pull"]))
        assert [x[:2] for x in r] == [("push", "PS_ERR_NOMEM"), ("push", "PS_OK"), ("pull", "PS_OK"),
                                      ("push", "PS_OK"), ("pull", "PS_OK")], r
        assert "out of memory" in r[0][4], r
        assert r[2][3] == [-1.0] * 4 and r[4][3] == [-2.0] * 4, r
        lines = fault_lines(c.log("server0"))
        assert len(lines) == 1 and "failed allocation #1 on server.0 while handling a received push" in lines[0], lines
        assert c.server_procs[0].poll() is None  # still serving


def test_rules_naming_the_worker():
    # The worker's blocking calls do their own socket I/O unless PSHARD_DIRECT=0; with
    # it, every frame passes the worker's connection layer.
    env = {"PSHARD_FAULT": "drop:type=pull-reply:n=1:node=worker.0;delay=300ms:type=push:dir=out:node=worker",
           "PSHARD_DIRECT": "0", "PSHARD_TIMEOUT_MS": "1000"}
    with Cluster(2, 1, extra_env=env) as c:
        r = results(run_worker(c, ["push", "pull", "pull"]))
        assert [x[1] for x in r] == ["PS_OK", "PS_ERR_TIMEOUT", "PS_OK"], r
        assert r[0][2] >= 290, r             # the push frames left 300 ms late
        assert r[2][3] == [-1.0] * 4, r
        for s in ("server0", "server1", "scheduler"):
            assert fault_lines(c.log(s)) == [], c.log(s)
