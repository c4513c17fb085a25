"""pshard.load_checkpoint and `pshard checkpoint inspect` on checkpoints written by the C
writer (tests/integration/ckpt_sample.c, built beside the library): values, optimiser
state and metadata read back exactly; the newest complete checkpoint of a directory;
damaged, truncated, mismatched and missing files refused with an error naming them; the
pure-Python xxh64 against the C library's on many lengths, and its speed on a few MB."""
import ctypes
import ctypes.util
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

import pshard
from pshard import checkpoint as ckmod

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("PSHARD_BUILD", os.path.join(ROOT, "build"))
SAMPLE = os.path.join(BUILD, "ckpt_sample")
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus", "ckpt")
EMB_KEYS = list(range(1, 21)) + [(1 << 40) + 7]


def write_sample(parent, cid, servers=1, clock=5, big=0):
    cmd = [SAMPLE, str(parent), str(cid), "--servers", str(servers), "--clock", str(clock)]
    if big:
        cmd += ["--big", str(big)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def flip(path, offset, mask=0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


@pytest.fixture(params=[False, True], ids=["module-or-python", "pure-python"])
def hashing(request, monkeypatch):
    """Run a test with the xxhash module if installed, and with the pure-Python xxh64."""
    if request.param:
        monkeypatch.setattr(ckmod, "_xxhash", None)
    return request.param


# ------------------------------------------------------------------------- xxh64

def test_xxh64_reference_values():
    assert ckmod._xxh64_py(b"") == 0xEF46DB3751D8E999
    assert ckmod._xxh64_py(b"a") == 0xD24EC4F1A98C6E5B
    assert ckmod._xxh64_py(b"abc") == 0x44BC2CF5AD770999
    assert ckmod.xxh64(b"") == 0xEF46DB3751D8E999


def test_xxh64_matches_the_c_library():
    name = ctypes.util.find_library("xxhash")
    if not name:
        pytest.skip("libxxhash not found")
    lib = ctypes.CDLL(name)
    lib.XXH64.restype = ctypes.c_uint64
    lib.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
    rng = np.random.default_rng(7)
    lengths = list(range(0, 70)) + [95, 96, 97, 127, 128, 255, 256, 1000, 4099, 65537]
    for n in lengths:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for seed in (0, 1, 0x70736872696E676B, (1 << 64) - 1):
            assert ckmod._xxh64_py(data, seed) == lib.XXH64(data, n, seed), (n, seed)
        assert ckmod._xxh64_py(memoryview(data)) == lib.XXH64(data, n, 0)


def test_pure_python_xxh64_is_not_slow_on_a_few_megabytes(tmp_path, monkeypatch):
    """About 20 MB/s on one core; the bound leaves room for a loaded machine."""
    monkeypatch.setattr(ckmod, "_xxhash", None)
    write_sample(tmp_path, 1, servers=2, big=1 << 20)  # 4 MB of parameters
    t0 = time.monotonic()
    ck = pshard.load_checkpoint(tmp_path)
    dt = time.monotonic() - t0
    i = np.arange(1 << 20)
    assert np.array_equal(ck["big"], (i % 1000 - 500).astype(np.float32))
    assert dt < 20, "loading 4 MB took %.1f s" % dt


# ------------------------------------------------------------------------- reading

@pytest.mark.parametrize("servers", [1, 3])
def test_load_the_c_writers_checkpoint(tmp_path, servers, hashing):
    cdir = write_sample(tmp_path, 7, servers=servers, clock=11)
    ck = pshard.load_checkpoint(cdir)
    assert isinstance(ck, dict)
    assert sorted(ck) == ["bias", "emb", "empty", "w"]
    assert (ck.id, ck.clock, ck.nservers) == (7, 11, servers)
    assert ck.path == cdir
    assert ck.state == b"sample scheduler state"
    assert ck.created_ms > 1_600_000_000_000

    i = np.arange(10, dtype=np.float32)
    w = ck["w"]
    assert w.dtype == np.float32 and w.shape == (10,)
    assert np.array_equal(w, 0.5 * i)
    assert sorted(ck.optimizer["w"]) == ["exp_avg", "exp_avg_sq"]
    assert np.array_equal(ck.optimizer["w"]["exp_avg"], -i)
    assert np.array_equal(ck.optimizer["w"]["exp_avg_sq"], 0.25 * i)
    info = ck.tables["w"]
    assert (info.kind, info.size, info.width, info.row_floats, info.opt) == ("dense", 10, 4, 12, "adam")
    assert (info.step, info.version, info.rows, info.options) == (3, 11, 3, "opt=adam slice=4")

    keys, rows = ck["emb"]
    assert keys.dtype == np.uint64 and rows.dtype == np.float32
    assert keys.tolist() == EMB_KEYS  # sorted by key, whichever server held them
    k = keys.astype(np.float64)[:, None]
    j = np.arange(3)[None, :]
    assert rows.shape == (21, 3)
    assert np.array_equal(rows, (k + j / 8).astype(np.float32))
    assert np.array_equal(ck.optimizer["emb"]["sum"], (2 * k + j).astype(np.float32))
    assert ck.tables["emb"].opt == "adagrad" and ck.tables["emb"].size == 3

    bkeys, brows = ck["bias"]
    assert bkeys.tolist() == [7, 8] and brows.tolist() == [[70.0], [80.0]]
    assert ck.optimizer["bias"] == {}
    ekeys, erows = ck["empty"]
    assert ekeys.shape == (0,) and erows.shape == (0, 4)
    assert ck.optimizer["empty"]["momentum_buffer"].shape == (0, 4)


def test_a_parent_directory_gives_the_newest_complete_checkpoint(tmp_path):
    for cid in (2, 10, 11):
        write_sample(tmp_path, cid, clock=cid)
    os.unlink(tmp_path / "ckpt-11" / "MANIFEST")   # being written: not a checkpoint yet
    (tmp_path / "ckpt-010").mkdir()                # not a name pshard writes
    shutil.copy(tmp_path / "ckpt-10" / "MANIFEST", tmp_path / "ckpt-010" / "MANIFEST")
    ck = pshard.load_checkpoint(tmp_path)
    assert (ck.id, ck.clock) == (10, 10)
    assert ck.path == os.path.join(str(tmp_path), "ckpt-10")


def test_no_complete_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        pshard.load_checkpoint(tmp_path)
    write_sample(tmp_path, 1)
    os.unlink(tmp_path / "ckpt-1" / "MANIFEST")
    with pytest.raises(FileNotFoundError, match="1 without a MANIFEST"):
        pshard.load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError):
        pshard.load_checkpoint(tmp_path / "absent")


def test_a_damaged_byte_is_refused_and_named(tmp_path, hashing):
    cdir = write_sample(tmp_path, 1, servers=2)
    path = os.path.join(cdir, "server-1.psck")
    flip(path, 400)   # inside a ROWS block of table emb
    with pytest.raises(pshard.CorruptError) as e:
        pshard.load_checkpoint(cdir)
    assert isinstance(e.value, pshard.Error) and isinstance(e.value, ValueError)
    assert e.value.code == 22 and e.value.name == "PS_ERR_CORRUPT"
    msg = str(e.value)
    assert "server-1.psck" in msg and "(ROWS)" in msg and "checksum mismatch" in msg, msg


def test_every_damaged_byte_of_a_data_file_is_refused(tmp_path):
    cdir = write_sample(tmp_path, 1)
    path = os.path.join(cdir, "server-0.psck")
    data = open(path, "rb").read()
    ckmod._read_file(path, ckmod.DATA)
    bad = os.path.join(str(tmp_path), "bad.psck")
    for off in range(len(data)):
        b = bytearray(data)
        b[off] ^= 0x20
        open(bad, "wb").write(bytes(b))
        with pytest.raises(pshard.CorruptError):
            ckmod._read_file(bad, ckmod.DATA)
    for n in range(len(data)):
        open(bad, "wb").write(data[:n])
        with pytest.raises(pshard.CorruptError):
            ckmod._read_file(bad, ckmod.DATA)


def test_the_c_corpus_reads(hashing):
    """The fuzz seeds (written by the C writer, *.psck) read with this reader too; the
    inputs the fuzzer kept beside them (named by their hash, most of them damaged) are
    read or refused as corrupt, never anything else."""
    every = sorted(os.listdir(CORPUS))
    names = [n for n in every if n.endswith(".psck")]
    assert names
    for name in every:
        if name in names:
            continue
        for what in (ckmod.MANIFEST, ckmod.DATA):
            try:
                ckmod._read_file(os.path.join(CORPUS, name), what)
            except pshard.CorruptError:
                pass
    for name in names:
        what = ckmod.MANIFEST if name.startswith("manifest") else ckmod.DATA
        header, blocks = ckmod._read_file(os.path.join(CORPUS, name), what)
        assert header["what"] == what and blocks is not None
        assert header["base"] == (2 if "increment" in name else 0), name
    assert {"data-increment.psck", "manifest-increment.psck", "manifest-v1.psck"} <= set(names)


def test_files_that_do_not_match_the_manifest(tmp_path):
    a = write_sample(tmp_path / "a", 1, servers=2)
    b = write_sample(tmp_path / "b", 2, servers=2)
    # a data file of another checkpoint
    shutil.copy(os.path.join(b, "server-0.psck"), os.path.join(a, "server-0.psck"))
    with pytest.raises(pshard.CorruptError, match="server-0.psck.*id 2, the manifest says 1"):
        pshard.load_checkpoint(a)
    # the ranks' files swapped
    a = write_sample(tmp_path / "c", 1, servers=2)
    os.rename(os.path.join(a, "server-0.psck"), os.path.join(a, "x"))
    os.rename(os.path.join(a, "server-1.psck"), os.path.join(a, "server-0.psck"))
    os.rename(os.path.join(a, "x"), os.path.join(a, "server-1.psck"))
    with pytest.raises(pshard.CorruptError, match="rank 1, the manifest says 0"):
        pshard.load_checkpoint(a)
    # cut at a block boundary: the END block gone
    a = write_sample(tmp_path / "d", 1, servers=2)
    path = os.path.join(a, "server-1.psck")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-40])
    with pytest.raises(pshard.CorruptError, match="without an END block"):
        pshard.load_checkpoint(a)
    # missing
    os.unlink(path)
    with pytest.raises(FileNotFoundError):
        pshard.load_checkpoint(a)


