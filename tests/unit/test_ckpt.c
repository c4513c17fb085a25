/*
 * test_ckpt.c - checkpoint files (store/ckpt.c): every block kind read back as written;
 * every damaged byte, every truncation, a foreign format version and lengths beyond
 * the limits refused with PS_ERR_CORRUPT and a message naming the file and the block;
 * ROWS blocks skipped by range without their payload; the writer's rules; a writer
 * that dies before its rename leaves no visible file; the newest complete checkpoint
 * of a directory and the pruning of the others; chains of increments (ps__ckpt_chain:
 * oldest first, a missing or mismatched base refused by name) and what pruning keeps
 * of them.
 *
 * Files go to a fresh directory under $TMPDIR (or /tmp), removed by each test.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/common.h"
#include "common/ring.h"
#include "store/ckpt.h"

#define OK(call) cr_assert(eq(int, (call), 0), "%s: %s", #call, ps_errmsg())

/* ---------------------------------------------------------------- files and directories */

static char tmpdir[512];

static void make_tmpdir(void) {
  const char *base = getenv("TMPDIR");
  snprintf(tmpdir, sizeof tmpdir, "%s/pshard-ckpt-XXXXXX", base && *base ? base : "/tmp");
  cr_assert(not(eq(ptr, mkdtemp(tmpdir), NULL)), "mkdtemp: %s", strerror(errno));
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f) {
  (void)st, (void)flag, (void)f;
  return remove(p);
}

static void remove_tmpdir(void) {
  if (tmpdir[0]) nftw(tmpdir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
  tmpdir[0] = '\0';
}

static uint8_t *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  cr_assert(not(eq(ptr, f, NULL)), "open %s: %s", path, strerror(errno));
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *p = malloc((size_t)len + 1);
  cr_assert(eq(sz, fread(p, 1, (size_t)len, f), (size_t)len));
  fclose(f);
  *n = (size_t)len;
  return p;
}

static void spit(const char *path, const uint8_t *p, size_t n) {
  FILE *f = fopen(path, "wb");
  cr_assert(not(eq(ptr, f, NULL)));
  cr_assert(eq(sz, fwrite(p, 1, n, f), n));
  cr_assert(eq(int, fclose(f), 0));
}

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

static int absent(const char *path) { return !exists(path); }

/* ---------------------------------------------------------------- the sample checkpoint */

/* A dense adam table of 10 floats in slices of 4 (3 slices, 12 floats a row), a sparse
 * adagrad table of dim 3 (6 floats a row) with five keys, and a sparse table with no
 * rows. Values are exact in float. */
#define NSPARSE 5
static const uint64_t sparse_keys[NSPARSE] = {5, 17, 42, 1000, 123456789};

static ps__ckpt_table table_of(uint32_t id, int kind, uint64_t size, const char *name, const char *opts,
                               uint32_t width, uint32_t row_floats, uint64_t nrows) {
  ps__ckpt_table t;
  memset(&t, 0, sizeof t);
  t.decl.id = id;
  t.decl.kind = (uint8_t)kind;
  t.decl.size = size;
  snprintf(t.decl.name, sizeof t.decl.name, "%s", name);
  snprintf(t.decl.options, sizeof t.decl.options, "%s", opts);
  t.width = width;
  t.row_floats = row_floats;
  t.step = 40 + id;
  t.version = 7;
  t.nrows = nrows;
  return t;
}

static float dense_val(uint64_t slice, uint32_t j) { return (float)slice * 100.0f + (float)j; }
static float sparse_val(uint64_t key, uint32_t j) { return (float)(key % 4096) + 0.5f * (float)j; }

/* The sparse keys sorted by ring position, as a server writes them. */
static void sorted_sparse(uint32_t table, uint64_t *keys) {
  memcpy(keys, sparse_keys, sizeof sparse_keys);
  for (int i = 1; i < NSPARSE; i++)
    for (int j = i; j > 0 && ps__ring_key_hash(table, keys[j]) < ps__ring_key_hash(table, keys[j - 1]); j--) {
      uint64_t t = keys[j];
      keys[j] = keys[j - 1];
      keys[j - 1] = t;
    }
}

static ps__ckpt_header header_of(uint32_t what, uint32_t rank, uint32_t nservers) {
  ps__ckpt_header h = {.what = what, .id = 9, .clock = 12, .rank = rank, .nservers = nservers,
                       .created_ms = 1700000000123ull};
  return h;
}

static ps__ckpt_summary write_data(const char *path) {
  ps__ckpt_writer *w;
  ps__ckpt_header h = header_of(PS_CKPT_DATA, 0, 1);
  OK(ps__ckpt_writer_open(&w, path, &h));
  ps__ckpt_table d = table_of(1, PS_DENSE, 10, "w", "opt=adam slice=4", 0, 12, 3);
  OK(ps__ckpt_write_table(w, &d));
  uint64_t dk[3] = {0, 1, 2};
  float dr[3 * 12];
  for (uint64_t k = 0; k < 3; k++)
    for (uint32_t j = 0; j < 12; j++) dr[k * 12 + j] = dense_val(k, j);
  OK(ps__ckpt_write_rows(w, 1, 12, dk, dr, 3, 0, 2));
  ps__ckpt_table s = table_of(2, PS_SPARSE, 3, "emb", "opt=adagrad", 3, 6, NSPARSE);
  OK(ps__ckpt_write_table(w, &s));
  uint64_t sk[NSPARSE];
  float sr[NSPARSE * 6];
  sorted_sparse(2, sk);
  for (int i = 0; i < NSPARSE; i++)
    for (uint32_t j = 0; j < 6; j++) sr[i * 6 + j] = sparse_val(sk[i], j);
  OK(ps__ckpt_write_rows(w, 2, 6, sk, sr, NSPARSE, 0, UINT64_MAX));
  ps__ckpt_table e = table_of(3, PS_SPARSE, 1, "bias", "", 0, 1, 0);
  OK(ps__ckpt_write_table(w, &e));
  ps__ckpt_summary sum;
  OK(ps__ckpt_writer_close(w, 1, &sum));
  return sum;
}

static const char state_bytes[] = "tasks: 3 partitions, epoch 2";

