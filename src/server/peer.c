/*
 * peer.c - the large-request path: dense values that stay in the worker's memory.
 *
 * A same-host worker may send, instead of a dense push's values or a pull's reply
 * space, the addresses of its buffers (PS_XPORT_PEER_MEM, protocol.md 6.2a). The server
 * reads a push's gradients from them and writes a pull's values into them: with
 * process_vm_readv/writev (net/peermem.c), with memcpy for a worker in this very
 * process, or in place where they lie in a buffer the worker shares with the servers
 * of its host (ps_alloc, net/shared.c). A large push to a sync table is added into its
 * round as it is read; a sync round whose pulls wait in peer memory is applied slice by
 * slice into them (the engine's round hooks). Copies of 4 MiB or more run on the loop
 * thread and the helper thread, half each. Under replicas an async push is read into
 * a shared buffer in the shape of its forward, which the next copy reads in place.
 */
#include <string.h>

#include "common/common.h"
#include "server/server_int.h"

/* The values of a peer-memory request on c (the tail after its keys) as a value
 * transport (net/xport.h): 0, or -1 when its regions are malformed (answered). */
static int vx_of(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const void *body, size_t blen, int write,
                 ps__vx *x) {
  size_t kbytes = 8u * (size_t)h->nkeys;
  if (ps__vx_open(x, &s->shm, c, s->pid, write, (const uint8_t *)body + kbytes, blen - kbytes) == 0) return 0;
  ps__srv_reply_err(c, h, PS_ERR_PROTO, "%s", ps_errmsg());
  return -1;
}

/* A peer-memory copy of PM_PAR_MIN bytes or more runs on the server's two threads,
 * half each: one core copies at about 3.5 GB/s here, and a socket would have split the
 * work between the worker's core and the server's. Not below 4 MiB: the 2 MiB parts of
 * a 1M-float sync round with K = S = 2 come from every worker at once, the cores are
 * busy anyway, and splitting them made the round about 10% slower (median of 8
 * alternating runs: 2.25 -> 2.05 ms with server processes, 1.95 -> 1.75 colocated). */
#define PM_PAR_MIN ((size_t)4 << 20)

typedef struct pm_par_job {
  int write;
  const uv_buf_t *loc;
  unsigned nloc;
  const ps__vx *x;
  size_t split; /* part 0 copies bytes [0, split), part 1 the rest */
  int rc[2];
  char msg[2][256];
} pm_par_job;

static void pm_par_part(void *arg, unsigned part) {
  pm_par_job *j = arg;
  uv_buf_t one[1], *sub = j->nloc > 1 ? ps__malloc(j->nloc * sizeof *sub) : one;
  if (!sub) {
    j->rc[part] = PS_ERR_NOMEM;
    snprintf(j->msg[part], sizeof j->msg[part], "out of memory");
    return;
  }
  unsigned n = 0;
  size_t at = 0; /* bytes before loc[i] */
  for (unsigned i = 0; i < j->nloc; at += j->loc[i].len, i++) {
    size_t a = at, b = at + j->loc[i].len; /* this region's bytes, cut to the part's range */
    size_t lo = part ? j->split : 0, hi = part ? SIZE_MAX : j->split;
    if (a < lo) a = lo;
    if (b > hi) b = hi;
    if (a >= b) continue;
    sub[n] = uv_buf_init(j->loc[i].base + (a - at), 0);
    sub[n++].len = b - a;
  }
  j->rc[part] = j->x->ops->copy(j->x, j->write, sub, n, part ? j->split : 0);
  if (j->rc[part]) snprintf(j->msg[part], sizeof j->msg[part], "%s", ps_errmsg());
  if (sub != one) free(sub);
}

