/*
 * ckpt.h - checkpoint files: the format, a writer and a reader (docs/checkpoint.md).
 *
 * A checkpoint is a directory DIR/ckpt-<id>/ with one data file per server
 * (server-<rank>.psck) and a MANIFEST written last by the scheduler: a checkpoint
 * without a manifest does not exist. Both kinds of file are a sequence of blocks:
 *
 *   u32 magic "PSCB" | u16 kind | u16 flags (0) | u64 payload length | payload | u64 checksum
 *
 * all little-endian; the checksum is the xxh64 of the block's first 16 bytes and its
 * payload, so a damaged kind or length is caught like a damaged payload. The first block
 * is a HEADER (file magic "PSCK", format version, what the file is), the last an END
 * (the number of blocks before it and the xxh64 of their checksums, so a file cut at a
 * block boundary is caught too). Payload lengths are bounded (PS_CKPT_MAX_BLOCK, and the
 * file's size) before anything is allocated. Data files hold TABLE blocks (a table's
 * declaration and its state) each followed by its ROWS blocks (keys and whole rows:
 * parameters then optimiser state), rows sorted by ring position (ps__ring_key_hash of
 * the table id in the TABLE block) for sparse tables and by slice for dense ones. A ROWS
 * payload starts with a 40-byte descriptor with its own checksum (table, rows, the range
 * [pos_lo, pos_hi] of positions they cover), so that a reader can skip the blocks
 * outside the ranges it wants after checking 56 bytes of each. A dense table is written
 * whole: every slice the server owns, touched or not. The manifest holds the
 * checkpoint's TABLE blocks (declarations, no rows), one FILE block per data file (name,
 * size, checksum, rows) and an opaque STATE block for the scheduler (tasks, clocks).
 *
 * Writing: ps__ckpt_writer_open writes to PATH.tmp; ps__ckpt_writer_close(commit) ends
 * the file, fsyncs it, renames it to PATH and fsyncs the directory. Any write, fsync or
 * close error fails the file (the temporary is removed; never retried in place). The
 * writer refuses what the reader would refuse (rows out of order, a ROWS block for
 * another table, a table whose rows do not add up to its nrows), so a file it commits
 * always reads back.
 *
 * Reading: every block's checksum is verified before its payload is used; a truncated,
 * corrupt or version-mismatched file fails with PS_ERR_IO (unreadable) or
 * PS_ERR_CORRUPT and a message naming the file and the block (index and kind).
 *
 * Threads: a writer or a reader is used by one thread at a time (the server's
 * checkpoint thread writes; the loop thread reads at a restore). No global state.
 */
#ifndef PS_CKPT_H
#define PS_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "proto/msg.h"

/* Bytes of a block's framing: the 16 before the payload and the checksum after it. */
#define PS_CKPT_BLOCK_HDR 16
#define PS_CKPT_ROWS_DESC 40 /* a ROWS payload's descriptor, its checksum included */

#define PS_CKPT_FILE_MAGIC 0x4b435350u  /* "PSCK" */
#define PS_CKPT_BLOCK_MAGIC 0x42435350u /* "PSCB" */
#define PS_CKPT_FORMAT 2 /* written; format 1 (without `base`) is read too */
#define PS_CKPT_MAX_BLOCK ((uint64_t)64 << 20) /* payload bytes of one block, at most */
#define PS_CKPT_ROWS_PER_BLOCK 65536u          /* what the writer puts in one ROWS block, at most */

enum {
  PS_CKPT_B_HEADER = 1,
  PS_CKPT_B_TABLE = 2,
  PS_CKPT_B_ROWS = 3,
  PS_CKPT_B_FILE = 4,  /* manifest: one data file */
  PS_CKPT_B_STATE = 5, /* manifest: the scheduler's state (opaque bytes) */
  PS_CKPT_B_END = 6
};

enum { PS_CKPT_DATA = 1, PS_CKPT_MANIFEST = 2 };

