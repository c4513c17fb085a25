/*
 * ckpt.c - checkpoint files (store/ckpt.h; docs/checkpoint.md is the normative format).
 *
 * The writer streams each block: it knows a block's length before its payload, so the
 * framing goes out first and the checksum is folded over the pieces as they are written
 * (no copy of a table's rows). It keeps the same rules the reader checks (block order,
 * rows sorted and inside their table, row counts) and fails the file at the first
 * violation, so a committed file always reads back.
 *
 * The reader never trusts a length: a block's length is bounded by its kind, by
 * PS_CKPT_MAX_BLOCK and by what is left of the file before its buffer grows, and no
 * field of a payload is used before the payload's checksum matched. A ROWS block has a
 * second, small checksum over its descriptor so that a skipped block's range and length
 * are trusted without reading its rows. The END block closes a chain over every block's
 * checksum, which catches blocks dropped, repeated or cut off at a block boundary.
 * Errors are sticky: after one, every call returns it again.
 */
#include "store/ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH64_state_t on the stack */
#include <xxhash.h>

#include "common/common.h"
#include "common/ring.h"
#include "proto/spec.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint rows are written and read in place as little-endian floats"
#endif

#define HEADER_LEN 48           /* a HEADER payload */
#define HEADER_MIN 8            /* file magic and format: the part every version keeps */
#define HEADER_MAX 4096         /* what a reader accepts before looking at the format */
#define END_LEN 16
#define TABLE_FIXED 48          /* a TABLE payload without its two strings */
#define TABLE_MAX (TABLE_FIXED + 8 + PS_NAME_MAX + PS_OPTS_MAX)
#define FILE_MAX (4 + 64 + 4 + 8 + 8 + 8)
#define FILE_NAME_MAX 64
#define MAX_STATE_BLOCKS 3      /* parameters + adam's or ftrl's two blocks */
#define MAX_WIDTH (1u << 20)    /* proto/spec.c's widest row */

/* ---------------------------------------------------------------- shared */

const char *ps__ckpt_kind_name(int kind) {
  switch (kind) {
  case PS_CKPT_B_HEADER: return "HEADER";
  case PS_CKPT_B_TABLE: return "TABLE";
  case PS_CKPT_B_ROWS: return "ROWS";
  case PS_CKPT_B_FILE: return "FILE";
  case PS_CKPT_B_STATE: return "STATE";
  case PS_CKPT_B_END: return "END";
  }
  return "unknown";
}

static void frame_put(uint8_t *p, int kind, uint64_t len) {
  ps__put_u32(p, PS_CKPT_BLOCK_MAGIC);
  ps__put_u16(p + 4, (uint16_t)kind);
  ps__put_u16(p + 6, 0);
  ps__put_u64(p + 8, len);
}

/* The slices of a dense table, or 0 for a sparse one. */
static uint64_t dense_slices(int kind, uint64_t size, uint32_t width) {
  return kind == PS_DENSE && width ? (size + width - 1) / width : 0;
}

/* The position a row is sorted and skipped by: its slice, or its ring position. */
static uint64_t row_pos(int kind, uint32_t table, uint64_t key) {
  return kind == PS_DENSE ? key : ps__ring_key_hash(table, key);
}

/* A data file's name in a manifest: a plain name in this directory. */
static int name_ok(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n >= FILE_NAME_MAX || s[0] == '.') return 0;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
          c == '_'))
      return 0;
  }
  return 1;
}

/* The rules a TABLE block obeys, for the writer and the reader; NULL when it does. */
static const char *table_problem(const ps__ckpt_table *t, int what) {
  const ps__declare *d = &t->decl;
  if (d->kind != PS_DENSE && d->kind != PS_SPARSE) return "kind is neither dense nor sparse";
  if (d->size == 0) return "size 0";
  if (!d->name[0]) return "empty name";
  if (t->width == 0 || t->width > MAX_WIDTH) return "width out of range";
  if (d->kind == PS_SPARSE && t->width != d->size) return "a sparse table's width is not its dim";
  if (d->kind == PS_DENSE && t->width > d->size) return "slice width larger than the table";
  if (t->row_floats % t->width != 0 || t->row_floats / t->width < 1 || t->row_floats / t->width > MAX_STATE_BLOCKS)
    return "row_floats is not 1 to 3 times the width";
  uint64_t slices = dense_slices(d->kind, d->size, t->width);
  if (d->kind == PS_DENSE && t->nrows > slices) return "more rows than the table has slices";
  if (d->kind == PS_DENSE && what == PS_CKPT_MANIFEST && t->nrows != slices)
    return "a dense table's rows in all files are not its slices";
  return NULL;
}

/* ---------------------------------------------------------------- writing */

struct ps__ckpt_writer {
  int fd;
  int err;
  uint32_t what, nservers;
  uint32_t index;             /* blocks written */
  uint64_t bytes;             /* written so far */
  XXH64_state_t chain;        /* over the blocks' checksums */
  XXH64_state_t block;        /* the block being written */
  uint64_t rows;              /* ROWS rows in all */
  /* the table of the last TABLE block (data files) */
  int have_table;
  ps__ckpt_table table;
  uint64_t table_rows;
  uint64_t last_pos, last_key; /* of the table's last row written */
  int renamed;                /* PATH exists: the temporary was renamed */
  /* manifest */
  uint32_t files;
  uint8_t *ranks;             /* nservers flags: a FILE block for that rank */
  int have_state;
  ps__wbuf buf;               /* small payloads, and the staging of keys */
  char path[PATH_MAX];
  char tmp[PATH_MAX];
};

