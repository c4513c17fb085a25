/*
 * ckpt_read.c - the checkpoint reader (store/ckpt.h): every length bounded, every block
 * verified before use, errors sticky (ckpt.c's first comment has the design).
 */
#include "store/ckpt_int.h"

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
  if (format != PS_CKPT_FORMAT && format != 1)
    return rfail(r, PS_ERR_CORRUPT, "%s: format version %u, this build reads versions 1 and %d", w, format,
                 PS_CKPT_FORMAT);
  uint64_t want = format == 1 ? HEADER_LEN_V1 : HEADER_LEN;
  if (len != want)
    return rfail(r, PS_ERR_CORRUPT, "%s: %" PRIu64 " bytes, version %u has %" PRIu64, w, len, format, want);
  h->base = format == 1 ? 0 : ps__get_u64(p + 48);
  h->what = ps__get_u32(p + 8);
  h->rank = ps__get_u32(p + 12);
  h->nservers = ps__get_u32(p + 16);
  h->id = ps__get_u64(p + 24);
  h->clock = (int64_t)ps__get_u64(p + 32);
  h->created_ms = ps__get_u64(p + 40);
  if (h->what != PS_CKPT_DATA && h->what != PS_CKPT_MANIFEST)
    return rfail(r, PS_ERR_CORRUPT, "%s: unknown file type %u", w, h->what);
  if (ps__get_u32(p + 20) != 0) return rfail(r, PS_ERR_CORRUPT, "%s: reserved field not 0", w);
  if (h->base && h->base >= h->id)
    return rfail(r, PS_ERR_CORRUPT, "%s: an increment on checkpoint %" PRIu64 ", not older than itself (%" PRIu64 ")",
                 w, h->base, h->id);
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

