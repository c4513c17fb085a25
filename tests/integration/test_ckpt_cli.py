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
