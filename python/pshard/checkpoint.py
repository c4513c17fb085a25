"""checkpoint.py - read a pshard checkpoint into numpy arrays, in pure Python.

    ck = pshard.load_checkpoint("ckpts")        # the newest complete checkpoint there
    ck["w"]                                     # dense: float32 array of the table's size
    keys, rows = ck["emb"]                      # sparse: uint64 keys, float32 [n, dim]
    ck.optimizer["w"]["exp_avg"]                # the optimiser state, shaped like the table
    ck.id, ck.clock, ck.tables["emb"].opt
    ck.chain, ck.base                           # [1, 2, 3], 2: an increment on 2, read with 1 and 2

The format is docs/checkpoint.md; this module reads it without the C library. Every
checksum is verified before a byte is used: with the `xxhash` module when it is
installed, else with the pure-Python xxh64 below (about 10-20 MB/s; numpy turns the
bytes into words). A checkpoint that is an increment (its manifest names a base) is read
with its chain: DIR/ckpt-<base>, its base, ... down to a whole one, oldest first, every
later checkpoint's rows replacing the earlier ones (by key or slice); the tables, clock
and scheduler state are the newest manifest's, a table's step and version the newest
data files' that hold it (ck.chain lists the ids read). Every checkpoint of the chain is
read whole and checked whole: each data file against the manifest's entry for it (size,
checksum, rows, id, rank, base), its tables against the manifest's declarations, the
rows of every table against the totals, no slice or key twice within a checkpoint, and
the merged dense tables for every slice. A file that fails any check raises
pshard.CorruptError naming the file and the block; a file that cannot be read raises
the OSError of the operating system; a directory without a complete checkpoint, or a
chain whose base is missing, raises FileNotFoundError. Nothing is returned half-loaded.
"""
import os
import re
import struct
from collections import namedtuple

import numpy as np

from ._lib import error as _error

try:  # optional: a C xxh64, much faster than the one below
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the machine
    _xxhash = None

__all__ = ["load_checkpoint", "Checkpoint", "TableInfo", "xxh64"]

FILE_MAGIC = 0x4B435350   # "PSCK"
BLOCK_MAGIC = 0x42435350  # "PSCB"
FORMAT = 2  # written by this version; format 1 (no base) is read too
MAX_BLOCK = 64 << 20
ROWS_PER_BLOCK = 65536
MAX_MEMBERS = 4096
MAX_CHAIN = 4096  # checkpoints in a chain, at most (PS_CKPT_MAX_CHAIN)
B_HEADER, B_TABLE, B_ROWS, B_FILE, B_STATE, B_END = 1, 2, 3, 4, 5, 6
KIND_NAMES = {1: "HEADER", 2: "TABLE", 3: "ROWS", 4: "FILE", 5: "STATE", 6: "END"}
DATA, MANIFEST = 1, 2
DENSE, SPARSE = 1, 2
_MAX_LEN = {B_HEADER: 4096, B_TABLE: 48 + 8 + 128 + 1024, B_FILE: 4 + 64 + 28, B_END: 16}

# The optimiser state blocks of a row, after the parameters, named as PyTorch names them
# (store/optim.c follows PyTorch's update rules); FTRL's as McMahan et al. do.
OPT_STATE = {
    "sgd": (),
    "momentum": ("momentum_buffer",),
    "adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "ftrl": ("z", "n"),
}

# ------------------------------------------------------------------------- xxh64

_M64 = 0xFFFFFFFFFFFFFFFF
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & _M64


def _round(acc, lane):
    acc = (acc + lane * _P2) & _M64
    return (((acc << 31) | (acc >> 33)) & _M64) * _P1 & _M64