static int wfail(ps__ckpt_writer *w, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Fail the file with a message naming it (the first error is the one kept). */
static int wfail(ps__ckpt_writer *w, int err, const char *fmt, ...) {
  char msg[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!w->err) {
    w->err = err;
    ps__fail(err, "checkpoint %s: %s", w->path, msg);
  }
  return w->err;
}

static int put_bytes(ps__ckpt_writer *w, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0 && !w->err) {
    ssize_t k = write(w->fd, b, n > (1u << 30) ? (1u << 30) : n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return wfail(w, PS_ERR_IO, "cannot write %s: %s", w->tmp, k < 0 ? strerror(errno) : "no progress");
    b += k;
    n -= (size_t)k;
    w->bytes += (uint64_t)k;
  }
  return w->err;
}

/* A block in pieces: begin (framing), any number of body pieces, end (checksum). */
static int block_begin(ps__ckpt_writer *w, int kind, uint64_t len) {
  uint8_t fr[PS_CKPT_BLOCK_HDR];
  if (w->err) return w->err;
  if (len > PS_CKPT_MAX_BLOCK)
    return wfail(w, PS_ERR_INVALID, "a %s block of %" PRIu64 " bytes is over the limit of %" PRIu64,
                 ps__ckpt_kind_name(kind), len, PS_CKPT_MAX_BLOCK);
  frame_put(fr, kind, len);
  XXH64_reset(&w->block, 0);
  XXH64_update(&w->block, fr, sizeof fr);
  return put_bytes(w, fr, sizeof fr);
}

static int block_piece(ps__ckpt_writer *w, const void *p, size_t n) {
  if (w->err || n == 0) return w->err;
  XXH64_update(&w->block, p, n);
  return put_bytes(w, p, n);
}

static int block_end(ps__ckpt_writer *w) {
  uint8_t c[8];
  if (w->err) return w->err;
  uint64_t sum = XXH64_digest(&w->block);
  ps__put_u64(c, sum);
  XXH64_update(&w->chain, c, sizeof c);
  w->index++;
  return put_bytes(w, c, sizeof c);
}

static int block_whole(ps__ckpt_writer *w, int kind, const void *p, size_t n) {
  block_begin(w, kind, n);
  block_piece(w, p, n);
  return block_end(w);
}

static int writer_buf_ok(ps__ckpt_writer *w) {
  if (w->buf.oom) return wfail(w, PS_ERR_NOMEM, "out of memory");
  return w->err;
}

int ps__ckpt_writer_open(ps__ckpt_writer **out, const char *path, const ps__ckpt_header *h) {
  *out = NULL;
  if (!path || !h) return ps__fail(PS_ERR_INVALID, "checkpoint: no path or header");
  if (strlen(path) + 5 > PATH_MAX) return ps__fail(PS_ERR_INVALID, "checkpoint path too long: %.64s...", path);
  if (h->what != PS_CKPT_DATA && h->what != PS_CKPT_MANIFEST)
    return ps__fail(PS_ERR_INVALID, "checkpoint %s: unknown file type %u", path, h->what);
  if (h->nservers == 0 || h->nservers > PS_MAX_MEMBERS)
    return ps__fail(PS_ERR_INVALID, "checkpoint %s: %u servers (1 to %u)", path, h->nservers, PS_MAX_MEMBERS);
  if (h->what == PS_CKPT_DATA ? h->rank >= h->nservers : h->rank != 0)
    return ps__fail(PS_ERR_INVALID, "checkpoint %s: rank %u of %u servers", path, h->rank, h->nservers);
  ps__ckpt_writer *w = ps__calloc(1, sizeof *w);
  if (!w) return ps__fail(PS_ERR_NOMEM, "out of memory");
  w->fd = -1;
  snprintf(w->path, sizeof w->path, "%s", path);
  snprintf(w->tmp, sizeof w->tmp, "%s.tmp", path);
  w->what = h->what;
  w->nservers = h->nservers;
  ps__wbuf_init(&w->buf);
  XXH64_reset(&w->chain, 0);
  if (h->what == PS_CKPT_MANIFEST && !(w->ranks = ps__calloc(h->nservers, 1))) {
    free(w);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd < 0) {
    int rc = ps__fail(PS_ERR_IO, "checkpoint: cannot create %s: %s", w->tmp, strerror(errno));
    free(w->ranks);
    free(w);
    return rc;
  }
  uint64_t created = h->created_ms;
  if (!created) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    created = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
  }
  uint8_t p[HEADER_LEN];
  ps__put_u32(p, PS_CKPT_FILE_MAGIC);
  ps__put_u32(p + 4, PS_CKPT_FORMAT);
  ps__put_u32(p + 8, h->what);
  ps__put_u32(p + 12, h->rank);
  ps__put_u32(p + 16, h->nservers);
  ps__put_u32(p + 20, 0);
  ps__put_u64(p + 24, h->id);
  ps__put_u64(p + 32, (uint64_t)h->clock);
  ps__put_u64(p + 40, created);
  int rc = block_whole(w, PS_CKPT_B_HEADER, p, sizeof p);
  if (rc) {
    ps__ckpt_writer_close(w, 0, NULL);
    return rc;
  }
  *out = w;
  return 0;
}

/* Before another TABLE or the END: the last table's rows add up. */
static int table_done(ps__ckpt_writer *w) {
  if (w->err || !w->have_table || w->what != PS_CKPT_DATA) return w->err;
  if (w->table_rows != w->table.nrows)
    return wfail(w, PS_ERR_INVALID, "table '%s': %" PRIu64 " rows written, its TABLE block says %" PRIu64,
                 w->table.decl.name, w->table_rows, w->table.nrows);
  return 0;
}

int ps__ckpt_write_table(ps__ckpt_writer *w, const ps__ckpt_table *t) {
  if (w->err) return w->err;
  if (table_done(w)) return w->err;
  ps__ckpt_table c = *t;
  c.decl.name[PS_NAME_MAX - 1] = '\0';
  c.decl.options[PS_OPTS_MAX - 1] = '\0';
  if (c.width == 0) {
    ps__table_spec spec;
    char err[160];
    if (ps__table_spec_parse(&spec, c.decl.name, c.decl.kind, c.decl.size, c.decl.options, err, sizeof err))
      return wfail(w, PS_ERR_INVALID, "table '%s': %s", c.decl.name, err);
    c.width = spec.width;
  }
  const char *why = table_problem(&c, (int)w->what);
  if (why) return wfail(w, PS_ERR_INVALID, "table '%s': %s", c.decl.name, why);
  w->buf.len = 0;
  ps__wbuf_u32(&w->buf, c.decl.id);
  ps__wbuf_u32(&w->buf, c.decl.kind);
  ps__wbuf_u64(&w->buf, c.decl.size);
  ps__wbuf_u32(&w->buf, c.width);
  ps__wbuf_u32(&w->buf, c.row_floats);
  ps__wbuf_u64(&w->buf, c.step);
  ps__wbuf_u64(&w->buf, (uint64_t)c.version);
  ps__wbuf_u64(&w->buf, c.nrows);
  ps__wbuf_str(&w->buf, c.decl.name);
  ps__wbuf_str(&w->buf, c.decl.options);
  if (writer_buf_ok(w)) return w->err;
  if (block_whole(w, PS_CKPT_B_TABLE, w->buf.data, w->buf.len)) return w->err;
  w->table = c;
  w->have_table = 1;
  w->table_rows = 0;
  return 0;
}

