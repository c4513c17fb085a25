/*
 * ckpt.c - checkpoint files: the writer and the directory helpers (store/ckpt.h;
 * docs/checkpoint.md is the normative format; the reader is ckpt_read.c).
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
#include "store/ckpt_int.h"

#include <pthread.h>

#include "common/fault.h"

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
  uint64_t *progress;         /* bytes handed to the disk are added to it (atomically), or NULL */
  /* manifest */
  uint32_t files;
  uint8_t *ranks;             /* nservers flags: a FILE block for that rank */
  int have_state;
  ps__wbuf buf;               /* small payloads, and the staging of keys */
  /* data files: the bytes go out in OUT_BYTES pieces from an aligned buffer, with
   * O_DIRECT where the file system takes it (no copy into the page cache, which costs
   * this VM more than the disk does), the tail without it */
  uint8_t *out;
  size_t out_len;
  int direct;
  /* ... and a thread of their own writes each full buffer while the next one fills, so
   * the disk's time and the caller's (gathering rows) overlap */
  uint8_t *spare;             /* the other buffer */
  pthread_t io;
  int io_started, io_stop, io_errno;
  uint8_t *io_buf;            /* the buffer being written */
  size_t io_len;              /* its length; 0: the thread is idle */
  pthread_mutex_t io_mu;
  pthread_cond_t io_cv;
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

#define OUT_BYTES ((size_t)8 << 20)
#define OUT_ALIGN 4096

/* Go on without O_DIRECT (for the tail, which is not a whole number of pages). */
static int direct_off(ps__ckpt_writer *w) {
  if (!w->direct) return 0;
  int fl = fcntl(w->fd, F_GETFL);
  if (fl < 0 || fcntl(w->fd, F_SETFL, fl & ~O_DIRECT) < 0)
    return wfail(w, PS_ERR_IO, "cannot write %s: %s", w->tmp, strerror(errno));
  w->direct = 0;
  return 0;
}

/* Write n bytes at the file's end, as they are. */
static int write_all(ps__ckpt_writer *w, const uint8_t *b, size_t n) {
  while (n > 0 && !w->err) {
    ssize_t k = write(w->fd, b, n > (1u << 30) ? (1u << 30) : n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno == EINVAL && w->direct) { /* the file system refuses O_DIRECT writes after all */
      if (direct_off(w)) return w->err;
      continue;
    }
    if (k <= 0) return wfail(w, PS_ERR_IO, "cannot write %s: %s", w->tmp, k < 0 ? strerror(errno) : "no progress");
    b += k;
    n -= (size_t)k;
  }
  return w->err;
}

/* The I/O thread's write of n bytes: 0 or an errno. It alone touches the file while it
 * writes (the caller waits for it before the tail, the fsync and the close). */
static int io_write(ps__ckpt_writer *w, const uint8_t *b, size_t n) {
  while (n > 0) {
    ssize_t k = write(w->fd, b, n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno == EINVAL && w->direct) {
      int fl = fcntl(w->fd, F_GETFL);
      if (fl < 0 || fcntl(w->fd, F_SETFL, fl & ~O_DIRECT) < 0) return errno;
      w->direct = 0;
      continue;
    }
    if (k <= 0) return k < 0 ? errno : EIO;
    b += k;
    n -= (size_t)k;
  }
  return 0;
}

static void *io_main(void *arg) {
  ps__ckpt_writer *w = arg;
  pthread_mutex_lock(&w->io_mu);
  for (;;) {
    while (!w->io_len && !w->io_stop) pthread_cond_wait(&w->io_cv, &w->io_mu);
    if (!w->io_len) break;
    const uint8_t *b = w->io_buf;
    size_t n = w->io_len;
    pthread_mutex_unlock(&w->io_mu);
    int e = io_write(w, b, n);
    pthread_mutex_lock(&w->io_mu);
    if (e && !w->io_errno) w->io_errno = e;
    w->io_len = 0;
    pthread_cond_broadcast(&w->io_cv);
  }
  pthread_mutex_unlock(&w->io_mu);
  return NULL;
}

/* Wait until the I/O thread is idle; its error, if any, becomes the file's. */
static int io_wait(ps__ckpt_writer *w) {
  if (!w->io_started) return w->err;
  pthread_mutex_lock(&w->io_mu);
  while (w->io_len) pthread_cond_wait(&w->io_cv, &w->io_mu);
  int e = w->io_errno;
  pthread_mutex_unlock(&w->io_mu);
  if (e) return wfail(w, PS_ERR_IO, "cannot write %s: %s", w->tmp, strerror(e));
  return w->err;
}

