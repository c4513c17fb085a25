"""The metrics over HTTP: every server's /metrics and the scheduler's job-wide /metrics
(Prometheus text format 0.0.4), the dashboard's JSON API, and the HTTP server's answers
to bad requests and bad flags.

Every text is checked twice: by a strict checker of the format written here (HELP and
TYPE for every family before its samples, valid names and labels, no duplicate series,
counters named _total, cumulative histogram buckets ending in +Inf whose count is the
_count) and by the parser of Debian's python3-prometheus-client.
"""
import http.client
import json
import math
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, binary

CTYPE = "text/plain; version=0.0.4; charset=utf-8"
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)\Z")
PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|\Z)')


def parse_labels(text):
    labels, pos = {}, 0
    while pos < len(text):
        m = PAIR.match(text, pos)
        assert m, f"bad labels {{{text}}} at {pos}"
        name, value = m.group(1), m.group(2)
        assert LABEL.match(name) and not name.startswith("__"), f"bad label name {name!r}"
        assert re.fullmatch(r'(?:[^"\\\n]|\\[\\"n])*', value), f"bad escape in label value {value!r}"
        assert name not in labels, f"label {name} twice in {{{text}}}"
        labels[name] = value
        pos = m.end()
    return labels


def check_exposition(text):
    """The strict checker: returns {family: (type, [(sample name, labels, value)])}."""
    assert text.endswith("\n"), "the text must end with a newline"
    families, order, cur, helped = {}, [], None, set()
    series = set()
    for line in text.split("\n")[:-1]:
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            assert NAME.match(name) and help_, f"bad HELP line {line!r}"
            assert name not in helped, f"HELP of {name} twice"
            helped.add(name)
            continue
        if line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            assert name in helped, f"TYPE of {name} before its HELP"
            assert name not in families, f"family {name} declared twice"
            assert typ in ("counter", "gauge", "histogram"), f"{name}: type {typ!r}"
            assert name.startswith("ps_"), f"{name} is not a ps_ name"
            if typ == "counter":
                assert name.endswith("_total"), f"counter {name} does not end in _total"
            families[name] = (typ, [])
            order.append(name)
            cur = name
            continue
        assert not line.startswith("#"), f"unexpected comment {line!r}"
        m = SAMPLE.match(line)
        assert m, f"bad sample line {line!r}"
        name, labels, value = m.group(1), parse_labels(m.group(3) or ""), m.group(4)
        assert cur is not None, f"sample {line!r} before any TYPE"
        typ = families[cur][0]
        allowed = {cur} if typ != "histogram" else {cur + "_bucket", cur + "_sum", cur + "_count"}
        assert name in allowed, f"sample {name} is not of family {cur}"
        v = float(value)  # NaN and +Inf parse too
        key = (name, tuple(sorted(labels.items())))
        assert key not in series, f"duplicate series {line!r}"
        series.add(key)
        families[cur][1].append((name, labels, v))
    for name, (typ, samples) in families.items():
        assert name in helped
        if typ == "histogram":
            check_histogram(name, samples)
    return families


def check_histogram(name, samples):
    groups = {}
    for sname, labels, v in samples:
        rest = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
        g = groups.setdefault(rest, {"buckets": [], "sum": None, "count": None})
        if sname.endswith("_bucket"):
            assert "le" in labels, f"{name}: a bucket without le"
            g["buckets"].append((float(labels["le"]), v, labels["le"]))
        elif sname.endswith("_sum"):
            g["sum"] = v
        else:
            g["count"] = v
    for rest, g in groups.items():
        b = g["buckets"]
        assert b, f"{name}{rest}: no buckets"
        assert b[-1][2] == "+Inf", f"{name}{rest}: the last bucket is not +Inf"
        les = [x[0] for x in b]
        assert les == sorted(les) and len(set(les)) == len(les), f"{name}{rest}: le not increasing"
        counts = [x[1] for x in b]
        assert counts == sorted(counts), f"{name}{rest}: buckets are not cumulative"
        assert g["count"] is not None and g["sum"] is not None, f"{name}{rest}: no _sum or _count"
        assert g["count"] == b[-1][1], f"{name}{rest}: _count {g['count']} != +Inf bucket {b[-1][1]}"