/* Rows per ROWS block for rows of row_floats floats. */
static uint32_t rows_per_block(uint32_t row_floats) {
  uint64_t per = (PS_CKPT_MAX_BLOCK - PS_CKPT_ROWS_DESC) / (8u + 4u * (uint64_t)row_floats);
  return per < PS_CKPT_ROWS_PER_BLOCK ? (uint32_t)per : PS_CKPT_ROWS_PER_BLOCK;
}

static int write_rows_block(ps__ckpt_writer *w, const uint64_t *keys, const float *rows, uint32_t n, uint64_t lo,
                            uint64_t hi) {
  const ps__ckpt_table *t = &w->table;
  uint64_t len = PS_CKPT_ROWS_DESC + (uint64_t)n * 8u + (uint64_t)n * t->row_floats * 4u;
  uint8_t fr[PS_CKPT_BLOCK_HDR], desc[PS_CKPT_ROWS_DESC];
  frame_put(fr, PS_CKPT_B_ROWS, len);
  ps__put_u32(desc, t->decl.id);
  ps__put_u32(desc + 4, n);
  ps__put_u32(desc + 8, t->row_floats);
  ps__put_u32(desc + 12, 0);
  ps__put_u64(desc + 16, lo);
  ps__put_u64(desc + 24, hi);
  XXH64_state_t d;
  XXH64_reset(&d, 0);
  XXH64_update(&d, fr, sizeof fr);
  XXH64_update(&d, desc, 32);
  ps__put_u64(desc + 32, XXH64_digest(&d));
  if (block_begin(w, PS_CKPT_B_ROWS, len)) return w->err;
  block_piece(w, desc, sizeof desc);
  /* Keys through a staging buffer, little-endian. */
  enum { STAGE = 4096 };
  for (uint32_t i = 0; i < n && !w->err; i += STAGE) {
    uint32_t m = n - i < STAGE ? n - i : STAGE;
    w->buf.len = 0;
    for (uint32_t j = 0; j < m; j++) ps__wbuf_u64(&w->buf, keys[i + j]);
    if (writer_buf_ok(w)) return w->err;
    block_piece(w, w->buf.data, w->buf.len);
  }
  block_piece(w, rows, (size_t)n * t->row_floats * sizeof(float));
  return block_end(w);
}

int ps__ckpt_write_rows(ps__ckpt_writer *w, uint32_t table, uint32_t row_floats, const uint64_t *keys,
                        const float *rows, uint32_t n, uint64_t pos_lo, uint64_t pos_hi) {
  if (w->err) return w->err;
  if (w->what != PS_CKPT_DATA) return wfail(w, PS_ERR_INVALID, "ROWS in a manifest");
  if (!w->have_table) return wfail(w, PS_ERR_INVALID, "ROWS of table %u before its TABLE block", table);
  const ps__ckpt_table *t = &w->table;
  if (table != t->decl.id)
    return wfail(w, PS_ERR_INVALID, "ROWS of table %u after the TABLE block of table %u", table, t->decl.id);
  if (row_floats != t->row_floats)
    return wfail(w, PS_ERR_INVALID, "table '%s': rows of %u floats, its TABLE block says %u", t->decl.name,
                 row_floats, t->row_floats);
  if (n == 0) return 0;
  if (!keys || !rows) return wfail(w, PS_ERR_INVALID, "table '%s': no keys or rows", t->decl.name);
  if (pos_lo > pos_hi) return wfail(w, PS_ERR_INVALID, "table '%s': an empty position range", t->decl.name);
  if (w->table_rows + n > t->nrows)
    return wfail(w, PS_ERR_INVALID, "table '%s': more than the %" PRIu64 " rows its TABLE block says",
                 t->decl.name, t->nrows);
  /* Sorted by position within the table, across calls too: a reader checks the same. */
  uint64_t slices = dense_slices(t->decl.kind, t->decl.size, t->width);
  int have_prev = w->table_rows > 0;
  uint64_t prev = w->last_pos, prev_key = w->last_key;
  for (uint32_t i = 0; i < n; i++) {
    if (t->decl.kind == PS_DENSE && keys[i] >= slices)
      return wfail(w, PS_ERR_INVALID, "table '%s': slice %" PRIu64 " of %" PRIu64, t->decl.name, keys[i], slices);
    uint64_t p = row_pos(t->decl.kind, table, keys[i]);
    if (p < pos_lo || p > pos_hi)
      return wfail(w, PS_ERR_INVALID, "table '%s': key %" PRIu64 " outside the positions written", t->decl.name,
                   keys[i]);
    if (have_prev && (p < prev || (p == prev && keys[i] == prev_key)))
      return wfail(w, PS_ERR_INVALID, "table '%s': rows not sorted by position, or repeated (key %" PRIu64 ")",
                   t->decl.name, keys[i]);
    prev = p;
    prev_key = keys[i];
    have_prev = 1;
  }
  uint32_t per = rows_per_block(row_floats);
  for (uint32_t i = 0; i < n && !w->err; i += per) {
    uint32_t m = n - i < per ? n - i : per;
    uint64_t lo = row_pos(t->decl.kind, table, keys[i]), hi = row_pos(t->decl.kind, table, keys[i + m - 1]);
    write_rows_block(w, keys + i, rows + (size_t)i * row_floats, m, lo, hi);
  }
  if (w->err) return w->err;
  w->table_rows += n;
  w->rows += n;
  w->last_pos = prev;
  w->last_key = prev_key;
  return 0;
}

int ps__ckpt_write_file(ps__ckpt_writer *w, const ps__ckpt_file *f) {
  if (w->err) return w->err;
  if (w->what != PS_CKPT_MANIFEST) return wfail(w, PS_ERR_INVALID, "FILE in a data file");
  char name[FILE_NAME_MAX];
  snprintf(name, sizeof name, "%s", f->name);
  if (!name_ok(name)) return wfail(w, PS_ERR_INVALID, "bad data file name '%s'", name);
  if (f->rank >= w->nservers || w->ranks[f->rank])
    return wfail(w, PS_ERR_INVALID, "FILE for rank %u of %u servers (repeated or out of range)", f->rank,
                 w->nservers);
  w->buf.len = 0;
  ps__wbuf_str(&w->buf, name);
  ps__wbuf_u32(&w->buf, f->rank);
  ps__wbuf_u64(&w->buf, f->bytes);
  ps__wbuf_u64(&w->buf, f->checksum);
  ps__wbuf_u64(&w->buf, f->rows);
  if (writer_buf_ok(w)) return w->err;
  if (block_whole(w, PS_CKPT_B_FILE, w->buf.data, w->buf.len)) return w->err;
  w->ranks[f->rank] = 1;
  w->files++;
  return 0;
}