static void io_stop(ps__ckpt_writer *w) {
  if (!w->io_started) return;
  pthread_mutex_lock(&w->io_mu);
  w->io_stop = 1;
  pthread_cond_broadcast(&w->io_cv);
  pthread_mutex_unlock(&w->io_mu);
  pthread_join(w->io, NULL);
  w->io_started = 0;
  pthread_cond_destroy(&w->io_cv);
  pthread_mutex_destroy(&w->io_mu);
}

/* The full buffer goes to the I/O thread (or out at once without one). */
static int flush_out(ps__ckpt_writer *w) {
  if (ps__fault_on()) {
    ps__fault_sleep_ms(ps__fault_disk("checkpoint write")); /* a slow disk, for the tests that kill a writer */
  }
  if (w->progress) __atomic_add_fetch(w->progress, w->out_len, __ATOMIC_RELAXED);
  if (!w->io_started) {
    int rc = write_all(w, w->out, w->out_len);
    w->out_len = 0;
    return rc;
  }
  if (io_wait(w)) return w->err;
  uint8_t *full = w->out;
  pthread_mutex_lock(&w->io_mu);
  w->io_buf = full;
  w->io_len = w->out_len;
  pthread_cond_broadcast(&w->io_cv);
  pthread_mutex_unlock(&w->io_mu);
  w->out = w->spare;
  w->spare = full;
  w->out_len = 0;
  return 0;
}

static int put_bytes(ps__ckpt_writer *w, const void *p, size_t n) {
  const uint8_t *b = p;
  if (w->out) {
    while (n > 0 && !w->err) {
      size_t k = OUT_BYTES - w->out_len < n ? OUT_BYTES - w->out_len : n;
      memcpy(w->out + w->out_len, b, k);
      w->out_len += k;
      w->bytes += k;
      b += k;
      n -= k;
      if (w->out_len == OUT_BYTES) flush_out(w);
    }
    return w->err;
  }
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

void ps__ckpt_writer_progress(ps__ckpt_writer *w, uint64_t *counter) {
  if (w) w->progress = counter;
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
  if (h->base && h->base >= h->id)
    return ps__fail(PS_ERR_INVALID, "checkpoint %s: an increment on checkpoint %" PRIu64 ", not older than %" PRIu64,
                    path, h->base, h->id);
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
  w->fd = -1;
  if (h->what == PS_CKPT_DATA && (w->out = aligned_alloc(OUT_ALIGN, OUT_BYTES))) {
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    w->direct = w->fd >= 0;
    if (w->direct && (w->spare = aligned_alloc(OUT_ALIGN, OUT_BYTES))) {
      pthread_mutex_init(&w->io_mu, NULL);
      pthread_cond_init(&w->io_cv, NULL);
      w->io_started = pthread_create(&w->io, NULL, io_main, w) == 0;
      if (!w->io_started) {
        pthread_cond_destroy(&w->io_cv);
        pthread_mutex_destroy(&w->io_mu);
      }
    }
  }
  if (w->fd < 0) w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd < 0) {
    int rc = ps__fail(PS_ERR_IO, "checkpoint: cannot create %s: %s", w->tmp, strerror(errno));
    free(w->out);
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
  ps__put_u64(p + 48, h->base);
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
  if (w->out && io_wait(w)) return w->err;
  io_stop(w); /* the tail below, the fsync and the close are this thread's */
  if (w->out && w->out_len) {
    if (w->out_len % OUT_ALIGN && direct_off(w)) return w->err;
    if (flush_out(w)) return w->err;
  }
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
  io_stop(w);
  if (w->fd >= 0) close(w->fd);
  /* Not committed: the temporary goes. Failed after the rename (the directory's fsync):
   * the file is whole but not known to be durable, and a failed file never stays. */
  if (!w->renamed) unlink(w->tmp);
  else if (w->err) unlink(w->path);
  int rc = w->err;
  ps__wbuf_free(&w->buf);
  free(w->out);
  free(w->spare);
  free(w->ranks);
  free(w);
  return rc;
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
  uint64_t base; /* complete: its manifest's base (0: whole, or unreadable) */
} entry;

/* The header of the MANIFEST of checkpoint directory ckdir. */
static int manifest_header(const char *ckdir, ps__ckpt_header *h) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/MANIFEST", ckdir);
  ps__ckpt_reader *r;
  int rc = ps__ckpt_reader_open(&r, path, h);
  if (rc) return rc;
  ps__ckpt_reader_close(r);
  if (h->what != PS_CKPT_MANIFEST) return ps__fail(PS_ERR_CORRUPT, "%s is not a checkpoint manifest", path);
  return 0;
}

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
    v[*n].base = 0;
    if (v[*n].complete) {
      ps__ckpt_header h;
      snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
      if (manifest_header(p, &h) == 0) v[*n].base = h.base;
    }
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