typedef struct ps__ckpt_header {
  uint32_t what;       /* PS_CKPT_DATA or PS_CKPT_MANIFEST */
  uint64_t id;         /* the checkpoint's id (increasing within a directory) */
  int64_t clock;       /* sync tables: the clock every shard was cut at; else -1 */
  uint32_t rank;       /* data: the server's rank; manifest: 0 */
  uint32_t nservers;   /* servers of the job that wrote it */
  uint64_t created_ms; /* wall clock (ms since the epoch), for people */
  uint64_t base;       /* an increment on checkpoint `base` (< id): a data file holds the
                        * rows changed since, a manifest names its parent; 0: whole */
} ps__ckpt_header;

/* A table's declaration and its state when it was cut. */
typedef struct ps__ckpt_table {
  ps__declare decl;    /* id, kind, size, name, options: as the job declared it */
  uint32_t width;      /* parameters per row: the sparse dim, or the dense slice width;
                        * 0 when writing: taken from the declaration (proto/spec.c) */
  uint32_t row_floats; /* floats per stored row: width * (1 + optimiser state blocks) */
  uint64_t step;       /* optimiser steps applied (adam bias correction, the schedule) */
  int64_t version;     /* sync tables: rounds applied; else 0 */
  uint64_t nrows;      /* rows of this table in this file (manifest: in all files); the
                        * writer checks that the ROWS after it add up to this */
} ps__ckpt_table;

/* A manifest's entry for one data file. */
typedef struct ps__ckpt_file {
  char name[64];       /* relative to the checkpoint's directory */
  uint32_t rank;
  uint64_t bytes;
  uint64_t checksum;   /* the file's END checksum */
  uint64_t rows;
} ps__ckpt_file;

/* One block as the reader returns it. Pointers stay valid until the next call. */
typedef struct ps__ckpt_block {
  int kind;                   /* PS_CKPT_B_* */
  uint32_t index;             /* 0-based position in the file */
  uint64_t offset;            /* of the block's first byte in the file */
  uint64_t payload_len;
  uint64_t checksum;          /* the block's checksum (verified unless a skipped ROWS) */
  ps__ckpt_table table;       /* TABLE */
  ps__ckpt_file file;         /* FILE */
  /* ROWS: n rows of table `table_id`, row_floats floats each; positions [pos_lo, pos_hi] */
  uint32_t table_id, n, row_floats;
  uint64_t pos_lo, pos_hi;
  const uint8_t *keys;        /* n little-endian u64 (unaligned: read with ps__get_u64) */
  const float *rows;          /* n * row_floats floats (aligned) */
  /* STATE */
  const uint8_t *state;
  size_t state_len;
  /* END: the file's checksum (xxh64 of its blocks' checksums) and size, as the
   * manifest's FILE block for it records them */
  uint64_t end_checksum, end_bytes;
} ps__ckpt_block;

/* What a committed file is, for the manifest. */
typedef struct ps__ckpt_summary {
  uint64_t bytes, checksum, rows;
} ps__ckpt_summary;

typedef struct ps__ckpt_writer ps__ckpt_writer;
typedef struct ps__ckpt_reader ps__ckpt_reader;

/* ---------------------------------------------------------------- writing */

/* Start the file PATH (written as PATH.tmp) with its HEADER (created_ms 0: now).
 * 0, PS_ERR_INVALID (a bad header or path), PS_ERR_IO (with the path and errno's
 * text), PS_ERR_NOMEM. The calls below return 0, PS_ERR_INVALID for a use the format
 * does not allow (the message says which; the file is failed), or the file's first
 * error. */
int ps__ckpt_writer_open(ps__ckpt_writer **out, const char *path, const ps__ckpt_header *h);
/* From now on, the bytes of each piece handed to the disk are added to *counter
 * (atomically: another thread may read it to see the write getting on). */
void ps__ckpt_writer_progress(ps__ckpt_writer *w, uint64_t *counter);
/* A TABLE block: in a data file the ROWS of that table follow it (t->nrows of them). */
int ps__ckpt_write_table(ps__ckpt_writer *w, const ps__ckpt_table *t);
/* n rows of the table of the last TABLE block (keys host-order, rows n * row_floats
 * floats), sorted by position, one ROWS block per PS_CKPT_ROWS_PER_BLOCK rows (fewer
 * when rows are wide, to stay under PS_CKPT_MAX_BLOCK). pos_lo/pos_hi: the ring
 * positions (or slices) the caller covers; every row must lie inside, and each block
 * records the range of its own rows. n = 0 writes nothing. */
