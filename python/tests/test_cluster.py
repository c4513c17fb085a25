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


def test_shared_arrays_are_read_and_written_in_place_by_the_servers():
    """pshard.zeros (ps_alloc): the same-host servers map the arrays and add the pushes
    and write the pulls in place; the results are those of ordinary arrays."""
    code = ("import numpy as np, pshard\n"
            "ps = pshard.connect()\n"
            "r = ps.rank\n"
            "w = ps.dense('w', 300000, opt='sgd', lr=0.5, init='zero')\n"
            "g = pshard.zeros(300000)\n"
            "g[:] = (np.arange(300000) % 7 + 1) * (r + 1) / 16\n"
            "out = pshard.zeros(300000)\n"
            "for step in range(3):\n"
            "    w.push(g, batch=1)\n"
            "    ps.clock()\n"
            "    w.pull(out=out)\n"
            "    plain = w.pull()\n"
            "    assert np.array_equal(out, plain), step\n"
            "want = -0.5 * 3 * (np.arange(300000) % 7 + 1) * 3 / 16 / 2\n"
            "np.testing.assert_allclose(out, want, rtol=1e-6)\n"
            "ps.barrier(timeout=20)\n"
            "if r == 0:\n"
            "    n = [int(ps.server_stats(i)['shared_requests']) for i in range(ps.num_servers)]\n"
            "    assert all(x > 0 for x in n), n\n"
            "    print('shared', n)\n"
            "print('OK', r)\n")
    rc, out = run_job(["--mode", "sync", "--", sys.executable, "-c", code])
    assert rc == 0, out
    assert re.search(r"shared \[\d+, \d+\]", out), out
    assert sorted(re.findall(r"OK (\d)", out)) == ["0", "1"], out
