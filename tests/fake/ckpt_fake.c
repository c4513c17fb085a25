/*
 * ckpt_fake.c - a small stand-in for src/store/ckpt.c (the checkpoint format), built
 * only while that file is absent from the tree (CMakeLists.txt), so that the
 * scheduler's checkpoint code links and its unit tests run before the two are merged.
 *
 * It implements store/ckpt.h's block framing (magic, kind, length, payload, xxh64)
 * for the blocks the scheduler writes and reads (HEADER, TABLE, FILE, STATE, END) with
 * its own payload layout, and the directory helpers. It writes no fsync and no ROWS
 * blocks: it is not the product's format and is never built once ckpt.c exists.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/common.h"
#include "store/ckpt.h"

struct ps__ckpt_writer {
  FILE *f;
  char path[1200], tmp[1210];
  int err;
  uint32_t nblocks;
  uint64_t bytes;
};

struct ps__ckpt_reader {
  FILE *f;
  char path[1200];
  uint8_t *buf;
  uint32_t index;
};

static int put_block(ps__ckpt_writer *w, int kind, const ps__wbuf *b) {
  if (w->err) return w->err;
  uint8_t hd[16], tl[8];
  ps__put_u32(hd, PS_CKPT_BLOCK_MAGIC);
  ps__put_u16(hd + 4, (uint16_t)kind);
  ps__put_u16(hd + 6, 0);
  ps__put_u64(hd + 8, b->len);
  ps__put_u64(tl, XXH64(b->data, b->len, 0));
  if (b->oom || fwrite(hd, 1, 16, w->f) != 16 || (b->len && fwrite(b->data, 1, b->len, w->f) != b->len) ||
      fwrite(tl, 1, 8, w->f) != 8)
    w->err = ps__fail(PS_ERR_IO, "cannot write %s", w->tmp);
  w->nblocks++;
  w->bytes += 24 + b->len;
  return w->err;
}

int ps__ckpt_writer_open(ps__ckpt_writer **out, const char *path, const ps__ckpt_header *h) {
  ps__ckpt_writer *w = ps__calloc(1, sizeof *w);
  if (!w) return ps__fail(PS_ERR_NOMEM, "out of memory");
  snprintf(w->path, sizeof w->path, "%s", path);
  snprintf(w->tmp, sizeof w->tmp, "%s.tmp", path);
  w->f = fopen(w->tmp, "wb");
  if (!w->f) {
    int rc = ps__fail(PS_ERR_IO, "cannot create %s: %s", w->tmp, strerror(errno));
    free(w);
    return rc;
  }
  ps__wbuf b;
  ps__wbuf_init(&b);
  ps__wbuf_u32(&b, PS_CKPT_FILE_MAGIC);
  ps__wbuf_u32(&b, PS_CKPT_FORMAT);
  ps__wbuf_u32(&b, h->what);
  ps__wbuf_u64(&b, h->id);
  ps__wbuf_u64(&b, (uint64_t)h->clock);
  ps__wbuf_u32(&b, h->rank);
  ps__wbuf_u32(&b, h->nservers);
  ps__wbuf_u64(&b, h->created_ms);
  put_block(w, PS_CKPT_B_HEADER, &b);
  ps__wbuf_free(&b);
  *out = w;
  return w->err;
}

int ps__ckpt_write_table(ps__ckpt_writer *w, const ps__ckpt_table *t) {
  ps__wbuf b;
  ps__wbuf_init(&b);
  ps__declare_encode(&b, &t->decl);
  ps__wbuf_u32(&b, t->decl.id);
  ps__wbuf_u32(&b, t->row_floats);
  ps__wbuf_u64(&b, t->step);
  ps__wbuf_u64(&b, (uint64_t)t->version);
  ps__wbuf_u64(&b, t->nrows);
  int rc = put_block(w, PS_CKPT_B_TABLE, &b);
  ps__wbuf_free(&b);
  return rc;
}

int ps__ckpt_write_rows(ps__ckpt_writer *w, uint32_t table, uint32_t row_floats, const uint64_t *keys,
                        const float *rows, uint32_t n, uint64_t pos_lo, uint64_t pos_hi) {
  (void)table, (void)row_floats, (void)keys, (void)rows, (void)n, (void)pos_lo, (void)pos_hi;
  return w->err = ps__fail(PS_ERR_INTERNAL, "the stand-in checkpoint format writes no rows");
}

int ps__ckpt_write_file(ps__ckpt_writer *w, const ps__ckpt_file *f) {
  ps__wbuf b;
  ps__wbuf_init(&b);
  ps__wbuf_str(&b, f->name);
  ps__wbuf_u32(&b, f->rank);
  ps__wbuf_u64(&b, f->bytes);
  ps__wbuf_u64(&b, f->checksum);
  ps__wbuf_u64(&b, f->rows);
  int rc = put_block(w, PS_CKPT_B_FILE, &b);
  ps__wbuf_free(&b);
  return rc;
}

int ps__ckpt_write_state(ps__ckpt_writer *w, const void *state, size_t len) {
  ps__wbuf b;
  ps__wbuf_init(&b);
  ps__wbuf_bytes(&b, state, len);
  int rc = put_block(w, PS_CKPT_B_STATE, &b);
  ps__wbuf_free(&b);
  return rc;
}

int ps__ckpt_writer_close(ps__ckpt_writer *w, int commit, ps__ckpt_summary *sum) {
  if (!w) return 0;
  if (commit && !w->err) {
    ps__wbuf b;
    ps__wbuf_init(&b);
    ps__wbuf_u32(&b, w->nblocks);
    put_block(w, PS_CKPT_B_END, &b);
    ps__wbuf_free(&b);
  }
  if (fclose(w->f) != 0 && !w->err) w->err = ps__fail(PS_ERR_IO, "cannot write %s", w->tmp);
  int rc = w->err;
  if (commit && !rc && rename(w->tmp, w->path) != 0)
    rc = ps__fail(PS_ERR_IO, "cannot rename %s: %s", w->tmp, strerror(errno));
  if (!commit || rc) unlink(w->tmp);
  if (sum && !rc) sum->bytes = w->bytes, sum->checksum = 0, sum->rows = 0;
  free(w);
  return rc;
}

static int get_block(ps__ckpt_reader *r, int *kind, size_t *len) {
  uint8_t hd[16], tl[8];
  if (fread(hd, 1, 16, r->f) != 16) return ps__fail(PS_ERR_IO, "%s: truncated at block %u", r->path, r->index);
  uint64_t n = ps__get_u64(hd + 8);
  if (ps__get_u32(hd) != PS_CKPT_BLOCK_MAGIC || n > PS_CKPT_MAX_BLOCK)
    return ps__fail(PS_ERR_IO, "%s: bad block %u", r->path, r->index);
  free(r->buf);
  r->buf = malloc(n ? n : 1);
  if (!r->buf) return ps__fail(PS_ERR_NOMEM, "out of memory");
  if (fread(r->buf, 1, n, r->f) != n || fread(tl, 1, 8, r->f) != 8)
    return ps__fail(PS_ERR_IO, "%s: truncated at block %u", r->path, r->index);
  if (XXH64(r->buf, n, 0) != ps__get_u64(tl)) return ps__fail(PS_ERR_IO, "%s: block %u: bad checksum", r->path, r->index);
  *kind = ps__get_u16(hd + 4);
  *len = n;
  return 0;
}

int ps__ckpt_reader_open(ps__ckpt_reader **out, const char *path, ps__ckpt_header *h) {
  ps__ckpt_reader *r = ps__calloc(1, sizeof *r);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  snprintf(r->path, sizeof r->path, "%s", path);
  r->f = fopen(path, "rb");
  if (!r->f) {
    int rc = ps__fail(PS_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    free(r);
    return rc;
  }
  int kind = 0;
  size_t n = 0;
  int rc = get_block(r, &kind, &n);
  ps__rbuf b;
  ps__rbuf_init(&b, r->buf, rc ? 0 : n);
  uint32_t magic = ps__rbuf_u32(&b), fmt = ps__rbuf_u32(&b);
  h->what = ps__rbuf_u32(&b);
  h->id = ps__rbuf_u64(&b);
  h->clock = (int64_t)ps__rbuf_u64(&b);
  h->rank = ps__rbuf_u32(&b);
  h->nservers = ps__rbuf_u32(&b);
  h->created_ms = ps__rbuf_u64(&b);
  if (!rc && (kind != PS_CKPT_B_HEADER || b.err || magic != PS_CKPT_FILE_MAGIC || fmt != PS_CKPT_FORMAT))
    rc = ps__fail(PS_ERR_IO, "%s is not a checkpoint file", path);
  if (rc) {
    ps__ckpt_reader_close(r);
    return rc;
  }
  r->index = 1;
  *out = r;
  return 0;
}

int ps__ckpt_next(ps__ckpt_reader *r, ps__ckpt_block *o, ps__ckpt_want_fn want, void *arg) {
  (void)want, (void)arg;
  int kind = 0;
  size_t n = 0;
  int rc = get_block(r, &kind, &n);
  if (rc) return rc;
  memset(o, 0, sizeof *o);
  o->kind = kind;
  o->index = r->index++;
  ps__rbuf b;
  ps__rbuf_init(&b, r->buf, n);
  if (kind == PS_CKPT_B_TABLE) {
    /* The declaration, then a fixed tail. */
    size_t tail = 4 + 4 + 8 + 8 + 8;
    if (n < tail || ps__declare_decode(r->buf, n - tail, &o->table.decl))
      return ps__fail(PS_ERR_IO, "%s: block %u: bad table", r->path, o->index);
    b.off = n - tail;
    o->table.decl.id = ps__rbuf_u32(&b);
    o->table.row_floats = ps__rbuf_u32(&b);
    o->table.step = ps__rbuf_u64(&b);
    o->table.version = (int64_t)ps__rbuf_u64(&b);
    o->table.nrows = ps__rbuf_u64(&b);
  } else if (kind == PS_CKPT_B_FILE) {
    ps__rbuf_str(&b, o->file.name, sizeof o->file.name);
    o->file.rank = ps__rbuf_u32(&b);
    o->file.bytes = ps__rbuf_u64(&b);
    o->file.checksum = ps__rbuf_u64(&b);
    o->file.rows = ps__rbuf_u64(&b);
  } else if (kind == PS_CKPT_B_STATE) {
    o->state = r->buf;
    o->state_len = n;
  } else if (kind == PS_CKPT_B_END) {
    if (ps__rbuf_u32(&b) != o->index) return ps__fail(PS_ERR_IO, "%s: bad end block", r->path);
  } else {
    return ps__fail(PS_ERR_IO, "%s: block %u: kind %d not read by the stand-in", r->path, o->index, kind);
  }
  if (b.err) return ps__fail(PS_ERR_IO, "%s: block %u is malformed", r->path, o->index);
  return 0;
}