def _xxh64_py(data, seed=0):
    """xxh64 of a bytes-like object, in Python (the reference algorithm, XXH64)."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    i = 0
    if n >= 32:
        M, P1, P2 = _M64, _P1, _P2
        v1 = (seed + P1 + P2) & M
        v2 = (seed + P2) & M
        v3 = seed & M
        v4 = (seed - P1) & M
        nw = (n // 32) * 4
        w = np.frombuffer(mv, dtype="<u8", count=nw).tolist()
        for j in range(0, nw, 4):
            v1 = (v1 + w[j] * P2) & M
            v1 = (((v1 << 31) | (v1 >> 33)) & M) * P1 & M
            v2 = (v2 + w[j + 1] * P2) & M
            v2 = (((v2 << 31) | (v2 >> 33)) & M) * P1 & M
            v3 = (v3 + w[j + 2] * P2) & M
            v3 = (((v3 << 31) | (v3 >> 33)) & M) * P1 & M
            v4 = (v4 + w[j + 3] * P2) & M
            v4 = (((v4 << 31) | (v4 >> 33)) & M) * P1 & M
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & M
        for v in (v1, v2, v3, v4):
            h = ((h ^ _round(0, v)) * P1 + _P4) & M
        i = nw * 8
    else:
        h = (seed + _P5) & _M64
    h = (h + n) & _M64
    while i + 8 <= n:
        h ^= _round(0, int.from_bytes(mv[i:i + 8], "little"))
        h = (_rotl(h, 27) * _P1 + _P4) & _M64
        i += 8
    if i + 4 <= n:
        h ^= (int.from_bytes(mv[i:i + 4], "little") * _P1) & _M64
        h = (_rotl(h, 23) * _P2 + _P3) & _M64
        i += 4
    while i < n:
        h ^= (mv[i] * _P5) & _M64
        h = (_rotl(h, 11) * _P1) & _M64
        i += 1
    h ^= h >> 33
    h = (h * _P2) & _M64
    h ^= h >> 29
    h = (h * _P3) & _M64
    return h ^ (h >> 32)


def xxh64(data, seed=0):
    """xxh64 of a bytes-like object as an int: the xxhash module's if installed."""
    if _xxhash is not None:
        return _xxhash.xxh64_intdigest(bytes(data) if not isinstance(data, bytes) else data, seed)
    return _xxh64_py(data, seed)


# ------------------------------------------------------------------------- the result

TableInfo = namedtuple("TableInfo", "id kind size width row_floats opt state_names step version rows options")
TableInfo.__doc__ = """A table of a checkpoint: its id, kind ("dense" or "sparse"), size (dense: floats;
sparse: dim), width (parameters per stored row: the dense slice or the dim), row_floats,
optimiser name and the names of its state blocks, the optimiser steps applied, the sync
version (rounds applied), its rows in all files and its option string."""


class Checkpoint(dict):
    """Table name -> parameters: a float32 array of `size` floats for a dense table, a
    (keys uint64 [n], rows float32 [n, dim]) pair sorted by key for a sparse one.

    Attributes: id, clock (the clock every shard was cut at; -1 outside sync modes),
    base (the checkpoint it is an increment on; 0: whole), chain (the ids read, oldest
    first, ending with id), nservers (of the job that wrote it), created_ms, path (the checkpoint's directory),
    state (the scheduler's opaque bytes), tables (name -> TableInfo) and optimizer
    (name -> {state name: array shaped like the parameters}, e.g. "exp_avg")."""

    def __init__(self):
        super().__init__()
        self.id = None
        self.clock = None
        self.base = 0
        self.chain = []
        self.nservers = None
        self.created_ms = None
        self.path = None
        self.state = b""
        self.tables = {}
        self.optimizer = {}

    def __repr__(self):
        return "Checkpoint(id=%r, clock=%r, path=%r, tables=%r)" % (self.id, self.clock, self.path, sorted(self))


# ------------------------------------------------------------------------- one file

class _Corrupt(Exception):
    pass


def _corrupt(path, msg):
    return _error("PS_ERR_CORRUPT", "checkpoint %s: %s" % (path, msg))


def _where(index, kind, off):
    return "block %d (%s) at offset %d" % (index, KIND_NAMES.get(kind, "kind %d" % kind), off)


def _opt_of(options):
    m = re.search(r"(?:^|\s)opt=(\S+)", options)
    return m.group(1) if m else "sgd"


def _str(buf, off, end, cap, what):
    if off + 4 > end:
        raise _Corrupt("malformed %s payload" % what)
    (n,) = struct.unpack_from("<I", buf, off)
    off += 4
    if n >= cap or off + n > end:
        raise _Corrupt("malformed %s payload" % what)
    raw = bytes(buf[off:off + n])
    if b"\0" in raw:
        raise _Corrupt("a NUL inside a string of a %s block" % what)
    try:
        return raw.decode("utf-8"), off + n
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace"), off + n


