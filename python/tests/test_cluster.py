"""Two worker processes, two servers and a scheduler started by `pshard run`."""
import os
import re
import subprocess
import sys

import pshard

HERE = os.path.dirname(os.path.abspath(__file__))


def run_job(args, timeout=90):
    cmd = [pshard.find_command(), "run", "-s", "2", "-w", "2", "--progress-ms", "0", *args]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                       start_new_session=True)
    return p.returncode, p.stdout


def test_two_workers_sync():
    rc, out = run_job(["--mode", "sync", "--", sys.executable, os.path.join(HERE, "cluster_worker.py")])
    assert rc == 0, out
    oks = re.findall(r"OK (\d) tasks=\[([\d, ]*)\]", out)
    assert sorted(r for r, _ in oks) == ["0", "1"], out
    parts = sorted(int(x) for _, ps in oks for x in ps.split(",") if x.strip())
    assert parts == list(range(6)), out          # every partition processed exactly once


def test_worker_error_reaches_the_launcher():
    code = ("import pshard\n"
            "ps = pshard.connect()\n"
            "t = ps.dense('w', 4)\n"
            "try:\n"
            "    t.push([1.0, 2.0])\n"
            "except pshard.SizeError as e:\n"
            "    print('caught', e.name)\n"
            "    raise SystemExit(3)\n")
    rc, out = run_job(["--", sys.executable, "-c", code])
    assert rc == 3, out
    assert "caught PS_ERR_SIZE" in out