def check_with_client(text, families):
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (typ, samples) in families.items():
        base = name[:-6] if typ == "counter" else name  # the client drops _total from a counter's name
        assert base in parsed, f"prometheus_client did not find {name}"
        assert parsed[base].type == typ, f"{name}: the client says {parsed[base].type}"
        assert len(parsed[base].samples) == len(samples), f"{name}: sample counts differ"


def get(url, method="GET", body=None):
    req = urllib.request.Request(url, method=method, data=body)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def scrape(url):
    status, headers, text = get(url)
    assert status == 200, f"{url}: {status}"
    assert headers["Content-Type"] == CTYPE
    families = check_exposition(text)
    check_with_client(text, families)
    return families


def total(families, name, **labels):
    """The sum of the samples named name (a family's, or a histogram's _count) with labels."""
    return sum(v for _, samples in families.values() for sname, ls, v in samples
               if sname == name and all(ls.get(k) == x for k, x in labels.items()))


def url_in_log(c, name, what, timeout=10):
    deadline = time.time() + timeout
    pat = re.compile(what + r" on (http://[0-9.:]+)")
    while time.time() < deadline:
        m = pat.search(c.log(name))
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise AssertionError(f"{name} printed no {what} address:\n{c.log(name)}")


def poll(fn, timeout, what):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        ok, last = fn()
        if ok:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: {last}")


STEPS = 20


@pytest.fixture(scope="module")
def job():
    """2 servers and 2 workers that ran STEPS steps each; the daemons stay up."""
    with Cluster(2, 2) as c:
        dash = url_in_log(c, "scheduler", "dashboard")
        srv = [url_in_log(c, f"server{i}", "metrics") for i in range(2)]
        ws = [c.worker([binary("metrics_worker"), str(STEPS), "64", "200"], f"worker{i}") for i in range(2)]
        assert c.wait(ws, 60) == [0, 0], c.log("worker0") + c.log("worker1")
        for i in range(2):
            assert f"pushes {2 * STEPS} pulls {2 * STEPS}" in c.log(f"worker{i}")
        yield c, dash, srv


def test_server_metrics_are_valid_and_count_the_job(job):
    c, dash, srv = job
    for u in srv:
        f = scrape(u + "/metrics")
        for fam in ("ps_server_push_seconds", "ps_server_pull_seconds", "ps_server_push_requests_total",
                    "ps_server_table_rows", "ps_server_table_parameter_bytes", "ps_server_table_optimizer_bytes",
                    "ps_server_received_bytes_total", "ps_server_sent_bytes_total", "ps_server_pending_pulls",
                    "ps_process_resident_memory_bytes", "ps_server_push_staleness_clocks"):
            assert fam in f, f"{u}: no {fam}"
        # Both tables are split over both servers: every push of a worker reached each.
        poll(lambda: (total(scrape(u + "/metrics"), "ps_server_push_requests_total") == 2 * 2 * STEPS,
                      total(scrape(u + "/metrics"), "ps_server_push_requests_total")), 10, f"{u} push count")
        f = scrape(u + "/metrics")
        assert total(f, "ps_server_push_seconds_count") >= 2 * 2 * STEPS
        assert total(f, "ps_process_resident_memory_bytes") > 1 << 20
        rows = total(f, "ps_server_table_rows", table="emb")
        assert rows > 0
        # emb rows are 8 floats with adagrad's one slot of state, w's 1024 floats with none.
        assert total(f, "ps_server_table_parameter_bytes", table="emb") == rows * 8 * 4
        assert total(f, "ps_server_table_optimizer_bytes", table="emb") == rows * 8 * 4
        assert total(f, "ps_server_table_optimizer_bytes", table="w") == 0
        assert total(f, "ps_server_received_bytes_total") > 0 and total(f, "ps_server_sent_bytes_total") > 0
        assert total(f, "ps_server_table_sent_bytes_total", table="emb") > 0
        assert total(f, "ps_server_table_received_bytes_total", table="emb") > 0