int ps__ckpt_write_state(ps__ckpt_writer *w, const void *state, size_t len) {
  if (w->err) return w->err;
  if (w->what != PS_CKPT_MANIFEST) return wfail(w, PS_ERR_INVALID, "STATE in a data file");
  if (w->have_state) return wfail(w, PS_ERR_INVALID, "a second STATE block");
  if (len && !state) return wfail(w, PS_ERR_INVALID, "no state bytes");
  if (block_whole(w, PS_CKPT_B_STATE, state, len)) return w->err;
  w->have_state = 1;
  return 0;
}

/* fsync the directory holding path, so that a rename into it is durable. */
static int sync_dir_of(ps__ckpt_writer *w) {
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", w->path);
  char *slash = strrchr(dir, '/');
  if (!slash) snprintf(dir, sizeof dir, ".");
  else if (slash == dir) dir[1] = '\0';
  else *slash = '\0';
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return wfail(w, PS_ERR_IO, "cannot open directory %s: %s", dir, strerror(errno));
  int rc = fsync(fd);
  int e = errno;
  close(fd);
  if (rc != 0 && e != EINVAL) return wfail(w, PS_ERR_IO, "cannot fsync directory %s: %s", dir, strerror(e));
  return 0;
}

static int finish(ps__ckpt_writer *w, ps__ckpt_summary *sum) {
  if (table_done(w)) return w->err;
  if (w->what == PS_CKPT_MANIFEST && w->files != w->nservers)
    return wfail(w, PS_ERR_INVALID, "%u FILE blocks for %u servers", w->files, w->nservers);
  uint64_t chain = XXH64_digest(&w->chain);
  uint8_t p[END_LEN];
  ps__put_u64(p, w->index);
  ps__put_u64(p + 8, chain);
  if (block_whole(w, PS_CKPT_B_END, p, sizeof p)) return w->err;
  if (fsync(w->fd) != 0) return wfail(w, PS_ERR_IO, "cannot fsync %s: %s", w->tmp, strerror(errno));
  int fd = w->fd;
  w->fd = -1;
  if (close(fd) != 0) return wfail(w, PS_ERR_IO, "cannot close %s: %s", w->tmp, strerror(errno));
  if (rename(w->tmp, w->path) != 0)
    return wfail(w, PS_ERR_IO, "cannot rename %s to %s: %s", w->tmp, w->path, strerror(errno));
  w->renamed = 1;
  if (sync_dir_of(w)) return w->err;
  if (sum) {
    sum->bytes = w->bytes;
    sum->checksum = chain;
    sum->rows = w->rows;
  }
  return 0;
}

int ps__ckpt_writer_close(ps__ckpt_writer *w, int commit, ps__ckpt_summary *sum) {
  if (!w) return 0;
  if (commit && !w->err) finish(w, sum);
  if (w->fd >= 0) close(w->fd);
  /* Not committed: the temporary goes. Failed after the rename (the directory's fsync):
   * the file is whole but not known to be durable, and a failed file never stays. */
  if (!w->renamed) unlink(w->tmp);
  else if (w->err) unlink(w->path);
  int rc = w->err;
  ps__wbuf_free(&w->buf);
  free(w->ranks);
  free(w);
  return rc;
}

/* ---------------------------------------------------------------- reading */

struct ps__ckpt_reader {
  int fd;
  int err;
  int done;                   /* END read */
  uint32_t what, nservers;
  uint64_t size;              /* of the file at open */
  uint64_t off;               /* of the next block */
  uint32_t index;             /* of the next block */
  uint64_t header_len, header_sum;
  XXH64_state_t chain;
  uint8_t *buf;               /* the current payload */
  size_t cap;
  /* data: the table of the last TABLE block */
  int have_table;
  ps__ckpt_table table;
  uint64_t table_rows;
  uint64_t last_pos;          /* of the last row read of that table */
  uint64_t last_key;
  int have_last;
  /* manifest */
  uint32_t files;
  uint8_t *ranks;
  int have_state;
  char path[PATH_MAX];
};

