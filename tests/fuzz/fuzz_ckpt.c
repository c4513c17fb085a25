/*
 * fuzz_ckpt.c - fuzz target for the checkpoint reader (store/ckpt.c).
 *
 * An input is a checkpoint file (a data file or a manifest). It is written to a
 * temporary file and read three times:
 *  1. as it is, every ROWS block read;
 *  2. as it is, every other ROWS block skipped by the want callback;
 *  3. "resealed": every block's checksums (the ROWS descriptor's, the block's, the END
 *     chain) recomputed over the bytes as they are, so that mutated lengths, counts,
 *     strings and ranges get past the checksums to the decoders' own checks.
 * Besides "does not crash or read out of bounds", the target checks what the reader
 * promises: it ends with END or PS_ERR_CORRUPT (never another code, never with a block
 * after an error); a block handed out holds what its kind allows (strings terminated,
 * counts within bounds, every byte of keys and rows readable); and a file the reader
 * accepts whole is one the writer accepts too: written again block by block, it reads
 * back with the same blocks. A violated property aborts, which libFuzzer and the
 * replay driver report as a crash.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/common.h"
#include "store/ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "fuzz_ckpt: property violated at %s:%d: %s (%s)\n", __FILE__, \
              __LINE__, #cond, ps_errmsg());                                        \
      abort();                                                                      \
    }                                                                               \
  } while (0)

static char dir[256], in_path[320], out_path[320];

static void remove_files(void) {
  unlink(in_path);
  unlink(out_path);
  rmdir(dir);
}

/* A private directory, in memory when the machine has /dev/shm (the writer fsyncs). */
static void setup(void) {
  if (dir[0]) return;
  struct stat st;
  const char *base = getenv("TMPDIR");
  if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0) base = "/dev/shm";
  snprintf(dir, sizeof dir, "%s/pshard-fuzz-ckpt-XXXXXX", base && *base ? base : "/tmp");
  CHECK(mkdtemp(dir) != NULL);
  snprintf(in_path, sizeof in_path, "%s/in.psck", dir);
  snprintf(out_path, sizeof out_path, "%s/out.psck", dir);
  atexit(remove_files);
}

static void spit(const char *path, const uint8_t *p, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CHECK(fd >= 0);
  while (n > 0) {
    ssize_t k = write(fd, p, n);
    CHECK(k > 0);
    p += k;
    n -= (size_t)k;
  }
  CHECK(close(fd) == 0);
}

static int every_other(void *arg, uint32_t table, uint64_t lo, uint64_t hi) {
  (void)table, (void)lo, (void)hi;
  return (*(unsigned *)arg)++ % 2 == 0;
}

static volatile uint64_t sink;

/* What a block handed out may hold. */
static void check_block(const ps__ckpt_block *b, const ps__ckpt_header *h) {
  CHECK(b->kind >= PS_CKPT_B_TABLE && b->kind <= PS_CKPT_B_END);
  switch (b->kind) {
  case PS_CKPT_B_TABLE:
    CHECK(memchr(b->table.decl.name, 0, sizeof b->table.decl.name) != NULL);
    CHECK(memchr(b->table.decl.options, 0, sizeof b->table.decl.options) != NULL);
    CHECK(b->table.decl.name[0] != '\0');
    CHECK(b->table.decl.kind == PS_DENSE || b->table.decl.kind == PS_SPARSE);
    CHECK(b->table.width >= 1 && b->table.row_floats % b->table.width == 0);
    CHECK(b->table.row_floats / b->table.width >= 1 && b->table.row_floats / b->table.width <= 3);
    break;
  case PS_CKPT_B_ROWS: {
    CHECK(h->what == PS_CKPT_DATA);
    CHECK(b->pos_lo <= b->pos_hi);
    if (b->n == 0) {
      CHECK(b->keys == NULL && b->rows == NULL);
      break;
    }
    CHECK(b->n <= PS_CKPT_ROWS_PER_BLOCK);
    CHECK(b->keys != NULL && b->rows != NULL);
    CHECK(b->payload_len == PS_CKPT_ROWS_DESC + (uint64_t)b->n * 8 + (uint64_t)b->n * b->row_floats * 4);
    uint64_t acc = 0;
    for (uint32_t i = 0; i < b->n; i++) acc += ps__get_u64(b->keys + 8 * (size_t)i);
    for (size_t i = 0; i < (size_t)b->n * b->row_floats; i++) {
      float f = b->rows[i];
      uint32_t u;
      memcpy(&u, &f, sizeof u);
      acc += u;
    }
    sink = acc;
    break;
  }
  case PS_CKPT_B_FILE:
    CHECK(h->what == PS_CKPT_MANIFEST);
    CHECK(memchr(b->file.name, 0, sizeof b->file.name) != NULL);
    CHECK(b->file.name[0] != '\0' && b->file.name[0] != '.' && strchr(b->file.name, '/') == NULL);
    CHECK(b->file.rank < h->nservers);
    break;
  case PS_CKPT_B_STATE:
    CHECK(h->what == PS_CKPT_MANIFEST);
    CHECK(b->state_len == b->payload_len && b->state_len <= PS_CKPT_MAX_BLOCK);
    if (b->state_len) sink = b->state[0] + b->state[b->state_len - 1];
    break;
  }
}