static int pm_copy_par(ps__server *s, const ps__vx *x, int write, const uv_buf_t *loc, unsigned nloc) {
  size_t total = 0;
  for (unsigned i = 0; i < nloc; i++) total += loc[i].len;
  ps__par *par = total >= PM_PAR_MIN ? ps__srv_par(s, UINT32_MAX) : NULL;
  if (!par) return x->ops->copy(x, write, loc, nloc, 0);
  pm_par_job j = {.write = write, .loc = loc, .nloc = nloc, .x = x, .split = (total / 2) & ~(size_t)4095};
  ps__par_run(par, pm_par_part, &j);
  for (unsigned k = 0; k < 2; k++)
    if (j.rc[k]) return ps__fail(j.rc[k], "%s", j.msg[k]);
  return 0;
}


int ps__srv_write_rows_to_peer(ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, size_t blen,
                               const uv_buf_t *v, unsigned n, ps__frame_hdr *r) {
  ps__server *s = c->loop->data;
  ps__vx x;
  if (h->xport != PS_XPORT_PEER_MEM || !c->peer_pid) return 0;
  if (vx_of(s, c, h, keys, blen, 1, &x)) return 1;
  int rc = pm_copy_par(s, &x, 1, v, n);
  uint64_t moved = x.total;
  ps__vx_close(&x);
  if (rc == PS_ERR_UNAVAILABLE) {
    ps__log(PS_LOG_WARN, "%s; answering with the values instead", ps_errmsg());
    return 0;
  }
  if (rc == PS_ERR_TIMEOUT) return 0; /* expired (a pull of a replicated table waits long): inline */
  if (rc) {
    ps__srv_reply_err(c, h, rc, "%s", ps_errmsg());
    return 1;
  }
  r->xport = PS_XPORT_PEER_MEM;
  ps__conn_send_ctrl(c, r, NULL, 0);
  ps__srv_metrics_mem(s, c, h->table, 1, moved);
  s->pm_pulls++;
  return 1;
}


/* ---- a sync round applied slice by slice into its waiting peer-memory pulls
 *
 * When a round of a dense table completes, the pulls parked for it would otherwise read
 * every parameter back from memory once per worker after the update wrote it. Instead
 * each slice is updated and at once written into every such pull's buffers while it is
 * in cache (one pass over the parameters instead of K + 1). The values are the same. */

/* Take the parked peer-memory pulls of table t that this round makes ready. */
static pending_pull *take_fusable_pulls(ps__server *s, ps__table *t) {
  pending_pull *head = NULL, **tail = &head, **pp = &s->pulls;
  if (t->spec.kind != PS_DENSE) return NULL;
  while (*pp) {
    pending_pull *p = *pp;
    if (p->h.xport == PS_XPORT_PEER_MEM && p->conn->peer_pid && ps__shard_table(s->sh, p->h.table) == t &&
        p->h.clock / (int64_t)t->spec.every == t->version + 1) {
      *pp = p->next;
      p->next = NULL;
      size_t kbytes = 8u * (size_t)p->h.nkeys;
      p->fused_err = ps__vx_open(&p->fused, &s->shm, p->conn, s->pid, 1, (const uint8_t *)p->buf + kbytes,
                                 p->len - kbytes);
      if (p->fused_err) snprintf(p->fused_msg, sizeof p->fused_msg, "%s", ps_errmsg());
      *tail = p;
      tail = &p->next;
    } else {
      pp = &p->next;
    }
  }
  return head;
}

/* Does pull p ask for part of slice sl? */
static int pull_covers(const ps__table *t, const pending_pull *p, uint64_t sl) {
  uint64_t width = t->spec.width, lo = sl * width, hi = lo + width;
  const uint8_t *keys = p->buf;
  for (uint32_t i = 0; i + 1 < p->h.nkeys; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * (size_t)i), cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
    if (off < hi && off + cnt > lo) return 1;
  }
  return 0;
}