static void write_manifest(const char *path, const ps__ckpt_summary *sum) {
  ps__ckpt_writer *w;
  ps__ckpt_header h = header_of(PS_CKPT_MANIFEST, 0, 2);
  OK(ps__ckpt_writer_open(&w, path, &h));
  ps__ckpt_table d = table_of(1, PS_DENSE, 10, "w", "opt=adam slice=4", 4, 12, 3);
  OK(ps__ckpt_write_table(w, &d));
  ps__ckpt_table s = table_of(2, PS_SPARSE, 3, "emb", "opt=adagrad", 3, 6, NSPARSE);
  OK(ps__ckpt_write_table(w, &s));
  ps__ckpt_file f = {.name = "server-0.psck", .rank = 0, .bytes = sum->bytes, .checksum = sum->checksum,
                     .rows = sum->rows};
  OK(ps__ckpt_write_file(w, &f));
  ps__ckpt_file g = {.name = "server-1.psck", .rank = 1, .bytes = 1, .checksum = 2, .rows = 0};
  OK(ps__ckpt_write_file(w, &g));
  OK(ps__ckpt_write_state(w, state_bytes, sizeof state_bytes));
  OK(ps__ckpt_writer_close(w, 1, NULL));
}

/* Read a whole file; the first error's code (and its message in msg), or 0 at END. */
static int read_all(const char *path, ps__ckpt_want_fn want, void *arg, char *msg, size_t cap, int *blocks) {
  ps__ckpt_reader *r;
  ps__ckpt_header h;
  ps__ckpt_block b;
  int n = 0, rc = ps__ckpt_reader_open(&r, path, &h);
  if (!rc) {
    while ((rc = ps__ckpt_next(r, &b, want, arg)) == 0 && b.kind != PS_CKPT_B_END) n++;
    ps__ckpt_reader_close(r);
  }
  if (msg) snprintf(msg, cap, "%s", rc ? ps_errmsg() : "");
  if (blocks) *blocks = n;
  return rc;
}

/* ---------------------------------------------------------------- round trips */

Test(ckpt, error_code) {
  cr_assert(eq(int, PS_ERR_CORRUPT, 22));
  cr_assert(eq(str, (char *)ps_err_name(PS_ERR_CORRUPT), "PS_ERR_CORRUPT"));
  cr_assert(eq(str, (char *)ps_strerror(PS_ERR_CORRUPT), "corrupt data"));
}

Test(ckpt, data_file_round_trip, .init = make_tmpdir, .fini = remove_tmpdir) {
  char path[600], tmp[610];
  snprintf(path, sizeof path, "%s/server-0.psck", tmpdir);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  ps__ckpt_summary sum = write_data(path);
  cr_assert(absent(tmp));
  struct stat st;
  cr_assert(eq(int, stat(path, &st), 0));
  cr_assert(eq(u64, sum.bytes, (uint64_t)st.st_size));
  cr_assert(eq(u64, sum.rows, 3 + NSPARSE));

  ps__ckpt_reader *r;
  ps__ckpt_header h;
  ps__ckpt_block b;
  OK(ps__ckpt_reader_open(&r, path, &h));
  cr_assert(eq(u32, h.what, PS_CKPT_DATA));
  cr_assert(eq(u64, h.id, 9));
  cr_assert(eq(i64, h.clock, 12));
  cr_assert(eq(u32, h.rank, 0));
  cr_assert(eq(u32, h.nservers, 1));
  cr_assert(eq(u64, h.created_ms, 1700000000123ull));

  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_TABLE));
  cr_assert(eq(u32, b.index, 1));
  cr_assert(eq(u64, b.offset, 16 + 56 + 8));
  cr_assert(eq(u32, b.table.decl.id, 1));
  cr_assert(eq(u8, b.table.decl.kind, PS_DENSE));
  cr_assert(eq(u64, b.table.decl.size, 10));
  cr_assert(eq(str, b.table.decl.name, "w"));
  cr_assert(eq(str, b.table.decl.options, "opt=adam slice=4"));
  cr_assert(eq(u32, b.table.width, 4), "width taken from the options");
  cr_assert(eq(u32, b.table.row_floats, 12));
  cr_assert(eq(u64, b.table.step, 41));
  cr_assert(eq(i64, b.table.version, 7));
  cr_assert(eq(u64, b.table.nrows, 3));

  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_ROWS));
  cr_assert(eq(u32, b.table_id, 1));
  cr_assert(eq(u32, b.n, 3));
  cr_assert(eq(u32, b.row_floats, 12));
  cr_assert(eq(u64, b.pos_lo, 0));
  cr_assert(eq(u64, b.pos_hi, 2));
  cr_assert(eq(u64, b.payload_len, 40 + 3 * 8 + 3 * 12 * 4));
  cr_assert(eq(u64, (uintptr_t)b.rows % sizeof(float), 0));
  for (uint32_t i = 0; i < 3; i++) {
    cr_assert(eq(u64, ps__get_u64(b.keys + 8 * i), i));
    for (uint32_t j = 0; j < 12; j++) cr_assert(eq(flt, b.rows[i * 12 + j], dense_val(i, j)));
  }

  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_TABLE));
  cr_assert(eq(str, b.table.decl.name, "emb"));
  cr_assert(eq(u32, b.table.width, 3));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_ROWS));
  cr_assert(eq(u32, b.n, NSPARSE));
  uint64_t sk[NSPARSE];
  sorted_sparse(2, sk);
  cr_assert(eq(u64, b.pos_lo, ps__ring_key_hash(2, sk[0])), "the block states its own rows' range");
  cr_assert(eq(u64, b.pos_hi, ps__ring_key_hash(2, sk[NSPARSE - 1])));
  for (uint32_t i = 0; i < NSPARSE; i++) {
    cr_assert(eq(u64, ps__get_u64(b.keys + 8 * i), sk[i]));
    for (uint32_t j = 0; j < 6; j++) cr_assert(eq(flt, b.rows[i * 6 + j], sparse_val(sk[i], j)));
  }

  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_TABLE));
  cr_assert(eq(str, b.table.decl.name, "bias"));
  cr_assert(eq(u64, b.table.nrows, 0));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_END));
  cr_assert(eq(u32, b.index, 6));
  cr_assert(eq(u64, b.end_checksum, sum.checksum));
  cr_assert(eq(u64, b.end_bytes, sum.bytes));
  cr_assert(eq(int, ps__ckpt_next(r, &b, NULL, NULL), PS_ERR_INVALID), "nothing after END");
  ps__ckpt_reader_close(r);
  ps__ckpt_reader_close(NULL);
}