void ps__ckpt_reader_close(ps__ckpt_reader *r) {
  if (!r) return;
  if (r->f) fclose(r->f);
  free(r->buf);
  free(r);
}

void ps__ckpt_dir_of(const char *dir, uint64_t id, char *path, size_t cap) {
  snprintf(path, cap, "%s/ckpt-%llu", dir, (unsigned long long)id);
}

static int complete(const char *dir, uint64_t id) {
  char p[1200];
  snprintf(p, sizeof p, "%s/ckpt-%llu/MANIFEST", dir, (unsigned long long)id);
  return access(p, F_OK) == 0;
}

int ps__ckpt_latest(const char *dir, uint64_t *id, char *path, size_t cap) {
  DIR *d = opendir(dir);
  if (!d) return ps__fail(PS_ERR_IO, "cannot read %s: %s", dir, strerror(errno));
  uint64_t best = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    uint64_t v;
    if (!strncmp(e->d_name, "ckpt-", 5) && !ps__parse_u64(e->d_name + 5, &v) && v > best && complete(dir, v)) best = v;
  }
  closedir(d);
  if (!best) return ps__fail(PS_ERR_IO, "%s holds no complete checkpoint", dir);
  *id = best;
  ps__ckpt_dir_of(dir, best, path, cap);
  return 0;
}