static int rfail(ps__ckpt_reader *r, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Fail the reader for good; the message names the file (the block is in fmt). */
static int rfail(ps__ckpt_reader *r, int err, const char *fmt, ...) {
  char msg[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  r->err = err;
  return ps__fail(err, "checkpoint %s: %s", r->path, msg);
}

/* "block 3 (ROWS) at offset 1234" for messages. */
static const char *where(char *out, size_t cap, uint32_t index, int kind, uint64_t off) {
  if (kind) snprintf(out, cap, "block %u (%s) at offset %" PRIu64, index, ps__ckpt_kind_name(kind), off);
  else snprintf(out, cap, "block %u at offset %" PRIu64, index, off);
  return out;
}

/* Exactly n bytes at offset off (pread: the reader's offset is its own). */
static int read_at(ps__ckpt_reader *r, void *p, size_t n, uint64_t off, const char *what) {
  uint8_t *b = p;
  if (off > r->size || n > r->size - off)
    return rfail(r, PS_ERR_CORRUPT, "truncated: %s needs %zu bytes at offset %" PRIu64 ", the file has %" PRIu64,
                 what, n, off, r->size);
  while (n > 0) {
    ssize_t k = pread(r->fd, b, n, (off_t)off);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return rfail(r, PS_ERR_IO, "cannot read %s: %s", what, strerror(errno));
    if (k == 0) return rfail(r, PS_ERR_CORRUPT, "truncated while reading %s (the file shrank)", what);
    b += k;
    n -= (size_t)k;
    off += (uint64_t)k;
  }
  return 0;
}

static int grow(ps__ckpt_reader *r, size_t n) {
  if (n <= r->cap) return 0;
  size_t cap = r->cap ? r->cap : 4096;
  while (cap < n) cap *= 2;
  free(r->buf);
  r->cap = 0;
  if (!(r->buf = malloc(cap))) return rfail(r, PS_ERR_NOMEM, "out of memory for a block of %zu bytes", n);
  r->cap = cap;
  return 0;
}

/* The most a payload of this kind may hold (before the format's exact rules). */
static uint64_t max_len(int kind) {
  switch (kind) {
  case PS_CKPT_B_HEADER: return HEADER_MAX;
  case PS_CKPT_B_TABLE: return TABLE_MAX;
  case PS_CKPT_B_FILE: return FILE_MAX;
  case PS_CKPT_B_END: return END_LEN;
  default: return PS_CKPT_MAX_BLOCK;
  }
}

/* Read one block's framing at r->off; check magic, flags, kind and length bounds. */
static int read_frame(ps__ckpt_reader *r, uint8_t *fr, int *kind, uint64_t *len) {
  char w[96];
  if (r->off == r->size)
    return rfail(r, PS_ERR_CORRUPT, "truncated: the file ends after block %u without an END block",
                 r->index ? r->index - 1 : 0);
  if (read_at(r, fr, PS_CKPT_BLOCK_HDR, r->off, where(w, sizeof w, r->index, 0, r->off))) return r->err;
  if (ps__get_u32(fr) != PS_CKPT_BLOCK_MAGIC && r->index == 0)
    return rfail(r, PS_ERR_CORRUPT, "not a checkpoint file (bad block magic 0x%08x)", ps__get_u32(fr));
  if (ps__get_u32(fr) != PS_CKPT_BLOCK_MAGIC)
    return rfail(r, PS_ERR_CORRUPT, "%s: bad block magic 0x%08x", where(w, sizeof w, r->index, 0, r->off),
                 ps__get_u32(fr));
  *kind = ps__get_u16(fr + 4);
  *len = ps__get_u64(fr + 8);
  if (*kind < PS_CKPT_B_HEADER || *kind > PS_CKPT_B_END)
    return rfail(r, PS_ERR_CORRUPT, "%s: unknown block kind %d", where(w, sizeof w, r->index, 0, r->off), *kind);
  where(w, sizeof w, r->index, *kind, r->off);
  if (ps__get_u16(fr + 6) != 0) return rfail(r, PS_ERR_CORRUPT, "%s: flags 0x%04x, not 0", w, ps__get_u16(fr + 6));
  if (*len > max_len(*kind))
    return rfail(r, PS_ERR_CORRUPT, "%s: payload length %" PRIu64 " over the limit of %" PRIu64, w, *len,
                 max_len(*kind));
  uint64_t left = r->size - r->off - PS_CKPT_BLOCK_HDR;
  if (*len > left || left - *len < 8)
    return rfail(r, PS_ERR_CORRUPT, "truncated: %s: payload of %" PRIu64 " bytes and checksum, %" PRIu64 " left", w,
                 *len, left);
  return 0;
}

/* Read and verify the payload (and checksum) of the block whose framing is fr. */
static int read_payload(ps__ckpt_reader *r, const uint8_t *fr, int kind, uint64_t len, uint64_t *sum) {
  char w[96];
  where(w, sizeof w, r->index, kind, r->off);
  if (grow(r, (size_t)len + 8)) return r->err;
  if (read_at(r, r->buf, (size_t)len + 8, r->off + PS_CKPT_BLOCK_HDR, w)) return r->err;
  XXH64_state_t s;
  XXH64_reset(&s, 0);
  XXH64_update(&s, fr, PS_CKPT_BLOCK_HDR);
  XXH64_update(&s, r->buf, (size_t)len);
  *sum = ps__get_u64(r->buf + len);
  if (XXH64_digest(&s) != *sum) return rfail(r, PS_ERR_CORRUPT, "%s: checksum mismatch", w);
  return 0;
}

static int decode_header(ps__ckpt_reader *r, const uint8_t *p, uint64_t len, ps__ckpt_header *h) {
  char w[96];
  where(w, sizeof w, 0, PS_CKPT_B_HEADER, 0);
  if (len < HEADER_MIN || ps__get_u32(p) != PS_CKPT_FILE_MAGIC)
    return rfail(r, PS_ERR_CORRUPT, "%s: not a checkpoint file (bad file magic)", w);
  uint32_t format = ps__get_u32(p + 4);
  if (format != PS_CKPT_FORMAT)
    return rfail(r, PS_ERR_CORRUPT, "%s: format version %u, this build reads version %d", w, format, PS_CKPT_FORMAT);
  if (len != HEADER_LEN)
    return rfail(r, PS_ERR_CORRUPT, "%s: %" PRIu64 " bytes, version %d has %d", w, len, PS_CKPT_FORMAT, HEADER_LEN);
  h->what = ps__get_u32(p + 8);
  h->rank = ps__get_u32(p + 12);
  h->nservers = ps__get_u32(p + 16);
  h->id = ps__get_u64(p + 24);
  h->clock = (int64_t)ps__get_u64(p + 32);
  h->created_ms = ps__get_u64(p + 40);
  if (h->what != PS_CKPT_DATA && h->what != PS_CKPT_MANIFEST)
    return rfail(r, PS_ERR_CORRUPT, "%s: unknown file type %u", w, h->what);
  if (ps__get_u32(p + 20) != 0) return rfail(r, PS_ERR_CORRUPT, "%s: reserved field not 0", w);
  if (h->nservers == 0 || h->nservers > PS_MAX_MEMBERS)
    return rfail(r, PS_ERR_CORRUPT, "%s: %u servers (1 to %u)", w, h->nservers, PS_MAX_MEMBERS);
  if (h->what == PS_CKPT_DATA ? h->rank >= h->nservers : h->rank != 0)
    return rfail(r, PS_ERR_CORRUPT, "%s: rank %u of %u servers", w, h->rank, h->nservers);
  return 0;
}

int ps__ckpt_reader_open(ps__ckpt_reader **out, const char *path, ps__ckpt_header *h) {
  *out = NULL;
  if (!path || !h) return ps__fail(PS_ERR_INVALID, "checkpoint: no path or header");
  if (strlen(path) >= PATH_MAX) return ps__fail(PS_ERR_INVALID, "checkpoint path too long: %.64s...", path);
  ps__ckpt_reader *r = ps__calloc(1, sizeof *r);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  snprintf(r->path, sizeof r->path, "%s", path);
  XXH64_reset(&r->chain, 0);
  int rc = 0;
  struct stat st;
  r->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (r->fd < 0) {
    rc = rfail(r, PS_ERR_IO, "cannot open: %s", strerror(errno));
  } else if (fstat(r->fd, &st) != 0) {
    rc = rfail(r, PS_ERR_IO, "cannot stat: %s", strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    rc = rfail(r, PS_ERR_IO, "not a regular file");
  } else {
    r->size = (uint64_t)st.st_size;
    uint8_t fr[PS_CKPT_BLOCK_HDR];
    int kind;
    uint64_t len, sum;
    ps__ckpt_header hd;
    memset(&hd, 0, sizeof hd);
    if (r->size == 0) rc = rfail(r, PS_ERR_CORRUPT, "empty file");
    else if ((rc = read_frame(r, fr, &kind, &len)) != 0) {
      /* the message says why */
    } else if (kind != PS_CKPT_B_HEADER) {
      rc = rfail(r, PS_ERR_CORRUPT, "block 0 is a %s block, not a HEADER", ps__ckpt_kind_name(kind));
    } else if ((rc = read_payload(r, fr, kind, len, &sum)) == 0 && (rc = decode_header(r, r->buf, len, &hd)) == 0) {
      uint8_t c[8];
      ps__put_u64(c, sum);
      XXH64_update(&r->chain, c, sizeof c);
      r->off = PS_CKPT_BLOCK_HDR + len + 8;
      r->index = 1;
      r->header_len = len;
      r->header_sum = sum;
      r->what = hd.what;
      r->nservers = hd.nservers;
      if (hd.what == PS_CKPT_MANIFEST && !(r->ranks = ps__calloc(hd.nservers, 1)))
        rc = rfail(r, PS_ERR_NOMEM, "out of memory");
      else *h = hd;
    }
  }
  if (rc) {
    ps__ckpt_reader_close(r);
    return rc;
  }
  *out = r;
  return 0;
}

/* The rows of the current table are all there (at a TABLE or the END). */
static int rows_complete(ps__ckpt_reader *r, const char *w) {
  if (r->what != PS_CKPT_DATA || !r->have_table || r->table_rows == r->table.nrows) return 0;
  return rfail(r, PS_ERR_CORRUPT, "%s: table '%s' has %" PRIu64 " rows, its TABLE block says %" PRIu64, w,
               r->table.decl.name, r->table_rows, r->table.nrows);
}

static int decode_table(ps__ckpt_reader *r, const uint8_t *p, uint64_t len, ps__ckpt_block *b, const char *w) {
  ps__rbuf rb;
  ps__ckpt_table *t = &b->table;
  ps__rbuf_init(&rb, p, (size_t)len);
  memset(t, 0, sizeof *t);
  t->decl.id = ps__rbuf_u32(&rb);
  uint32_t kind = ps__rbuf_u32(&rb);
  t->decl.size = ps__rbuf_u64(&rb);
  t->width = ps__rbuf_u32(&rb);
  t->row_floats = ps__rbuf_u32(&rb);
  t->step = ps__rbuf_u64(&rb);
  t->version = (int64_t)ps__rbuf_u64(&rb);
  t->nrows = ps__rbuf_u64(&rb);
  ps__rbuf_str(&rb, t->decl.name, sizeof t->decl.name);
  ps__rbuf_str(&rb, t->decl.options, sizeof t->decl.options);
  if (rb.err || rb.off != len) return rfail(r, PS_ERR_CORRUPT, "%s: malformed TABLE payload", w);
  if (kind > 255) return rfail(r, PS_ERR_CORRUPT, "%s: kind %u", w, kind);
  t->decl.kind = (uint8_t)kind;
  /* A string with a NUL inside would read as a shorter one: the writer never makes one. */
  if (strlen(t->decl.name) + strlen(t->decl.options) + TABLE_FIXED + 8 != len)
    return rfail(r, PS_ERR_CORRUPT, "%s: a NUL inside the table's name or options", w);
  const char *why = table_problem(t, (int)r->what);
  if (why) return rfail(r, PS_ERR_CORRUPT, "%s: table '%s': %s", w, t->decl.name, why);
  if (r->what == PS_CKPT_DATA) {
    r->table = *t;
    r->have_table = 1;
    r->table_rows = 0;
    r->have_last = 0;
  }
  return 0;
}

static int decode_file(ps__ckpt_reader *r, const uint8_t *p, uint64_t len, ps__ckpt_block *b, const char *w) {
  ps__rbuf rb;
  ps__ckpt_file *f = &b->file;
  ps__rbuf_init(&rb, p, (size_t)len);
  memset(f, 0, sizeof *f);
  ps__rbuf_str(&rb, f->name, sizeof f->name);
  f->rank = ps__rbuf_u32(&rb);
  f->bytes = ps__rbuf_u64(&rb);
  f->checksum = ps__rbuf_u64(&rb);
  f->rows = ps__rbuf_u64(&rb);
  if (rb.err || rb.off != len) return rfail(r, PS_ERR_CORRUPT, "%s: malformed FILE payload", w);
  if (strlen(f->name) + 4 + 28 != len || !name_ok(f->name))
    return rfail(r, PS_ERR_CORRUPT, "%s: bad data file name", w);
  if (f->rank >= r->nservers || r->ranks[f->rank])
    return rfail(r, PS_ERR_CORRUPT, "%s: a FILE for rank %u of %u servers (repeated or out of range)", w, f->rank,
                 r->nservers);
  r->ranks[f->rank] = 1;
  r->files++;
  return 0;
}

/* The rows of a ROWS block read whole: inside the table, in order, in the block's range. */
static int check_rows(ps__ckpt_reader *r, ps__ckpt_block *b, const char *w) {
  const ps__ckpt_table *t = &r->table;
  uint64_t slices = dense_slices(t->decl.kind, t->decl.size, t->width);
  for (uint32_t i = 0; i < b->n; i++) {
    uint64_t key = ps__get_u64(b->keys + 8 * (size_t)i);
    if (t->decl.kind == PS_DENSE && key >= slices)
      return rfail(r, PS_ERR_CORRUPT, "%s: slice %" PRIu64 " of a table of %" PRIu64, w, key, slices);
    uint64_t p = row_pos(t->decl.kind, t->decl.id, key);
    if (p < b->pos_lo || p > b->pos_hi)
      return rfail(r, PS_ERR_CORRUPT, "%s: key %" PRIu64 " outside the block's positions", w, key);
    if (r->have_last && (p < r->last_pos || (p == r->last_pos && key == r->last_key)))
      return rfail(r, PS_ERR_CORRUPT, "%s: rows out of order at key %" PRIu64, w, key);
    r->last_pos = p;
    r->last_key = key;
    r->have_last = 1;
  }
  return 0;
}

static int next_rows(ps__ckpt_reader *r, const uint8_t *fr, uint64_t len, ps__ckpt_block *b, ps__ckpt_want_fn want,
                     void *arg, uint64_t *sum, const char *w) {
  uint8_t d[PS_CKPT_ROWS_DESC];
  if (r->what != PS_CKPT_DATA) return rfail(r, PS_ERR_CORRUPT, "%s: ROWS in a manifest", w);
  if (len < PS_CKPT_ROWS_DESC) return rfail(r, PS_ERR_CORRUPT, "%s: payload shorter than its descriptor", w);
  if (read_at(r, d, sizeof d, r->off + PS_CKPT_BLOCK_HDR, w)) return r->err;
  XXH64_state_t s;
  XXH64_reset(&s, 0);
  XXH64_update(&s, fr, PS_CKPT_BLOCK_HDR);
  XXH64_update(&s, d, 32);
  if (XXH64_digest(&s) != ps__get_u64(d + 32)) return rfail(r, PS_ERR_CORRUPT, "%s: descriptor checksum mismatch", w);
  b->table_id = ps__get_u32(d);
  b->n = ps__get_u32(d + 4);
  b->row_floats = ps__get_u32(d + 8);
  b->pos_lo = ps__get_u64(d + 16);
  b->pos_hi = ps__get_u64(d + 24);
  uint32_t n = b->n;
  const ps__ckpt_table *t = &r->table;
  if (!r->have_table) return rfail(r, PS_ERR_CORRUPT, "%s: ROWS before any TABLE block", w);
  if (b->table_id != t->decl.id)
    return rfail(r, PS_ERR_CORRUPT, "%s: rows of table %u after the TABLE block of table %u", w, b->table_id,
                 t->decl.id);
  if (b->row_floats != t->row_floats)
    return rfail(r, PS_ERR_CORRUPT, "%s: rows of %u floats, the table's are %u", w, b->row_floats, t->row_floats);
  if (ps__get_u32(d + 12) != 0) return rfail(r, PS_ERR_CORRUPT, "%s: reserved field not 0", w);
  if (n == 0 || n > PS_CKPT_ROWS_PER_BLOCK)
    return rfail(r, PS_ERR_CORRUPT, "%s: %u rows (1 to %u)", w, n, PS_CKPT_ROWS_PER_BLOCK);
  if (len != PS_CKPT_ROWS_DESC + (uint64_t)n * 8u + (uint64_t)n * b->row_floats * 4u)
    return rfail(r, PS_ERR_CORRUPT, "%s: payload of %" PRIu64 " bytes for %u rows of %u floats", w, len, n,
                 b->row_floats);
  if (b->pos_lo > b->pos_hi) return rfail(r, PS_ERR_CORRUPT, "%s: an empty position range", w);
  if (r->table_rows + n > t->nrows)
    return rfail(r, PS_ERR_CORRUPT, "%s: more rows than the %" PRIu64 " its TABLE block says", w, t->nrows);
  r->table_rows += n;
  if (want && !want(arg, b->table_id, b->pos_lo, b->pos_hi)) {
    uint8_t c[8];
    if (read_at(r, c, sizeof c, r->off + PS_CKPT_BLOCK_HDR + len, w)) return r->err;
    *sum = ps__get_u64(c);
    b->n = 0;
    r->have_last = 0; /* order is checked within the rows read */
    return 0;
  }
  if (read_payload(r, fr, PS_CKPT_B_ROWS, len, sum)) return r->err;
  b->keys = r->buf + PS_CKPT_ROWS_DESC;
  b->rows = (const float *)(const void *)(r->buf + PS_CKPT_ROWS_DESC + 8 * (size_t)n);
  return check_rows(r, b, w);
}

int ps__ckpt_next(ps__ckpt_reader *r, ps__ckpt_block *b, ps__ckpt_want_fn want, void *arg) {
  if (r->err) return r->err;
  if (r->done) return ps__fail(PS_ERR_INVALID, "checkpoint %s: read past its END block", r->path);
  memset(b, 0, sizeof *b);
  uint8_t fr[PS_CKPT_BLOCK_HDR];
  int kind;
  uint64_t len, sum = 0;
  char w[96];
  if (r->index == UINT32_MAX) return rfail(r, PS_ERR_CORRUPT, "too many blocks");
  if (read_frame(r, fr, &kind, &len)) return r->err;
  where(w, sizeof w, r->index, kind, r->off);
  b->kind = kind;
  b->index = r->index;
  b->offset = r->off;
  b->payload_len = len;
  int rc = 0;
  switch (kind) {
  case PS_CKPT_B_HEADER: return rfail(r, PS_ERR_CORRUPT, "%s: a second HEADER", w);
  case PS_CKPT_B_ROWS: rc = next_rows(r, fr, len, b, want, arg, &sum, w); break;
  default:
    if ((rc = read_payload(r, fr, kind, len, &sum)) != 0) break;
    if (kind == PS_CKPT_B_TABLE) {
      if ((rc = rows_complete(r, w)) == 0) rc = decode_table(r, r->buf, len, b, w);
    } else if (kind == PS_CKPT_B_FILE) {
      rc = r->what == PS_CKPT_MANIFEST ? decode_file(r, r->buf, len, b, w)
                                       : rfail(r, PS_ERR_CORRUPT, "%s: FILE in a data file", w);
    } else if (kind == PS_CKPT_B_STATE) {
      if (r->what != PS_CKPT_MANIFEST) rc = rfail(r, PS_ERR_CORRUPT, "%s: STATE in a data file", w);
      else if (r->have_state) rc = rfail(r, PS_ERR_CORRUPT, "%s: a second STATE block", w);
      else {
        r->have_state = 1;
        b->state = r->buf;
        b->state_len = (size_t)len;
      }
    } else { /* END */
      if (len != END_LEN) rc = rfail(r, PS_ERR_CORRUPT, "%s: payload of %" PRIu64 " bytes, not %d", w, len, END_LEN);
      else if (ps__get_u64(r->buf) != r->index)
        rc = rfail(r, PS_ERR_CORRUPT, "%s: says %" PRIu64 " blocks before it, the file has %u", w, ps__get_u64(r->buf),
                   r->index);
      else if (ps__get_u64(r->buf + 8) != XXH64_digest(&r->chain))
        rc = rfail(r, PS_ERR_CORRUPT, "%s: the blocks' checksums do not match its chain", w);
      else if (r->off + PS_CKPT_BLOCK_HDR + len + 8 != r->size)
        rc = rfail(r, PS_ERR_CORRUPT, "%s: %" PRIu64 " bytes after the END block", w,
                   r->size - (r->off + PS_CKPT_BLOCK_HDR + len + 8));
      else if (r->what == PS_CKPT_MANIFEST && r->files != r->nservers)
        rc = rfail(r, PS_ERR_CORRUPT, "%s: %u FILE blocks for %u servers", w, r->files, r->nservers);
      else rc = rows_complete(r, w);
      if (!rc) {
        r->done = 1;
        b->end_checksum = ps__get_u64(r->buf + 8);
        b->end_bytes = r->size;
      }
    }
  }
  if (rc) {
    memset(b, 0, sizeof *b);
    return rc;
  }
  b->checksum = sum;
  uint8_t c[8];
  ps__put_u64(c, sum);
  XXH64_update(&r->chain, c, sizeof c);
  r->off += PS_CKPT_BLOCK_HDR + len + 8;
  r->index++;
  return 0;
}

void ps__ckpt_reader_header_block(const ps__ckpt_reader *r, uint64_t *payload_len, uint64_t *checksum) {
  *payload_len = r->header_len;
  *checksum = r->header_sum;
}

void ps__ckpt_reader_close(ps__ckpt_reader *r) {
  if (!r) return;
  if (r->fd >= 0) close(r->fd);
  free(r->buf);
  free(r->ranks);
  free(r);
}

/* ---------------------------------------------------------------- a directory of checkpoints */

void ps__ckpt_dir_of(const char *dir, uint64_t id, char *path, size_t cap) {
  snprintf(path, cap, "%s/ckpt-%" PRIu64, dir, id);
}

/* "ckpt-<id>" in its one spelling (decimal, no sign, no leading zero) -> id. */
static int parse_entry(const char *name, uint64_t *id) {
  if (strncmp(name, "ckpt-", 5) != 0) return -1;
  const char *s = name + 5;
  if (!*s || (s[0] == '0' && s[1]) || strlen(s) > 20) return -1;
  for (const char *p = s; *p; p++)
    if (*p < '0' || *p > '9') return -1;
  return ps__parse_u64(s, id);
}

typedef struct entry {
  uint64_t id;
  int complete;
} entry;

static int cmp_entry(const void *a, const void *b) {
  uint64_t x = ((const entry *)a)->id, y = ((const entry *)b)->id;
  return (x > y) - (x < y);
}

/* The checkpoint directories of dir, sorted by id. */
static int list_entries(const char *dir, entry **out, size_t *n) {
  *out = NULL;
  *n = 0;
  DIR *d = opendir(dir);
  if (!d) return ps__fail(PS_ERR_IO, "cannot open checkpoint directory %s: %s", dir, strerror(errno));
  entry *v = NULL;
  size_t cap = 0;
  struct dirent *e;
  int rc = 0;
  while ((e = readdir(d))) {
    uint64_t id;
    if (parse_entry(e->d_name, &id) != 0) continue;
    char p[PATH_MAX];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (*n == cap) {
      cap = cap ? 2 * cap : 16;
      entry *nv = ps__realloc(v, cap * sizeof *nv);
      if (!nv) {
        rc = ps__fail(PS_ERR_NOMEM, "out of memory");
        break;
      }
      v = nv;
    }
    snprintf(p, sizeof p, "%s/%s/MANIFEST", dir, e->d_name);
    v[*n].id = id;
    v[*n].complete = stat(p, &st) == 0 && S_ISREG(st.st_mode);
    (*n)++;
  }
  closedir(d);
  if (rc) {
    free(v);
    *n = 0;
    return rc;
  }
  if (*n) qsort(v, *n, sizeof *v, cmp_entry);
  *out = v;
  return 0;
}

int ps__ckpt_latest(const char *dir, uint64_t *id, char *path, size_t cap) {
  entry *v;
  size_t n;
  int rc = list_entries(dir, &v, &n);
  if (rc) return rc;
  size_t i = n;
  while (i > 0 && !v[i - 1].complete) i--;
  if (i == 0) {
    rc = ps__fail(PS_ERR_IO, "no complete checkpoint in %s (%zu without a MANIFEST)", dir, n);
  } else {
    *id = v[i - 1].id;
    ps__ckpt_dir_of(dir, *id, path, cap);
  }
  free(v);
  return rc;
}

/* Delete one checkpoint directory: its MANIFEST first (from then on it is incomplete,
 * never a complete checkpoint with files missing), then the rest. Plain files only. */
static int remove_checkpoint(const char *dir, uint64_t id) {
  char p[PATH_MAX], f[PATH_MAX];
  ps__ckpt_dir_of(dir, id, p, sizeof p);
  snprintf(f, sizeof f, "%s/MANIFEST", p);
  if (unlink(f) != 0 && errno != ENOENT) return ps__fail(PS_ERR_IO, "cannot remove %s: %s", f, strerror(errno));
  DIR *d = opendir(p);
  if (!d) return ps__fail(PS_ERR_IO, "cannot open %s: %s", p, strerror(errno));
  struct dirent *e;
  int rc = 0;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(f, sizeof f, "%s/%s", p, e->d_name);
    if (unlink(f) != 0 && errno != ENOENT && !rc)
      rc = ps__fail(PS_ERR_IO, "cannot remove %s: %s", f, strerror(errno));
  }
  closedir(d);
  if (!rc && rmdir(p) != 0) rc = ps__fail(PS_ERR_IO, "cannot remove %s: %s", p, strerror(errno));
  return rc;
}

int ps__ckpt_prune(const char *dir, unsigned keep) {
  entry *v;
  size_t n;
  int rc = list_entries(dir, &v, &n);
  if (rc) return rc;
  if (keep == 0) keep = 1; /* never the newest complete one */
  uint64_t newest = 0;
  int any = 0;
  for (size_t i = 0; i < n; i++)
    if (v[i].complete) newest = v[i].id, any = 1;
  unsigned kept = 0;
  for (size_t i = n; i-- > 0;) {
    int drop;
    if (v[i].complete) drop = ++kept > keep;
    else drop = any && v[i].id < newest;
    if (drop) {
      int r2 = remove_checkpoint(dir, v[i].id);
      if (r2 && !rc) rc = r2;
    }
  }
  free(v);
  return rc;
}
