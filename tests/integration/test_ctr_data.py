"""Integration tests of the click-through example's data side (examples/ctr):
the generator ctr_gen, the reader/writer library through the ctr_check tool, and the
library's own self-test ctr_data_test.

Binaries are taken from $PSHARD_BUILD/examples/ctr (default <repo>/build). Build them
with:  cmake -S . -B build && cmake --build build --target ctr_gen ctr_check ctr_data_test
Every process runs with a timeout, so a hang fails the test instead of blocking it.
"""
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("PSHARD_BUILD", REPO / "build"))
BIN = BUILD / "examples" / "ctr"
HEART_SCALE = Path("/usr/share/doc/liblinear-tools/examples/heart_scale")
TIMEOUT = 120


def tool(name):
    p = BIN / name
    if not p.exists():
        pytest.fail(f"{p} is not built (cmake --build {BUILD} --target {name})")
    return str(p)


def run(*args, check=True):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                       timeout=TIMEOUT)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} exited {r.returncode}: {r.stderr}")
    return r


def gen(out, *extra):
    return run(tool("ctr_gen"), "--out", out, "--quiet", *extra)


def meta(d):
    m = {}
    for line in (Path(d) / "meta.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            k, v = line.split("=", 1)
            m[k] = v
    return m


def check(path):
    """ctr_check FILE -> dict of its counts; fails on error."""
    r = run(tool("ctr_check"), path)
    m = re.fullmatch(r"(.*): rows=(\d+) nnz=(\d+) positives=(\d+) format=(\w+)\n", r.stdout)
    assert m, r.stdout
    return {"rows": int(m[2]), "nnz": int(m[3]), "positives": int(m[4]), "format": m[5]}


def check_fails(path):
    """ctr_check FILE must fail with exit 1 and one error line; returns the message."""
    r = run(tool("ctr_check"), path, check=False)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr.startswith("ctr_check: ") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr[len("ctr_check: "):].rstrip("\n")


SMALL = ["--rows", "20000", "--test-rows", "5000"]


def files(d):
    return sorted(p.name for p in Path(d).iterdir())


def test_generation_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    gen(a, *SMALL, "--parts", "3", "--seed", "42")
    gen(b, *SMALL, "--parts", "3", "--seed", "42", "--threads", "1")
    assert files(a) == ["meta.txt", "test.txt", "train-00000.txt", "train-00001.txt",
                        "train-00002.txt"]
    for name in files(a):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # another seed gives other data
    c = tmp_path / "c"
    gen(c, *SMALL, "--parts", "3", "--seed", "43")
    assert (c / "test.txt").read_bytes() != (a / "test.txt").read_bytes()


def test_concatenated_parts_do_not_depend_on_part_count(tmp_path):
    one, five = tmp_path / "one", tmp_path / "five"
    gen(one, *SMALL, "--parts", "1", "--seed", "5")
    gen(five, *SMALL, "--parts", "5", "--seed", "5")
    joined = b"".join((five / f"train-{i:05d}.txt").read_bytes() for i in range(5))
    assert joined == (one / "train-00000.txt").read_bytes()
    assert (one / "test.txt").read_bytes() == (five / "test.txt").read_bytes()
    # a rerun with fewer parts removes the extra parts of the earlier run
    gen(five, *SMALL, "--parts", "2", "--seed", "5")
    assert files(five) == ["meta.txt", "test.txt", "train-00000.txt", "train-00001.txt"]


def test_meta_is_plausible_and_matches_files(tmp_path):
    d = tmp_path / "d"
    gen(d, "--rows", "30000", "--test-rows", "20000", "--parts", "2")
    m = meta(d)
    assert int(m["rows"]) == 30000 and int(m["test_rows"]) == 20000
    assert int(m["parts"]) == 2 and int(m["fields"]) == 39
    auc, ll = float(m["planted_test_auc"]), float(m["planted_test_logloss"])
    assert 0.7 < auc < 0.95, auc
    assert 0.18 <= float(m["positive_rate"]) <= 0.27
    assert 0.18 <= float(m["test_positive_rate"]) <= 0.27
    assert ll < float(m["constant_test_logloss"]), (ll, m["constant_test_logloss"])
    parts = [check(d / f"train-{i:05d}.txt") for i in range(2)]
    assert [p["rows"] for p in parts] == [15000, 15000]
    assert sum(p["nnz"] for p in parts) == int(m["nnz"])
    pos = sum(p["positives"] for p in parts)
    assert abs(pos / 30000 - float(m["positive_rate"])) < 1e-6
    t = check(d / "test.txt")
    assert t["rows"] == 20000 and t["nnz"] == int(m["test_nnz"])


def test_generator_prints_planted_metrics_and_speed(tmp_path):
    r = run(tool("ctr_gen"), "--out", tmp_path / "d", *SMALL)
    assert re.search(r"planted model on test: logloss 0\.\d+, auc 0\.\d+", r.stdout), r.stdout
    assert re.search(r"\d+ rows/s", r.stdout), r.stdout


def test_binary_format_holds_the_same_examples(tmp_path):
    t, b = tmp_path / "t", tmp_path / "b"
    gen(t, *SMALL, "--parts", "2", "--seed", "9")
    gen(b, *SMALL, "--parts", "2", "--seed", "9", "--format", "bin")
    assert files(b) == ["meta.txt", "test.bin", "train-00000.bin", "train-00001.bin"]
    for name in ["train-00000", "train-00001", "test"]:
        ct, cb = check(t / f"{name}.txt"), check(b / f"{name}.bin")
        assert cb["format"] == "bin"
        assert {**ct, "format": "bin"} == cb
        # converting the text file gives the generator's binary file, byte for byte
        conv = tmp_path / f"{name}.bin"
        run(tool("ctr_check"), "--convert", conv, t / f"{name}.txt")
        assert conv.read_bytes() == (b / f"{name}.bin").read_bytes()


def write(path, text):
    path.write_text(text)
    return path


def test_bad_label_names_file_and_line(tmp_path):
    good = "".join(f"{i % 2} {i + 1}:1 {i + 7}:0.5\n" for i in range(16))
    p = write(tmp_path / "part-0.txt", good + "2 3:1\n1 4:1\n")
    assert check_fails(p) == f"{p}:17: label '2' is not 0/1 or -1/+1"
    p = write(tmp_path / "word.txt", "+1 1:1\nyes 2:1\n")
    assert check_fails(p) == f"{p}:2: label 'yes' is not 0/1 or -1/+1"


def test_bad_feature_id_names_file_and_line(tmp_path):
    p = write(tmp_path / "ids.txt", "1 1:1\n0 2:1 abc:1\n")
    assert check_fails(p) == f"{p}:2: feature id 'abc' does not parse"
    p = write(tmp_path / "neg.txt", "1 -5:1\n")
    assert check_fails(p) == f"{p}:1: feature id '-5' does not parse"
    p = write(tmp_path / "big.txt", "1 18446744073709551616:1\n")  # 2^64
    assert check_fails(p) == f"{p}:1: feature id '18446744073709551616' does not parse"
    p = write(tmp_path / "colon.txt", "1 1:1\n\n1 7\n")
    assert check_fails(p) == f"{p}:3: feature '7' is not id:value"


def test_bad_value_names_file_and_line(tmp_path):
    p = write(tmp_path / "val.txt", "1 1:0.5\n0 2:x\n")
    assert check_fails(p) == f"{p}:2: value 'x' of feature 2 does not parse"
    p = write(tmp_path / "inf.txt", "1 1:inf\n")
    assert check_fails(p) == f"{p}:1: value 'inf' of feature 1 is not a finite number"


def test_accepted_text_variants(tmp_path):
    p = write(tmp_path / "ok.txt",
              "# header comment\n"
              "+1 1:0.5 18446744073709551615:1\r\n"
              "\n"
              "-1 3:-2.5e-3   # trailing comment\n"
              "0\n"
              "1.0 4:1\n"
              "-1.0\t5:2")  # no final newline
    c = check(p)
    assert c == {"rows": 5, "nnz": 5, "positives": 2, "format": "libsvm"}


def test_missing_file_and_directory(tmp_path):
    p = tmp_path / "nope.txt"
    assert check_fails(p) == f"cannot open {p}: No such file or directory"
    assert check_fails(tmp_path) == f"cannot read {tmp_path}: is a directory"


def heart_bin(tmp_path):
    out = tmp_path / "heart.bin"
    run(tool("ctr_check"), "--convert", out, HEART_SCALE)
    return out


def test_heart_scale_reads_fine(tmp_path):
    if not HEART_SCALE.exists():
        pytest.skip("liblinear-tools is not installed")
    c = check(HEART_SCALE)
    assert c == {"rows": 270, "nnz": 3378, "positives": 120, "format": "libsvm"}
    b = heart_bin(tmp_path)
    assert check(b) == {**c, "format": "bin"}
    # text -> binary -> text -> binary is stable and keeps the real-valued features
    txt = tmp_path / "heart.txt"
    run(tool("ctr_check"), "--convert", txt, b)
    assert txt.read_text().splitlines()[0] == (
        "1 1:0.708333 2:1 3:1 4:-0.320755 5:-0.105023 6:-1 7:1 8:-0.419847 9:-1 "
        "10:-0.225806 12:1 13:-1")
    b2 = tmp_path / "heart2.bin"
    run(tool("ctr_check"), "--convert", b2, txt)
    assert b2.read_bytes() == b.read_bytes()


def test_truncated_binary_file_is_rejected(tmp_path):
    data = heart_bin(tmp_path).read_bytes()
    p = tmp_path / "cut.bin"
    for n, what in [(10, "truncated binary file header"),
                    (24, "file is truncated: it ends after 0 rows without an end block"),
                    (40, "file is truncated inside a block header"),
                    (len(data) // 2, "file is truncated: block needs"),
                    (len(data) - 48, "file is truncated: it ends after 270 rows"),
                    (len(data) - 3, "file is truncated: block needs 8 payload bytes")]:
        p.write_bytes(data[:n])
        msg = check_fails(p)
        assert msg.startswith(f"{p}: ") and what in msg, (n, msg)


def test_corrupt_binary_file_is_rejected(tmp_path):
    data = heart_bin(tmp_path).read_bytes()
    p = tmp_path / "bad.bin"
    for off, what in [(5, "header checksum mismatch"),
                      (1000, "block 0 at byte 24: checksum mismatch (file is corrupt)"),
                      (len(data) - 60, "checksum mismatch (file is corrupt)"),
                      (len(data) - 2, "block 1 at byte"),
                      (24 + 12, "block 0 at byte 24: malformed block header"),
                      (24 + 16, "its counts need")]:
        b = bytearray(data)
        b[off] ^= 0x20
        p.write_bytes(bytes(b))
        msg = check_fails(p)
        assert msg.startswith(f"{p}: ") and what in msg, (off, msg)
    # bytes after the end block
    p.write_bytes(data + b"junk")
    assert "unexpected bytes after the end block" in check_fails(p)


def test_ctr_data_selftest(tmp_path):
    r = run(tool("ctr_data_test"), tmp_path)
    assert "all checks passed" in r.stdout


def test_generator_rejects_bad_options(tmp_path):
    for args, what in [(["--rows", "abc"], "--rows: 'abc' is not a count"),
                       (["--parts", "0"], "--parts"),
                       (["--fields", "7"], "--fields"),
                       (["--format", "csv"], "--format: 'csv' is not libsvm or bin"),
                       (["--nope", "1"], "unknown option '--nope'")]:
        r = run(tool("ctr_gen"), "--out", tmp_path / "x", *args, check=False)
        assert r.returncode == 2 and what in r.stderr, (args, r.stderr)
    f = tmp_path / "file"
    f.write_text("")
    r = run(tool("ctr_gen"), "--out", f, "--rows", "10", check=False)
    assert r.returncode == 1 and "cannot create directory" in r.stderr


def examples(path):
    """The examples of a libsvm file: (label, set of feature ids) each."""
    out = []
    for line in Path(path).read_text().splitlines():
        label, *feats = line.split()
        out.append((label, {int(f.split(":")[0]) for f in feats}))
    return out


def test_crosses_add_one_feature_per_cross_and_leave_the_rest(tmp_path):
    plain, crossed, zero = tmp_path / "p", tmp_path / "c", tmp_path / "z"
    gen(plain, *SMALL, "--seed", "3")
    gen(zero, *SMALL, "--seed", "3", "--crosses", "0")
    gen(crossed, *SMALL, "--seed", "3", "--crosses", "20")
    for name in ("train-00000.txt", "test.txt"):  # --crosses 0 is the data without crosses
        assert (plain / name).read_bytes() == (zero / name).read_bytes(), name
    assert meta(zero)["crosses"] == "0" and meta(crossed)["crosses"] == "20"
    a, b = examples(plain / "train-00000.txt"), examples(crossed / "train-00000.txt")
    assert len(a) == len(b) == 20000
    extra, every_plain, every_cross = [], set(), set()
    for (_, fa), (_, fb) in zip(a, b):
        assert fa <= fb  # crosses draw no random numbers: the same single-field features
        extra.append(len(fb) - len(fa))
        every_plain |= fa
        every_cross |= fb - fa
    assert max(extra) <= 20 and min(extra) >= 0
    # the first crosses pair the fields with most values, rarely missing: most are present
    assert sum(extra) / len(extra) > 15, sum(extra) / len(extra)
    assert not every_plain & every_cross
    # and they multiply the distinct ids, which is what they are for
    assert len(every_cross) > 3 * len(every_plain), (len(every_cross), len(every_plain))
    m = meta(crossed)
    assert int(m["nnz"]) == sum(len(f) for _, f in b)
    assert 0.7 < float(m["planted_test_auc"]) < 0.99


def test_crosses_are_deterministic_across_parts_and_threads(tmp_path):
    one, four = tmp_path / "one", tmp_path / "four"
    gen(one, *SMALL, "--crosses", "30", "--format", "bin", "--parts", "1", "--threads", "1")
    gen(four, *SMALL, "--crosses", "30", "--format", "bin", "--parts", "4")
    joined = b"".join((four / f"train-{i:05d}.bin").read_bytes() for i in range(4))
    # binary parts carry a header each: compare the examples through ctr_check's counts
    # and a conversion of the concatenation to text
    ta, tb = tmp_path / "a.txt", tmp_path / "b.txt"
    run(tool("ctr_check"), "--convert", ta, one / "train-00000.bin")
    texts = []
    for i in range(4):
        t = tmp_path / f"p{i}.txt"
        run(tool("ctr_check"), "--convert", t, four / f"train-{i:05d}.bin")
        texts.append(t.read_bytes())
    tb.write_bytes(b"".join(texts))
    assert ta.read_bytes() == tb.read_bytes()
    assert (one / "test.bin").read_bytes() == (four / "test.bin").read_bytes()
    assert len(joined) > 0


def test_ctr_check_counts_distinct_ids(tmp_path):
    d = tmp_path / "d"
    gen(d, *SMALL, "--crosses", "10", "--parts", "2")
    r = run(tool("ctr_check"), "--distinct", d / "train-00000.txt", d / "train-00001.txt")
    m = re.search(r"^distinct_ids=(\d+)$", r.stdout, re.M)
    assert m, r.stdout
    ids = set()
    for p in ("train-00000.txt", "train-00001.txt"):
        for _, f in examples(d / p):
            ids |= f
    assert int(m[1]) == len(ids)


def test_bad_crosses_are_refused(tmp_path):
    for args, what in [(["--crosses", "-1"], "--crosses: '-1' is not in 0..1000"),
                       (["--crosses", "x"], "--crosses: 'x' is not in 0..1000"),
                       (["--crosses", "1001"], "--crosses: '1001' is not in 0..1000"),
                       (["--crosses", "326"], "326 crosses need more categorical fields than 26 (325 pairs)"),
                       (["--fields", "13,1", "--crosses", "1"], "1 crosses need more categorical fields than 1")]:
        r = run(tool("ctr_gen"), "--out", tmp_path / "x", *args, check=False)
        assert r.returncode == 2 and what in r.stderr, (args, r.stderr)
        assert not (tmp_path / "x" / "meta.txt").exists()