static void remove_ckpt(const char *dir, uint64_t id) {
  char p[1200], f[1500];
  ps__ckpt_dir_of(dir, id, p, sizeof p);
  DIR *d = opendir(p);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(f, sizeof f, "%s/%s", p, e->d_name);
    unlink(f);
  }
  closedir(d);
  rmdir(p);
}

int ps__ckpt_prune(const char *dir, unsigned keep) {
  uint64_t ids[4096];
  size_t n = 0;
  DIR *d = opendir(dir);
  if (!d) return ps__fail(PS_ERR_IO, "cannot read %s: %s", dir, strerror(errno));
  struct dirent *e;
  uint64_t newest = 0;
  while ((e = readdir(d)) && n < 4096) {
    uint64_t v;
    if (strncmp(e->d_name, "ckpt-", 5) || ps__parse_u64(e->d_name + 5, &v)) continue;
    ids[n++] = v;
    if (complete(dir, v) && v > newest) newest = v;
  }
  closedir(d);
  for (size_t i = 0; i < n; i++) {
    unsigned newer = 0;
    for (size_t j = 0; j < n; j++) newer += ids[j] > ids[i] && complete(dir, ids[j]);
    if (complete(dir, ids[i]) ? newer >= keep : ids[i] < newest) remove_ckpt(dir, ids[i]);
  }
  return 0;
}