def test_job_metrics_are_the_sum_of_the_nodes(job):
    c, dash, srv = job

    def agree():
        j = scrape(dash + "/metrics")
        got = []
        for u in srv:
            own = scrape(u + "/metrics")
            sid = next(ls["server"] for n, ls, v in own["ps_server_info"][1])
            for name in ("ps_server_push_requests_total", "ps_server_pull_requests_total",
                         "ps_server_push_seconds_count", "ps_server_table_rows"):
                got.append((name, sid, total(own, name), total(j, name, node=sid)))
        return all(a == b for _, _, a, b in got), got

    poll(agree, 10, "the job's figures are the servers' own")
    j = scrape(dash + "/metrics")
    # The workers' own figures come with their heartbeats, the last one sent as they left.
    assert total(j, "ps_client_push_requests_total") == 2 * 2 * STEPS
    assert total(j, "ps_client_pull_requests_total") == 2 * 2 * STEPS
    assert total(j, "ps_client_push_seconds_count") == 2 * 2 * STEPS
    assert total(j, "ps_client_pull_seconds_count") == 2 * 2 * STEPS
    assert total(j, "ps_worker_compute_seconds_total") > 0
    assert total(j, "ps_server_push_requests_total") == 2 * (2 * 2 * STEPS)
    # The sparse pulls' answers: 64 rows of 8 floats a step and worker, and a header each.
    assert total(j, "ps_server_table_sent_bytes_total", table="emb") >= 2 * STEPS * 64 * 8 * 4
    info = j["ps_node_info"][1]
    assert sorted(ls["role"] for _, ls, _ in info) == ["server", "server", "worker", "worker"]
    assert sorted(ls["state"] for _, ls, _ in info) == ["alive", "alive", "left", "left"]
    # Every node's samples carry its node label.
    for name in ("ps_client_push_seconds", "ps_server_push_seconds"):
        assert all("node" in ls for _, ls, _ in j[name][1])
    loss = [v for _, ls, v in j["ps_user_metric"][1] if ls["name"] == "loss"]
    assert len(loss) == 2 and all(abs(v - 1 / math.sqrt(STEPS)) < 1e-6 for v in loss)


def test_api_snapshot_and_history(job):
    c, dash, srv = job
    status, headers, body = get(dash + "/api/snapshot")
    assert status == 200 and headers["Content-Type"] == "application/json"
    snap = json.loads(body)
    roles = sorted((n["role"], n["state"]) for n in snap["nodes"])
    assert roles == [("server", "alive"), ("server", "alive"), ("worker", "left"), ("worker", "left")]
    for n in snap["nodes"]:
        if n["role"] == "server":
            assert re.fullmatch(r"127\.0\.0\.1:\d+", n["addr"])
            assert n["figures"]["resident_bytes"] > 1 << 20
        assert set(n["figures"]) >= {"examples_per_s", "loss", "compute", "pull_wait", "push_wait",
                                     "bytes_in_per_s", "bytes_out_per_s", "table_bytes", "staleness"}
    h = json.loads(get(dash + "/api/history")[2])
    assert h["interval_s"] == 1 and len(h["t"]) >= 2
    assert all(b > a for a, b in zip(h["t"], h["t"][1:])), "the sample times increase"
    for n in h["nodes"]:
        for f in h["fields"]:
            assert len(n["series"][f]) == len(h["t"])
    workers = [n for n in h["nodes"] if n["role"] == "worker"]
    assert len(workers) == 2
    assert any(v for n in workers for v in n["series"]["pushes_per_s"] if v), "the workers' push rate was sampled"
    assert any(v is not None for n in workers for v in n["series"]["loss"])


