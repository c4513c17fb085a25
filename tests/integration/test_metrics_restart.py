"""The dashboard across a scheduler restart under `pshard run`: the scheduler started
again keeps its dashboard port, `pshard run` prints the address again, and every node's
metrics (NODE_METRICS) reach the new scheduler's /metrics."""
import os
import re
import signal
import subprocess
import threading
import time

from cluster import binary
from test_metrics import scrape, total

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1


def wait_for(lines, pattern, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in list(lines):
            m = re.search(pattern, line)
            if m:
                return m
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} in:\n" + "".join(lines))


def test_the_dashboard_survives_a_scheduler_restart():
    p = subprocess.Popen([binary("pshard"), "run", "-s", "2", "-w", "2", "--progress-ms", "0", "--",
                          binary("metrics_worker"), "100", "16", "100"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in p.stdout], daemon=True)
    reader.start()
    try:
        dash = wait_for(lines, r"\[pshard\] dashboard: (http://127\.0\.0\.1:\d+)/ ", 20 * SLOW).group(1)
        # Both workers counted before the kill.
        deadline = time.time() + 20 * SLOW
        while total(scrape(dash + "/metrics"), "ps_worker_clock") < 4 and time.time() < deadline:
            time.sleep(0.2)
        pids = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "pshard scheduler"], capture_output=True,
                              text=True).stdout.split()
        assert len(pids) == 1, pids
        os.kill(int(pids[0]), signal.SIGKILL)
        again = wait_for(lines, r"\[pshard\] dashboard \(the scheduler started again\): (http://[0-9.:]+)/ ",
                         20 * SLOW).group(1)
        assert again == dash  # the same port

        def figures():
            f = scrape(dash + "/metrics")
            roles = {ls["node"]: ls["role"] for _, ls, _ in f.get("ps_node_info", ("", []))[1]}
            servers = {ls["node"] for _, ls, _ in f.get("ps_server_info", ("", []))[1]}
            workers = {ls["node"] for _, ls, _ in f.get("ps_worker_info", ("", []))[1]}
            return f, roles, servers, workers

        # The new scheduler knows every node again, and each sends it its figures.
        deadline = time.time() + 20 * SLOW
        while time.time() < deadline:
            f, roles, servers, workers = figures()
            if len(servers) == 2 and len(workers) == 2:
                break
            time.sleep(0.2)
        assert len(servers) == 2 and len(workers) == 2, (roles, servers, workers)
        assert all(roles[n] == "server" for n in servers) and all(roles[n] == "worker" for n in workers)
        c0 = total(f, "ps_worker_clock")
        time.sleep(1.5)
        f, *_ = figures()
        assert total(f, "ps_worker_clock") > c0, "the workers' figures did not move after the restart"
        assert total(f, "ps_server_push_requests_total") > 0
        assert p.wait(timeout=90 * SLOW) == 0, "".join(lines)
        reader.join(timeout=10)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)
