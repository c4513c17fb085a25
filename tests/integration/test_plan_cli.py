"""`pshard plan` end to end: the textbook figures of issue 6 in the table and in --json,
units stated, and usage errors exiting with status 2.

The binary is $PSHARD_BIN, or build/pshard under the repository root.
"""
import json
import math
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("PSHARD_BIN", str(ROOT / "build" / "pshard"))


def plan(*args):
    if not os.access(BIN, os.X_OK):
        pytest.fail(f"no pshard binary at {BIN}: build it or set PSHARD_BIN")
    return subprocess.run([BIN, "plan", *args], capture_output=True, text=True, timeout=30)


def table(*args):
    """Run plan and return {label: value} of the table rows."""
    p = plan(*args)
    assert p.returncode == 0, p.stderr
    rows = {}
    for line in p.stdout.splitlines():
        if line.startswith("  "):
            label, _, value = line.strip().partition("  ")
            rows[label.strip()] = value.strip()
    return p.stdout, rows


def plan_json(*args):
    p = plan(*args, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_memory_of_seven_billion_params():
    out, rows = table("--params", "7e9", "--recipe", "mixed-adam", "--servers", "4")
    assert "decimal units: 1 GB = 10^9 B" in out
    assert rows["weights only (fp16)"] == "14 GB"
    assert rows["training state (16 B/param)"] == "112 GB"
    assert rows["state per server (S = 4)"] == "28 GB"


def test_bytes_per_param_and_binary_units():
    out, rows = table("--params", "7e9", "--bytes-per-param", "16", "--servers", "4", "--binary")
    assert "binary units: 1 GiB = 2^30 B" in out
    assert rows["training state (16 B/param)"] == "104.3 GiB"  # 112e9 / 2^30
    assert rows["state per server (S = 4)"] == "26.08 GiB"


def test_sixty_four_days_on_sixteen_workers():
    _, rows = table("--compute-time", "64d", "--workers", "16")
    assert rows["compute for the job on K = 16"].startswith("4 d ")


def test_gradient_over_the_link():
    for link in ("100Gbit/s", "12.5GB/s", "100Gb/s"):
        _, rows = table("--gradient", "140GB", "--link", link)
        assert rows["one push on the link (G / link)"] == "11.2 s", link
        assert rows["link"] == "12.5 GB/s = 100 Gbit/s"


def test_global_batch_and_learning_rate():
    _, rows = table("--workers", "32", "--batch", "32", "--ref-batch", "256", "--ref-lr", "0.1")
    assert rows["global batch"].startswith("1,024 ")
    assert rows["learning rate (linear scaling)"].startswith("0.4 ")
    assert "5 epochs" in rows["warm-up"]


def test_json_has_the_textbook_values():
    j = plan_json("--params", "7e9", "--recipe", "mixed-adam", "--servers", "4",
                  "--workers", "32", "--batch", "32", "--ref-batch", "256", "--ref-lr", "0.1",
                  "--link", "100Gbit/s", "--compute-time", "64d")
    assert j["units"] == {"size": "B", "time": "s", "rate": "B/s"}
    assert j["weights_bytes"] == 14e9
    assert j["state_bytes"] == 112e9
    assert j["state_per_server_bytes"] == 28e9
    assert j["push_bytes"] == 14e9
    assert j["traffic_bytes_per_step"] == 2 * 32 * 14e9
    assert j["link_bytes_per_s"] == 12.5e9
    assert math.isclose(j["push_time_s"], 1.12, rel_tol=1e-12)
    assert j["job_compute_s"] == 64 * 86400 / 32
    assert j["global_batch"] == 1024
    assert math.isclose(j["lr"], 0.4, rel_tol=1e-12)
    assert j["steps"] is None  # unknown inputs are null, not made up

    j = plan_json("--gradient", "140GB", "--link", "100Gbit/s")
    assert math.isclose(j["push_time_s"], 11.2, rel_tol=1e-12)
    j = plan_json("--compute-time", "64d", "--workers", "16")
    assert j["job_compute_s"] == 4 * 86400


@pytest.mark.parametrize("args, flag", [
    (["--no-such-flag"], "--no-such-flag"),
    (["--link", "100"], "--link"),
    (["--link", "12.5GB"], "--link"),
    (["--params", "seven"], "--params"),
    (["--servers", "0"], "--servers"),
    (["--compute-time", "64"], "--compute-time"),
    (["--gradient", "140Gb"], "--gradient"),
    (["--recipe", "adam"], "--recipe"),
    (["--workers"], "--workers"),
])
def test_usage_errors_exit_2_naming_the_flag(args, flag):
    p = plan(*args)
    assert p.returncode == 2
    assert flag in p.stderr
    assert p.stdout == ""


def test_help():
    p = plan("--help")
    assert p.returncode == 0
    assert "2 K G" in p.stdout and "Goyal" in p.stdout