Test(ckpt, manifest_round_trip, .init = make_tmpdir, .fini = remove_tmpdir) {
  char path[600], data[600];
  snprintf(data, sizeof data, "%s/server-0.psck", tmpdir);
  snprintf(path, sizeof path, "%s/MANIFEST", tmpdir);
  ps__ckpt_summary sum = write_data(data);
  write_manifest(path, &sum);
  ps__ckpt_reader *r;
  ps__ckpt_header h;
  ps__ckpt_block b;
  OK(ps__ckpt_reader_open(&r, path, &h));
  cr_assert(eq(u32, h.what, PS_CKPT_MANIFEST));
  cr_assert(eq(u32, h.nservers, 2));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_TABLE));
  cr_assert(eq(str, b.table.decl.name, "w"));
  cr_assert(eq(u64, b.table.nrows, 3));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(str, b.table.decl.name, "emb"));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_FILE));
  cr_assert(eq(str, b.file.name, "server-0.psck"));
  cr_assert(eq(u32, b.file.rank, 0));
  cr_assert(eq(u64, b.file.bytes, sum.bytes));
  cr_assert(eq(u64, b.file.checksum, sum.checksum));
  cr_assert(eq(u64, b.file.rows, sum.rows));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(str, b.file.name, "server-1.psck"));
  cr_assert(eq(u32, b.file.rank, 1));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_STATE));
  cr_assert(eq(sz, b.state_len, sizeof state_bytes));
  cr_assert(eq(int, memcmp(b.state, state_bytes, sizeof state_bytes), 0));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  cr_assert(eq(int, b.kind, PS_CKPT_B_END));
  ps__ckpt_reader_close(r);
}

/* Wide rows go in several ROWS blocks, each with its own range; wanted ranges skip. */
typedef struct want_range {
  uint64_t lo, hi;
  int calls;
} want_range;

static int want_fn(void *arg, uint32_t table, uint64_t lo, uint64_t hi) {
  want_range *w = arg;
  w->calls++;
  return table == 5 && hi >= w->lo && lo <= w->hi;
}

/* A data file of about 40 MB: several full output buffers go through the writer's I/O
 * thread (and O_DIRECT where the file system takes it), then the tail; it reads back
 * exactly. */
Test(ckpt, a_large_file_reads_back_exactly, .init = make_tmpdir, .fini = remove_tmpdir) {
  char path[600];
  snprintf(path, sizeof path, "%s/large.psck", tmpdir);
  const uint32_t rf = 32, n = 300001; /* 128 B a row: 38.4 MB of rows, a ragged tail */
  uint64_t *keys = malloc(n * sizeof *keys);
  float *rows = malloc((size_t)n * rf * sizeof *rows);
  cr_assert(keys && rows);
  for (uint32_t i = 0; i < n; i++) {
    keys[i] = i;
    for (uint32_t j = 0; j < rf; j++) rows[(size_t)i * rf + j] = (float)i + (float)j / 64.0f;
  }
  ps__ckpt_writer *w;
  ps__ckpt_header h = header_of(PS_CKPT_DATA, 0, 1);
  OK(ps__ckpt_writer_open(&w, path, &h));
  ps__ckpt_table t = table_of(7, PS_DENSE, (uint64_t)n * rf, "large", "slice=32", 32, rf, n);
  OK(ps__ckpt_write_table(w, &t));
  OK(ps__ckpt_write_rows(w, 7, rf, keys, rows, n, 0, n - 1));
  ps__ckpt_summary sum;
  OK(ps__ckpt_writer_close(w, 1, &sum));
  struct stat st;
  cr_assert(eq(int, stat(path, &st), 0));
  cr_assert(eq(u64, sum.bytes, (uint64_t)st.st_size));
  cr_assert(gt(u64, sum.bytes, (uint64_t)32 << 20), "four full buffers at least");
  ps__ckpt_reader *r;
  ps__ckpt_block b;
  OK(ps__ckpt_reader_open(&r, path, &h));
  OK(ps__ckpt_next(r, &b, NULL, NULL)); /* TABLE */
  uint64_t seen = 0;
  for (;;) {
    OK(ps__ckpt_next(r, &b, NULL, NULL));
    if (b.kind == PS_CKPT_B_END) break;
    cr_assert(eq(int, b.kind, PS_CKPT_B_ROWS));
    cr_assert(eq(int, memcmp(b.rows, rows + seen * rf, (size_t)b.n * rf * sizeof(float)), 0), "rows from %llu",
              (unsigned long long)seen);
    for (uint32_t i = 0; i < b.n; i++) cr_assert(eq(u64, ps__get_u64(b.keys + 8 * (size_t)i), seen + i));
    seen += b.n;
  }
  cr_assert(eq(u64, seen, n));
  ps__ckpt_reader_close(r);
  free(keys);
  free(rows);
}

