/*
 * ckpt.c - a server's part of a checkpoint, and its restore (docs/checkpoint.md).
 *
 * Writing. The scheduler's CKPT request names the checkpoint, its directory and its
 * clock. Every table is cut by the shard engine (shard/snap.c): a sync table once its
 * rounds reach the clock, before the next round changes it; any other at once. A cut
 * copies nothing; once every table is cut, a writer thread sorts the rows by ring
 * position (sparse) or slice (dense), reads them through the cuts (a row written on the
 * loop before the writer read it was saved first), writes server-<rank>.psck through
 * store/ckpt.h (temporary name, fsync, rename, fsync of the directory) and posts its
 * result back to the loop, which answers the scheduler. Training goes on meanwhile.
 * One checkpoint at a time; a probe (id 0) is answered at once with the smallest clock
 * this server can still cut at.
 *
 * Increments. A request with track set makes every table keep the set of rows changed
 * since its cut; a request with base B, when this server's last checkpoint written with
 * tracking on was B, writes only those rows (the file's base is B); else the file is
 * whole (base 0), which a restore reads just as well.
 *
 * Restore. A server started with a restore directory reads the checkpoint's manifest
 * when it is created (the clock workers start at, the data files); when a table is
 * created, it reads every data file's blocks of that table and keeps the rows it owns
 * under the current ring, whatever the number of servers that wrote them.
 *
 * Replicas (R >= 2). A server writes the rows of the chains it heads (after a failover,
 * the dead server's ranges too), judged with the copy of the ring in k->rows, and a
 * restore keeps the rows of every chain the server is in (server/repl.c, ps__srv_rows).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PS__CKPT_WRITER_NICE 10

#include "common/common.h"
#include "server/server_int.h"
#include "store/ckpt.h"

/* ------------------------------------------------------------------ writing */

struct srv_ckpt {
  ps__server *s;
  ps__frame_hdr req;      /* the scheduler's request, for the reply */
  ps__ckpt_req q;
  ps__snap_table *t;      /* one per table being written */
  size_t nt, cap;
  size_t waiting;         /* tables not cut yet */
  uint32_t *wait_ids;     /* their ids */
  pthread_t thread;
  int thread_started;
  /* the writer thread's result */
  int rc;
  char msg[512];
  ps__ckpt_summary sum;
  uint64_t base;          /* the file is an increment on this checkpoint; 0: whole */
  ps__srv_rows rows;      /* the rows this server writes: of the chains it heads (R >= 2) */
  uint64_t t0_ms, cut_ms, sort_ms, rows_ms, sync_ms; /* where the time went */
  /* Progress: rows put in order, rows and bytes written so far (the writer adds, atomically);
   * the loop tells the scheduler when it grew (ps__srv_ckpt_tick). */
  uint64_t progress, progress_said, said_ms;
};

/* On the loop thread, with the writer thread gone: the tables forget their cuts. */
static void ckpt_free(srv_ckpt *k) {
  if (!k) return;
  for (size_t i = 0; i < k->nt; i++) ps__shard_snap_release(k->s->sh, &k->t[i]);
  free(k->t);
  free(k->wait_ids);
  ps__srv_rows_free(&k->rows);
  free(k);
}

/* Which rows of t this server writes: runs[] (dense, S of them) or the routes of
 * k->rows (sparse). Everything without replication. */
typedef struct row_filter {
  const ps__srv_rows *rows;
  uint8_t *runs;       /* dense; NULL: every slice */
  uint64_t nslices;
  size_t S;
} row_filter;

static int filter_open(row_filter *f, const ps__srv_rows *rows, uint32_t table, int dense, uint64_t nslices) {
  *f = (row_filter){.rows = rows, .nslices = nslices};
  if (!rows->ring || !dense) return 0;
  f->S = ps__ring_size(rows->ring);
  if (!(f->runs = ps__malloc(f->S))) return ps__fail(PS_ERR_NOMEM, "out of memory");
  return ps__srv_rows_dense(rows, table, f->runs);
}

static int filter_keeps(const row_filter *f, uint32_t table, int dense, uint64_t key) {
  if (!f->rows->ring) return 1;
  if (dense) return key < f->nslices && f->runs[ps__dense_run(key, f->nslices, f->S)];
  return ps__srv_rows_key(f->rows, table, key);
}

static void ckpt_reply_err(ps__server *s, const ps__frame_hdr *req, int err, const char *msg) {
  ps__conn *c = s->agent.conn;
  if (c) ps__conn_send_error(c, req, err, msg);
}

