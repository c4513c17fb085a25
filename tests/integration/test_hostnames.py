"""Host names where addresses are expected: a job whose scheduler binds `localhost` and
whose server and worker reach it as `localhost:PORT` trains normally (names are looked
up; numeric addresses need no lookup)."""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import binary  # noqa: E402


def test_a_job_reached_through_localhost(tmp_path):
    addr_file = str(tmp_path / "addr")
    sched = subprocess.Popen([binary("pshard"), "scheduler", "--servers", "1", "--workers", "1", "--host", "localhost",
                              "--addr-file", addr_file, "--exit-when-done"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    procs = [sched]
    try:
        deadline = time.time() + 10
        while not os.path.exists(addr_file) and time.time() < deadline and sched.poll() is None:
            time.sleep(0.02)
        assert os.path.exists(addr_file), sched.communicate(timeout=5)[0]
        port = open(addr_file).read().strip().rsplit(":", 1)[1]
        where = "localhost:" + port
        procs.append(subprocess.Popen([binary("pshard"), "server", "--scheduler", where], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        out = str(tmp_path / "params")
        env = dict(os.environ, PSHARD_SCHEDULER=where)
        w = subprocess.run([binary("ckpt_worker"), "--steps", "3", "--out", out], env=env, capture_output=True, text=True,
                           timeout=60)
        assert w.returncode == 0, w.stdout + w.stderr
        assert len(open(out).read().splitlines()) > 0
        assert sched.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_worker_pointed_at_no_scheduler_says_so_before_it_gives_up():
    env = dict(os.environ, PSHARD_SCHEDULER="127.0.0.1:1", PSHARD_CONNECT_TIMEOUT_MS="5000")
    t0 = time.time()
    w = subprocess.run([binary("ckpt_worker"), "--steps", "1", "--out", os.devnull], env=env, capture_output=True,
                       text=True, timeout=60)
    assert w.returncode != 0
    assert "the scheduler at 127.0.0.1:1 refuses connections" in w.stderr, w.stderr
    assert "retried for 5000 ms" in w.stderr, w.stderr
    assert w.stderr.index("refuses connections") < w.stderr.index("retried for"), "the note comes first"
    assert time.time() - t0 < 30