Test(ckpt, rows_split_into_blocks_and_skipped_by_range, .init = make_tmpdir, .fini = remove_tmpdir) {
  char path[600];
  snprintf(path, sizeof path, "%s/big.psck", tmpdir);
  const uint32_t n = PS_CKPT_ROWS_PER_BLOCK * 2 + 1100; /* 1000, then 65536, 65536 and 100 */
  uint64_t *keys = malloc(n * sizeof *keys);
  float *rows = malloc(n * sizeof *rows);
  for (uint32_t i = 0; i < n; i++) keys[i] = i, rows[i] = (float)i;
  ps__ckpt_writer *w;
  ps__ckpt_header h = header_of(PS_CKPT_DATA, 0, 1);
  OK(ps__ckpt_writer_open(&w, path, &h));
  ps__ckpt_table t = table_of(5, PS_DENSE, n, "big", "slice=1", 0, 1, n);
  OK(ps__ckpt_write_table(w, &t));
  /* In two calls: the order holds across them. */
  OK(ps__ckpt_write_rows(w, 5, 1, keys, rows, 1000, 0, n - 1));
  OK(ps__ckpt_write_rows(w, 5, 1, keys + 1000, rows + 1000, n - 1000, 0, n - 1));
  OK(ps__ckpt_writer_close(w, 1, NULL));

  /* Everything: four ROWS blocks (1000, 65536, 65536, the rest). */
  ps__ckpt_reader *r;
  ps__ckpt_block b;
  OK(ps__ckpt_reader_open(&r, path, &h));
  OK(ps__ckpt_next(r, &b, NULL, NULL));
  uint64_t seen = 0, blocks = 0;
  for (;;) {
    OK(ps__ckpt_next(r, &b, NULL, NULL));
    if (b.kind == PS_CKPT_B_END) break;
    cr_assert(eq(int, b.kind, PS_CKPT_B_ROWS));
    cr_assert(eq(u64, b.pos_lo, seen));
    cr_assert(eq(u64, b.pos_hi, seen + b.n - 1));
    for (uint32_t i = 0; i < b.n; i++) cr_assert(eq(flt, b.rows[i], (float)(seen + i)));
    seen += b.n;
    blocks++;
  }
  ps__ckpt_reader_close(r);
  cr_assert(eq(u64, seen, n));
  cr_assert(eq(u64, blocks, 4));

  /* Only the middle: the others come back with no rows. */
  want_range wr = {.lo = 70000, .hi = 70010};
  OK(ps__ckpt_reader_open(&r, path, &h));
  OK(ps__ckpt_next(r, &b, want_fn, &wr));
  uint32_t read = 0, skipped = 0;
  for (;;) {
    OK(ps__ckpt_next(r, &b, want_fn, &wr));
    if (b.kind == PS_CKPT_B_END) break;
    if (b.n) {
      read++;
      cr_assert(b.pos_lo <= 70000 && b.pos_hi >= 70010);
    } else {
      skipped++;
      cr_assert(eq(ptr, (void *)b.keys, NULL));
      cr_assert(eq(ptr, (void *)b.rows, NULL));
    }
  }
  ps__ckpt_reader_close(r);
  cr_assert(eq(u32, read, 1));
  cr_assert(eq(u32, skipped, 3));
  cr_assert(eq(int, wr.calls, 4));

  /* A damaged row in a skipped block goes unnoticed (it is not read)... */
  size_t len;
  uint8_t *p = slurp(path, &len);
  size_t last_row = len - 8 /* END checksum */ - 16 - 16 /* END */ - 8 /* ROWS checksum */ - 4;
  p[last_row] ^= 0x40;
  spit(path, p, len);
  cr_assert(eq(int, read_all(path, want_fn, &wr, NULL, 0, NULL), 0));
  /* ... and is refused when that block is read. */
  char msg[512];
  cr_assert(eq(int, read_all(path, NULL, NULL, msg, sizeof msg, NULL), PS_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(msg, "block 5 (ROWS)"), NULL)), "%s", msg);
  cr_assert(not(eq(ptr, strstr(msg, "checksum mismatch"), NULL)), "%s", msg);
  /* A damaged descriptor is refused even when the block is skipped. */
  p[last_row] ^= 0x40;
  size_t desc = 16 + 56 + 8; /* HEADER */
  desc += 16 + (48 + 8 + 3 + 7) + 8; /* TABLE "big" "slice=1" */
  desc += 16 + 16;                   /* ROWS 1's framing, to its pos_lo */
  p[desc] ^= 1;
  spit(path, p, len);
  cr_assert(eq(int, read_all(path, want_fn, &wr, msg, sizeof msg, NULL), PS_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(msg, "block 2 (ROWS)"), NULL)), "%s", msg);
  cr_assert(not(eq(ptr, strstr(msg, "descriptor"), NULL)), "%s", msg);
  free(p);
  free(keys);
  free(rows);
}

/* ---------------------------------------------------------------- damaged files */

/* Flip every byte of the file, one at a time: every flip refused, none crashes. */
static void flip_every_byte(const char *path) {
  size_t n;
  uint8_t *orig = slurp(path, &n);
  char bad[700], msg[512];
  snprintf(bad, sizeof bad, "%s.bad", path);
  cr_assert(eq(int, read_all(path, NULL, NULL, NULL, 0, NULL), 0));
  for (size_t i = 0; i < n; i++) {
    static const uint8_t masks[] = {0x01, 0x80, 0xff};
    for (size_t m = 0; m < sizeof masks; m++) {
      orig[i] ^= masks[m];
      spit(bad, orig, n);
      orig[i] ^= masks[m];
      int rc = read_all(bad, NULL, NULL, msg, sizeof msg, NULL);
      cr_assert(eq(int, rc, PS_ERR_CORRUPT), "%s: byte %zu ^ 0x%02x: rc %d (%s)", path, i, masks[m], rc, msg);
      cr_assert(not(eq(ptr, strstr(msg, bad), NULL)), "the message names the file: %s", msg);
    }
  }
  free(orig);
}

Test(ckpt, every_damaged_byte_is_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
  char data[600], man[600];
  snprintf(data, sizeof data, "%s/server-0.psck", tmpdir);
  snprintf(man, sizeof man, "%s/MANIFEST", tmpdir);
  ps__ckpt_summary sum = write_data(data);
  write_manifest(man, &sum);
  flip_every_byte(data);
  flip_every_byte(man);
}

Test(ckpt, every_truncation_is_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
  char data[600], man[600], bad[700], msg[512];
  snprintf(data, sizeof data, "%s/server-0.psck", tmpdir);
  snprintf(man, sizeof man, "%s/MANIFEST", tmpdir);
  ps__ckpt_summary sum = write_data(data);
  write_manifest(man, &sum);
  const char *files[] = {data, man};
  for (int f = 0; f < 2; f++) {
    size_t n;
    uint8_t *p = slurp(files[f], &n);
    snprintf(bad, sizeof bad, "%s.cut", files[f]);
    for (size_t len = 0; len < n; len++) {
      spit(bad, p, len);
      int rc = read_all(bad, NULL, NULL, msg, sizeof msg, NULL);
      cr_assert(eq(int, rc, PS_ERR_CORRUPT), "%s cut at %zu: rc %d (%s)", files[f], len, rc, msg);
    }
    /* Cut at the last block boundary (the END block gone): the message says so. */
    spit(bad, p, n - 40);
    cr_assert(eq(int, read_all(bad, NULL, NULL, msg, sizeof msg, NULL), PS_ERR_CORRUPT));
    cr_assert(not(eq(ptr, strstr(msg, "without an END block"), NULL)), "%s", msg);
    /* And a byte too many. */
    uint8_t *q = malloc(n + 1);
    memcpy(q, p, n);
    q[n] = 0;
    spit(bad, q, n + 1);
    cr_assert(eq(int, read_all(bad, NULL, NULL, msg, sizeof msg, NULL), PS_ERR_CORRUPT));
    cr_assert(not(eq(ptr, strstr(msg, "after the END block"), NULL)), "%s", msg);
    free(q);
    free(p);
  }
}

