"""The scheduler's dashboard in a real browser: Debian's chromium driven by playwright-core
(tests/integration/browser, installed by `make deps-test`) opens the dashboard of a
running job with every request not to 127.0.0.1 blocked, and sees its plots fill with
data and move on; the screenshot is saved in the test's output directory.
"""
import json
import os
import shutil
import subprocess

from cluster import Cluster, binary
from test_metrics import url_in_log

HERE = os.path.dirname(os.path.abspath(__file__))
BROWSER = os.path.join(HERE, "browser")


def test_dashboard_plots_fill_and_update(tmp_path):
    node = shutil.which("node")
    assert node, "node is missing: make deps-test installs it"
    assert os.path.isdir(os.path.join(BROWSER, "node_modules", "playwright-core")), \
        "playwright-core is missing: run make deps-test (npm ci in tests/integration/browser)"
    assert os.path.exists("/usr/bin/chromium"), "chromium is missing: make deps-test installs it"
    shot = tmp_path / "dashboard.png"
    with Cluster(2, 2, extra_env={"PSHARD_MODE": "async"}) as c:
        dash = url_in_log(c, "scheduler", "dashboard")
        ws = [c.worker([binary("metrics_worker"), "120", "256", "100"], f"worker{i}") for i in range(2)]
        r = subprocess.run([node, os.path.join(BROWSER, "dashboard.js"), dash + "/", str(shot)], cwd=BROWSER,
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr + r.stdout
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert c.wait(ws, 60) == [0, 0]
    first, second = seen["first"], seen["second"]
    assert seen["errors"] == [], seen["errors"]
    assert seen["blocked"] == [], "the page asked for something beyond the scheduler"
    for plot in ("plot-throughput", "plot-loss", "plot-split", "plot-network", "plot-memory", "plot-staleness"):
        assert first["points"][plot] > 0, f"{plot} has no data: {first}"
    assert second["points"]["plot-throughput"] > first["points"]["plot-throughput"], "the plots do not move on"
    assert second["updates"] > first["updates"] and second["last"] > first["last"]
    assert first["canvases"] >= 6
    roles = sorted(row[1] for row in second["rows"])
    assert roles == ["server", "server", "worker", "worker"], second["rows"]
    assert all(row[3] == "alive" for row in second["rows"])
    assert "running" in second["job"]
    assert shot.exists() and shot.stat().st_size > 20000