static entry *find_entry(entry *v, size_t n, uint64_t id) {
  entry key = {.id = id};
  return n ? bsearch(&key, v, n, sizeof *v, cmp_entry) : NULL;
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
  /* Kept: the newest `keep` complete ones and every checkpoint their chains read. */
  unsigned char *need = ps__calloc(n ? n : 1, 1);
  if (!need) {
    free(v);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  unsigned kept = 0;
  for (size_t i = n; i-- > 0 && kept < keep;) {
    if (!v[i].complete) continue;
    kept++;
    for (entry *e = &v[i]; e && e->complete && !need[e - v]; e = e->base ? find_entry(v, n, e->base) : NULL)
      need[e - v] = 1;
  }
  for (size_t i = n; i-- > 0;) {
    int drop = v[i].complete ? !need[i] : any && v[i].id < newest;
    if (drop) {
      int r2 = remove_checkpoint(dir, v[i].id);
      if (r2 && !rc) rc = r2;
    }
  }
  free(need);
  free(v);
  return rc;
}

int ps__ckpt_chain(const char *ckdir, ps__ckpt_link **out, size_t *n) {
  *out = NULL;
  *n = 0;
  char root[PATH_MAX];
  snprintf(root, sizeof root, "%s", ckdir);
  for (size_t l = strlen(root); l > 1 && root[l - 1] == '/';) root[--l] = '\0'; /* "DIR/ckpt-4/" */
  char *slash = strrchr(root, '/');
  if (!slash) snprintf(root, sizeof root, ".");
  else if (slash == root) root[1] = '\0';
  else *slash = '\0';
  ps__ckpt_link *v = NULL;
  size_t cnt = 0, cap = 0;
  char cur[PS_CKPT_DIR_MAX];
  snprintf(cur, sizeof cur, "%s", ckdir);
  int rc = 0;
  for (;;) {
    ps__ckpt_header h;
    if ((rc = manifest_header(cur, &h))) break;
    if (cnt && h.id != v[cnt - 1].base) {
      rc = ps__fail(PS_ERR_CORRUPT, "%s/MANIFEST: checkpoint %" PRIu64 ", where checkpoint %" PRIu64 " belongs", cur,
                    h.id, v[cnt - 1].base);
      break;
    }
    if (cnt == PS_CKPT_MAX_CHAIN) {
      rc = ps__fail(PS_ERR_CORRUPT, "%s: a chain of increments longer than %d", ckdir, PS_CKPT_MAX_CHAIN);
      break;
    }
    if (cnt == cap) {
      cap = cap ? 2 * cap : 8;
      ps__ckpt_link *nv = ps__realloc(v, cap * sizeof *nv);
      if (!nv) {
        rc = ps__fail(PS_ERR_NOMEM, "out of memory");
        break;
      }
      v = nv;
    }
    snprintf(v[cnt].dir, sizeof v[cnt].dir, "%s", cur);
    v[cnt].id = h.id;
    v[cnt].base = h.base;
    v[cnt].clock = h.clock;
    v[cnt].nservers = h.nservers;
    cnt++;
    if (!h.base) break;
    char next[PATH_MAX];
    ps__ckpt_dir_of(root, h.base, next, sizeof next);
    struct stat st;
    snprintf(cur, sizeof cur, "%s/MANIFEST", next);
    if (stat(cur, &st) != 0) {
      rc = ps__fail(PS_ERR_CORRUPT, "%s is an increment on checkpoint %" PRIu64 ", and %s is not a complete checkpoint",
                    v[cnt - 1].dir, h.base, next);
      break;
    }
    snprintf(cur, sizeof cur, "%s", next);
  }
  if (rc) {
    free(v);
    return rc;
  }
  for (size_t i = 0; i < cnt / 2; i++) { /* oldest first */
    ps__ckpt_link t = v[i];
    v[i] = v[cnt - 1 - i];
    v[cnt - 1 - i] = t;
  }
  *out = v;
  *n = cnt;
  return 0;
}
