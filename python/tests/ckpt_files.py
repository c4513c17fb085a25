"""ckpt_files.py - write checkpoint files (docs/checkpoint.md, format 2) from Python, for
the tests: whole checkpoints and increments with exactly the rows a test wants (a dense
table with only some slices, a whole file inside an increment, a repeated key), which a
real job does not make on demand. Rows are sorted by position as the C writer sorts them,
so that `pshard checkpoint inspect` reads these files too.

    write_checkpoint(root, 2, base=1, clock=4, files=[{TABLE: (keys, rows)}, ...])
"""
import os
import struct

import numpy as np

from pshard import checkpoint as ckmod

RING_SEED = 0x70736872696E676B


class Table:
    """A table's declaration: id, kind (ckmod.DENSE / SPARSE), size, width, options,
    row_floats (width times 1 + the optimiser's state blocks), step, version."""

    def __init__(self, tid, name, kind, size, width, row_floats, options, step=0, version=0):
        self.id, self.name, self.kind, self.size, self.width = tid, name, kind, size, width
        self.row_floats, self.options, self.step, self.version = row_floats, options, step, version

    @property
    def slices(self):
        return -(-self.size // self.width)


def _str(s):
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def _frame(kind, payload):
    head = struct.pack("<IHHQ", ckmod.BLOCK_MAGIC, kind, 0, len(payload))
    return head + payload + struct.pack("<Q", ckmod.xxh64(head + payload))


def _table_payload(t, nrows):
    return (struct.pack("<IIQIIQqQ", t.id, t.kind, t.size, t.width, t.row_floats, t.step, t.version, nrows)
            + _str(t.name) + _str(t.options))


def _position(t, key):
    return key if t.kind == ckmod.DENSE else ckmod.xxh64(struct.pack("<IQ", t.id, key), RING_SEED)


def _rows_block(t, keys, rows):
    pos = [_position(t, k) for k in keys]
    desc = struct.pack("<IIIIQQ", t.id, len(keys), t.row_floats, 0, min(pos), max(pos))
    head = struct.pack("<IHHQ", ckmod.BLOCK_MAGIC, ckmod.B_ROWS, 0,
                       40 + 8 * len(keys) + 4 * len(keys) * t.row_floats)
    payload = (desc + struct.pack("<Q", ckmod.xxh64(head + desc)) + np.asarray(keys, "<u8").tobytes()
               + np.asarray(rows, "<f4").reshape(len(keys), t.row_floats).tobytes())
    return _frame(ckmod.B_ROWS, payload)


def _write(path, what, cid, clock, rank, nservers, base, blocks):
    """HEADER, the given framed blocks, END; (bytes, END chain) of the file."""
    header = struct.pack("<IIIIIIQqQQ", ckmod.FILE_MAGIC, 2, what, rank, nservers, 0, cid, clock,
                         1700000000000, base)
    blocks = [_frame(ckmod.B_HEADER, header)] + blocks
    sums = b"".join(b[-8:] for b in blocks)
    chain = ckmod.xxh64(sums)
    data = b"".join(blocks) + _frame(ckmod.B_END, struct.pack("<QQ", len(blocks), chain))
    with open(path, "wb") as f:
        f.write(data)
    return len(data), chain


def write_checkpoint(root, cid, tables, files, base=0, clock=-1, file_base=None, state=b"state",
                     sparse_counted=True):
    """root/ckpt-<cid>: one data file per element of `files` (a dict table -> (keys,
    rows [n, row_floats]), the rows of that table in that server's file; tables without
    an entry get a TABLE block with no rows), then the MANIFEST. file_base: the base
    written in the data files, one for all or a list by rank (default: the manifest's);
    sparse_counted: the manifest
    records a sparse table's rows (pshard's scheduler writes 0). Returns the directory."""
    d = os.path.join(str(root), "ckpt-%d" % cid)
    os.makedirs(d, exist_ok=True)
    n = len(files)
    fblocks, totals = [], {t.id: 0 for t in tables}
    for rank, content in enumerate(files):
        blocks, rows_in = [], 0
        for t in tables:
            keys, rows = content.get(t, ([], np.zeros((0, t.row_floats), np.float32)))
            keys = [int(k) for k in keys]
            rows = np.asarray(rows, np.float32).reshape(len(keys), t.row_floats)
            order = sorted(range(len(keys)), key=lambda i: (_position(t, keys[i]), keys[i]))
            blocks.append(_frame(ckmod.B_TABLE, _table_payload(t, len(keys))))
            if keys:
                blocks.append(_rows_block(t, [keys[i] for i in order], rows[order]))
            rows_in += len(keys)
            totals[t.id] += len(keys)
        fb = base if file_base is None else file_base[rank] if isinstance(file_base, (list, tuple)) else file_base
        name = "server-%d.psck" % rank
        nbytes, chain = _write(os.path.join(d, name), ckmod.DATA, cid, clock, rank, n, fb, blocks)
        fblocks.append(_frame(ckmod.B_FILE, _str(name) + struct.pack("<IQQQ", rank, nbytes, chain, rows_in)))
    mblocks = []
    for t in tables:
        nrows = t.slices if t.kind == ckmod.DENSE else (totals[t.id] if sparse_counted else 0)
        mblocks.append(_frame(ckmod.B_TABLE, _table_payload(t, nrows)))
    mblocks += fblocks + [_frame(ckmod.B_STATE, state)]
    _write(os.path.join(d, "MANIFEST"), ckmod.MANIFEST, cid, clock, 0, n, base, mblocks)
    return d