/* Write the part of slice sl (parameters w) that pull p asked for into its buffers. */
static void fused_write(ps__table *t, pending_pull *p, uint64_t sl, const float *w) {
  uint64_t width = t->spec.width, lo = sl * width, hi = lo + width, pos = 0;
  const uint8_t *keys = p->buf;
  for (uint32_t i = 0; i + 1 < p->h.nkeys && !p->fused_err; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * (size_t)i), cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
    uint64_t a = off > lo ? off : lo, b = off + cnt < hi ? off + cnt : hi;
    if (a < b) {
      uv_buf_t l = uv_buf_init((char *)(w + (a - lo)), 0);
      l.len = (size_t)(b - a) * 4;
      int rc = p->fused.ops->copy(&p->fused, 1, &l, 1, (pos + a - off) * 4);
      if (rc) {
        p->fused_err = rc;
        snprintf(p->fused_msg, sizeof p->fused_msg, "%s", ps_errmsg());
      }
    }
    pos += cnt;
  }
}

/* Apply round r of table t, writing each updated slice into the pulls f at once.
 * 0, or -1 if nothing was done (out of memory: the caller applies it the usual way). */
static int apply_round_fused(ps__table *t, ps__round *r, pending_pull *f) {
  uint64_t width = t->spec.width, nsl = (t->spec.size + width - 1) / width, lo = UINT64_MAX, hi = 0;
  for (pending_pull *p = f; p; p = p->next) {
    const uint8_t *keys = p->buf;
    for (uint32_t i = 0; i + 1 < p->h.nkeys; i += 2) {
      uint64_t off = ps__get_u64(keys + 8 * (size_t)i), cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
      if (off / width < lo) lo = off / width;
      if ((off + cnt - 1) / width > hi) hi = (off + cnt - 1) / width;
    }
  }
  uint8_t *done = ps__calloc(nsl ? nsl : 1, 1);
  if (!done || lo > hi) {
    free(done);
    return -1;
  }
  double denom;
  uint64_t step;
  float lr;
  size_t n = ps__shard_round_begin(t, r, &lr, &step, &denom) ? ps__rowmap_count(r->acc) : 0;
  int oom = 0;
  for (uint64_t sl = lo; sl <= hi && !oom; sl++) {
    int covered = 0; /* the range may span other servers' slices */
    for (pending_pull *p = f; p && !covered; p = p->next) covered = pull_covers(t, p, sl);
    if (!covered) continue;
    float *g = n ? ps__rowmap_get(r->acc, sl) : NULL;
    if (g && ps__shard_apply_row(t, sl, g, denom, lr, step)) oom = 1;
    done[sl] = 1;
    const float *w = oom ? NULL : ps__shard_row(t, sl);
    if (!w) oom = 1;
    for (pending_pull *p = f; p && !oom; p = p->next)
      if (!p->fused_err && pull_covers(t, p, sl)) fused_write(t, p, sl, w);
  }
  for (size_t i = 0; i < n && !oom; i++) { /* slices no pull asked for */
    uint64_t key = ps__rowmap_key_at(r->acc, i);
    if (key < nsl && done[key]) continue;
    if (ps__shard_apply_row(t, key, ps__rowmap_row_at(r->acc, i), denom, lr, step)) oom = 1;
  }
  if (n && !oom) t->applied++;
  for (pending_pull *p = f; p && oom; p = p->next)
    if (!p->fused_err) {
      p->fused_err = PS_ERR_NOMEM;
      snprintf(p->fused_msg, sizeof p->fused_msg, "server out of memory");
    }
  free(done);
  return 0;
}

/* Answer the pulls of a fused round (the table's version counts the round now). */
static void answer_fused_pulls(ps__server *s, ps__table *t, pending_pull *f) {
  while (f) {
    pending_pull *p = f;
    f = p->next;
    uint64_t moved = p->fused.total;
    ps__vx_close(&p->fused);
    if (p->fused_err == PS_ERR_UNAVAILABLE || p->fused_err == PS_ERR_TIMEOUT) {
      /* not fused, not permitted after all, or expired: inline */
      ps__srv_answer_pull(s, p->conn, &p->h, p->buf, p->len);
    } else if (p->fused_err) {
      ps__srv_reply_err(p->conn, &p->h, p->fused_err, "%s", p->fused_msg);
    } else {
      ps__frame_hdr r = ps__srv_pull_reply_hdr(s, t, &p->h);
      r.xport = PS_XPORT_PEER_MEM;
      ps__conn_send_ctrl(p->conn, &r, NULL, 0);
      ps__srv_metrics_mem(s, p->conn, p->h.table, 1, moved);
      t->pulls++;
      s->pm_pulls++;
      s->fused_pulls++;
    }
    ps__pool_put(s->pool, p->buf, p->len);
    free(p);
  }
}