int ps__ckpt_write_rows(ps__ckpt_writer *w, uint32_t table, uint32_t row_floats, const uint64_t *keys,
                        const float *rows, uint32_t n, uint64_t pos_lo, uint64_t pos_hi);
int ps__ckpt_write_file(ps__ckpt_writer *w, const ps__ckpt_file *f);
int ps__ckpt_write_state(ps__ckpt_writer *w, const void *state, size_t len);
/* commit: END, fsync, rename to PATH, fsync the directory, fill *sum (may be NULL);
 * else (or after any earlier error) remove the temporary. Frees w either way; returns
 * the first error of the file's life. NULL is a no-op returning 0. */
int ps__ckpt_writer_close(ps__ckpt_writer *w, int commit, ps__ckpt_summary *sum);

/* ---------------------------------------------------------------- reading */

/* "HEADER", "ROWS", ...; "unknown" for another value. */
const char *ps__ckpt_kind_name(int kind);

/* Open PATH and check its HEADER (magic, format, checksum). 0, PS_ERR_IO (cannot read
 * it), PS_ERR_CORRUPT (not a checkpoint file, another format, a bad header block). */
int ps__ckpt_reader_open(ps__ckpt_reader **out, const char *path, ps__ckpt_header *h);
/* The next block into *b (its checksum verified). 0 for a block; b->kind == END once
 * the file ended well (its block count and checksum chain checked, nothing after it);
 * PS_ERR_CORRUPT or PS_ERR_IO otherwise, and again on every later call. A ROWS block
 * for which want(arg, table, pos_lo, pos_hi) returns 0 (want may be NULL: everything)
 * is skipped after its descriptor is checked, without its payload being read or
 * checked: b->n is then 0 and b->keys NULL. A block read is also checked against the
 * format's rules (the order of blocks, rows inside their table and their block's range,
 * in order). next after END returns PS_ERR_INVALID. */
typedef int (*ps__ckpt_want_fn)(void *arg, uint32_t table, uint64_t pos_lo, uint64_t pos_hi);
int ps__ckpt_next(ps__ckpt_reader *r, ps__ckpt_block *b, ps__ckpt_want_fn want, void *arg);
/* The HEADER block's payload length and checksum (verified by ps__ckpt_reader_open). */
void ps__ckpt_reader_header_block(const ps__ckpt_reader *r, uint64_t *payload_len, uint64_t *checksum);
void ps__ckpt_reader_close(ps__ckpt_reader *r);

/* ---------------------------------------------------------------- a directory of checkpoints */

/* The newest checkpoint of dir that has a manifest: its id into *id and its
 * directory's path into path. 0, or PS_ERR_IO when there is none (the message says
 * what was found). */
int ps__ckpt_latest(const char *dir, uint64_t *id, char *path, size_t cap);
/* DIR/ckpt-<id> into path. */
void ps__ckpt_dir_of(const char *dir, uint64_t id, char *path, size_t cap);
/* Remove the complete checkpoints of dir beyond the newest `keep`, except those a kept
 * increment reads (its chain), and those without a manifest older than the newest
 * complete one. 0 or PS_ERR_IO. */
int ps__ckpt_prune(const char *dir, unsigned keep);

/* A checkpoint and the ones it is an increment on: the chain a restore reads, oldest
 * (a whole checkpoint) first, each later one overriding the rows it holds. */
#define PS_CKPT_MAX_CHAIN 4096
typedef struct ps__ckpt_link {
  char dir[PS_CKPT_DIR_MAX];
  uint64_t id, base;
  int64_t clock;
  uint32_t nservers;
} ps__ckpt_link;
/* The chain of the checkpoint in directory ckdir (which has a MANIFEST): each base is
 * found beside it (../ckpt-<base>). *out is malloc'd. 0, PS_ERR_IO, PS_ERR_CORRUPT
 * (a manifest unreadable, a base missing or incomplete), PS_ERR_NOMEM. */
int ps__ckpt_chain(const char *ckdir, ps__ckpt_link **out, size_t *n);

#endif /* PS_CKPT_H */