/* Read path with want; if rewrite, write every block to out_path as it comes. Returns
 * the reader's verdict (0: END reached). */
static int read_file(const char *path, ps__ckpt_want_fn want, void *arg, int rewrite) {
  ps__ckpt_reader *r;
  ps__ckpt_header h;
  int rc = ps__ckpt_reader_open(&r, path, &h);
  if (rc) {
    CHECK(rc == PS_ERR_CORRUPT);
    return rc;
  }
  CHECK(h.what == PS_CKPT_DATA || h.what == PS_CKPT_MANIFEST);
  CHECK(h.nservers >= 1 && (h.what == PS_CKPT_MANIFEST || h.rank < h.nservers));
  ps__ckpt_writer *w = NULL;
  if (rewrite) CHECK(ps__ckpt_writer_open(&w, out_path, &h) == 0);
  ps__ckpt_block b;
  uint32_t index = 1;
  for (;;) {
    rc = ps__ckpt_next(r, &b, want, arg);
    if (rc) {
      CHECK(rc == PS_ERR_CORRUPT);
      CHECK(ps__ckpt_next(r, &b, want, arg) == rc); /* sticky */
      break;
    }
    CHECK(b.index == index++);
    check_block(&b, &h);
    if (b.kind == PS_CKPT_B_END) {
      CHECK(ps__ckpt_next(r, &b, want, arg) == PS_ERR_INVALID);
      break;
    }
    if (!w) continue;
    int wrc = 0;
    if (b.kind == PS_CKPT_B_TABLE) wrc = ps__ckpt_write_table(w, &b.table);
    else if (b.kind == PS_CKPT_B_FILE) wrc = ps__ckpt_write_file(w, &b.file);
    else if (b.kind == PS_CKPT_B_STATE) wrc = ps__ckpt_write_state(w, b.state, b.state_len);
    else if (b.kind == PS_CKPT_B_ROWS) {
      uint64_t *keys = malloc((size_t)b.n * sizeof *keys + 1);
      CHECK(keys != NULL);
      for (uint32_t i = 0; i < b.n; i++) keys[i] = ps__get_u64(b.keys + 8 * (size_t)i);
      wrc = ps__ckpt_write_rows(w, b.table_id, b.row_floats, keys, b.rows, b.n, b.pos_lo, b.pos_hi);
      free(keys);
    }
    CHECK(wrc == 0);
  }
  ps__ckpt_reader_close(r);
  if (w) {
    /* What the reader accepted whole, the writer accepts. */
    int wrc = ps__ckpt_writer_close(w, rc == 0, NULL);
    CHECK(rc != 0 || wrc == 0);
  }
  return rc;
}

/* The two files hold the same blocks (the rewritten one may split ROWS differently:
 * only rows, not their blocks, are compared). */