/* The order of the rows in a file: by ring position (sparse: the hash of table and key)
 * or by slice (dense), ties by key.
 *
 * A table's rows are put in that order a bucket at a time. A counting pass over the rows
 * counts them by the top bits of their positions (about 4 rows to a bucket, 2^22
 * buckets at most; sparse positions are hashes, so evenly), and a second pass scatters
 * an 8-byte entry per row into its bucket: its row number and the next 32 bits of its
 * position. The writer sorts each bucket on those entries when it reaches it; entries
 * whose 32 bits are equal are ordered on their whole positions and keys, looked up again.
 * Memory: 8 bytes a row and 4 a bucket beside the table (3.8 GB for 4.7 × 10^8 rows,
 * where a sorted array of (position, key, row) needed 24 bytes a row, twice over while
 * it was sorted). The rows themselves are read once, in the file's order, by the writer. */
typedef struct places {
  const ps__snap_table *t;
  uint64_t *progress; /* rows gone through, added to as the passes go */
  row_filter f;
  int whole, dense, shift;
  uint64_t *e;      /* entries, bucket by bucket: next 32 bits of the position << 32 | row */
  uint32_t *end;    /* end[b]: where bucket b ends in e */
  size_t nb, b;     /* buckets; the next one to sort */
  uint64_t n, at;   /* entries; the next one handed out */
  uint64_t lo, hi;  /* the current bucket, sorted: e[lo .. hi), e[at ..) still to hand out */
} places;

static uint64_t place_pos(const places *p, uint64_t key) {
  return p->dense ? key : ps__ring_key_hash(p->t->decl.id, key);
}

/* Is row i written (changed, for an increment; not another server's copy)? Its key and
 * position. */
static int place_of(const places *p, uint64_t i, uint64_t *key, uint64_t *pos) {
  const ps__snap_table *t = p->t;
  if (!p->whole && !ps__snap_dirty(t, i)) return 0;
  *key = ps__snap_key(t, i);
  if (!filter_keeps(&p->f, t->decl.id, p->dense, *key)) return 0;
  *pos = place_pos(p, *key);
  return 1;
}

static inline uint64_t place_frag(const places *p, uint64_t pos) {
  return (p->shift >= 32 ? pos >> (p->shift - 32) : pos << (32 - p->shift)) & 0xffffffffu;
}

static void places_free(places *p) {
  free(p->f.runs);
  free(p->e);
  free(p->end);
}

#define PLACE_BATCH 256 /* rows a pass of places_open looks at before it touches their buckets */

/* 0, or -1 (out of memory, or more rows than 32-bit row numbers hold). */
static int places_open(places *p, const ps__snap_table *t, int whole, const ps__srv_rows *rows, uint64_t *progress) {
  *p = (places){.t = t, .whole = whole, .dense = t->decl.kind == PS_DENSE, .progress = progress};
  uint64_t nslices = (t->decl.size + t->width - 1) / t->width;
  if (t->n > UINT32_MAX || filter_open(&p->f, rows, t->decl.id, p->dense, nslices)) return -1;
  int bits = p->dense ? 64 - __builtin_clzll(nslices | 1) : 64; /* a slice number, or a 64-bit hash */
  int want = t->n >= 8 ? 64 - __builtin_clzll(t->n / 4) : 1;
  if (want > 22) want = 22;
  if (want > bits) want = bits;
  p->shift = bits - want;
  p->nb = (size_t)1 << want;
  if (!(p->end = ps__calloc(p->nb + 1, sizeof *p->end))) return -1;
  /* Both passes go in batches: the positions of a batch first, then its buckets' counts
   * (prefetched), then its entries' slots (prefetched): the misses of a batch overlap. */
  uint32_t bk[PLACE_BATCH], dst[PLACE_BATCH];
  uint64_t ent[PLACE_BATCH], key, pos, m = 0;
  for (int pass = 0; pass < 2; pass++) {
    for (uint64_t i0 = 0; i0 < t->n; i0 += PLACE_BATCH) {
      uint32_t nb = 0;
      if (!(i0 & 0xffff)) __atomic_add_fetch(p->progress, i0 + 0x10000 < t->n ? 0x10000 : t->n - i0, __ATOMIC_RELAXED);
      for (uint64_t i = i0; i < t->n && i < i0 + PLACE_BATCH; i++) {
        if (!place_of(p, i, &key, &pos)) continue;
        bk[nb] = (uint32_t)(pos >> p->shift) + (pass == 0);
        ent[nb++] = place_frag(p, pos) << 32 | i;
        __builtin_prefetch(&p->end[bk[nb - 1]], 1);
      }
      if (pass == 0) {
        for (uint32_t j = 0; j < nb; j++) p->end[bk[j]]++;
        continue;
      }
      for (uint32_t j = 0; j < nb; j++) {
        dst[j] = p->end[bk[j]]++; /* end[b]: the end of b so far */
        if (dst[j] >= p->n) return -1; /* (never: a cut's rows stay; the file's writer checks the order) */
        __builtin_prefetch(&p->e[dst[j]], 1);
      }
      for (uint32_t j = 0; j < nb && m < p->n; j++) p->e[dst[j]] = ent[j], m++;
    }
    if (pass == 0) {
      for (size_t b = 0; b < p->nb; b++) p->end[b + 1] += p->end[b]; /* end[b]: start of b */
      p->n = p->end[p->nb];
      if (!(p->e = ps__malloc((p->n ? p->n : 1) * sizeof *p->e))) return -1;
    }
  }
  return m == p->n ? 0 : -1; /* (the rows of a cut do not change between the passes) */
}