# ------------------------------------------------------------------------- the command

def inspect(*args):
    return subprocess.run([pshard.find_command(), "checkpoint", "inspect", *map(str, args)], capture_output=True,
                          text=True, timeout=60)


def test_inspect_verifies_and_describes(tmp_path):
    cdir = write_sample(tmp_path, 4, servers=2, clock=9)
    out = inspect(tmp_path)   # the parent: the newest complete one
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "checkpoint %s" % cdir in text
    assert "id 4, clock 9, 2 servers" in text
    for line in ("w ", "dense", "10 floats, slices of 4", "adam", "emb", "sparse", "rows of dim 3", "adagrad"):
        assert line in text, line
    assert text.count("    block 0    HEADER") == 3          # the manifest and two data files
    assert "server-0.psck" in text and "server-1.psck" in text
    assert "FAILED" not in text and text.rstrip().endswith("result: verified")

    summary = inspect("--summary", cdir)
    assert summary.returncode == 0 and "block 0" not in summary.stdout

    flip(os.path.join(cdir, "server-1.psck"), 400)
    out = inspect(cdir)
    assert out.returncode == 1, out.stdout
    assert "FAILED: checkpoint %s" % os.path.join(cdir, "server-1.psck") in out.stdout
    assert "checksum mismatch" in out.stdout and "result: FAILED" in out.stdout

    flip(os.path.join(cdir, "MANIFEST"), 100)
    out = inspect(cdir)
    assert out.returncode == 1 and "MANIFEST" in out.stdout and "result: FAILED" in out.stdout