/* A streamed peer-memory push: a sync round's accumulator rows are filled from the
 * worker's buffers directly (the round's first gradient for a slice) or through a
 * cache-sized staging buffer (the others), without a copy of the whole push. */
#define PM_STREAM_MIN ((uint64_t)1 << 20)
#define PM_CHUNK ((size_t)32 << 10)

typedef struct pm_acc_arg {
  ps__server *s;
  ps__rowmap *acc;
  float weight;
  unsigned width;
  const ps__vx *x;
} pm_acc_arg;

static int pm_read(pm_acc_arg *a, float *dst, uint64_t n, uint64_t pos) {
  uv_buf_t l = uv_buf_init((char *)dst, 0);
  l.len = (size_t)n * 4;
  return a->x->ops->copy(a->x, 0, &l, 1, pos * 4);
}

/* A created accumulator row: zero but for [within, within + n), which the caller fills. */
static void acc_row_fresh(float *row, size_t row_floats, uint64_t within, uint64_t n) {
  memset(row, 0, within * 4);
  memset(row + within + n, 0, (row_floats - within - n) * 4);
}

static int pm_acc_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  pm_acc_arg *a = arg;
  int created, rc;
  float *row = ps__rowmap_upsert_uninit(a->acc, slice, &created);
  if (!row) return PS_ERR_NOMEM;
  if (created) {
    acc_row_fresh(row, a->width, within, n);
    if ((rc = pm_read(a, row + within, n, pos))) {
      memset(row + within, 0, n * 4);
      return rc;
    }
    if (a->weight != 1.0f) ps__vscale(row + within, a->weight, n);
    return 0;
  }
  /* where the values can be read in place (a colocated worker's, a shared buffer's),
   * they are added from there: no staging copy */
  if ((rc = a->x->ops->axpy(a->x, row + within, a->weight, n, pos)) != PS_ERR_UNAVAILABLE) return rc;
  for (uint64_t k = 0; k < n; k += PM_CHUNK) {
    uint64_t m = n - k < PM_CHUNK ? n - k : PM_CHUNK;
    if ((rc = pm_read(a, a->s->pm_chunk, m, pos + k))) return rc;
    ps__axpy(row + within + k, a->weight, a->s->pm_chunk, m);
  }
  return 0;
}

/* A large peer-memory push to a sync dense table. 0 if handled (answered), 1 if it
 * must be staged instead. The worker's regions are checked against its mappings first,
 * so a bad address fails before any value is added (process_vm_readv would stop part
 * way); only a mapping removed while the push runs (the worker freeing a buffer it
 * is pushing from) can then leave part of it in the round, which is logged. */