/* Recompute the checksum of the block at off after an edit (as a forger would). */
static void reseal(uint8_t *p, size_t off) {
  uint64_t len = ps__get_u64(p + off + 8);
  ps__put_u64(p + off + 16 + len, ps__hash64(p + off, 16 + len, 0));
}

Test(ckpt, another_format_version_is_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
  char path[600], msg[512];
  snprintf(path, sizeof path, "%s/server-0.psck", tmpdir);
  write_data(path);
  size_t n;
  uint8_t *p = slurp(path, &n);
  ps__put_u32(p + 16 + 4, 3);
  reseal(p, 0);
  spit(path, p, n);
  ps__ckpt_reader *r;
  ps__ckpt_header h;
  cr_assert(eq(int, ps__ckpt_reader_open(&r, path, &h), PS_ERR_CORRUPT));
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  cr_assert(not(eq(ptr, strstr(msg, "format version 3, this build reads versions 1 and 2"), NULL)), "%s", msg);
  cr_assert(not(eq(ptr, strstr(msg, "block 0 (HEADER)"), NULL)), "%s", msg);
  cr_assert(not(eq(ptr, strstr(msg, path), NULL)), "%s", msg);
  /* Not a checkpoint at all. */
  spit(path, (const uint8_t *)"hello world, this is not a checkpoint", 37);
  cr_assert(eq(int, ps__ckpt_reader_open(&r, path, &h), PS_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "not a checkpoint file"), NULL)), "%s", ps_errmsg());
  /* Cannot be read: PS_ERR_IO. */
  cr_assert(eq(int, ps__ckpt_reader_open(&r, tmpdir, &h), PS_ERR_IO));
  char missing[620];
  snprintf(missing, sizeof missing, "%s/nothing-here", tmpdir);
  cr_assert(eq(int, ps__ckpt_reader_open(&r, missing, &h), PS_ERR_IO));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "No such file"), NULL)), "%s", ps_errmsg());
  free(p);
}

Test(ckpt, oversized_lengths_are_refused_before_allocating, .init = make_tmpdir, .fini = remove_tmpdir) {
  char path[600], msg[512];
  snprintf(path, sizeof path, "%s/server-0.psck", tmpdir);
  write_data(path);
  size_t n;
  uint8_t *orig = slurp(path, &n);
  uint8_t *p = malloc(n);
  const size_t table = 16 + 56 + 8;                         /* the first TABLE block */
  const size_t rows = table + 16 + (48 + 8 + 1 + 16) + 8;   /* its ROWS block */
  const uint64_t lens[] = {PS_CKPT_MAX_BLOCK + 1, UINT64_MAX, UINT64_MAX - 15, (uint64_t)1 << 40, n};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    const size_t at[] = {0, table, rows};
    for (size_t k = 0; k < 3; k++) {
      memcpy(p, orig, n);
      ps__put_u64(p + at[k] + 8, lens[i]);
      spit(path, p, n);
      cr_assert(eq(int, read_all(path, NULL, NULL, msg, sizeof msg, NULL), PS_ERR_CORRUPT), "len %llu at %zu",
                (unsigned long long)lens[i], at[k]);
      cr_assert(strstr(msg, "over the limit") || strstr(msg, "truncated"), "%s", msg);
    }
  }
  /* A ROWS descriptor claiming more rows than its payload holds, with its checksums
   * forged: the length rule catches it. */
  memcpy(p, orig, n);
  ps__put_u32(p + rows + 16 + 4, PS_CKPT_ROWS_PER_BLOCK);
  ps__put_u64(p + rows + 16 + 32, ps__hash64(p + rows, 16 + 32, 0));
  reseal(p, rows);
  spit(path, p, n);
  cr_assert(eq(int, read_all(path, NULL, NULL, msg, sizeof msg, NULL), PS_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(msg, "block 2 (ROWS)"), NULL)), "%s", msg);
  cr_assert(not(eq(ptr, strstr(msg, "for 65536 rows"), NULL)), "%s", msg);
  free(p);
  free(orig);
}

Test(ckpt, a_missing_block_is_caught, .init = make_tmpdir, .fini = remove_tmpdir) {
  char path[600], msg[512];
  snprintf(path, sizeof path, "%s/server-0.psck", tmpdir);
  write_data(path);
  size_t n;
  uint8_t *p = slurp(path, &n);
  /* Drop the last TABLE block ("bias", no rows): every remaining block is intact. */
  size_t end = n - 40, len = 16 + 48 + 8 + 4 + 0 + 8;
  memmove(p + end - len, p + end, 40);
  spit(path, p, n - len);
  cr_assert(eq(int, read_all(path, NULL, NULL, msg, sizeof msg, NULL), PS_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(msg, "END"), NULL)), "%s", msg);
  free(p);
}

/* ---------------------------------------------------------------- the writer */

