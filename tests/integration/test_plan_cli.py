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
    out, rows = table("--params", "7e9", "--recipe", "mixed-adam", "--servers", "4", "--replicas", "1")
    assert "decimal units: 1 GB = 10^9 B" in out
    assert rows["weights only (fp16)"] == "14 GB"
    assert rows["training state (16 B/param)"] == "112 GB"
    assert rows["state per server (S = 4)"] == "28 GB"


def test_two_copies_by_default_from_two_servers_on():
    # As pshard run and the scheduler: R = 2 whenever S >= 2 unless --replicas says.
    _, rows = table("--params", "7e9", "--recipe", "mixed-adam", "--servers", "4")
    assert rows["state per server (S = 4, R = 2)"] == "56 GB"
    _, rows = table("--params", "7e9", "--recipe", "mixed-adam", "--servers", "1")
    assert rows["state per server (S = 1)"] == "112 GB"


def test_bytes_per_param_and_binary_units():
    out, rows = table("--params", "7e9", "--bytes-per-param", "16", "--servers", "4", "--replicas", "1", "--binary")
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
    j = plan_json("--params", "7e9", "--recipe", "mixed-adam", "--servers", "4", "--replicas", "1",
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


# ---------------------------------------------------------------- sparse tables

def rowmap_bytes(rows, row_floats):
    """The row store by hand (src/store/rowmap.c): each row's 8-byte key and its floats
    in a record, and 4-byte index entries, a power of two >= 16 holding at most 7/8 of it
    in rows; the old index (half the size) is still there while rows move to a new one."""
    icap = 16
    while rows > icap * 7 // 8:
        icap *= 2
    steady = rows * (4 * row_floats + 8) + icap * 4
    return steady, steady + icap // 2 * 4


def test_a_billion_rows_of_dim_64_with_adagrad():
    gib = 2 ** 30
    j = plan_json("--sparse", "1e9x64:adagrad", "--server-mem", "64GiB", "--servers", "8", "--replicas", "1",
                  "--rows-per-batch", "20000")
    t = j["sparse"][0]
    assert t["state_floats_per_row"] == 64  # adagrad: one accumulator per parameter
    assert t["payload_bytes_per_row"] == 4 * 64 * 2
    rows = -(-10 ** 9 // 8)  # 125,000,000
    steady, peak = rowmap_bytes(rows, 128)
    assert t["rows_per_server"] == rows
    assert t["bytes_per_server"] == steady
    assert t["peak_bytes_per_server"] == peak
    assert math.isclose(t["bytes_per_row"], steady / rows, rel_tol=1e-12)
    # The fewest servers whose peak fits 64 GiB, by hand: 7 do not, 8 do.
    s = 1
    while rowmap_bytes(-(-10 ** 9 // s), 128)[1] > 64 * gib:
        s += 1
    assert s == 8 and j["servers_needed"] == 8
    assert t["push_bytes"] == t["pull_bytes"] == 20000 * (8 + 4 * 64)
    assert j["push_bytes"] == 20000 * (8 + 4 * 64)

    # The table says the same, and names the answer.
    _, r = table("--sparse", "1e9x64:adagrad", "--server-mem", "64GiB", "--binary")
    assert r["servers needed (64 GiB each)"] == "8"
    assert r["optimiser state per row"] == "64 floats (1 x dim)"

    # Two copies of every row: twice the rows per server, 16 servers.
    j = plan_json("--sparse", "1e9x64:adagrad", "--server-mem", "64GiB", "--replicas", "2",
                  "--servers", "2")
    s = 2
    while rowmap_bytes(-(-2 * 10 ** 9 // s), 128)[1] > 64 * gib:
        s += 1
    assert j["servers_needed"] == s == 16


@pytest.mark.parametrize("opt, nstate", [("sgd", 0), ("momentum", 1), ("adagrad", 1),
                                         ("adam", 2), ("ftrl", 2), ("opt=adam lr=0.001", 2)])
def test_optimiser_state_per_row(opt, nstate):
    j = plan_json("--sparse", f"1000x16:{opt}")
    assert j["sparse"][0]["state_floats_per_row"] == nstate * 16
    assert j["sparse"][0]["bytes_per_server"] == rowmap_bytes(1000, 16 * (1 + nstate))[0]


def test_sparse_traffic_in_the_step_time():
    # Dense 1e6 fp32 parameters plus two tables, 4 workers, 2 servers, 1 GB/s.
    j = plan_json("--params", "1e6", "--recipe", "fp32-adam", "--sparse", "1e8x32:adam",
                  "--sparse", "1e6x8", "--rows-per-batch", "5000,300", "--workers", "4",
                  "--servers", "2", "--replicas", "1", "--link", "1GB/s", "--step-time", "1s")
    g = 1e6 * 4 + 5000 * (8 + 128) + 300 * (8 + 32)
    assert j["sparse_push_bytes"] == 5000 * (8 + 128) + 300 * (8 + 32)
    assert j["push_bytes"] == g
    assert j["traffic_bytes_per_step"] == 2 * 4 * g
    assert math.isclose(j["comm_time_per_step_s"], 2 * max(g, 4 * g / 2) / 1e9, rel_tol=1e-12)
    # K > S: 1 / K = 2 K G / (S L)  ->  K = sqrt(S L / 2 G)
    assert math.isclose(j["comm_dominates_above_k"], math.sqrt(2 * 1e9 / (2 * g)), rel_tol=1e-12)


def test_zipf_rows_per_batch():
    # 1000 rows, 64 draws of Zipf(1.1): the expected number of distinct ids by hand.
    h = sum(i ** -1.1 for i in range(1, 1001))
    want = sum(1 - (1 - i ** -1.1 / h) ** 64 for i in range(1, 1001))
    j = plan_json("--sparse", "1000x4", "--zipf", "1.1", "--batch", "16", "--ids-per-example", "4")
    assert math.isclose(j["sparse"][0]["rows_touched_per_step"], want, rel_tol=1e-9)
    j = plan_json("--sparse", "1000x4", "--zipf", "1.1")
    assert j["sparse"][0]["rows_touched_per_step"] is None  # needs --batch


@pytest.mark.parametrize("args, flag", [
    (["--sparse", "1e9"], "--sparse"),
    (["--sparse", "1e9x64:adamw"], "--sparse"),
    (["--sparse", "0x64"], "--sparse"),
    (["--sparse", "10x4", "--rows-per-batch", "11"], "rows touched"),
    (["--sparse", "10x4", "--rows-per-batch", "1,2"], "--rows-per-batch"),
    (["--rows-per-batch", "5"], "--rows-per-batch"),
    (["--sparse", "10x4", "--rows-per-batch", "5", "--zipf", "1"], "--zipf"),
    (["--zipf", "1"], "--zipf"),
    (["--replicas", "2"], "replicas"),
])
def test_sparse_usage_errors(args, flag):
    p = plan(*args)
    assert p.returncode == 2, p.stdout
    assert flag in p.stderr
    assert p.stdout == ""
