"""`pshard stats HOST:PORT [--json]` and `pshard top HOST:PORT --once` against a running job: the scheduler lists every
node with its address, each server its tables; the JSON has the same figures as the
text, and pshard.core.parse_stats reads the text the same way."""
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from cluster import Cluster, binary  # noqa: E402


def stats(addr, *flags):
    p = subprocess.run([binary("pshard"), "stats", addr] + list(flags), capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_stats_of_every_node_of_a_running_job(tmp_path):
    core = None
    if not os.environ.get("PSHARD_SANITIZED"):  # a sanitized library loads only with its runtime preloaded
        import pshard.core as core
    with Cluster(2, 1) as c:
        w = c.worker([binary("ckpt_worker"), "--steps", "200", "--step-ms", "20", "--out", str(tmp_path / "p")], "w0")
        deadline = time.time() + 30
        while True:  # until the worker registered and the tables exist
            j = json.loads(stats(c.addr, "--json"))
            servers = [n for n in j.get("nodes", []) if n["role"] == "server" and n["alive"]]
            workers = [n for n in j.get("nodes", []) if n["role"] == "worker" and n["alive"]]
            if len(servers) == 2 and workers and j["started"] == 1:
                break
            assert time.time() < deadline and w.poll() is None, (j, c.log("w0"))
            time.sleep(0.1)
        assert sorted(n["rank"] for n in servers) == [0, 1]
        text = stats(c.addr)
        assert "role=server" in text and "addr=" in text
        if core:
            assert core.parse_stats(text)["nodes"] == j["nodes"]
        seen = set()
        for n in servers:
            deadline = time.time() + 30
            while True:
                sj = json.loads(stats(n["addr"], "--json"))
                if {"da", "dg", "sa", "sg"} <= set(sj["tables"]):
                    break
                assert time.time() < deadline, sj
                time.sleep(0.1)
            assert sj["server"] == n["id"] and sj["rank"] == n["rank"]
            assert isinstance(sj["push_staleness"], list)
            if core:
                assert set(core.parse_stats(stats(n["addr"]))["tables"]) == set(sj["tables"])
            for name, t in sj["tables"].items():
                assert t["name"] == name and isinstance(t["rows"], int)
            seen.add(n["id"])
        assert len(seen) == 2
        # pshard top --once: one frame with every server and the worker, rates measured
        top = subprocess.run([binary("pshard"), "top", c.addr, "--once"], capture_output=True, text=True, timeout=60)
        assert top.returncode == 0, top.stderr
        out = top.stdout
        assert "\033[" not in out, "no screen control with --once"
        assert "servers 2/2" in out and "workers 1/1" in out, out
        for n in servers:
            assert re.search(r"^%d\s+%d\s+%s\s+yes" % (n["id"], n["rank"], re.escape(n["addr"])), out, re.M), out
        wl = [l for l in out.splitlines() if re.match(r"^%d\s+0\s+yes" % workers[0]["id"], l)]
        assert len(wl) == 1, out
        assert "%" in wl[0], "the step split of a worker that reported twice: " + wl[0]
        w.kill()
    bad = subprocess.run([binary("pshard"), "stats", "127.0.0.1:1", "--timeout", "2000"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 1 and "pshard stats:" in bad.stderr
    bad = subprocess.run([binary("pshard"), "stats"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "HOST:PORT is required" in bad.stderr