Test(ckpt, the_writer_refuses_what_a_reader_would, .init = make_tmpdir, .fini = remove_tmpdir) {
  char path[600], tmp[610];
  snprintf(path, sizeof path, "%s/x.psck", tmpdir);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  ps__ckpt_header h = header_of(PS_CKPT_DATA, 0, 1);
  ps__ckpt_writer *w;
  uint64_t keys[3] = {0, 2, 1};
  float rows[3] = {1, 2, 3};
  ps__ckpt_table t = table_of(1, PS_DENSE, 3, "v", "slice=1", 0, 1, 3);

  /* rows before any table */
  OK(ps__ckpt_writer_open(&w, path, &h));
  cr_assert(eq(int, ps__ckpt_write_rows(w, 1, 1, keys, rows, 1, 0, 2), PS_ERR_INVALID));
  cr_assert(eq(int, ps__ckpt_write_table(w, &t), PS_ERR_INVALID), "the file stays failed");
  cr_assert(eq(int, ps__ckpt_writer_close(w, 1, NULL), PS_ERR_INVALID));
  cr_assert(absent(path) && absent(tmp));

  /* an increment on a checkpoint that is not older */
  ps__ckpt_header hinc = h;
  hinc.base = hinc.id;
  cr_assert(eq(int, ps__ckpt_writer_open(&w, path, &hinc), PS_ERR_INVALID));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "not older than"), NULL)), "%s", ps_errmsg());
  cr_assert(absent(path) && absent(tmp));
  /* out of order, outside the range given, of another table, of another width */
  struct {
    uint32_t table, rf, n;
    uint64_t lo, hi;
    const char *what;
  } bad[] = {{1, 1, 3, 0, 2, "sorted"}, {1, 1, 2, 1, 2, "outside"}, {2, 1, 1, 0, 2, "TABLE block of table 1"},
             {1, 2, 1, 0, 2, "floats"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    OK(ps__ckpt_writer_open(&w, path, &h));
    OK(ps__ckpt_write_table(w, &t));
    cr_assert(eq(int, ps__ckpt_write_rows(w, bad[i].table, bad[i].rf, keys, rows, bad[i].n, bad[i].lo, bad[i].hi),
                 PS_ERR_INVALID));
    cr_assert(not(eq(ptr, strstr(ps_errmsg(), bad[i].what), NULL)), "%s", ps_errmsg());
    cr_assert(eq(int, ps__ckpt_writer_close(w, 1, NULL), PS_ERR_INVALID));
    cr_assert(absent(path) && absent(tmp));
  }

  /* fewer rows than the TABLE block says */
  OK(ps__ckpt_writer_open(&w, path, &h));
  OK(ps__ckpt_write_table(w, &t));
  OK(ps__ckpt_write_rows(w, 1, 1, keys, rows, 2, 0, 2));
  cr_assert(eq(int, ps__ckpt_writer_close(w, 1, NULL), PS_ERR_INVALID));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "2 rows written"), NULL)), "%s", ps_errmsg());
  cr_assert(absent(path) && absent(tmp));

  /* a table whose options do not parse, a sparse table of the wrong width */
  OK(ps__ckpt_writer_open(&w, path, &h));
  ps__ckpt_table u = table_of(1, PS_DENSE, 3, "v", "opt=nonsense", 0, 1, 3);
  cr_assert(eq(int, ps__ckpt_write_table(w, &u), PS_ERR_INVALID));
  ps__ckpt_writer_close(w, 0, NULL);
  OK(ps__ckpt_writer_open(&w, path, &h));
  ps__ckpt_table s = table_of(1, PS_SPARSE, 3, "v", "", 2, 2, 3);
  cr_assert(eq(int, ps__ckpt_write_table(w, &s), PS_ERR_INVALID));
  ps__ckpt_writer_close(w, 0, NULL);

  /* a manifest: FILE names are plain, ranks once each, one per server */
  ps__ckpt_header m = header_of(PS_CKPT_MANIFEST, 0, 2);
  ps__ckpt_file f = {.name = "../etc/passwd", .rank = 0};
  OK(ps__ckpt_writer_open(&w, path, &m));
  cr_assert(eq(int, ps__ckpt_write_file(w, &f), PS_ERR_INVALID));
  ps__ckpt_writer_close(w, 0, NULL);
  snprintf(f.name, sizeof f.name, "server-0.psck");
  OK(ps__ckpt_writer_open(&w, path, &m));
  OK(ps__ckpt_write_file(w, &f));
  cr_assert(eq(int, ps__ckpt_write_file(w, &f), PS_ERR_INVALID));
  ps__ckpt_writer_close(w, 0, NULL);
  OK(ps__ckpt_writer_open(&w, path, &m));
  OK(ps__ckpt_write_file(w, &f));
  cr_assert(eq(int, ps__ckpt_writer_close(w, 1, NULL), PS_ERR_INVALID));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "1 FILE blocks for 2 servers"), NULL)), "%s", ps_errmsg());
  cr_assert(absent(path) && absent(tmp));

  /* bad headers, an unwritable place */
  ps__ckpt_header hb = header_of(PS_CKPT_DATA, 3, 2);
  cr_assert(eq(int, ps__ckpt_writer_open(&w, path, &hb), PS_ERR_INVALID));
  cr_assert(eq(ptr, w, NULL));
  char nowhere[620];
  snprintf(nowhere, sizeof nowhere, "%s/no/such/dir/x.psck", tmpdir);
  cr_assert(eq(int, ps__ckpt_writer_open(&w, nowhere, &h), PS_ERR_IO));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "No such file"), NULL)), "%s", ps_errmsg());
  cr_assert(eq(int, ps__ckpt_writer_close(NULL, 1, NULL), 0));

  /* not committed: nothing stays */
  OK(ps__ckpt_writer_open(&w, path, &h));
  OK(ps__ckpt_write_table(w, &t));
  cr_assert(exists(tmp));
  OK(ps__ckpt_writer_close(w, 0, NULL));
  cr_assert(absent(path) && absent(tmp));
}

Test(ckpt, a_writer_that_dies_before_its_rename_leaves_no_visible_file, .init = make_tmpdir,
     .fini = remove_tmpdir) {
  char cdir[600], path[700], tmp[710];
  ps__ckpt_dir_of(tmpdir, 4, cdir, sizeof cdir);
  cr_assert(eq(int, mkdir(cdir, 0755), 0));
  snprintf(path, sizeof path, "%s/server-0.psck", cdir);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    ps__ckpt_writer *w;
    ps__ckpt_header h = header_of(PS_CKPT_DATA, 0, 1);
    ps__ckpt_table t = table_of(1, PS_DENSE, 3, "v", "slice=1", 0, 1, 3);
    uint64_t keys[3] = {0, 1, 2};
    float rows[3] = {1, 2, 3};
    if (ps__ckpt_writer_open(&w, path, &h) || ps__ckpt_write_table(w, &t) ||
        ps__ckpt_write_rows(w, 1, 1, keys, rows, 3, 0, 2))
      _exit(1);
    _exit(0); /* killed before ps__ckpt_writer_close */
  }
  int st;
  cr_assert(eq(int, waitpid(pid, &st, 0), pid));
  int clean = WIFEXITED(st) && WEXITSTATUS(st) == 0;
  cr_assert(clean, "the writer exited with %d", st);
  cr_assert(exists(tmp), "the temporary holds what was written");
  cr_assert(absent(path), "nothing under the real name");
  ps__ckpt_reader *r;
  ps__ckpt_header h;
  cr_assert(eq(int, ps__ckpt_reader_open(&r, path, &h), PS_ERR_IO));
  /* The temporary itself is refused too: it has no END. */
  cr_assert(eq(int, read_all(tmp, NULL, NULL, NULL, 0, NULL), PS_ERR_CORRUPT));
  /* And the checkpoint directory, without a manifest, does not exist. */
  uint64_t id;
  char latest[700];
  cr_assert(eq(int, ps__ckpt_latest(tmpdir, &id, latest, sizeof latest), PS_ERR_IO));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "1 without a MANIFEST"), NULL)), "%s", ps_errmsg());
}