def _table_problem(t, what):
    if t["kind"] not in (DENSE, SPARSE):
        return "kind is neither dense nor sparse"
    if t["size"] == 0:
        return "size 0"
    if not t["name"]:
        return "empty name"
    w = t["width"]
    if w == 0 or w > (1 << 20):
        return "width out of range"
    if t["kind"] == SPARSE and w != t["size"]:
        return "a sparse table's width is not its dim"
    if t["kind"] == DENSE and w > t["size"]:
        return "slice width larger than the table"
    if t["row_floats"] % w or not 1 <= t["row_floats"] // w <= 3:
        return "row_floats is not 1 to 3 times the width"
    slices = -(-t["size"] // w) if t["kind"] == DENSE else 0
    if t["kind"] == DENSE and t["nrows"] > slices:
        return "more rows than the table has slices"
    if t["kind"] == DENSE and what == MANIFEST and t["nrows"] != slices:
        return "a dense table's rows in all files are not its slices"
    return None


def _parse_table(buf, off, end):
    fields = struct.unpack_from("<IIQIIQqQ", buf, off) if off + 48 <= end else None
    if fields is None:
        raise _Corrupt("malformed TABLE payload")
    t = dict(zip(("id", "kind", "size", "width", "row_floats", "step", "version", "nrows"), fields))
    t["name"], o = _str(buf, off + 48, end, 128, "TABLE")
    t["options"], o = _str(buf, o, end, 1024, "TABLE")
    if o != end:
        raise _Corrupt("malformed TABLE payload")
    return t


def _read_file(path, what):
    """Every block of one file, verified: (header dict, [(kind, fields)])."""
    with open(path, "rb") as f:
        buf = f.read()
    size = len(buf)
    blocks = []
    sums = []
    off = 0
    index = 0
    header = None
    table = None        # data: the current table and its rows so far
    table_rows = 0
    files = set()
    have_state = False
    try:
        if size == 0:
            raise _Corrupt("empty file")
        while True:
            if off == size:
                raise _Corrupt("truncated: the file ends after block %d without an END block" % max(index - 1, 0))
            if size - off < 16:
                raise _Corrupt("truncated: %s needs 16 bytes at offset %d, the file has %d"
                               % ("block %d at offset %d" % (index, off), off, size))
            magic, kind, flags, length = struct.unpack_from("<IHHQ", buf, off)
            if magic != BLOCK_MAGIC:
                if index == 0:
                    raise _Corrupt("not a checkpoint file (bad block magic 0x%08x)" % magic)
                raise _Corrupt("block %d at offset %d: bad block magic 0x%08x" % (index, off, magic))
            if not B_HEADER <= kind <= B_END:
                raise _Corrupt("block %d at offset %d: unknown block kind %d" % (index, off, kind))
            w = _where(index, kind, off)
            if flags:
                raise _Corrupt("%s: flags 0x%04x, not 0" % (w, flags))
            limit = _MAX_LEN.get(kind, MAX_BLOCK)
            if length > limit:
                raise _Corrupt("%s: payload length %d over the limit of %d" % (w, length, limit))
            left = size - off - 16
            if length > left or left - length < 8:
                raise _Corrupt("truncated: %s: payload of %d bytes and checksum, %d left" % (w, length, left))
            p = off + 16
            end = p + length
            (stored,) = struct.unpack_from("<Q", buf, end)
            if kind == B_ROWS:
                if length < 40:
                    raise _Corrupt("%s: payload shorter than its descriptor" % w)
                if xxh64(memoryview(buf)[off:p + 32]) != struct.unpack_from("<Q", buf, p + 32)[0]:
                    raise _Corrupt("%s: descriptor checksum mismatch" % w)
            if xxh64(memoryview(buf)[off:end]) != stored:
                raise _Corrupt("%s: checksum mismatch" % w)
            if index == 0 and kind != B_HEADER:
                raise _Corrupt("block 0 is a %s block, not a HEADER" % KIND_NAMES[kind])
            if kind == B_HEADER:
                if index:
                    raise _Corrupt("%s: a second HEADER" % w)
                if length < 8 or struct.unpack_from("<I", buf, p)[0] != FILE_MAGIC:
                    raise _Corrupt("%s: not a checkpoint file (bad file magic)" % w)
                fmt = struct.unpack_from("<I", buf, p + 4)[0]
                if fmt not in (1, FORMAT):
                    raise _Corrupt("%s: format version %d, this reader reads versions 1 and %d" % (w, fmt, FORMAT))
                want = 48 if fmt == 1 else 56
                if length != want:
                    raise _Corrupt("%s: %d bytes, version %d has %d" % (w, length, fmt, want))
                _, _, fwhat, rank, nservers, res, fid, clock, created = struct.unpack_from("<IIIIIIQqQ", buf, p)
                base = struct.unpack_from("<Q", buf, p + 48)[0] if fmt >= 2 else 0
                if base and base >= fid:
                    raise _Corrupt("%s: an increment on checkpoint %d, not older than itself (%d)" % (w, base, fid))
                if fwhat not in (DATA, MANIFEST):
                    raise _Corrupt("%s: unknown file type %d" % (w, fwhat))
                if res:
                    raise _Corrupt("%s: reserved field not 0" % w)
                if not 1 <= nservers <= MAX_MEMBERS:
                    raise _Corrupt("%s: %d servers (1 to %d)" % (w, nservers, MAX_MEMBERS))
                if (rank >= nservers) if fwhat == DATA else rank:
                    raise _Corrupt("%s: rank %d of %d servers" % (w, rank, nservers))
                if fwhat != what:
                    raise _Corrupt("%s: a %s where a %s belongs" % (
                        w, "manifest" if fwhat == MANIFEST else "data file", "manifest" if what == MANIFEST else "data file"))
                header = dict(what=fwhat, rank=rank, nservers=nservers, id=fid, clock=clock, created_ms=created,
                              base=base)
            elif kind == B_TABLE:
                if table is not None and table_rows != table["nrows"]:
                    raise _Corrupt("%s: table '%s' has %d rows, its TABLE block says %d"
                                   % (w, table["name"], table_rows, table["nrows"]))
                t = _parse_table(buf, p, end)
                why = _table_problem(t, what)
                if why:
                    raise _Corrupt("%s: table '%s': %s" % (w, t["name"], why))
                blocks.append((kind, t))
                if what == DATA:
                    table, table_rows = t, 0
            elif kind == B_ROWS:
                if what != DATA:
                    raise _Corrupt("%s: ROWS in a manifest" % w)
                tid, n, rf, res, lo, hi = struct.unpack_from("<IIIIQQ", buf, p)
                if table is None:
                    raise _Corrupt("%s: ROWS before any TABLE block" % w)
                if tid != table["id"]:
                    raise _Corrupt("%s: rows of table %d after the TABLE block of table %d" % (w, tid, table["id"]))
                if rf != table["row_floats"]:
                    raise _Corrupt("%s: rows of %d floats, the table's are %d" % (w, rf, table["row_floats"]))
                if res:
                    raise _Corrupt("%s: reserved field not 0" % w)
                if not 1 <= n <= ROWS_PER_BLOCK:
                    raise _Corrupt("%s: %d rows (1 to %d)" % (w, n, ROWS_PER_BLOCK))
                if length != 40 + 8 * n + 4 * n * rf:
                    raise _Corrupt("%s: payload of %d bytes for %d rows of %d floats" % (w, length, n, rf))
                if lo > hi:
                    raise _Corrupt("%s: an empty position range" % w)
                if table_rows + n > table["nrows"]:
                    raise _Corrupt("%s: more rows than the %d its TABLE block says" % (w, table["nrows"]))
                table_rows += n
                keys = np.frombuffer(buf, dtype="<u8", count=n, offset=p + 40)
                rows = np.frombuffer(buf, dtype="<f4", count=n * rf, offset=p + 40 + 8 * n).reshape(n, rf)
                if table["kind"] == DENSE and n and int(keys.max()) >= -(-table["size"] // table["width"]):
                    raise _Corrupt("%s: slice %d of a table of %d" % (w, int(keys.max()), -(-table["size"] // table["width"])))
                blocks.append((kind, dict(table=tid, keys=keys, rows=rows, where=w)))
            elif kind == B_FILE:
                if what != MANIFEST:
                    raise _Corrupt("%s: FILE in a data file" % w)
                name, o = _str(buf, p, end, 64, "FILE")
                if o + 28 != end:
                    raise _Corrupt("%s: malformed FILE payload" % w)
                rank, nbytes, checksum, frows = struct.unpack_from("<IQQQ", buf, o)
                if not re.fullmatch(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]*", name) or name.startswith("."):
                    raise _Corrupt("%s: bad data file name" % w)
                if rank >= header["nservers"] or rank in files:
                    raise _Corrupt("%s: a FILE for rank %d of %d servers (repeated or out of range)"
                                   % (w, rank, header["nservers"]))
                files.add(rank)
                blocks.append((kind, dict(name=name, rank=rank, bytes=nbytes, checksum=checksum, rows=frows)))
            elif kind == B_STATE:
                if what != MANIFEST:
                    raise _Corrupt("%s: STATE in a data file" % w)
                if have_state:
                    raise _Corrupt("%s: a second STATE block" % w)
                have_state = True
                blocks.append((kind, bytes(buf[p:end])))
            else:  # END
                if length != 16:
                    raise _Corrupt("%s: payload of %d bytes, not 16" % (w, length))
                nblocks, chain = struct.unpack_from("<QQ", buf, p)
                if nblocks != index:
                    raise _Corrupt("%s: says %d blocks before it, the file has %d" % (w, nblocks, index))
                if chain != xxh64(b"".join(struct.pack("<Q", s) for s in sums)):
                    raise _Corrupt("%s: the blocks' checksums do not match its chain" % w)
                if end + 8 != size:
                    raise _Corrupt("%s: %d bytes after the END block" % (w, size - end - 8))
                if what == MANIFEST and len(files) != header["nservers"]:
                    raise _Corrupt("%s: %d FILE blocks for %d servers" % (w, len(files), header["nservers"]))
                if table is not None and table_rows != table["nrows"]:
                    raise _Corrupt("%s: table '%s' has %d rows, its TABLE block says %d"
                                   % (w, table["name"], table_rows, table["nrows"]))
                header["end_checksum"] = chain
                header["bytes"] = size
                return header, blocks
            sums.append(stored)
            off = end + 8
            index += 1
    except _Corrupt as e:
        raise _corrupt(path, str(e)) from None


# ------------------------------------------------------------------------- the checkpoint

def _checkpoint_dir(path):
    """path itself if it holds a MANIFEST, else its newest complete ckpt-<id>."""
    if not os.path.isdir(path):
        raise FileNotFoundError("checkpoint: %s is not a directory" % path)
    if os.path.isfile(os.path.join(path, "MANIFEST")):
        return path
    best, incomplete = None, 0
    for name in os.listdir(path):
        m = re.fullmatch(r"ckpt-(0|[1-9][0-9]{0,19})", name)
        if not m or not os.path.isdir(os.path.join(path, name)):
            continue
        cid = int(m.group(1))
        if cid >= 1 << 64:
            continue
        if os.path.isfile(os.path.join(path, name, "MANIFEST")):
            if best is None or cid > best:
                best = cid
        else:
            incomplete += 1
    if best is None:
        raise FileNotFoundError("no complete checkpoint in %s (%d without a MANIFEST)" % (path, incomplete))
    return os.path.join(path, "ckpt-%d" % best)


def _same_decl(a, b):
    return all(a[k] == b[k] for k in ("kind", "size", "name", "options", "width", "row_floats"))


def _slices(t):
    return -(-t["size"] // t["width"])


def _read_checkpoint(cdir):
    """One checkpoint of a chain, every file verified against its manifest: a dict with
    its manifest header, tables (id -> declaration), state, and per table the rows of
    its data files (id -> [(keys, rows)]) and their TABLE blocks; bytes and rows of its
    files, the manifest included."""
    mpath = os.path.join(cdir, "MANIFEST")
    mh, mblocks = _read_file(mpath, MANIFEST)
    tables = {}   # id -> declaration
    names = set()
    files = []
    state = b""
    for kind, b in mblocks:
        if kind == B_TABLE:
            if b["id"] in tables or b["name"] in names:
                raise _corrupt(mpath, "table %d '%s' declared twice" % (b["id"], b["name"]))
            tables[b["id"]] = b
            names.add(b["name"])
        elif kind == B_FILE:
            files.append(b)
        elif kind == B_STATE:
            state = b
    parts = {tid: [] for tid in tables}   # id -> [(keys, rows)]
    heads = {tid: [] for tid in tables}   # id -> the data files' TABLE blocks of it
    nbytes, nrows_all = mh["bytes"], 0
    for f in sorted(files, key=lambda f: f["rank"]):
        fpath = os.path.join(cdir, f["name"])
        h, blocks = _read_file(fpath, DATA)
        for field, want in (("id", mh["id"]), ("rank", f["rank"]), ("nservers", mh["nservers"]), ("clock", mh["clock"])):
            if h[field] != want:
                raise _corrupt(fpath, "%s %d, the manifest says %d" % (field, h[field], want))
        # A whole file may stand in an increment (its server could not build on the
        # base), never an increment in a whole checkpoint or on another base.
        if h["base"] not in (0, mh["base"]):
            raise _corrupt(fpath, "an increment on checkpoint %d, the manifest's base is %d" % (h["base"], mh["base"]))
        if h["bytes"] != f["bytes"] or h["end_checksum"] != f["checksum"]:
            raise _corrupt(fpath, "not the file the manifest describes (%d bytes, checksum %016x; the manifest says "
                           "%d bytes, %016x)" % (h["bytes"], h["end_checksum"], f["bytes"], f["checksum"]))
        nrows = 0
        for kind, b in blocks:
            if kind == B_TABLE:
                t = tables.get(b["id"])
                if t is None or not _same_decl(t, b):
                    raise _corrupt(fpath, "table %d '%s' is not the manifest's" % (b["id"], b["name"]))
                heads[b["id"]].append(b)
            elif kind == B_ROWS:
                parts[b["table"]].append((b["keys"], b["rows"]))
                nrows += len(b["keys"])
        if nrows != f["rows"]:
            raise _corrupt(fpath, "%d rows, the manifest says %d" % (nrows, f["rows"]))
        nbytes += h["bytes"]
        nrows_all += nrows

    data = {}
    for tid, t in tables.items():
        keys = np.concatenate([k for k, _ in parts[tid]]) if parts[tid] else np.zeros(0, np.uint64)
        rows = (np.concatenate([r for _, r in parts[tid]]) if parts[tid]
                else np.zeros((0, t["row_floats"]), np.float32))
        # The manifest's count: a dense table's slices (the whole table, which an
        # increment's files hold part of); a sparse table's rows over the data files,
        # or 0 when the writer did not count them.
        if t["kind"] == DENSE:
            bad = len(keys) != t["nrows"] if not mh["base"] else len(keys) > t["nrows"]
        else:
            bad = t["nrows"] != 0 and len(keys) != t["nrows"]
        if bad:
            raise _corrupt(mpath, "table '%s': %d rows in the data files, the manifest says %d"
                           % (t["name"], len(keys), t["nrows"]))
        if t["kind"] == DENSE:
            seen = np.bincount(keys.astype(np.int64), minlength=_slices(t)) if len(keys) else np.zeros(0, np.int64)
            if (seen > 1).any():
                raise _corrupt(cdir, "dense table '%s': slice %d is repeated" % (t["name"], int(np.argmax(seen > 1))))
        else:
            skeys = np.sort(keys)
            if len(skeys) > 1 and (skeys[1:] == skeys[:-1]).any():
                dup = int(skeys[1:][skeys[1:] == skeys[:-1]][0])
                raise _corrupt(cdir, "sparse table '%s': key %d is in more than one row" % (t["name"], dup))
        data[tid] = (keys, rows)
    return dict(header=mh, path=cdir, tables=tables, state=state, data=data, heads=heads, bytes=nbytes,
                rows=nrows_all)


def _chain(cdir):
    """The checkpoint in cdir and the ones it is an increment on, each read and verified
    (_read_checkpoint), oldest (a whole checkpoint) first. Its bases are found beside
    it, as DIR/ckpt-<base>."""
    root = os.path.dirname(os.path.normpath(cdir))
    links = [_read_checkpoint(cdir)]
    while links[-1]["header"]["base"]:
        child = links[-1]
        base = child["header"]["base"]
        if len(links) == MAX_CHAIN:
            raise _corrupt(cdir, "a chain of increments longer than %d" % MAX_CHAIN)
        bdir = os.path.join(root, "ckpt-%d" % base)
        if not os.path.isfile(os.path.join(bdir, "MANIFEST")):
            raise FileNotFoundError("checkpoint %s is an increment on checkpoint %d, and %s is not a complete "
                                    "checkpoint" % (child["path"], base, bdir))
        link = _read_checkpoint(bdir)
        if link["header"]["id"] != base:
            raise _corrupt(os.path.join(bdir, "MANIFEST"), "checkpoint %d, where checkpoint %d belongs"
                           % (link["header"]["id"], base))
        links.append(link)
    links.reverse()
    return links


def _merge_table(t, links):
    """Table t (a declaration of the newest manifest) over the chain, oldest first: (keys,
    rows) with every later checkpoint's rows replacing earlier ones, and the TABLE blocks
    of the newest checkpoint whose data files hold it. A dense table comes back as
    (slice indices 0 .. n-1, rows), with every slice required."""
    tid = t["id"]
    ks, rs, heads = [], [], []
    for link in links:
        old = link["tables"].get(tid)
        if old is None:
            continue
        if not _same_decl(old, t):
            raise _corrupt(os.path.join(link["path"], "MANIFEST"), "table %d '%s' is not the one checkpoint %d "
                           "declares" % (tid, old["name"], links[-1]["header"]["id"]))
        keys, rows = link["data"][tid]
        ks.append(keys)
        rs.append(rows)
        if link["heads"][tid]:
            heads = link["heads"][tid]
    keys = np.concatenate(ks) if ks else np.zeros(0, np.uint64)
    rows = np.concatenate(rs) if rs else np.zeros((0, t["row_floats"]), np.float32)
    if t["kind"] == DENSE:
        nslices = _slices(t)
        full = np.empty((nslices, t["row_floats"]), dtype=np.float32)
        seen = np.zeros(nslices, dtype=bool)
        idx = keys.astype(np.int64)
        full[idx] = rows           # in chain order: the last write of a slice wins
        seen[idx] = True
        if not seen.all():
            raise _corrupt(links[-1]["path"], "dense table '%s': slice %d is missing"
                           % (t["name"], int(np.argmin(seen))))
        return np.arange(nslices, dtype=np.uint64), full, heads
    # Stable: among equal keys the chain's order stays, and the last one is kept.
    order = np.argsort(keys, kind="stable")
    skeys = keys[order].astype(np.uint64)
    last = np.ones(len(skeys), dtype=bool)
    if len(skeys) > 1:
        last[:-1] = skeys[1:] != skeys[:-1]
    return skeys[last], rows[order[last]], heads


def load_checkpoint(path):
    """Load the checkpoint in directory `path` (one with a MANIFEST), or the newest
    complete one among the ckpt-<id> directories in `path`. An increment is read with
    the chain it builds on, oldest first, each later checkpoint's rows replacing the
    earlier ones. Returns a Checkpoint (a dict of table name -> parameters, with id,
    clock, base, chain, tables, optimizer, state); raises pshard.CorruptError for
    anything that fails a check (the message names the file and the block), OSError
    when a file cannot be read, FileNotFoundError when there is no complete checkpoint,
    a data file is missing or a base of the chain is."""
    cdir = _checkpoint_dir(os.fspath(path))
    links = _chain(cdir)
    newest = links[-1]
    mh = newest["header"]
    ck = Checkpoint()
    ck.state = newest["state"]
    for t in newest["tables"].values():
        keys, rows, heads = _merge_table(t, links)
        opt = _opt_of(t["options"])
        nstate = t["row_floats"] // t["width"] - 1
        state_names = OPT_STATE.get(opt, ())
        if len(state_names) != nstate:
            state_names = tuple("state%d" % i for i in range(nstate))
        w = t["width"]
        blocks = [rows[:, i * w:(i + 1) * w] for i in range(1 + nstate)]
        if t["kind"] == DENSE:
            out = [blk.reshape(-1)[:t["size"]].copy() for blk in (np.ascontiguousarray(b) for b in blocks)]
            ck[t["name"]] = out[0]
        else:
            out = [np.ascontiguousarray(blk) for blk in blocks]
            ck[t["name"]] = (keys, out[0])
        ck.optimizer[t["name"]] = dict(zip(state_names, out[1:]))
        # Steps and versions are the servers': the largest of the newest files that
        # hold the table (a manifest may leave them 0).
        step = max([t["step"]] + [h["step"] for h in heads])
        version = max([t["version"]] + [h["version"] for h in heads])
        ck.tables[t["name"]] = TableInfo(
            id=t["id"], kind="dense" if t["kind"] == DENSE else "sparse", size=t["size"], width=w,
            row_floats=t["row_floats"], opt=opt, state_names=state_names, step=step,
            version=version, rows=len(keys), options=t["options"])
    ck.id = mh["id"]
    ck.clock = mh["clock"]
    ck.base = mh["base"]
    ck.chain = [link["header"]["id"] for link in links]
    ck.nservers = mh["nservers"]
    ck.created_ms = mh["created_ms"]
    ck.path = cdir
    return ck