def test_bad_requests(job):
    c, dash, srv = job
    for base in (dash, srv[0]):
        assert get(base + "/no/such/path")[0] == 404
        assert get(base + "/metrics", method="POST", body=b"x=1")[0] == 405
        assert get(base + "/metrics", method="DELETE")[0] == 405
        host, port = base[len("http://"):].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("HEAD", "/metrics")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == CTYPE and r.read() == b""
        conn.close()
        # Garbage instead of HTTP gets an answer or a close, and the server goes on.
        s = socket.create_connection((host, int(port)), timeout=2)
        s.sendall(b"\x00\x01garbage\r\n\r\n")
        try:
            s.recv(4096)
        except OSError:
            pass
        s.close()
        assert get(base + "/metrics")[0] == 200
    # A few connections that send nothing do not keep others out; 32 from one address are
    # its limit, and the next is closed unanswered until they go.
    host, port = dash[len("http://"):].split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(8)]
    try:
        assert get(dash + "/metrics")[0] == 200
        idle += [socket.create_connection((host, int(port)), timeout=10) for _ in range(24)]
        time.sleep(0.3)  # the server thread takes them all in
        with pytest.raises((ConnectionError, http.client.HTTPException, urllib.error.URLError, OSError)):
            get(dash + "/metrics")
    finally:
        for s in idle:
            s.close()
    def served():
        try:
            return get(dash + "/metrics")[0] == 200, "served"
        except OSError as e:
            return False, repr(e)
    poll(served, 10, "served again once the idle ones closed")


def run_cli(args, env=None, timeout=20):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([binary("pshard")] + args, capture_output=True, text=True, timeout=timeout, env=e)


def test_http_flags():
    r = run_cli(["scheduler", "--servers", "1", "--workers", "1", "--http-port", "nope"])
    assert r.returncode == 2 and "bad value 'nope' for --http-port" in r.stderr
    r = run_cli(["server", "--scheduler", "127.0.0.1:1", "--http-port", "70000"])
    assert r.returncode == 2 and "--http-port" in r.stderr
    r = run_cli(["scheduler", "--servers", "1", "--workers", "1"], env={"PSHARD_HTTP_PORT": "x"})
    assert r.returncode == 2 and "PSHARD_HTTP_PORT" in r.stderr
    r = run_cli(["run", "--http-port", "-1", "--", "true"])
    assert r.returncode == 2 and "--http-port" in r.stderr
    # A port in use is a clear error, not a crash.
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        r = run_cli(["scheduler", "--servers", "1", "--workers", "1", "--http-port", str(port)])
        assert r.returncode == 1 and f"cannot serve HTTP on 127.0.0.1:{port}" in r.stderr, r.stderr
    finally:
        busy.close()


def test_http_off_and_fixed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with Cluster(1, 1, extra_env={"PSHARD_HTTP_PORT": "off"}) as c:
        w = c.worker([binary("metrics_worker"), "2", "4", "0"], "worker0")
        assert c.wait([w], 30) == [0]
        assert "dashboard on" not in c.log("scheduler") and "metrics on" not in c.log("server0")
    p = subprocess.Popen([binary("pshard"), "scheduler", "--servers", "1", "--workers", "1", "--http-port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = [p.stdout.readline() for _ in range(3)]
        assert any(f"dashboard on http://127.0.0.1:{port}/" in x for x in lines), lines
        scrape(f"http://127.0.0.1:{port}/metrics")
        status, headers, body = get(f"http://127.0.0.1:{port}/")
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8" and "uPlot" in body
    finally:
        os.killpg(p.pid, 9)
        p.wait(timeout=5)
        p.stdout.close()


def test_run_prints_the_dashboard():
    r = run_cli(["run", "-s", "1", "-w", "1", "--", binary("metrics_worker"), "3", "4", "0"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"\[pshard\] dashboard: http://127\.0\.0\.1:\d+/ ", r.stderr), r.stderr