/* ---------------------------------------------------------------- a directory of checkpoints */

static void make_checkpoint(uint64_t id, int complete) {
  char d[600], f[700];
  ps__ckpt_dir_of(tmpdir, id, d, sizeof d);
  cr_assert(eq(int, mkdir(d, 0755), 0));
  snprintf(f, sizeof f, "%s/server-0.psck", d);
  spit(f, (const uint8_t *)"x", 1);
  if (complete) {
    snprintf(f, sizeof f, "%s/MANIFEST", d);
    spit(f, (const uint8_t *)"x", 1);
  }
}

static int has_checkpoint(uint64_t id) {
  char d[600];
  ps__ckpt_dir_of(tmpdir, id, d, sizeof d);
  return exists(d);
}

static int absent_checkpoint(uint64_t id) { return !has_checkpoint(id); }

Test(ckpt, latest_and_prune, .init = make_tmpdir, .fini = remove_tmpdir) {
  uint64_t id = 0;
  char path[700], want[700], other[700];
  cr_assert(eq(int, ps__ckpt_latest(tmpdir, &id, path, sizeof path), PS_ERR_IO), "an empty directory");
  snprintf(other, sizeof other, "%s/absent", tmpdir);
  cr_assert(eq(int, ps__ckpt_latest(other, &id, path, sizeof path), PS_ERR_IO));
  cr_assert(eq(int, ps__ckpt_prune(other, 1), PS_ERR_IO));

  ps__ckpt_dir_of("/a/b", 12, path, sizeof path);
  cr_assert(eq(str, path, "/a/b/ckpt-12"));

  make_checkpoint(1, 1);
  make_checkpoint(2, 1);
  make_checkpoint(3, 0);
  make_checkpoint(10, 1); /* numeric order, not the names' */
  make_checkpoint(11, 0); /* newer than the newest complete one: maybe being written */
  const char *foreign[] = {"ckpt-010", "ckpt-x", "ckpt-", "other", "ckpt-99999999999999999999999"};
  for (size_t i = 0; i < sizeof foreign / sizeof foreign[0]; i++) {
    snprintf(other, sizeof other, "%s/%s", tmpdir, foreign[i]);
    cr_assert(eq(int, mkdir(other, 0755), 0));
    snprintf(other, sizeof other, "%s/%s/MANIFEST", tmpdir, foreign[i]);
    spit(other, (const uint8_t *)"x", 1);
  }
  OK(ps__ckpt_latest(tmpdir, &id, path, sizeof path));
  cr_assert(eq(u64, id, 10));
  ps__ckpt_dir_of(tmpdir, 10, want, sizeof want);
  cr_assert(eq(str, path, want));

  OK(ps__ckpt_prune(tmpdir, 2));
  cr_assert(absent_checkpoint(1), "complete, beyond the newest two");
  cr_assert(has_checkpoint(2) && has_checkpoint(10));
  cr_assert(absent_checkpoint(3), "incomplete, older than the newest complete one");
  cr_assert(has_checkpoint(11), "incomplete but newer: left alone");
  for (size_t i = 0; i < sizeof foreign / sizeof foreign[0]; i++) {
    snprintf(other, sizeof other, "%s/%s", tmpdir, foreign[i]);
    cr_assert(exists(other), "%s is not a checkpoint: left alone", foreign[i]);
  }

  OK(ps__ckpt_prune(tmpdir, 0));
  cr_assert(has_checkpoint(10), "never the newest complete one");
  cr_assert(absent_checkpoint(2));
  cr_assert(has_checkpoint(11));
  OK(ps__ckpt_latest(tmpdir, &id, path, sizeof path));
  cr_assert(eq(u64, id, 10));

  /* Only incomplete ones: nothing is pruned. */
  snprintf(other, sizeof other, "%s/ckpt-10/MANIFEST", tmpdir);
  cr_assert(eq(int, unlink(other), 0));
  OK(ps__ckpt_prune(tmpdir, 1));
  cr_assert(has_checkpoint(10) && has_checkpoint(11));
}

/* ---------------------------------------------------------------- chains of increments */

/* DIR/ckpt-<dirid>/MANIFEST for checkpoint id (normally dirid) on base (0: whole),
 * with one data file entry; complete = 0 leaves only a data file. */
static void make_manifest(uint64_t dirid, uint64_t id, uint64_t base, int complete) {
  char d[600], f[700];
  ps__ckpt_dir_of(tmpdir, dirid, d, sizeof d);
  cr_assert(eq(int, mkdir(d, 0755), 0));
  snprintf(f, sizeof f, "%s/server-0.psck", d);
  spit(f, (const uint8_t *)"x", 1);
  if (!complete) return;
  snprintf(f, sizeof f, "%s/MANIFEST", d);
  ps__ckpt_header h = {.what = PS_CKPT_MANIFEST, .id = id, .clock = (int64_t)(2 * id), .nservers = 1,
                       .created_ms = 1, .base = base};
  ps__ckpt_writer *w;
  OK(ps__ckpt_writer_open(&w, f, &h));
  ps__ckpt_file file = {.name = "server-0.psck", .rank = 0, .bytes = 1, .checksum = 7, .rows = 0};
  OK(ps__ckpt_write_file(w, &file));
  OK(ps__ckpt_writer_close(w, 1, NULL));
}

static void make_link(uint64_t id, uint64_t base) { make_manifest(id, id, base, 1); }

/* ps__ckpt_chain of DIR/ckpt-<id>: its return code, the links into *v (freed by the
 * caller) and their count into *n. */
static int chain_of(uint64_t id, ps__ckpt_link **v, size_t *n) {
  char d[600];
  ps__ckpt_dir_of(tmpdir, id, d, sizeof d);
  return ps__ckpt_chain(d, v, n);
}