static int u64_cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* Rows whose 32 bits of position are equal, ordered on their whole positions and keys. */
typedef struct tie {
  uint64_t pos, key, e;
} tie;

static int tie_cmp(const void *a, const void *b) {
  const tie *x = a, *y = b;
  if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
  return (x->key > y->key) - (x->key < y->key);
}

/* Sort e[0 .. n) into file order: on the entries (insertion sort when short), then any
 * run of equal 32 bits on positions and keys. 0 or -1 (out of memory). */
static int sort_bucket(const places *p, uint64_t *e, uint64_t n) {
  if (n > 32) qsort(e, n, sizeof *e, u64_cmp);
  else
    for (uint64_t i = 1; i < n; i++) {
      uint64_t x = e[i], j = i;
      for (; j > 0 && x < e[j - 1]; j--) e[j] = e[j - 1];
      e[j] = x;
    }
  for (uint64_t a = 0, b; a < n; a = b) {
    for (b = a + 1; b < n && e[b] >> 32 == e[a] >> 32;) b++;
    if (b - a < 2) continue;
    tie *v = ps__malloc((b - a) * sizeof *v);
    if (!v) return -1;
    for (uint64_t k = a; k < b; k++) {
      v[k - a].e = e[k];
      v[k - a].key = ps__snap_key(p->t, (uint32_t)e[k]);
      v[k - a].pos = place_pos(p, v[k - a].key);
    }
    qsort(v, b - a, sizeof *v, tie_cmp);
    for (uint64_t k = a; k < b; k++) e[k] = v[k - a].e;
    free(v);
  }
  return 0;
}

/* Up to want row numbers, in file order, into out; how many (0 at the end), or -1 (out
 * of memory). */
static int64_t places_next(places *p, uint32_t *out, uint64_t want) {
  uint64_t got = 0;
  while (got < want) {
    if (p->at == p->hi) {
      if (p->b == p->nb) break;
      p->lo = p->hi;
      p->hi = p->end[p->b++];
      if (sort_bucket(p, p->e + p->lo, p->hi - p->lo)) return -1;
      continue;
    }
    for (; p->at < p->hi && got < want; p->at++) out[got++] = (uint32_t)p->e[p->at];
  }
  return (int64_t)got;
}

#define READ_AHEAD 16 /* rows (and their state words) prefetched ahead of the one read */

/* Write the rows of t at the places p, in blocks; 0 or an error (with a message). */
static int write_table_rows(ps__ckpt_writer *w, ps__snap_table *t, places *p) {
  uint64_t rf = t->row_floats;
  uint64_t per = (PS_CKPT_MAX_BLOCK - 64) / (8 + 4 * rf);
  if (per > PS_CKPT_ROWS_PER_BLOCK) per = PS_CKPT_ROWS_PER_BLOCK;
  if (per == 0) return ps__fail(PS_ERR_INVALID, "rows of table '%s' are too large for a block", t->decl.name);
  uint64_t *keys = ps__malloc(per * sizeof *keys);
  float *rows = ps__malloc(per * rf * sizeof *rows);
  uint32_t *at = ps__malloc(per * sizeof *at);
  int rc = keys && rows && at ? 0 : ps__fail(PS_ERR_NOMEM, "out of memory writing table '%s'", t->decl.name);
  while (!rc) {
    int64_t got = places_next(p, at, per);
    if (got < 0) rc = ps__fail(PS_ERR_NOMEM, "out of memory sorting table '%s'", t->decl.name);
    if (got <= 0) break;
    uint32_t m = (uint32_t)got;
    for (uint32_t j = 0; j < m && j < READ_AHEAD; j++) ps__snap_prefetch(t, at[j]);
    for (uint32_t j = 0; j < m && !rc; j++) {
      if (j + READ_AHEAD < m) ps__snap_prefetch(t, at[j + READ_AHEAD]); /* its key and row */
      keys[j] = ps__snap_key(t, at[j]);
      if (ps__snap_read(t, at[j], rows + (size_t)j * rf))
        rc = ps__fail(PS_ERR_NOMEM, "table '%s': a row changed before it was saved (out of memory)", t->decl.name);
    }
    if (!rc)
      rc = ps__ckpt_write_rows(w, t->decl.id, (uint32_t)rf, keys, rows, m, place_pos(p, keys[0]),
                               place_pos(p, keys[m - 1]));
    __atomic_add_fetch(p->progress, m, __ATOMIC_RELAXED);
  }
  free(keys);
  free(rows);
  free(at);
  return rc;
}

