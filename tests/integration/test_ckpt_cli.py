"""The command's side of checkpoints: the flags of `pshard run`, `pshard exec` and
`pshard server` are checked before anything starts, and `pshard run` hands them to the
roles it starts. Tests marked `merged` need the scheduler's checkpoint flags and are
skipped until that side is in the tree."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import binary  # noqa: E402

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1


def run(argv, timeout=60, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout * SLOW, **kw)


def test_run_checks_the_checkpoint_flags(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    cases = (
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--checkpoint-keep", "2"], "--checkpoint-keep needs --checkpoint-dir"),
        (["--checkpoint-dir", str(tmp_path), "--checkpoint-keep", "0"], "--checkpoint-keep"),
        (["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "often"], "--checkpoint-every"),
        (["--checkpoint-dir", ""], "--checkpoint-dir"),
        (["--restore", str(tmp_path / "missing")], "No such file"),
        (["--restore", str(f)], "not a directory"),
        (["--colocate", "-w", "2", "--restore", str(tmp_path)], "--colocate"),
    )
    for flags, msg in cases:
        r = run([binary("pshard"), "run", *flags, "--", "true"])
        assert r.returncode == 2, (flags, r.stderr)
        assert msg in r.stderr, (flags, r.stderr)
    assert not (tmp_path / "ckpt-1").exists()


def test_run_help_lists_the_checkpoint_flags():
    r = run([binary("pshard"), "run", "--help"])
    assert r.returncode == 0
    for flag in ("--checkpoint-dir", "--checkpoint-every", "--checkpoint-keep", "--restore"):
        assert flag in r.stdout, flag


def test_run_cannot_create_the_checkpoint_directory(tmp_path):
    r = run([binary("pshard"), "run", "--checkpoint-dir", str(tmp_path / "a" / "b"), "--", "true"])
    assert r.returncode == 1
    assert "cannot create the checkpoint directory" in r.stderr, r.stderr


def test_exec_checks_the_checkpoint_flags(tmp_path):
    env = dict(os.environ, OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="3")
    for flags, msg in ((["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
                       (["--restore", str(tmp_path / "missing")], "--restore"),
                       (["--colocate", "--restore", str(tmp_path)], "--colocate")):
        r = run([binary("pshard"), "exec", "-s", "1", "--addr-file", str(tmp_path / "addr"), *flags, "--", "true"],
                env=env)
        assert r.returncode == 2, (flags, r.stderr)
        assert msg in r.stderr, (flags, r.stderr)


def test_server_restore_flag():
    r = run([binary("pshard"), "server", "--help"])
    assert r.returncode == 0 and "--restore DIR" in r.stdout
    r = run([binary("pshard"), "server", "--scheduler", "127.0.0.1:1", "--restore", ""])
    assert r.returncode == 2 and "--restore" in r.stderr, r.stderr
    r = run([binary("pshard"), "server", "--scheduler", "127.0.0.1:1", "--restore", "d" * 1100])
    assert r.returncode == 2 and "--restore" in r.stderr, r.stderr


def test_run_passes_the_checkpoint_settings(tmp_path):
    d = tmp_path / "ckpt"
    r = run([binary("pshard"), "run", "-s", "1", "-w", "2", "--progress-ms", "0", "--checkpoint-dir", str(d),
             "--checkpoint-every", "5", "--checkpoint-keep", "2", "--", "sh", "-c",
             'echo "every=$PSHARD_CHECKPOINT_EVERY"'])
    assert r.returncode == 0, r.stderr
    assert d.is_dir()
    lines = [l for l in r.stdout.splitlines() if "every=" in l]
    assert len(lines) == 2 and all(l.endswith("every=5") for l in lines), r.stdout


# ------------------------------------------------------------------------- inspect a chain

import re  # noqa: E402
import shutil  # noqa: E402


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A real job's chain: checkpoints at clocks 2, 4, 6 with --checkpoint-full-every 3
    (1 whole, 2 and 3 increments)."""
    d = str(tmp_path_factory.mktemp("chain") / "ck")
    r = run([binary("pshard"), "run", "-s", "2", "-w", "2", "--mode", "sync", "--progress-ms", "0",
             "--checkpoint-dir", d, "--checkpoint-full-every", "3", "--", binary("ckpt_worker"), "--steps", "6",
             "--out", d + ".params", "--keyspace", "4096", "--ckpt-at", "2,4,6"], timeout=120,
            start_new_session=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def inspect(*args):
    return run([binary("pshard"), "checkpoint", "inspect", *map(str, args)])


def sizes(ckdir):
    return sum(os.path.getsize(os.path.join(ckdir, f)) for f in os.listdir(ckdir))


def test_inspect_a_chain(chain):
    out = inspect(chain)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert text.startswith("checkpoint %s/ckpt-3\n" % chain), text
    assert "  an increment on checkpoint 2; chain: 1 2 3\n" in text, text
    # every file of the chain verified, block by block
    for i in (1, 2, 3):
        assert "checkpoint %s/ckpt-%d\n" % (chain, i) in text
    assert text.count("    block 0    HEADER") == 9          # 3 manifests, 6 data files
    assert text.count("    verified\n") == 6 and "FAILED" not in text
    # per checkpoint its bytes and rows, and the total
    lines = dict((int(m.group(1)), m.groups()[1:]) for m in
                 re.finditer(r"^  checkpoint (\d+) +(whole|increment) +clock (\d+) +(\d+) bytes, (\d+) rows$", text,
                             re.M))
    assert sorted(lines) == [1, 2, 3], text
    assert [lines[i][:2] for i in (1, 2, 3)] == [("whole", "2"), ("increment", "4"), ("increment", "6")]
    for i in (1, 2, 3):
        assert int(lines[i][2]) == sizes(os.path.join(chain, "ckpt-%d" % i))
    total = sum(int(lines[i][2]) for i in (1, 2, 3)), sum(int(lines[i][3]) for i in (1, 2, 3))
    assert "  total: 3 checkpoints, %d bytes, %d rows\n" % total in text
    assert text.rstrip().endswith("result: verified")
    # --summary: no block lines, the chain on one line
    out = inspect("--summary", os.path.join(chain, "ckpt-3"))
    assert out.returncode == 0 and "block 0" not in out.stdout, out.stdout
    summary = [l for l in out.stdout.splitlines() if l.startswith("chain:")]
    assert len(summary) == 1, out.stdout
    assert summary[0].startswith("chain: 1 (whole, %s bytes, %s rows), 2 (increment, " % lines[1][2:])
    assert summary[0].endswith("; total 3 checkpoints, %d bytes, %d rows" % total), summary
    # a checkpoint in the middle reads its own chain; the whole one has none
    out = inspect(os.path.join(chain, "ckpt-2"))
    assert out.returncode == 0 and "chain: 1 2\n" in out.stdout and "ckpt-3" not in out.stdout, out.stdout
    out = inspect(os.path.join(chain, "ckpt-1"))
    assert out.returncode == 0 and "an increment" not in out.stdout and "chain:" not in out.stdout, out.stdout


def test_inspect_refuses_a_damaged_or_missing_base(chain, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(chain, d)
    victim = os.path.join(d, "ckpt-1", "server-0.psck")
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    out = inspect("--summary", d)
    assert out.returncode == 1, out.stdout
    assert "FAILED: checkpoint %s" % victim in out.stdout and "result: FAILED (1 problem)" in out.stdout, out.stdout
    shutil.rmtree(os.path.join(d, "ckpt-2"))
    out = inspect(d)
    assert out.returncode == 1, out.stdout
    assert ("FAILED: %s/ckpt-3 is an increment on checkpoint 2, and %s/ckpt-2 is not a complete checkpoint"
            % (d, d)) in out.stdout, out.stdout
    assert "server-1.psck (rank 1" in out.stdout   # the checkpoint itself is still verified