static void same_blocks(const char *a, const char *b) {
  ps__ckpt_reader *ra, *rb;
  ps__ckpt_header ha, hb;
  CHECK(ps__ckpt_reader_open(&ra, a, &ha) == 0);
  CHECK(ps__ckpt_reader_open(&rb, b, &hb) == 0);
  CHECK(ha.what == hb.what && ha.id == hb.id && ha.clock == hb.clock && ha.rank == hb.rank &&
        ha.nservers == hb.nservers);
  CHECK(ha.created_ms == hb.created_ms || ha.created_ms == 0);
  ps__ckpt_block x, y;
  for (;;) {
    CHECK(ps__ckpt_next(ra, &x, NULL, NULL) == 0);
    CHECK(ps__ckpt_next(rb, &y, NULL, NULL) == 0);
    CHECK(x.kind == y.kind);
    if (x.kind == PS_CKPT_B_END) break;
    if (x.kind == PS_CKPT_B_TABLE) {
      CHECK(x.table.decl.id == y.table.decl.id && x.table.decl.kind == y.table.decl.kind);
      CHECK(x.table.decl.size == y.table.decl.size && !strcmp(x.table.decl.name, y.table.decl.name));
      CHECK(!strcmp(x.table.decl.options, y.table.decl.options));
      CHECK(x.table.width == y.table.width && x.table.row_floats == y.table.row_floats);
      CHECK(x.table.step == y.table.step && x.table.version == y.table.version && x.table.nrows == y.table.nrows);
    } else if (x.kind == PS_CKPT_B_FILE) {
      CHECK(!strcmp(x.file.name, y.file.name) && x.file.rank == y.file.rank && x.file.bytes == y.file.bytes);
      CHECK(x.file.checksum == y.file.checksum && x.file.rows == y.file.rows);
    } else if (x.kind == PS_CKPT_B_STATE) {
      CHECK(x.state_len == y.state_len && (!x.state_len || !memcmp(x.state, y.state, x.state_len)));
    } else if (x.kind == PS_CKPT_B_ROWS) {
      /* The writer puts at most as many rows in a block as the reader accepts. */
      CHECK(x.n == y.n && x.table_id == y.table_id && x.row_floats == y.row_floats);
      CHECK(y.pos_lo >= x.pos_lo && y.pos_hi <= x.pos_hi);
      CHECK(!memcmp(x.keys, y.keys, 8 * (size_t)x.n));
      CHECK(!memcmp(x.rows, y.rows, 4 * (size_t)x.n * x.row_floats));
    }
  }
  ps__ckpt_reader_close(ra);
  ps__ckpt_reader_close(rb);
}

/* Recompute every checksum over the bytes as they are (while the framing parses). */
static void reseal(uint8_t *p, size_t n) {
  size_t off = 0;
  uint64_t nblocks = 0;
  uint8_t *chain = NULL;
  while (n - off >= PS_CKPT_BLOCK_HDR + 8) {
    uint64_t len = ps__get_u64(p + off + 8);
    if (len > n - off - PS_CKPT_BLOCK_HDR - 8) break;
    unsigned kind = ps__get_u16(p + off + 4);
    if (kind == PS_CKPT_B_ROWS && len >= PS_CKPT_ROWS_DESC)
      ps__put_u64(p + off + PS_CKPT_BLOCK_HDR + 32, ps__hash64(p + off, PS_CKPT_BLOCK_HDR + 32, 0));
    if (kind == PS_CKPT_B_END && len == 16) {
      ps__put_u64(p + off + PS_CKPT_BLOCK_HDR, nblocks);
      ps__put_u64(p + off + PS_CKPT_BLOCK_HDR + 8, chain ? ps__hash64(chain, 8 * nblocks, 0) : ps__hash64("", 0, 0));
    }
    uint64_t sum = ps__hash64(p + off, PS_CKPT_BLOCK_HDR + len, 0);
    ps__put_u64(p + off + PS_CKPT_BLOCK_HDR + len, sum);
    uint8_t *nc = realloc(chain, 8 * (nblocks + 1));
    CHECK(nc != NULL);
    chain = nc;
    ps__put_u64(chain + 8 * nblocks++, sum);
    off += PS_CKPT_BLOCK_HDR + len + 8;
    if (kind == PS_CKPT_B_END) break;
  }
  free(chain);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  setup();
  spit(in_path, data, size);
  int whole = read_file(in_path, NULL, NULL, 1) == 0;
  if (whole) same_blocks(in_path, out_path);
  unsigned k = 0;
  int rc = read_file(in_path, every_other, &k, 0);
  CHECK(!whole || rc == 0); /* skipping never turns a good file bad */

  uint8_t *copy = malloc(size ? size : 1);
  CHECK(copy != NULL);
  memcpy(copy, data, size);
  reseal(copy, size);
  spit(in_path, copy, size);
  if (read_file(in_path, NULL, NULL, 1) == 0) same_blocks(in_path, out_path);
  free(copy);
  return 0;
}