/* One table: its TABLE block and its rows. */
static int write_table(srv_ckpt *k, ps__ckpt_writer *w, ps__snap_table *t) {
  places p;
  uint64_t t0 = ps__now_ms();
  if (places_open(&p, t, k->base == 0, &k->rows, &k->progress)) {
    places_free(&p);
    return ps__fail(PS_ERR_NOMEM, "out of memory sorting table '%s' (%llu rows)", t->decl.name,
                    (unsigned long long)t->n);
  }
  uint64_t t1 = ps__now_ms();
  ps__ckpt_table ct = {.decl = t->decl, .width = t->width, .row_floats = t->row_floats, .step = t->step,
                       .version = t->version, .nrows = p.n};
  int rc = ps__ckpt_write_table(w, &ct);
  if (!rc) rc = write_table_rows(w, t, &p);
  if (!rc && p.at != p.n)
    rc = ps__fail(PS_ERR_INVALID, "table '%s': %llu rows written of %llu", t->decl.name, (unsigned long long)p.at,
                  (unsigned long long)p.n);
  places_free(&p);
  k->sort_ms += t1 - t0;
  k->rows_ms += ps__now_ms() - t1;
  return rc;
}

static void *writer_main(void *arg) {
  srv_ckpt *k = arg;
  /* Below the loop thread: when the cores are busy, requests go first and the write
   * takes the time left (Linux nice values are per thread; the file's I/O thread,
   * started from this one, inherits it). */
  if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), PS__CKPT_WRITER_NICE) != 0)
    ps__log(PS_LOG_INFO, "checkpoint writer: cannot lower its priority: %s", strerror(errno));
  char path[PS_CKPT_DIR_MAX + 64];
  snprintf(path, sizeof path, "%s/server-%u.psck", k->q.dir, k->s->rank);
  ps__ckpt_header h = {.what = PS_CKPT_DATA, .id = k->q.id, .clock = k->q.clock, .rank = k->q.part,
                       .nservers = k->q.nservers, .base = k->base};
  ps__ckpt_writer *w = NULL;
  int rc = ps__ckpt_writer_open(&w, path, &h);
  ps__ckpt_writer_progress(w, &k->progress); /* (rows and bytes alike: any growth is progress) */
  for (size_t i = 0; !rc && i < k->nt; i++) rc = write_table(k, w, &k->t[i]);
  if (rc) snprintf(k->msg, sizeof k->msg, "%s", ps_errmsg());
  uint64_t t0 = ps__now_ms();
  int crc = ps__ckpt_writer_close(w, rc == 0, &k->sum);
  k->sync_ms = ps__now_ms() - t0;
  if (!rc && crc) {
    rc = crc;
    snprintf(k->msg, sizeof k->msg, "%s", ps_errmsg());
  }
  k->rc = rc;
  if (ps__mailbox_post(k->s->mail, ps__srv_ckpt_written, k)) k->rc = PS_ERR_CLOSED; /* the loop is gone */
  return NULL;
}