Test(ckpt, chain_oldest_first, .init = make_tmpdir, .fini = remove_tmpdir) {
  make_link(1, 0);
  make_link(2, 1);
  make_link(4, 2); /* ids need not be consecutive: the base is named */
  make_link(5, 0); /* whole, not in 4's chain */
  ps__ckpt_link *v;
  size_t n;
  OK(chain_of(4, &v, &n));
  cr_assert(eq(sz, n, 3));
  const uint64_t ids[] = {1, 2, 4}, bases[] = {0, 1, 2};
  for (size_t i = 0; i < n; i++) {
    char want[600];
    ps__ckpt_dir_of(tmpdir, ids[i], want, sizeof want);
    cr_assert(eq(u64, v[i].id, ids[i]));
    cr_assert(eq(u64, v[i].base, bases[i]));
    cr_assert(eq(i64, v[i].clock, (int64_t)(2 * ids[i])));
    cr_assert(eq(u32, v[i].nservers, 1));
    cr_assert(eq(str, v[i].dir, want));
  }
  free(v);
  OK(chain_of(5, &v, &n));
  cr_assert(all(eq(sz, n, 1), eq(u64, v[0].id, 5), eq(u64, v[0].base, 0)), "a whole checkpoint is its own chain");
  free(v);
  OK(chain_of(2, &v, &n));
  cr_assert(all(eq(sz, n, 2), eq(u64, v[0].id, 1), eq(u64, v[1].id, 2)));
  free(v);
  /* Named with a trailing slash (as a shell completes it), its bases are still beside it. */
  char d[700];
  ps__ckpt_dir_of(tmpdir, 4, d, sizeof d);
  strcat(d, "//");
  OK(ps__ckpt_chain(d, &v, &n));
  cr_assert(all(eq(sz, n, 3), eq(u64, v[0].id, 1), eq(u64, v[1].id, 2)));
  free(v);
}

Test(ckpt, chain_missing_base, .init = make_tmpdir, .fini = remove_tmpdir) {
  make_link(1, 0);
  make_manifest(2, 2, 1, 0); /* being written (or removed halfway): no MANIFEST */
  make_link(3, 2);
  make_link(5, 4);           /* ckpt-4 does not exist */
  ps__ckpt_link *v = (ps__ckpt_link *)&v;
  size_t n = 9;
  char want[1400], d3[600], d2[600];
  ps__ckpt_dir_of(tmpdir, 3, d3, sizeof d3);
  ps__ckpt_dir_of(tmpdir, 2, d2, sizeof d2);
  cr_assert(eq(int, chain_of(3, &v, &n), PS_ERR_CORRUPT));
  cr_assert(all(eq(ptr, v, NULL), eq(sz, n, 0)), "nothing is handed out on an error");
  snprintf(want, sizeof want, "%s is an increment on checkpoint 2, and %s is not a complete checkpoint", d3, d2);
  cr_assert(eq(str, (char *)ps_errmsg(), want));
  cr_assert(eq(int, chain_of(5, &v, &n), PS_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "is an increment on checkpoint 4, and"), NULL)), "%s", ps_errmsg());
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "ckpt-4 is not a complete checkpoint"), NULL)), "%s", ps_errmsg());
  cr_assert(eq(int, chain_of(6, &v, &n), PS_ERR_IO), "no checkpoint at all: its manifest cannot be read");
}

Test(ckpt, chain_refuses_a_base_of_another_id, .init = make_tmpdir, .fini = remove_tmpdir) {
  make_manifest(2, 7, 0, 1); /* ckpt-2 holds checkpoint 7's manifest */
  make_link(8, 2);
  ps__ckpt_link *v;
  size_t n;
  cr_assert(eq(int, chain_of(8, &v, &n), PS_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "ckpt-2/MANIFEST: checkpoint 7, where checkpoint 2 belongs"), NULL)), "%s",
            ps_errmsg());
  /* A damaged manifest in the chain is refused too. */
  make_link(9, 0);
  make_link(10, 9);
  char f[700];
  ps__ckpt_dir_of(tmpdir, 9, f, sizeof f);
  strcat(f, "/MANIFEST");
  size_t len;
  uint8_t *p = slurp(f, &len);
  p[30] ^= 1;
  spit(f, p, len);
  free(p);
  cr_assert(eq(int, chain_of(10, &v, &n), PS_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "ckpt-9/MANIFEST"), NULL)), "%s", ps_errmsg());
}

Test(ckpt, prune_keeps_the_chains_it_must, .init = make_tmpdir, .fini = remove_tmpdir) {
  make_link(1, 0);
  make_manifest(2, 2, 0, 0); /* incomplete, older than the newest complete one */
  make_link(3, 1);
  make_link(4, 3);
  OK(ps__ckpt_prune(tmpdir, 1));
  cr_assert(has_checkpoint(1) && has_checkpoint(3) && has_checkpoint(4), "keep=1 keeps the newest's whole chain");
  cr_assert(absent_checkpoint(2), "incomplete and older than the newest complete one");

  make_link(5, 0);           /* a newer whole checkpoint frees the older chain */
  make_link(6, 5);
  make_manifest(7, 7, 6, 0); /* newer than the newest complete one: maybe being written */
  OK(ps__ckpt_prune(tmpdir, 1));
  cr_assert(absent_checkpoint(1) && absent_checkpoint(3) && absent_checkpoint(4));
  cr_assert(has_checkpoint(5) && has_checkpoint(6) && has_checkpoint(7));

  /* keep=3: the newest three (10, 9, 8) and what they read (6, 5); then keep=2. */
  make_link(8, 6);
  make_link(9, 0);
  make_link(10, 9);
  OK(ps__ckpt_prune(tmpdir, 3));
  cr_assert(has_checkpoint(5) && has_checkpoint(6) && has_checkpoint(8) && has_checkpoint(9) && has_checkpoint(10));
  cr_assert(absent_checkpoint(7), "incomplete, now older than the newest complete one");
  OK(ps__ckpt_prune(tmpdir, 2));
  cr_assert(has_checkpoint(9) && has_checkpoint(10));
  cr_assert(absent_checkpoint(5) && absent_checkpoint(6) && absent_checkpoint(8), "neither kept nor read by one kept");
  ps__ckpt_link *v;
  size_t n;
  OK(chain_of(10, &v, &n));
  cr_assert(eq(sz, n, 2));
  free(v);
}
