"""/metrics of a server colocated in a worker (PSHARD_COLOCATE=1): served on an
ephemeral loopback port by default as `pshard server`'s is (PSHARD_HTTP_PORT,
PSHARD_HTTP_HOST; off for none), its address in ps_ctx_stat's http_port and in the
`http` label of ps_server_info, which the scheduler's /metrics carries for every
server."""
import os
import re
import socket
import subprocess

from cluster import Cluster, binary
from test_metrics import poll, scrape, total, url_in_log

STEPS = 20


def ports(c, n):
    return [int(poll(lambda: ((m := re.search(r"http_port (-?\d+)", c.log(f"worker{i}"))) is not None,
                              m and m.group(1)), 20, f"worker{i}'s http_port")) for i in range(n)]


def test_colocated_servers_serve_metrics():
    with Cluster(2, 2, colocate=True) as c:
        dash = url_in_log(c, "scheduler", "dashboard")
        ws = [c.worker([binary("metrics_worker"), str(STEPS), "64", "200"], f"worker{i}") for i in range(2)]
        hp = ports(c, 2)
        assert all(p > 0 for p in hp) and hp[0] != hp[1], hp
        for p in hp:
            url = f"http://127.0.0.1:{p}/metrics"
            # Each server holds a part of both tables and sees every push of both workers;
            # read while the workers run (their servers stop with the last of them).
            f = poll(lambda: (total(scrape(url), "ps_server_push_requests_total") >= 2 * 2 * 3, scrape(url)),
                     STEPS * 0.2, f"{url}: pushes")
            (info,) = f["ps_server_info"][1]
            assert info[1]["http"] == f"127.0.0.1:{p}", info
            assert total(f, "ps_server_push_seconds_count") >= 2 * 2 * 3
        assert c.wait(ws, 60) == [0, 0], c.log("worker0") + c.log("worker1")
        # The scheduler has every server's address among its figures.
        j = scrape(dash + "/metrics")
        assert sorted(int(ls["http"].rsplit(":", 1)[1]) for _, ls, _ in j["ps_server_info"][1]) == sorted(hp)


def test_colocated_metrics_off_and_a_bad_port():
    with Cluster(1, 1, colocate=True, extra_env={"PSHARD_HTTP_PORT": "off"}) as c:
        w = c.worker([binary("metrics_worker"), "2", "8", "0"], "worker0")
        assert c.wait([w], 60) == [0], c.log("worker0")
        assert "http_port -1" in c.log("worker0")
    # A taken port fails the open with the HTTP server's message; a bad value is refused.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        with Cluster(1, 1, colocate=True) as c:
            w = c.worker([binary("metrics_worker"), "2", "8", "0"], "worker0", {"PSHARD_HTTP_PORT": str(taken)})
            assert c.wait([w], 60) != [0]
            assert str(taken) in c.log("worker0"), c.log("worker0")
            w = c.worker([binary("metrics_worker"), "2", "8", "0"], "worker1", {"PSHARD_HTTP_PORT": "99999"})
            assert c.wait([w], 60) != [0]
            assert "PSHARD_HTTP_PORT" in c.log("worker1") and "or off" in c.log("worker1"), c.log("worker1")


def test_pshard_run_colocated_keeps_the_dashboard_port_its_own():
    """PSHARD_HTTP_PORT=P for `pshard run --colocate`: the dashboard takes P, and each
    colocated server a port of its own (as the server processes do)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PSHARD_HTTP_PORT=str(port))
    r = subprocess.run([binary("pshard"), "run", "--colocate", "-s", "2", "-w", "2", "--progress-ms", "0", "--",
                        binary("metrics_worker"), "3", "8", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"[pshard] dashboard: http://127.0.0.1:{port}/ " in r.stderr, r.stderr
    hp = [int(x) for x in re.findall(r"http_port (-?\d+)", r.stdout)]
    assert len(hp) == 2 and all(p > 0 and p != port for p in hp), r.stdout