static int push_peer_streamed(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys,
                              const ps__vx *x) {
  uint64_t total = x->total;
  ps__table *t = ps__shard_table(s->sh, h->table);
  if (!t || t->spec.kind != PS_DENSE || !ps__table_is_sync(t) || total < PM_STREAM_MIN) return 1;
  /* Under replicas a sync push goes through the round's replication (repl_sync.c). */
  if (s->replicas > 1) return 1;
  /* Streamed values are added as they are read: only a table that takes any value
   * (nonfinite=allow) can skip the finite check of the staged path. */
  if (t->spec.nonfinite != PS__NONFINITE_ALLOW) return 1;
  /* Close to its expiry a streamed push could expire part way: the staged path then
   * fails whole instead. */
  if (x->until && ps__now_ms() + 1000 >= x->until) return 1;
  if (!s->pm_chunk && !(s->pm_chunk = ps__malloc(PM_CHUNK * 4))) return 1;
  int rc = x->ops->check(x, 0);
  if (rc == PS_ERR_IO) {
    ps__srv_reply_err(c, h, rc, "%s", ps_errmsg());
    return 0;
  }
  if (rc) return 1;
  ps__push p = ps__srv_push_of(h, keys, total / 4);
  p.vals = NULL; /* read from the worker's memory as it goes */
  if (!(t = ps__srv_table_of(s, c, h, PS_DENSE)) || ps__srv_push_shape(s, c, h, t, &p, 1)) return 0;
  ps__verdict v;
  ps__rowmap *acc = ps__shard_push_acc(s->sh, &p, &v);
  if (!acc) {
    if (v.dup)
      ps__srv_reply_ok(c, h, 0); /* applied before: a re-sent push */
    else
      ps__srv_reply_verdict(c, h, &v);
    return 0;
  }
  pm_acc_arg a = {s, acc, t->spec.update == PS__UPDATE_MEAN ? (float)h->batch : 1.0f, t->spec.width, x};
  if ((rc = ps__walk_slices(keys, h->nkeys, t->spec.width, pm_acc_slice, &a))) {
    if (rc != PS_ERR_NOMEM)
      ps__log(PS_LOG_ERROR, "a push of worker %u to table '%s' failed part way (%s): round %lld may hold part of it",
              h->sender, t->decl.name, ps_errmsg(), (long long)(h->clock / (int64_t)t->spec.every));
    ps__srv_reply_err(c, h, rc, "%s", rc == PS_ERR_NOMEM ? "server out of memory" : ps_errmsg());
    return 0;
  }
  t->pushes++;
  ps__shard_push_done(s->sh, &p);
  ps__srv_metrics_mem(s, c, h->table, 0, total);
  ps__srv_reply_ok(c, h, 0);
  return 0;
}

/* A peer-memory dense push: fetch the values from the worker's buffers into a body of
 * the usual form (segments, then values), then serve it as any push. Nothing is
 * applied unless every value was read. */
