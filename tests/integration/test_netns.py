"""Links shaped like a cluster's (bench/netns.py): a job whose nodes each live in a
network namespace, every link limited to 1 Gbit/s by tc tbf.

A 1-server 1-worker job across the namespaces trains (its loss falls), and a bulk
dense pull through the shaped links runs at the shaped rate: below 1.3 Gbit/s (the
shaping works) and above 0.5 Gbit/s (it is the link, not something else, that limits).
Needs root; skipped with the reason otherwise.
"""
import os
import sys

import pytest

from cluster import binary

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import netns  # noqa: E402

SANITIZED = bool(os.environ.get("PSHARD_SANITIZED"))


@pytest.fixture
def links():
    try:
        net = netns.Links(rate_gbit=1)
    except netns.Unavailable as e:
        pytest.skip(f"shaped links unavailable: {e}")
    try:
        yield net
    finally:
        net.close()
    left = [ns for ns in netns._namespaces() if ns.startswith(net.tag)]
    assert left == [], f"namespaces left behind: {left}"


def lines_of(net, p):
    out = {}
    for line in net.log(p).splitlines():
        parts = line.split()
        if parts:
            out[parts[0]] = parts[1:]
    return out


def test_job_across_namespaces_trains_and_a_bulk_pull_runs_at_the_shaped_rate(links):
    worker = binary(os.path.join("bench", "links_worker"))
    job = netns.Job(links, binary("pshard"), servers=1, workers=1)
    assert job.addr.startswith(netns.SUBNET + "."), job.addr
    ws = job.workers([worker, "--mb", "1", "--steps", "8", "--warmup", "1"])
    links.wait(ws, timeout=120)
    out = lines_of(links, ws[0])
    l0, l1 = float(out["loss"][0]), float(out["loss"][1])
    assert l0 > 0.1 and l1 < l0 * 0.01, f"loss {l0} -> {l1}"
    pushed, pulled = float(out["payload"][0]), float(out["payload"][1])
    assert pushed >= 8 * 4 * 262144 and pulled >= 9 * 4 * 262144, out["payload"]
    links.wait([job.scheduler], timeout=30)

    job2 = netns.Job(links, binary("pshard"), servers=1, workers=1)
    mb = 16 if SANITIZED else 32
    ws = job2.workers([worker, "--mb", str(mb), "--steps", "5", "--pull-only"])
    links.wait(ws, timeout=120)
    gbps = float(lines_of(links, ws[0])["pull_gbps"][0])
    assert 0.5 < gbps < 1.3, f"bulk pull at {gbps:.3f} Gbit/s through a 1 Gbit/s link"
