"""Incremental checkpoints end to end (`pshard run --checkpoint-full-every N`): a whole
checkpoint, then increments holding only the rows changed since the one before; a
restore reads the chain. Real processes on loopback (tests/integration/ckpt_worker.c).
"""
import os
import shutil
import struct
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import binary  # noqa: E402
from test_checkpoint import complete_checkpoints, launch  # noqa: E402

KEYS = 4096  # the sparse tables' key space: a step touches a few dozen keys of it


def train(tmp, name, servers, workers, steps, ckpt_at=None, ckpt_dir=None, restore=None, keep=None,
          full_every=None):
    out = os.path.join(tmp, name + ".params")
    argv = [binary("pshard"), "run", "-s", str(servers), "-w", str(workers), "--mode", "sync",
            "--progress-ms", "0"]
    if ckpt_dir:
        argv += ["--checkpoint-dir", ckpt_dir]
    if keep:
        argv += ["--checkpoint-keep", str(keep)]
    if full_every:
        argv += ["--checkpoint-full-every", str(full_every)]
    if restore:
        argv += ["--restore", restore]
    argv += ["--", binary("ckpt_worker"), "--steps", str(steps), "--out", out, "--keyspace", str(KEYS)]
    if ckpt_at is not None:
        argv += ["--ckpt-at", ",".join(str(c) for c in ckpt_at)]
    rc, so, se = launch(argv, timeout=120)
    assert rc == 0, f"{name}: exit {rc}\n{so}\n{se}"
    with open(out) as f:
        return f.read().splitlines(), so + se


def header(path):
    """(id, clock, base) of a checkpoint file's HEADER block (format 2)."""
    with open(path, "rb") as f:
        b = f.read(16 + 56)
    magic, fmt = struct.unpack_from("<II", b, 16)
    assert magic == 0x4B435350 and fmt == 2, (hex(magic), fmt)
    fid, clock, _, base = struct.unpack_from("<QqQQ", b, 16 + 24)
    return fid, clock, base


def data_bytes(ckdir):
    return sum(os.path.getsize(os.path.join(ckdir, f)) for f in os.listdir(ckdir) if f.endswith(".psck"))


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="pshard-incr-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_chain_restores_what_a_whole_checkpoint_at_the_same_clock_holds(tmp):
    ck = os.path.join(tmp, "chain")
    at8, log = train(tmp, "chain", 2, 2, 8, ckpt_at=[2, 4, 6, 8], ckpt_dir=ck, keep=1, full_every=4)
    assert complete_checkpoints(ck) == [1, 2, 3, 4], "a kept increment keeps the chain it builds on"
    for i in (1, 2, 3, 4):
        d = os.path.join(ck, "ckpt-%d" % i)
        for f in ("MANIFEST", "server-0.psck", "server-1.psck"):
            assert header(os.path.join(d, f)) == (i, 2 * i, 0 if i == 1 else i - 1), (i, f)
    # The same job with whole checkpoints only: its checkpoint at clock 8.
    wk = os.path.join(tmp, "whole")
    same, _ = train(tmp, "whole", 2, 2, 8, ckpt_at=[8], ckpt_dir=wk)
    assert same == at8
    full = data_bytes(os.path.join(wk, "ckpt-1"))
    sizes = [data_bytes(os.path.join(ck, "ckpt-%d" % i)) for i in (1, 2, 3, 4)]
    print("whole at clock 8:", full, "bytes; the chain:", sizes)
    for i, inc in enumerate(sizes[1:], 2):
        assert inc < full * 0.6, f"increment {i}: {inc} bytes, a whole one at clock 8 {full}"
    # Restored onto three servers (no step taken): the chain and the whole checkpoint
    # give the parameters the job had at clock 8, bit for bit.
    from_chain, log = train(tmp, "from_chain", 3, 2, 8, restore=os.path.join(ck, "ckpt-4"))
    assert "rank 0 starts at clock 8" in log, log
    assert from_chain == at8
    from_whole, _ = train(tmp, "from_whole", 3, 2, 8, restore=wk)
    assert from_whole == at8
    # And training goes on from the chain exactly as an uninterrupted run: optimiser
    # state (adam moments and steps, adagrad sums) came back too.
    uninterrupted, _ = train(tmp, "to12", 2, 2, 12)
    resumed, _ = train(tmp, "chain12", 1, 2, 12, restore=ck)
    assert resumed == uninterrupted


def test_every_nth_checkpoint_is_whole_and_old_chains_are_pruned(tmp):
    ck = os.path.join(tmp, "ck")
    _, log = train(tmp, "five", 2, 1, 10, ckpt_at=[2, 4, 6, 8, 10], ckpt_dir=ck, keep=1, full_every=3)
    # 1 whole, 2 and 3 increments, 4 whole, 5 an increment on 4: keeping one leaves 4 and 5.
    assert complete_checkpoints(ck) == [4, 5], complete_checkpoints(ck)
    assert header(os.path.join(ck, "ckpt-4", "MANIFEST"))[2] == 0
    assert header(os.path.join(ck, "ckpt-5", "MANIFEST"))[2] == 4


def test_a_missing_base_is_refused_by_name(tmp):
    ck = os.path.join(tmp, "ck")
    train(tmp, "two", 1, 1, 4, ckpt_at=[2, 4], ckpt_dir=ck, full_every=2)
    shutil.rmtree(os.path.join(ck, "ckpt-1"))
    argv = [binary("pshard"), "run", "-s", "1", "-w", "1", "--mode", "sync", "--progress-ms", "0",
            "--restore", os.path.join(ck, "ckpt-2"), "--", binary("ckpt_worker"), "--steps", "4",
            "--out", os.path.join(tmp, "x"), "--keyspace", str(KEYS)]
    rc, so, se = launch(argv, timeout=60)
    assert rc != 0
    assert "an increment on checkpoint 1" in so + se, so + se


def test_checkpoint_every_takes_a_duration(tmp):
    ck = os.path.join(tmp, "ck")
    out = os.path.join(tmp, "p")
    argv = [binary("pshard"), "run", "-s", "2", "-w", "2", "--mode", "sync", "--progress-ms", "0",
            "--checkpoint-dir", ck, "--checkpoint-every", "300ms", "--checkpoint-keep", "100", "--",
            binary("ckpt_worker"), "--steps", "30", "--step-ms", "50", "--out", out, "--keyspace", str(KEYS)]
    rc, so, se = launch(argv, timeout=120)
    assert rc == 0, so + se
    got = complete_checkpoints(ck)
    # 30 steps of at least 50 ms: 1.5 s or more, a checkpoint asked for every 300 ms
    assert len(got) >= 2, (got, so + se)
    clocks = sorted(header(os.path.join(ck, "ckpt-%d" % i, "MANIFEST"))[1] for i in got)
    assert clocks == sorted(set(clocks)) and clocks[0] > 0, clocks
    bad = [binary("pshard"), "run", "-s", "1", "-w", "1", "--checkpoint-dir", ck, "--checkpoint-every", "5x", "--",
           binary("ckpt_worker"), "--steps", "1"]
    rc, so, se = launch(bad, timeout=30)
    assert rc == 2 and "bad value '5x' for --checkpoint-every" in se, (rc, so, se)
