"""The counting switch (metrics=on|off, PSHARD_METRICS) and what the byte counters
count: with counting off every node still answers /metrics and STATS, its latency
histograms and byte counters stay flat, and the engine's own counters (requests taken
by a table) go on; a bad value is refused with a message."""
import json
import subprocess

from cluster import Cluster, binary
from test_metrics import poll, scrape, total, url_in_log

STEPS = 10


def stats_json(addr):
    p = subprocess.run([binary("pshard"), "stats", addr, "--json"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def server_addrs(c):
    j = stats_json(c.addr)
    return [n["addr"] for n in j["nodes"] if n["role"] == "server"]


def settled(url, steps=STEPS):
    """The server's text once it has rendered every push of the job (once a second)."""
    return poll(lambda: (total(scrape(url), "ps_server_push_requests_total") == 2 * steps, scrape(url)), 10,
                f"{url}: every push counted")


def run_job(c, env=None, steps=STEPS):
    w = c.worker([binary("metrics_worker"), str(steps), "64", "0"], "worker0", env)
    assert c.wait([w], 60) == [0], c.log("worker0")
    assert f"pushes {2 * steps} pulls {2 * steps}" in c.log("worker0")


def test_counting_off_keeps_every_answer_and_the_counters_flat():
    with Cluster(1, 1, extra_env={"PSHARD_METRICS": "off"}) as c:
        dash = url_in_log(c, "scheduler", "dashboard")
        srv = url_in_log(c, "server0", "metrics")
        run_job(c)
        f = settled(srv + "/metrics")
        assert total(f, "ps_metrics_counting") == 0
        assert total(f, "ps_server_push_seconds_count") == 0 and total(f, "ps_server_pull_seconds_count") == 0
        assert total(f, "ps_server_table_received_bytes_total") == 0
        assert total(f, "ps_server_table_sent_bytes_total") == 0
        # The engine's counters are the tables' state, not the request path's: they go on.
        assert total(f, "ps_server_push_requests_total") == 2 * STEPS
        assert total(f, "ps_server_table_rows", table="emb") > 0
        # The worker's figures, as the scheduler serves them after it left.
        j = poll(lambda: (total(scrape(dash + "/metrics"), "ps_worker_clock") == STEPS,
                          scrape(dash + "/metrics")), 10, "the worker's last figures")
        workers = [ls["node"] for _, ls, _ in j["ps_worker_info"][1]]
        assert len(workers) == 1
        assert total(j, "ps_metrics_counting", node=workers[0]) == 0
        for name in ("ps_client_push_requests_total", "ps_client_pull_requests_total", "ps_client_push_seconds_count",
                     "ps_client_pull_seconds_count", "ps_client_pushed_bytes_total", "ps_client_pulled_bytes_total"):
            assert total(j, name) == 0, name
        # STATS answers too, and says counting is off.
        (addr,) = server_addrs(c)
        s = stats_json(addr)
        assert s["metrics_counting"] == 0
        assert s["tables"]["emb"]["pushes"] == STEPS and s["tables"]["w"]["pulls"] == STEPS


def test_counting_on_for_the_servers_off_for_the_worker():
    with Cluster(1, 1) as c:
        dash = url_in_log(c, "scheduler", "dashboard")
        srv = url_in_log(c, "server0", "metrics")
        run_job(c, {"PSHARD_METRICS": "off"})
        f = settled(srv + "/metrics")
        assert total(f, "ps_metrics_counting") == 1
        assert total(f, "ps_server_push_seconds_count") == 2 * STEPS
        assert total(f, "ps_server_table_received_bytes_total", table="emb") > 0
        j = poll(lambda: (total(scrape(dash + "/metrics"), "ps_worker_clock") == STEPS,
                          scrape(dash + "/metrics")), 10, "the worker's last figures")
        assert total(j, "ps_client_push_seconds_count") == 0 and total(j, "ps_client_push_requests_total") == 0
        (addr,) = server_addrs(c)
        assert stats_json(addr)["metrics_counting"] == 1


def test_a_bad_value_is_refused():
    with Cluster(1, 1) as c:
        w = c.worker([binary("metrics_worker"), "1", "8", "0"], "worker0", {"PSHARD_METRICS": "sometimes"})
        assert c.wait([w], 30) != [0]
        assert "PSHARD_METRICS" in c.log("worker0") and "on or off" in c.log("worker0")
        p = subprocess.run([binary("pshard"), "server", "--scheduler", c.addr], capture_output=True, text=True,
                           timeout=30, env=dict(c.env, PSHARD_METRICS="2"))
        assert p.returncode != 0 and "bad PSHARD_METRICS '2' (on or off)" in p.stderr, p.stderr


def pm_job(tmp_path, env, floats, steps):
    """pm_worker alone on one server: its three dense tables' bytes as the server and
    the scheduler count them, and the worker's peer-memory parts."""
    out = str(tmp_path / "pm.txt")
    with Cluster(1, 1, extra_env=env) as c:
        dash = url_in_log(c, "scheduler", "dashboard")
        srv = url_in_log(c, "server0", "metrics")
        w = c.worker([binary("pm_worker"), "--floats", str(floats), "--steps", str(steps), "--out", out] +
                     (["--shared", "1"] if env.get("SHARED") else []), "worker0")
        assert c.wait([w], 120) == [0], c.log("worker0")
        parts = int(c.log("worker0").split("peer_mem_parts ")[1].split()[0])
        pushes = 4 * steps  # sum takes two a step
        f = poll(lambda: (total(scrape(srv + "/metrics"), "ps_server_push_requests_total") == pushes,
                          scrape(srv + "/metrics")), 10, "every push counted")
        j = poll(lambda: (total(scrape(dash + "/metrics"), "ps_worker_clock") == steps, scrape(dash + "/metrics")),
                 10, "the worker's last figures")
        return f, j, parts


def near(got, want, slack):
    return want <= got <= want * 1.001 + slack


def test_same_host_bytes_are_counted_as_the_socket_s(tmp_path):
    """A job with transport auto on one host: the values moved by peer memory (and by
    buffers shared with ps_alloc) are counted by table and by peer as the socket's are,
    within the frames' headers and keys of what the socket path counts."""
    n, steps = 1 << 20, 3
    v = n * 4
    cnt = n - 100000  # pm_worker's second push to "sum", a range inside the table
    want_in = {"sum": steps * (v + cnt * 4), "mean": steps * v, "async": steps * v}
    want_out = {t: (steps + 1) * v for t in want_in}  # a pull a step, and rank 0's last one
    slack = 64 << 10
    for env in ({}, {"SHARED": "1"}, {"PSHARD_PEER_MEM": "0"}):
        f, j, parts = pm_job(tmp_path, env, n, steps)
        assert (parts > 0) == (env.get("PSHARD_PEER_MEM") != "0"), (env, parts)
        for t in want_in:
            got_in = total(f, "ps_server_table_received_bytes_total", table=t)
            got_out = total(f, "ps_server_table_sent_bytes_total", table=t)
            assert near(got_in, want_in[t], slack), (env, t, got_in, want_in[t])
            assert near(got_out, want_out[t], slack), (env, t, got_out, want_out[t])
        peers = f["ps_server_received_bytes_total"][1]
        worker_in = max(val for _, ls, val in peers)
        assert near(worker_in, sum(want_in.values()), 3 * slack), (env, peers)
        worker_out = max(val for _, ls, val in f["ps_server_sent_bytes_total"][1])
        assert near(worker_out, sum(want_out.values()), 3 * slack), env
        # The worker's own: every value pushed and pulled, whichever way it went.
        assert near(total(j, "ps_client_pushed_bytes_total"), sum(want_in.values()), 3 * slack), env
        assert near(total(j, "ps_client_pulled_bytes_total"), sum(want_out.values()), 3 * slack), env


def test_the_worker_counts_each_table_s_traffic():
    """metrics_worker's two tables (emb: sparse, dim 8, 64 keys a step; w: dense, 1024
    floats, one slice) on two servers: the worker's /metrics, through the scheduler,
    has each table's bytes and frames with a table label, adding up to its totals."""
    with Cluster(2, 1) as c:
        dash = url_in_log(c, "scheduler", "dashboard")
        run_job(c)
        j = poll(lambda: (total(scrape(dash + "/metrics"), "ps_worker_clock") == STEPS, scrape(dash + "/metrics")),
                 10, "the worker's last figures")

        def t(name, table):
            return total(j, f"ps_client_table_{name}_total", table=table)

        assert sorted(ls["table"] for _, ls, _ in j["ps_client_table_pushed_bytes_total"][1]) == ["emb", "w"]
        assert t("pushed_bytes", "emb") == STEPS * 64 * (8 + 8 * 4)  # keys and rows
        assert t("pulled_bytes", "emb") == STEPS * 64 * 8 * 4
        assert t("pushed_bytes", "w") == STEPS * (1024 * 4 + 16)  # values and their one segment
        assert t("pulled_bytes", "w") == STEPS * 1024 * 4
        for name in ("pushed_bytes", "pulled_bytes"):
            assert t(name, "emb") + t(name, "w") == total(j, f"ps_client_{name}_total"), name
        # A push goes to both servers; the dense pull to the one holding w's slice.
        assert t("sent_frames", "w") == t("received_frames", "w") == STEPS * 3
        assert t("sent_frames", "emb") == t("received_frames", "emb") == STEPS * 4  # 64 keys reach both
