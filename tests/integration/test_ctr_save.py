"""The click-through worker saves its model and loads it again: train with --save DIR on
two servers, then `pshard run --restore DIR` with --load DIR --epochs 0 on one and on
three servers evaluates the very same model (the printed figures are equal), the
directory reads back with pshard.load_checkpoint, and a load without the restore fails
clearly."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import ROOT, binary  # noqa: E402

SLOW = 3 if os.environ.get("PSHARD_SANITIZED") else 1
WORKER = os.path.join("examples", "ctr", "ctr_worker")
FIGURES = r"test logloss ([0-9.]+)\s+auc ([0-9.na]+)\s+accuracy ([0-9.]+)"


def run(servers, workers, args, restore=None, timeout=120):
    argv = [binary("pshard"), "run", "-s", str(servers), "-w", str(workers), "--progress-ms", "0", "--mode", "sync"]
    if restore:
        argv += ["--restore", restore]
    argv += ["--", binary(WORKER)] + args
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout * SLOW)


@pytest.fixture(scope="module")
def data():
    d = tempfile.mkdtemp(prefix="pshard-ctrsave-")
    r = subprocess.run([binary(os.path.join("examples", "ctr", "ctr_gen")), "--rows", "30000", "--test-rows", "5000",
                        "--parts", "4", "--out", os.path.join(d, "data"), "--quiet"],
                       capture_output=True, text=True, timeout=60 * SLOW)
    assert r.returncode == 0, r.stderr
    yield d
    shutil.rmtree(d, ignore_errors=True)


READ = """
import json, sys
sys.path.insert(0, sys.argv[1])
import pshard
ck = pshard.load_checkpoint(sys.argv[2])
keys, rows = ck["ctr_weights"]
print(json.dumps({"id": ck.id, "nservers": ck.nservers, "keys": [int(k) for k in keys], "shape": list(rows.shape),
                  "opt": ck.tables["ctr_weights"].opt, "state": sorted(ck.optimizer["ctr_weights"])}))
"""


def load_checkpoint(path):
    """pshard.load_checkpoint(path), in a child Python: the binding loads libpshard, which
    in a sanitized build needs the sanitizer's runtime preloaded."""
    env = dict(os.environ)
    if os.environ.get("PSHARD_SANITIZED"):
        asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
        env.update(LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0")
    r = subprocess.run([sys.executable, "-c", READ, os.path.join(ROOT, "python"), path], capture_output=True,
                       text=True, env=env, timeout=120 * SLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def feature_ids(paths):
    ids = set()
    for path in paths:
        for line in open(path):
            ids.update(int(tok.split(":", 1)[0]) for tok in line.split()[1:])
    return ids


def test_save_then_load_on_other_server_counts(data):
    d = os.path.join(data, "data")
    model = os.path.join(data, "model")
    r = run(2, 2, ["--data", d, "--epochs", "2", "--batch", "200", "--save", model])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    trained = re.findall(r"epoch 2: " + FIGURES, out)
    assert len(trained) == 1, out
    assert re.search(r"saved the model: checkpoint 1 in " + re.escape(model), out), out
    assert sorted(os.listdir(os.path.join(model, "ckpt-1"))) == ["MANIFEST", "server-0.psck", "server-1.psck"]

    for servers in (3, 1):
        r = run(servers, 2, ["--data", d, "--epochs", "0", "--load", model], restore=model)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        loaded = re.findall(r"loaded model: " + FIGURES, out)
        assert loaded == trained, f"{servers} servers: {loaded} != {trained}\n{out}"
        assert "epoch 1:" not in out and "trained on" not in out, "--epochs 0 only evaluates"

    # The saved table: one row per feature id the job touched (training and test
    # examples; a pull creates a row) and the bias.
    ck = load_checkpoint(model)
    assert ck["nservers"] == 2 and ck["id"] == 1
    parts = [os.path.join(d, f) for f in os.listdir(d) if f.startswith(("train", "test"))]
    want = feature_ids(parts) | {2 ** 64 - 1}
    assert len(ck["keys"]) == len(want), (len(ck["keys"]), len(want))
    assert set(ck["keys"]) == want
    assert ck["shape"] == [len(want), 1]
    assert ck["opt"] == "ftrl" and ck["state"] == ["n", "z"]

    # Training goes on from the loaded model: one more epoch, saved again beside it.
    r = run(1, 2, ["--data", d, "--epochs", "1", "--batch", "200", "--load", model, "--save", model], restore=model)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert re.findall(r"loaded model: " + FIGURES, out) == trained, out
    assert re.search(r"epoch 1: " + FIGURES, out) and "saved the model: checkpoint 2 in" in out, out
    assert load_checkpoint(model)["id"] == 2


def test_load_without_a_restore_or_a_model_fails_clearly(data):
    d = os.path.join(data, "data")
    model = os.path.join(data, "model-missing")
    os.makedirs(model, exist_ok=True)
    r = run(1, 1, ["--data", d, "--epochs", "0", "--load", model], restore=None)
    assert r.returncode == 1
    assert "no complete checkpoint there" in r.stdout + r.stderr, r.stdout + r.stderr
    saved = os.path.join(data, "model-small")
    r = run(1, 1, ["--data", d, "--epochs", "1", "--save", saved])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(1, 1, ["--data", d, "--epochs", "0", "--load", saved])
    assert r.returncode == 1
    assert "did not start from that checkpoint" in r.stdout + r.stderr and "--restore" in r.stdout + r.stderr
    r = run(1, 1, ["--data", d, "--epochs", "0"])
    assert r.returncode == 2 and "needs --load" in r.stdout + r.stderr, r.stdout + r.stderr


def id_key(i, bits):
    """ctr_worker's --id-bits mapping: the top `bits` bits of murmur3's 64-bit finalizer."""
    m = 2 ** 64 - 1
    i ^= i >> 33
    i = (i * 0xFF51AFD7ED558CCD) & m
    i ^= i >> 33
    i = (i * 0xC4CEB9FE1A85EC53) & m
    i ^= i >> 33
    return i >> (64 - bits)


def test_id_bits_hash_ids_into_a_wider_than_32_bit_space(data):
    """--id-bits 33: every key is the id's hash cut to 33 bits, and those above 2^32 reach
    the server intact (the table holds exactly the hashed ids touched, and the bias)."""
    d = os.path.join(data, "data")
    model = os.path.join(data, "model-bits")
    r = run(1, 1, ["--data", d, "--epochs", "1", "--batch", "500", "--opt", "adagrad", "--id-bits", "33",
                   "--save", model])
    assert r.returncode == 0, r.stdout + r.stderr
    ck = load_checkpoint(model)
    parts = [os.path.join(d, f) for f in os.listdir(d) if f.startswith(("train", "test"))]
    ids = feature_ids(parts)
    want = {id_key(i, 33) for i in ids} | {2 ** 64 - 1}
    keys = set(ck["keys"])
    assert keys == want
    high = [k for k in keys if 2 ** 32 <= k < 2 ** 33]
    assert len(high) > len(keys) // 4, "about half of the hashed keys lie above 2^32"
    assert max(k for k in keys if k != 2 ** 64 - 1) < 2 ** 33
    assert ck["opt"] == "adagrad"
    # The data's own ids, as they are, span all 64 bits (the test above saves them all).
    assert sum(1 for i in ids if i >= 2 ** 32) > len(ids) // 2
    for bad in ("0", "65", "x"):
        r = run(1, 1, ["--data", d, "--epochs", "1", "--id-bits", bad])
        assert r.returncode != 0 and "--id-bits" in r.stdout + r.stderr, r.stdout + r.stderr