def test_inspect_usage(tmp_path):
    assert inspect().returncode == 2
    assert inspect("--bogus", tmp_path).returncode == 2
    out = inspect(tmp_path)
    assert out.returncode == 1 and "no complete checkpoint" in out.stderr
    out = inspect(tmp_path / "absent")
    assert out.returncode == 1 and "not a directory" in out.stderr
    top = subprocess.run([pshard.find_command(), "--help"], capture_output=True, text=True, timeout=30)
    assert "checkpoint" in top.stdout


# ------------------------------------------------------------------------- chains of increments

import sys  # noqa: E402

sys.path.insert(0, HERE)
from ckpt_files import Table, write_checkpoint  # noqa: E402

WORKER = os.path.join(BUILD, "ckpt_worker")


def run_job(ckdir, ckpt_at, full_every=None, servers=2):
    """A real job (pshard run, ckpt_worker in sync mode) writing checkpoints at the clocks
    ckpt_at into ckdir; the worker's final parameters as text."""
    out = ckdir + ".params"
    argv = [pshard.find_command(), "run", "-s", str(servers), "-w", "2", "--mode", "sync", "--progress-ms", "0",
            "--checkpoint-dir", ckdir, "--checkpoint-keep", "8"]
    if full_every:
        argv += ["--checkpoint-full-every", str(full_every)]
    argv += ["--", WORKER, "--steps", str(ckpt_at[-1]), "--out", out, "--keyspace", "4096", "--dense", "40",
             "--ckpt-at", ",".join(map(str, ckpt_at))]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out) as f:
        return f.read()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The same job twice: checkpoints at clocks 2, 4, 6, 8 (1 whole, 2-4 increments)
    and one whole checkpoint at clock 8."""
    if not os.access(WORKER, os.X_OK):
        pytest.skip("ckpt_worker is not built")
    top = tmp_path_factory.mktemp("chains")
    chain, whole = str(top / "chain"), str(top / "whole")
    a = run_job(chain, [2, 4, 6, 8], full_every=4)
    b = run_job(whole, [8])
    assert a == b
    return chain, whole


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a.tables[name] == b.tables[name], name
        if a.tables[name].kind == "dense":
            assert np.array_equal(a[name], b[name]), name
        else:
            assert np.array_equal(a[name][0], b[name][0]) and np.array_equal(a[name][1], b[name][1]), name
        assert sorted(a.optimizer[name]) == sorted(b.optimizer[name])
        for s in a.optimizer[name]:
            assert np.array_equal(a.optimizer[name][s], b.optimizer[name][s]), (name, s)


def test_a_real_chain_loads_equal_to_a_whole_checkpoint(jobs, hashing):
    chain, whole = jobs
    ck = pshard.load_checkpoint(chain)           # the parent: the newest, ckpt-4
    full = pshard.load_checkpoint(whole)
    assert (ck.id, ck.base, ck.chain, ck.clock) == (4, 3, [1, 2, 3, 4], 8)
    assert (full.id, full.base, full.chain, full.clock) == (1, 0, [1], 8)
    assert ck.path == os.path.join(chain, "ckpt-4")
    assert_same(ck, full)
    assert ck.state == full.state
    assert ck.tables["sa"].step == 8 and ck.tables["da"].version == 8
    # The increment alone holds fewer sparse rows than the merged table: the older
    # checkpoints' rows were needed.
    alone = ckmod._read_checkpoint(os.path.join(chain, "ckpt-4"))
    assert 0 < len(alone["data"][ck.tables["sa"].id][0]) < ck.tables["sa"].rows
    # A checkpoint in the middle of the chain reads its own, shorter chain.
    mid = pshard.load_checkpoint(os.path.join(chain, "ckpt-2"))
    assert (mid.id, mid.base, mid.chain, mid.clock) == (2, 1, [1, 2], 4)


def test_a_damaged_byte_in_an_increment_is_refused(jobs, tmp_path):
    chain, _ = jobs
    for victim in ("ckpt-3", "ckpt-1"):   # an increment of the chain, and its whole base
        copy = str(tmp_path / victim)
        shutil.copytree(chain, copy)
        path = os.path.join(copy, victim, "server-1.psck")
        flip(path, os.path.getsize(path) // 2)
        with pytest.raises(pshard.CorruptError) as e:
            pshard.load_checkpoint(os.path.join(copy, "ckpt-4"))
        assert os.path.join(victim, "server-1.psck") in str(e.value), str(e.value)


def test_a_missing_or_incomplete_base_is_refused_by_name(jobs, tmp_path):
    chain, _ = jobs
    copy = str(tmp_path / "c")
    shutil.copytree(chain, copy)
    os.unlink(os.path.join(copy, "ckpt-2", "MANIFEST"))     # incomplete
    with pytest.raises(FileNotFoundError) as e:
        pshard.load_checkpoint(copy)
    msg = str(e.value)
    assert "ckpt-3 is an increment on checkpoint 2" in msg and os.path.join(copy, "ckpt-2") in msg, msg
    shutil.rmtree(os.path.join(copy, "ckpt-2"))             # gone
    with pytest.raises(FileNotFoundError, match="an increment on checkpoint 2"):
        pshard.load_checkpoint(copy)
    # ckpt-1 (whole) still loads on its own.
    assert pshard.load_checkpoint(os.path.join(copy, "ckpt-1")).chain == [1]


# Synthetic chains: rows exactly as a test wants them.
W = Table(1, "w", ckmod.DENSE, 10, 4, 8, "opt=adagrad slice=4", step=2, version=2)
E = Table(2, "emb", ckmod.SPARSE, 2, 2, 2, "opt=sgd", step=2)


def dense_rows(slices, v):
    return slices, [[v + s] * 4 + [-v - s] * 4 for s in slices]


def sparse_rows(keys, v):
    return keys, [[v + k, v - k] for k in keys]


def test_a_synthetic_chain_merges_slices_and_keys(tmp_path):
    """Base: every slice and keys 1-4 on two servers; increment 2 changes slice 1 and
    keys 2, 9; increment 3 has a whole file (rank 0, base 0 in its header) and an
    increment (rank 1) that holds no rows."""
    write_checkpoint(tmp_path, 5, [W, E], [{W: dense_rows([0, 1], 0), E: sparse_rows([1, 3], 0)},
                                           {W: dense_rows([2], 0), E: sparse_rows([2, 4], 0)}], clock=2)
    w2 = Table(1, "w", ckmod.DENSE, 10, 4, 8, "opt=adagrad slice=4", step=4, version=4)
    write_checkpoint(tmp_path, 6, [w2, E], [{w2: dense_rows([1], 100)}, {E: sparse_rows([2, 9], 100)}],
                     base=5, clock=4, sparse_counted=False)
    w3 = Table(1, "w", ckmod.DENSE, 10, 4, 8, "opt=adagrad slice=4", step=6, version=6)
    d = write_checkpoint(tmp_path, 7, [w3, E], [{w3: dense_rows([0, 1], 200), E: sparse_rows([1, 3, 9], 200)},
                                                {}], base=6, clock=6, file_base=[0, 6], state=b"newest")
    ck = pshard.load_checkpoint(d)
    assert (ck.id, ck.base, ck.chain, ck.clock, ck.state) == (7, 6, [5, 6, 7], 6, b"newest")
    slice_of = [200, 200, 0]   # the value each slice was last written with
    want = np.concatenate([np.full(4, v + s, np.float32) for s, v in enumerate(slice_of)])[:10]
    assert np.array_equal(ck["w"], want)
    assert np.array_equal(ck.optimizer["w"]["sum"], -want)
    assert (ck.tables["w"].step, ck.tables["w"].version, ck.tables["w"].rows) == (6, 6, 3)
    keys, rows = ck["emb"]
    assert keys.tolist() == [1, 2, 3, 4, 9]
    last = {1: 200, 2: 100, 3: 200, 4: 0, 9: 200}
    assert rows.tolist() == [[last[k] + k, last[k] - k] for k in keys.tolist()]
    assert ck.tables["emb"].rows == 5


def test_synthetic_chains_that_are_refused(tmp_path):
    base = [{W: dense_rows([0, 1, 2], 0), E: sparse_rows([1, 2], 0)}]
    # a slice twice in one increment (two servers wrote it)
    write_checkpoint(tmp_path / "a", 1, [W, E], base)
    d = write_checkpoint(tmp_path / "a", 2, [W, E], [{W: dense_rows([1], 1)}, {W: dense_rows([1], 2)}], base=1)
    with pytest.raises(pshard.CorruptError, match="dense table 'w': slice 1 is repeated"):
        pshard.load_checkpoint(d)
    # a key twice in one increment
    d = write_checkpoint(tmp_path / "a", 3, [W, E], [{E: sparse_rows([5], 1)}, {E: sparse_rows([5], 2)}], base=1)
    with pytest.raises(pshard.CorruptError, match="sparse table 'emb': key 5 is in more than one row"):
        pshard.load_checkpoint(d)
    # a dense table whose base lacks a slice: a whole checkpoint's count is every slice
    write_checkpoint(tmp_path / "b", 1, [W], [{W: dense_rows([0, 2], 0)}])
    d = write_checkpoint(tmp_path / "b", 2, [W], [{W: dense_rows([0], 1)}], base=1)
    with pytest.raises(pshard.CorruptError, match="ckpt-1/MANIFEST: table 'w': 2 rows in the data files"):
        pshard.load_checkpoint(d)
    # a table first declared in an increment must come whole there
    write_checkpoint(tmp_path / "c", 1, [E], [{E: sparse_rows([1], 0)}])
    d = write_checkpoint(tmp_path / "c", 2, [W, E], [{W: dense_rows([0, 1], 1)}], base=1)
    with pytest.raises(pshard.CorruptError, match="dense table 'w': slice 2 is missing"):
        pshard.load_checkpoint(d)
    # the base's directory holds another checkpoint
    write_checkpoint(tmp_path / "d", 1, [W, E], base)
    os.rename(tmp_path / "d" / "ckpt-1", tmp_path / "d" / "ckpt-2")
    d = write_checkpoint(tmp_path / "d", 3, [W, E], [{E: sparse_rows([5], 1)}], base=2)
    with pytest.raises(pshard.CorruptError, match="ckpt-2/MANIFEST: checkpoint 1, where checkpoint 2 belongs"):
        pshard.load_checkpoint(d)
    # a data file that is an increment on another base, or an increment in a whole checkpoint
    write_checkpoint(tmp_path / "e", 2, [W, E], [{E: sparse_rows([5], 1)}], base=1, file_base=0)
    write_checkpoint(tmp_path / "e", 1, [W, E], base)
    d = write_checkpoint(tmp_path / "e", 3, [W, E], [{E: sparse_rows([5], 1)}], base=2, file_base=1)
    with pytest.raises(pshard.CorruptError, match="an increment on checkpoint 1, the manifest's base is 2"):
        pshard.load_checkpoint(d)
    d = write_checkpoint(tmp_path / "e", 4, [W, E], base, base=0, file_base=3)
    with pytest.raises(pshard.CorruptError, match="an increment on checkpoint 3, the manifest's base is 0"):
        pshard.load_checkpoint(d)
    # the same table id declared otherwise in the base
    w_other = Table(1, "w", ckmod.DENSE, 10, 4, 8, "opt=adagrad slice=4 lr=0.5")
    write_checkpoint(tmp_path / "f", 1, [w_other, E], [{w_other: dense_rows([0, 1, 2], 0)}])
    d = write_checkpoint(tmp_path / "f", 2, [W, E], [{E: sparse_rows([5], 1)}], base=1)
    with pytest.raises(pshard.CorruptError, match="table 1 'w' is not the one checkpoint 2 declares"):
        pshard.load_checkpoint(d)