/* On the loop: the writer thread is done. */
void ps__srv_ckpt_written(void *arg) {
  srv_ckpt *k = arg;
  ps__server *s = k->s;
  pthread_join(k->thread, NULL);
  if (k->rc) {
    ps__log(PS_LOG_ERROR, "checkpoint %llu: %s", (unsigned long long)k->q.id, k->msg);
    ckpt_reply_err(s, &k->req, k->rc, k->msg);
    s->ckpt_last = 0; /* the rows changed since this cut are not on disk: the next one is whole */
  } else {
    s->ckpt_last = k->q.track ? k->q.id : 0;
    ps__ckpt_done d = {.rank = k->q.part, .bytes = k->sum.bytes, .checksum = k->sum.checksum, .rows = k->sum.rows,
                       .base = k->base};
    snprintf(d.name, sizeof d.name, "server-%u.psck", s->rank);
    ps__wbuf w;
    ps__wbuf_init(&w);
    ps__ckpt_done_encode(&w, &d);
    ps__frame_hdr r = {.type = PS_MSG_CKPT | PS_FRAME_REPLY, .req_id = k->req.req_id, .clock = k->q.clock,
                       .sender = s->id};
    if (s->agent.conn && !w.oom) ps__conn_send_ctrl(s->agent.conn, &r, w.data, w.len);
    ps__wbuf_free(&w);
    ps__log(PS_LOG_INFO,
            "checkpoint %llu: wrote %s/%s (%s%llu rows, %llu bytes) in %llu ms (cut %llu, sort %llu, rows %llu, "
            "fsync %llu)",
            (unsigned long long)k->q.id, k->q.dir, d.name, k->base ? "increment: " : "", (unsigned long long)d.rows,
            (unsigned long long)d.bytes, (unsigned long long)(ps__now_ms() - k->t0_ms),
            (unsigned long long)k->cut_ms, (unsigned long long)k->sort_ms, (unsigned long long)k->rows_ms,
            (unsigned long long)k->sync_ms);
  }
  if (s->ckpt == k) s->ckpt = NULL;
  ckpt_free(k);
}

/* Each heartbeat: while the writer gets on (rows put in order or written since the last
 * word), say so to the scheduler every PS__CKPT_PROGRESS_MS, so that a large file's
 * write is not taken for a hung server; a writer stuck in one place says nothing. */
#define PS__CKPT_PROGRESS_MS 1000
void ps__srv_ckpt_tick(ps__server *s) {
  srv_ckpt *k = s->ckpt;
  if (!k || !k->thread_started || !s->agent.conn) return;
  uint64_t now = ps__now_ms(), done = __atomic_load_n(&k->progress, __ATOMIC_RELAXED);
  if (done == k->progress_said || now - k->said_ms < PS__CKPT_PROGRESS_MS) return;
  k->progress_said = done;
  k->said_ms = now;
  ps__frame_hdr r = {.type = PS_MSG_CKPT | PS_FRAME_REPLY, .flags = PS_FLAG_PROGRESS, .req_id = k->req.req_id,
                     .clock = k->q.clock, .sender = s->id};
  ps__conn_send_ctrl(s->agent.conn, &r, NULL, 0);
}

static void start_writer(srv_ckpt *k) {
  k->said_ms = ps__now_ms();
  if (pthread_create(&k->thread, NULL, writer_main, k)) {
    ckpt_reply_err(k->s, &k->req, PS_ERR_NOMEM, "cannot start the checkpoint writer thread");
    k->s->ckpt = NULL;
    ckpt_free(k);
    return;
  }
  k->thread_started = 1;
}

/* The engine's cut hook: table t is at the checkpoint's clock now. */
void ps__srv_cut(void *arg, ps__table *t) {
  ps__server *s = arg;
  srv_ckpt *k = s->ckpt;
  if (!k || k->thread_started) return;
  size_t w = 0;
  for (; w < k->waiting && k->wait_ids[w] != t->id; w++) {}
  if (w == k->waiting) return; /* created after the request: not in this checkpoint */
  k->wait_ids[w] = k->wait_ids[--k->waiting];
  /* A dense table is written whole: every slice this server owns (heads), touched or not. */
  uint64_t lo = 0, hi = 0, nsl = (t->spec.size + t->spec.width - 1) / t->spec.width;
  row_filter f = {.rows = &k->rows};
  int dense = t->spec.kind == PS_DENSE;
  int oom = dense && (k->rows.ring ? filter_open(&f, &k->rows, t->id, 1, nsl) : ps__srv_dense_mine(s, t, &lo, &hi));
  if (dense && k->rows.ring) lo = 0, hi = nsl;
  for (uint64_t sl = lo; !oom && sl < hi; sl++)
    if (filter_keeps(&f, t->id, dense, sl)) oom = ps__shard_row(t, sl) == NULL;
  free(f.runs);
  uint64_t t0 = ps__now_ms();
  if (oom || ps__shard_snap(t, &k->t[k->nt], (int)k->q.track)) {
    ckpt_reply_err(s, &k->req, PS_ERR_NOMEM, ps_errmsg());
    for (size_t i = 0; i < s->sh->ntables; i++)
      if (s->sh->tables[i]) s->sh->tables[i]->cut_at = -1;
    s->ckpt = NULL;
    ckpt_free(k);
    return;
  }
  k->nt++;
  k->cut_ms += ps__now_ms() - t0;
  if (k->waiting == 0) start_writer(k);
}

