"""Value compression (push_codec= / pull_codec=, docs/design.md "Compression"): sync
training through real processes with encoded pushes and pulls, against the same job
uncompressed, and encoded frames a server must refuse without applying anything.

codec_worker trains a dense least-squares problem and a sparse one with a known answer
(tests/integration/codec_worker.c); two servers, so every push and pull is cut into one
part per server and each part is encoded on its own.
"""
import struct
import time

from cluster import Cluster, binary
from test_core import E_PROTO, REPLY, SCALE, T_PUSH, T_PUSH_DENSE, T_STATS, Raw, frame, server_port

E_INVALID = 1
DENSE = "opt=sgd lr=0.5 mode=sync slice=64"
SPARSE = "opt=sgd lr=0.5 mode=sync"
FP16_TOLERANCE = 2e-3  # max |w_fp16 - w_raw| over the 300 dense weights after 60 steps


def train(steps, dense_codec="", sparse_codec="", dense=DENSE, sparse=SPARSE, servers=2, workers=2):
    with Cluster(servers, workers) as c:
        ws = [c.worker([binary("codec_worker"), str(steps), f"{dense} {dense_codec}", f"{sparse} {sparse_codec}"],
                       f"w{i}") for i in range(workers)]
        rcs = c.wait(ws, 120 * SCALE)
        logs = [c.log(f"w{i}") for i in range(workers)]
        assert rcs == [0] * workers, logs + [c.log("server0")]
    out = {}
    for line in "".join(logs).splitlines():
        f = line.split()
        if f and f[0] == "loss":
            out["dense"] = (float(f[2]), float(f[3]))
            out["sparse"] = (float(f[5]), float(f[6]))
        elif f and f[0] == "w":
            out["w"] = [float(x) for x in f[1:]]
        elif f and f[0] == "bytes":
            out["bytes"] = {f[i]: int(f[i + 1]) for i in range(1, len(f), 2)}
        elif f and f[0] == "codec_lines":
            out["codec_lines"] = int(f[1])
    assert len(out.get("w", [])) == 300, logs
    return out


def test_fp16_pushes_train_within_tolerance_of_uncompressed():
    raw = train(60)
    fp16 = train(60, "push_codec=fp16", "push_codec=fp16")
    assert raw["dense"][1] < 1e-2 * raw["dense"][0], raw["dense"]
    diff = max(abs(a - b) for a, b in zip(raw["w"], fp16["w"]))
    assert diff <= FP16_TOLERANCE, diff
    assert abs(fp16["sparse"][1] - raw["sparse"][1]) <= 0.01 * raw["sparse"][0], (raw["sparse"], fp16["sparse"])
    # The tables without a codec count nothing; fp16 halves the pushed value bytes.
    assert raw["bytes"] == {"push_raw": 0, "push_wire": 0, "pull_raw": 0, "pull_wire": 0}
    assert raw["codec_lines"] == 0
    b = fp16["bytes"]
    assert b["push_raw"] > 0 and b["push_wire"] * 2 == b["push_raw"], b
    assert b["pull_raw"] == 0 and b["pull_wire"] == 0, b
    assert fp16["codec_lines"] == 2


def test_int8_pushes_and_pulls_converge():
    r = train(60, "push_codec=int8 pull_codec=int8", "push_codec=int8 pull_codec=int8")
    assert r["dense"][1] < 1e-3 * r["dense"][0], r["dense"]
    assert r["sparse"][1] < 0.05 * r["sparse"][0], r["sparse"]
    b = r["bytes"]
    assert 0 < b["push_wire"] < 0.3 * b["push_raw"], b
    assert 0 < b["pull_wire"] < 0.3 * b["pull_raw"], b


def test_topk_pushes_converge_with_error_feedback():
    # 1% of the values per part and push: what is not sent waits in the worker's
    # residual, so training still gets there, more slowly (a smaller rate, more steps).
    r = train(300, "push_codec=topk:0.01 pull_codec=bf16", "push_codec=topk:0.01",
              dense="opt=sgd lr=0.05 mode=sync slice=64", sparse="opt=sgd lr=0.05 mode=sync")
    assert r["dense"][1] < 1e-3 * r["dense"][0], r["dense"]
    assert r["sparse"][1] < 0.75 * r["sparse"][0], r["sparse"]
    b = r["bytes"]
    assert 0 < b["push_wire"] < 0.05 * b["push_raw"], b
    assert b["pull_wire"] * 2 == b["pull_raw"], b


def wait_for_tables(port, names):
    deadline = time.time() + 20 * SCALE
    while time.time() < deadline:
        r = Raw(port)
        try:
            r.send(frame(T_STATS, req_id=1))
            h, body = r.read_frame()
        finally:
            r.close()
        text = body.decode()
        if all(f"name={n} " in text for n in names):
            return text
        time.sleep(0.05)
    raise AssertionError("tables never created: " + text)


def test_bad_encoded_pushes_are_refused_before_the_engine():
    with Cluster(1, 1) as c:
        w = c.worker([binary("codec_worker"), "100000", f"{DENSE} push_codec=int8",
                      f"{SPARSE} push_codec=topk:0.01", "1"], "w0")
        port = server_port(c)
        wait_for_tables(port, ["w", "e"])
        seg = struct.pack("<QQ", 0, 300)  # table 1: dense "w" of 300 floats
        block = lambda n, scale=1.0: struct.pack("<f", scale) + bytes(n)
        int8_300 = block(256) + block(44)
        cases = [
            ("another codec than the table's", T_PUSH_DENSE, 1, 1, seg, bytes(600), E_INVALID, "push codec is int8"),
            ("int8 body one byte short", T_PUSH_DENSE, 1, 3, seg, int8_300[:-1], E_PROTO, "bytes where"),
            ("int8 body one byte long", T_PUSH_DENSE, 1, 3, seg, int8_300 + b"\0", E_PROTO, "bytes where"),
            ("int8 negative scale", T_PUSH_DENSE, 1, 3, seg, block(256, -2.0) + block(44), E_PROTO, "negative scale"),
            ("topk indices out of order", T_PUSH, 2, 4, struct.pack("<Q", 7),
             struct.pack("<IfIf", 5, 1.0, 2, 1.0), E_PROTO, "indices must increase"),
            ("topk index out of range", T_PUSH, 2, 4, struct.pack("<Q", 7), struct.pack("<If", 8, 1.0), E_PROTO,
             "out of range"),
            ("topk pairs not whole", T_PUSH, 2, 4, struct.pack("<Q", 7), b"\0" * 12, E_PROTO, "whole"),
        ]
        r = Raw(port)
        try:
            for i, (what, type_, table, codec, keys, vals, status, msg) in enumerate(cases):
                nkeys = len(keys) // 8
                r.send(frame(type_, keys + vals, codec=codec, sender=424242, req_id=100 + i, table=table, batch=1,
                             nkeys=nkeys))
                got = r.read_frame()
                assert got is not None, f"{what}: connection closed"
                h, body = got
                assert h["req_id"] == 100 + i and h["type"] == type_ | REPLY, (what, h)
                assert h["status"] == status, (what, h, body)
                assert msg in body.decode(), (what, body)
        finally:
            r.close()
        # The worker went on untouched by any of it, and nothing enrolled the forger.
        assert w.poll() is None, c.log("w0")
        text = wait_for_tables(port, ["w", "e"])
        assert "codec 1 name=w push=int8" in text and "codec 2 name=e push=topk:0.01" in text, text