void ps__srv_on_push_peer(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  size_t kbytes = 8u * (size_t)h->nkeys;
  s->pm_pushes++; /* served, or answered with an error */
  if (!c->peer_pid || !ps__pm_usable()) {
    ps__srv_reply_err(c, h, PS_ERR_PROTO, "this server does not take peer-memory pushes on this connection (%s)",
              c->peer_pid ? "peer memory is not usable here" : "not a same-host AF_UNIX socket");
    return;
  }
  ps__vx x;
  if (vx_of(s, c, h, b->buf, b->len, 0, &x)) return;
  uint64_t total = x.total;
  if (total > c->max_payload - kbytes) {
    ps__vx_close(&x);
    ps__srv_reply_err(c, h, PS_ERR_TOO_LARGE, "a peer-memory push of %llu bytes exceeds the frame limit",
              (unsigned long long)total);
    return;
  }
  if (total % 4) {
    ps__vx_close(&x);
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "a peer-memory push of %llu bytes is not whole floats", (unsigned long long)total);
    return;
  }
  if (!push_peer_streamed(s, c, h, b->buf, &x)) {
    ps__vx_close(&x);
    return;
  }
  ps__table *t = ps__shard_table(s->sh, h->table);
  /* Under replicas, a sync push that names the copy its worker keeps (PS_FLAG_KEPT, one
   * region of a shared buffer, mapped here): added to the round from there. That copy
   * does not change before the round is on every copy (client/keep.c); a worker that
   * wrote into it meanwhile would only garble its own push. */
  if ((h->flags & PS_FLAG_KEPT) && s->replicas > 1 && t && ps__table_is_sync(t) && x.ops == &ps__vx_shared_ops &&
      x.nd == 1 && ps__get_u64(x.d) % 4 == 0) {
    const float *at = (const float *)(uintptr_t)ps__get_u64(x.d);
    int expired = x.until && ps__now_ms() >= x.until;
    ps__vx_close(&x);
    if (expired) {
      ps__srv_reply_err(c, h, PS_ERR_TIMEOUT, "peer-memory push of process %d expired", c->peer_pid);
      return;
    }
    ps__srv_metrics_mem(s, c, h->table, 0, total);
    ps__push p = ps__srv_push_of(h, b->buf, total / 4);
    p.vals = at;
    ps__owned none = {NULL, 0};
    ps__srv_push(s, c, h, &p, &none, 1);
    s->kept_in_place++;
    return;
  }
  /* Under replicas, an async table's push is read into a shared buffer in the shape of
   * its forward (prefix, segments, values): the next copy, on this host, applies the
   * values where they lie there (repl.c) instead of reading the worker's memory again. */
  size_t pre = s->replicas > 1 && t && t->spec.kind == PS_DENSE && !ps__table_is_sync(t) && !ps__table_aggregates(t)
                   ? PS_FWD_PREFIX
                   : 0;
  size_t len = pre + kbytes + (size_t)total;
  uint8_t *buf = pre ? ps__srv_fwd_buf_shared(s, len) : NULL;
  if (!buf) {
    pre = 0;
    len = kbytes + (size_t)total;
    buf = ps__pool_get(c->pool, len);
  }
  if (!buf) {
    ps__vx_close(&x);
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory for a %zu-byte push", len);
    return;
  }
  memcpy(buf + pre, b->buf, kbytes);
  uv_buf_t dst = uv_buf_init((char *)buf + pre + kbytes, 0);
  dst.len = (size_t)total;
  int rc = pm_copy_par(s, &x, 0, &dst, 1);
  ps__vx_close(&x);
  if (rc) {
    ps__srv_fwd_buf_put(s, buf, len);
    ps__srv_reply_err(c, h, rc, "%s", ps_errmsg());
    return;
  }
  ps__srv_metrics_mem(s, c, h->table, 0, total); /* read, whatever the engine makes of it */
  ps__push p = ps__srv_push_of(h, buf + pre, total / 4);
  ps__owned body = {buf, len};
  s->pm_body = pre ? buf : NULL; /* the forward to the next copy names its values (repl.c) */
  ps__srv_push(s, c, h, &p, &body, 1);
  s->pm_body = NULL;
  if (body.buf) ps__srv_fwd_buf_put(s, buf, len); /* not taken by the engine */
}

int ps__srv_peer_values(ps__server *s, ps__conn *c, uint32_t table, const void *body, size_t blen, size_t pre,
                        const void **in_place, uint64_t *in_len, void **out, size_t *olen) {
  if (pre > blen) return ps__fail(PS_ERR_SIZE, "peer-memory frame of %zu bytes", blen);
  if (!c->is_unix || c->peer_pid <= 0 || !ps__pm_usable())
    return ps__fail(PS_ERR_UNAVAILABLE, "server %u cannot read its sender's memory", s->id);
  ps__vx x;
  if (ps__vx_open(&x, &s->shm, c, s->pid, 0, (const uint8_t *)body + pre, blen - pre))
    return ps__fail(PS_ERR_PROTO, "%s", ps_errmsg());
  uint64_t total = x.total;
  if (total % 4 || pre + total > s->o.max_payload) {
    ps__vx_close(&x);
    return ps__fail(PS_ERR_SIZE, "a peer-memory frame of %llu bytes of values", (unsigned long long)total);
  }
  if (in_place && x.ops == &ps__vx_shared_ops && x.nd == 1 && ps__get_u64(x.d) % 4 == 0) {
    /* one region of a shared buffer, mapped here, of whole floats: read where it is */
    const void *at = (const void *)(uintptr_t)ps__get_u64(x.d);
    int expired = x.until && ps__now_ms() >= x.until;
    ps__vx_close(&x);
    if (expired) return ps__fail(PS_ERR_TIMEOUT, "peer-memory frame of process %d expired", c->peer_pid);
    *in_place = at;
    *in_len = total;
    *out = NULL;
    *olen = 0;
    ps__srv_metrics_mem(s, c, table, 0, total);
    return 0;
  }
  size_t len = pre + (size_t)total;
  uint8_t *buf = ps__pool_get(s->pool, len);
  if (!buf) {
    ps__vx_close(&x);
    return ps__fail(PS_ERR_NOMEM, "server out of memory for a %zu-byte frame", len);
  }
  memcpy(buf, body, pre);
  uv_buf_t dst = uv_buf_init((char *)buf + pre, 0);
  dst.len = (size_t)total;
  int rc = pm_copy_par(s, &x, 0, &dst, 1);
  ps__vx_close(&x);
  if (rc) {
    ps__pool_put(s->pool, buf, len);
    return ps__fail(rc == PS_ERR_TIMEOUT ? rc : PS_ERR_UNAVAILABLE,
                    "server %u could not read the memory of process %d: %s", s->id, c->peer_pid, ps_errmsg());
  }
  ps__srv_metrics_mem(s, c, table, 0, total);
  *out = buf;
  *olen = len;
  return 0;
}