/* The smallest clock every sync table of this server can still be cut at. */
static int64_t cut_floor(const ps__server *s) {
  int64_t c = 0;
  for (size_t i = 0; i < s->sh->ntables; i++) {
    const ps__table *t = s->sh->tables[i];
    if (t && ps__shard_table_clock(t) > c) c = ps__shard_table_clock(t);
  }
  return c;
}

void ps__srv_on_ckpt(ps__server *s, const ps__frame_hdr *h, const ps__body *b) {
  ps__ckpt_req q;
  if (ps__ckpt_req_decode(b->buf, b->len, &q)) {
    ckpt_reply_err(s, h, PS_ERR_PROTO, ps_errmsg());
    return;
  }
  if (q.id == 0) { /* a probe */
    ps__frame_hdr r = {.type = PS_MSG_CKPT | PS_FRAME_REPLY, .req_id = h->req_id, .clock = cut_floor(s),
                       .sender = s->id};
    if (s->agent.conn) ps__conn_send_ctrl(s->agent.conn, &r, NULL, 0);
    return;
  }
  if (s->ckpt) {
    ckpt_reply_err(s, h, PS_ERR_UNAVAILABLE, "a checkpoint is being written on this server");
    return;
  }
  srv_ckpt *k = ps__calloc(1, sizeof *k);
  size_t nt = 0;
  for (size_t i = 0; i < s->sh->ntables; i++) nt += s->sh->tables[i] != NULL;
  if (!k || !(k->t = ps__calloc(nt ? nt : 1, sizeof *k->t)) || !(k->wait_ids = ps__calloc(nt ? nt : 1, 4))) {
    ckpt_free(k);
    ckpt_reply_err(s, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  if (ps__srv_rows_init(s, &k->rows, 0)) {
    ckpt_free(k);
    ckpt_reply_err(s, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  k->s = s;
  k->req = *h;
  k->q = q;
  k->cap = nt;
  k->t0_ms = ps__now_ms();
  /* An increment needs the changed rows since its base: this server's sets start at
   * the cut of the last checkpoint it wrote with tracking on. Otherwise the file is whole. */
  k->base = q.base && q.base == s->ckpt_last ? q.base : 0;
  for (size_t i = 0; i < s->sh->ntables; i++) /* first check that no sync table is past the clock */
    if (s->sh->tables[i]) {
      ps__table *t = s->sh->tables[i];
      if (ps__shard_cut_too_late(t, q.clock)) {
        char msg[300];
        snprintf(msg, sizeof msg, "server %u: table '%s' is at clock %lld, past the checkpoint's clock %lld",
                 s->rank, t->decl.name, (long long)ps__shard_table_clock(t), (long long)q.clock);
        ckpt_free(k);
        ckpt_reply_err(s, h, PS_ERR_CLOCK, msg);
        return;
      }
      k->wait_ids[k->waiting++] = t->id;
    }
  s->ckpt = k;
  if (k->waiting == 0) {
    start_writer(k);
    return;
  }
  for (size_t i = 0; i < s->sh->ntables && s->ckpt == k && !k->thread_started; i++)
    if (s->sh->tables[i]) ps__shard_cut_at(s->sh, s->sh->tables[i], q.clock); /* may cut (and start) now */
}

/* The loop is going away: wait for a writer still running (its files stay consistent:
 * without a manifest the checkpoint does not count). */
void ps__srv_ckpt_stop(ps__server *s) {
  srv_ckpt *k = s->ckpt;
  s->ckpt = NULL;
  if (!k) return;
  if (k->thread_started) pthread_join(k->thread, NULL); /* its mail is dropped with the loop */
  ckpt_free(k);
}

/* ------------------------------------------------------------------ restore */

/* One checkpoint of the chain being restored: its directory and data files. */
typedef struct srv_link {
  char dir[PS_CKPT_DIR_MAX];
  uint64_t id;
  ps__ckpt_file *files;
  size_t nfiles;
} srv_link;

struct srv_restore {
  uint64_t id;        /* the checkpoint restored (the newest of the chain) */
  int64_t clock;
  uint32_t nservers;
  srv_link *links;    /* its chain, oldest (a whole checkpoint) first */
  size_t nlinks;
};

void ps__srv_restore_free(ps__server *s) {
  srv_restore *r = s->restore;
  if (!r) return;
  for (size_t i = 0; i < r->nlinks; i++) free(r->links[i].files);
  free(r->links);
  free(r);
  s->restore = NULL;
}

/* The data files of the checkpoint in l->dir, from its manifest. */
static int read_manifest(srv_link *l) {
  char path[PS_CKPT_DIR_MAX + 16];
  snprintf(path, sizeof path, "%s/MANIFEST", l->dir);
  ps__ckpt_reader *rd;
  ps__ckpt_header h;
  int rc = ps__ckpt_reader_open(&rd, path, &h);
  if (rc) return rc;
  if (h.what != PS_CKPT_MANIFEST) {
    ps__ckpt_reader_close(rd);
    return ps__fail(PS_ERR_CORRUPT, "%s is not a checkpoint manifest", path);
  }
  ps__ckpt_block b;
  while (!(rc = ps__ckpt_next(rd, &b, NULL, NULL)) && b.kind != PS_CKPT_B_END) {
    if (b.kind != PS_CKPT_B_FILE) continue;
    ps__ckpt_file *f = ps__realloc(l->files, (l->nfiles + 1) * sizeof *f);
    if (!f) {
      rc = ps__fail(PS_ERR_NOMEM, "out of memory reading %s", path);
      break;
    }
    l->files = f;
    l->files[l->nfiles++] = b.file;
  }
  ps__ckpt_reader_close(rd);
  return rc;
}

/* The checkpoint in dir and the chain it builds on. */
static int open_chain(srv_restore *r, const char *dir) {
  ps__ckpt_link *chain;
  size_t n;
  int rc = ps__ckpt_chain(dir, &chain, &n);
  if (rc) return rc;
  r->links = ps__calloc(n, sizeof *r->links);
  if (!r->links) rc = ps__fail(PS_ERR_NOMEM, "out of memory");
  for (size_t i = 0; !rc && i < n; i++) {
    srv_link *l = &r->links[r->nlinks++];
    snprintf(l->dir, sizeof l->dir, "%s", chain[i].dir);
    l->id = chain[i].id;
    rc = read_manifest(l);
  }
  if (!rc) {
    r->id = chain[n - 1].id;
    r->clock = chain[n - 1].clock;
    r->nservers = chain[n - 1].nservers;
  }
  free(chain);
  return rc;
}

int ps__srv_restore_open(ps__server *s, const char *dir) {
  srv_restore *r = ps__calloc(1, sizeof *r);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  struct stat st;
  char m[PS_CKPT_DIR_MAX + 16], newest[PS_CKPT_DIR_MAX];
  snprintf(m, sizeof m, "%s/MANIFEST", dir);
  int rc = 0;
  uint64_t id;
  if (stat(m, &st) == 0)
    snprintf(newest, sizeof newest, "%s", dir);
  else
    rc = ps__ckpt_latest(dir, &id, newest, sizeof newest);
  if (!rc) {
    s->restore = r;
    rc = open_chain(r, newest);
  }
  if (rc) {
    char msg[600];
    snprintf(msg, sizeof msg, "cannot restore from %s: %s", dir, ps_errmsg());
    s->restore = r;
    ps__srv_restore_free(s);
    return ps__fail(rc, "%s", msg);
  }
  s->sh->base_clock = r->clock > 0 ? r->clock : 0;
  size_t nfiles = 0;
  for (size_t i = 0; i < r->nlinks; i++) nfiles += r->links[i].nfiles;
  ps__log(PS_LOG_INFO, "restoring checkpoint %llu (clock %lld, %zu checkpoints in its chain, %zu files) from %s",
          (unsigned long long)r->id, (long long)r->clock, r->nlinks, nfiles, newest);
  return 0;
}

typedef struct load_arg {
  ps__server *s;
  ps__table *t;
  uint64_t lo, hi;     /* dense: the slices this server owns (R = 1) */
  row_filter f;        /* R >= 2: the rows of the chains this server is in */
  int found;
  uint64_t step, rows;
  int64_t version;
} load_arg;

static int want_table(void *arg, uint32_t table, uint64_t pos_lo, uint64_t pos_hi) {
  load_arg *a = arg;
  if (table != a->t->id) return 0;
  if (a->t->spec.kind == PS_DENSE && !a->f.rows->ring) return pos_hi >= a->lo && pos_lo < a->hi; /* slices */
  return 1;
}

static int owned(load_arg *a, uint64_t key) {
  if (a->f.rows->ring) return filter_keeps(&a->f, a->t->id, a->t->spec.kind == PS_DENSE, key);
  if (a->t->spec.kind == PS_DENSE) return key >= a->lo && key < a->hi;
  ps__ring *ring = a->s->ring;
  return !ring || ps__ring_size(ring) <= 1 || ps__ring_owner(ring, a->t->id, key) == a->s->id;
}

/* The checkpoint's declaration of t must give the same table. */
static int same_table(const ps__table *t, const ps__ckpt_table *ct, const char *file) {
  ps__table_spec spec;
  char err[256];
  if (ps__table_spec_parse(&spec, ct->decl.name, ct->decl.kind, ct->decl.size, ct->decl.options, err, sizeof err) ||
      strcmp(ct->decl.name, t->decl.name) || memcmp(&spec, &t->spec, sizeof spec) ||
      ct->row_floats != ps__spec_row_floats(&t->spec))
    return ps__fail(PS_ERR_CONFLICT, "table %u is '%s' (%s %llu '%s') in %s, but the job declares '%s' (%s %llu '%s')",
                    t->id, ct->decl.name, ct->decl.kind == PS_DENSE ? "dense" : "sparse",
                    (unsigned long long)ct->decl.size, ct->decl.options, file, t->decl.name,
                    t->spec.kind == PS_DENSE ? "dense" : "sparse", (unsigned long long)t->decl.size, t->decl.options);
  return 0;
}

static int load_file(load_arg *a, const char *path) {
  ps__ckpt_reader *rd;
  ps__ckpt_header h;
  int rc = ps__ckpt_reader_open(&rd, path, &h);
  if (rc) return rc;
  ps__ckpt_block b;
  int in_table = 0;
  while (!(rc = ps__ckpt_next(rd, &b, want_table, a)) && b.kind != PS_CKPT_B_END) {
    if (b.kind == PS_CKPT_B_TABLE) {
      in_table = b.table.decl.id == a->t->id;
      if (!in_table) continue;
      if ((rc = same_table(a->t, &b.table, path))) break;
      a->found = 1;
      if (b.table.step > a->step) a->step = b.table.step;
      if (b.table.version > a->version) a->version = b.table.version;
    } else if (b.kind == PS_CKPT_B_ROWS && in_table && b.n) {
      for (uint32_t i = 0; i < b.n && !rc; i++) {
        uint64_t key = ps__get_u64(b.keys + 8 * (size_t)i);
        if (!owned(a, key)) continue;
        if (ps__shard_import(a->t, key, b.rows + (size_t)i * b.row_floats))
          rc = ps__fail(PS_ERR_NOMEM, "out of memory restoring table '%s'", a->t->decl.name);
        a->rows++;
      }
    }
  }
  ps__ckpt_reader_close(rd);
  return rc;
}

int ps__srv_restore_table(ps__server *s, ps__table *t) {
  srv_restore *r = s->restore;
  if (!r) return 0;
  load_arg a = {.s = s, .t = t};
  ps__srv_rows rows;
  if (ps__srv_rows_init(s, &rows, 1)) return PS_ERR_NOMEM;
  int dense = t->spec.kind == PS_DENSE;
  if (filter_open(&a.f, &rows, t->id, dense, (t->spec.size + t->spec.width - 1) / t->spec.width) ||
      (dense && !rows.ring && ps__srv_dense_mine(s, t, &a.lo, &a.hi))) {
    free(a.f.runs);
    ps__srv_rows_free(&rows);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  uint64_t t0 = ps__now_ms();
  /* Oldest first: a later checkpoint's rows replace the earlier ones'. */
  for (size_t c = 0; c < r->nlinks; c++)
    for (size_t i = 0; i < r->links[c].nfiles; i++) {
      char path[PS_CKPT_DIR_MAX + 80];
      snprintf(path, sizeof path, "%s/%s", r->links[c].dir, r->links[c].files[i].name);
      int rc = load_file(&a, path);
      if (rc) {
        free(a.f.runs);
        ps__srv_rows_free(&rows);
        return rc;
      }
    }
  free(a.f.runs);
  ps__srv_rows_free(&rows);
  if (!a.found) {
    ps__log(PS_LOG_INFO, "table '%s' is not in checkpoint %llu: it starts afresh", t->decl.name,
            (unsigned long long)r->id);
    return 0;
  }
  t->step = a.step;
  if (ps__table_is_sync(t)) t->version = a.version;
  ps__log(PS_LOG_INFO, "table '%s': restored %llu rows (step %llu, version %lld) from checkpoint %llu in %llu ms",
          t->decl.name, (unsigned long long)a.rows, (unsigned long long)a.step, (long long)a.version,
          (unsigned long long)r->id, (unsigned long long)(ps__now_ms() - t0));
  return 0;
}