int ps__srv_fwd_values(ps__server *s, ps__conn *c, ps__frame_hdr *h, ps__body *b, size_t pre, const void **at) {
  uint64_t vlen = 0;
  void *nb = NULL;
  size_t nlen = 0;
  *at = NULL;
  int rc = ps__srv_peer_values(s, c, h->table, b->buf, b->len, pre, ps__srv_repair_syncing(s) ? NULL : at, &vlen,
                               &nb, &nlen);
  if (rc) { /* not readable (out of memory too), or not in time: the sender sends the values */
    ps__srv_reply_err(c, h, rc == PS_ERR_NOMEM ? PS_ERR_UNAVAILABLE : rc, "%s", ps_errmsg());
    return -1;
  }
  s->pm_fwd_in++;
  h->xport = PS_XPORT_INLINE;
  if (*at) { /* the body keeps its tail; its length is that of the values in place */
    h->payload_len = pre + vlen;
    return 0;
  }
  ps__pool_put(c->pool, b->buf, b->len);
  b->buf = nb;
  b->len = nlen;
  h->payload_len = nlen;
  return 0;
}

int ps__srv_check_peer_pull(ps__conn *c, const ps__frame_hdr *h, const ps__body *b, int64_t n) {
  /* The worker's buffers must hold exactly the values asked for. */
  size_t kbytes = 8u * (size_t)h->nkeys;
  ps__vx x;
  if (ps__vx_parse(&x, (const uint8_t *)b->buf + kbytes, b->len - kbytes)) {
    ps__srv_reply_err(c, h, PS_ERR_PROTO, "%s", ps_errmsg());
    return -1;
  }
  uint64_t total = x.total;
  if (total != 4u * (uint64_t)n) {
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "peer-memory regions of %llu bytes for %lld values", (unsigned long long)total,
                      (long long)n);
    return -1;
  }
  return 0;
}

int ps__srv_round_apply(void *arg, ps__table *t, ps__round *r, void **token) {
  ps__server *s = arg;
  /* Under replicas a pull is answered once its round is on every copy (repl_sync.c),
   * not when the head applies it. */
  if (s->replicas > 1) return 0;
  pending_pull *fused = take_fusable_pulls(s, t);
  *token = fused;
  if (!fused) return 0;
  if (apply_round_fused(t, r, fused) == 0) return 1;
  for (pending_pull *p = fused; p; p = p->next) p->fused_err = PS_ERR_UNAVAILABLE; /* answered as usual */
  return 0;
}

void ps__srv_round_done(void *arg, ps__table *t, void *token) {
  if (token) answer_fused_pulls(arg, t, token);
}
