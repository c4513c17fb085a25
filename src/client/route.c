/*
 * route.c - routing: sparse keys and dense ranges to one part per server by the ring,
 * de-duplicated large pulls, and the push and pull entry points of the API.
 *
 * Runs on callers' threads. A sparse request partitions its keys (and values or reply
 * slots) by owner into a pooled block, unless one server holds them all; pushes go to
 * every server (each must count the worker's batch). A dense request cuts its range
 * into runs of slices with one owner; large parts to a same-host server name the
 * caller's buffers instead of carrying the values (peer memory, chosen and described
 * by net/xport.h).
 */
#include <stdio.h>
#include <string.h>

#include "client/client_int.h"

/* Snapshot of routing state for one request. */
static int route_state(ps_ctx *ctx, uint32_t table, table_info *ti, ps__ring **ring) {
  int rc = ps__ctx_state_err(ctx);
  if (rc) return rc;
  pthread_mutex_lock(&ctx->mu);
  if (table == 0 || table >= ctx->ntables || ctx->tables[table].kind == 0) {
    pthread_mutex_unlock(&ctx->mu);
    return ps__fail(PS_ERR_NO_TABLE, "unknown table %u (declare it with ps_table_declare)", table);
  }
  *ti = ctx->tables[table];
  *ring = ctx->ring;
  pthread_mutex_unlock(&ctx->mu);
  if (!*ring) return ps__fail(PS_ERR_UNAVAILABLE, "no servers in the job");
  return 0;
}

/* Remember the batch behind this clock's pushes (the examples counter). */
static void note_batch(ps_ctx *ctx, uint32_t batch) {
  uint32_t cur = __atomic_load_n(&ctx->clock_batch, __ATOMIC_RELAXED);
  while (batch > cur &&
         !__atomic_compare_exchange_n(&ctx->clock_batch, &cur, batch, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}

/* ---- sparse */

/* One function for the whole sparse request build (route, partition, parts): it is the
 * hot path of every sparse call, kept in one piece so the compiler sees it whole. */
static int sparse_start_keys(ps_ctx *ctx, int is_push, uint32_t table, const uint64_t *keys, size_t nkeys,
                             const float *grads, float *out, uint32_t batch, float lr, uint64_t deadline,
                             ps_req **out_req) {
  table_info ti = {0};
  ps__ring *ring = NULL;
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = route_state(ctx, table, &ti, &ring))) return rc;
  if (ti.kind != PS_SPARSE) return ps__fail(PS_ERR_INVALID, "table %u is dense: use ps_%s_range", table, is_push ? "push" : "pull");
  if (nkeys && !keys) return ps__fail(PS_ERR_INVALID, "keys is NULL");
  if (nkeys && is_push && !grads) return ps__fail(PS_ERR_INVALID, "grads is NULL");
  if (nkeys && !is_push && !out) return ps__fail(PS_ERR_INVALID, "out is NULL");
  if (nkeys > UINT32_MAX) return ps__fail(PS_ERR_TOO_LARGE, "%zu keys in one call (at most %u)", nkeys, UINT32_MAX);
  if (is_push && ti.update == PS__UPDATE_MEAN && batch == 0 && nkeys)
    return ps__fail(PS_ERR_INVALID, "push with batch size 0 to a mean-mode table");
  /* Keys go by route: with replicas R >= 2 a route is a chain of R servers (its keys
   * travel together and go to its head), else a server. */
  size_t S = ps__ring_nroutes(ring);
  int repl = ps__ring_replicas(ring) > 1;
  size_t w = ti.width;
  uint64_t bytes = (uint64_t)nkeys * (8 + 4 * w);
  if (bytes > ctx->max_payload) return ps__fail(PS_ERR_TOO_LARGE, "request of %llu bytes exceeds max_frame_mb", (unsigned long long)bytes);
  int64_t clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED);

  /* Route: owner index per key. */
  uint32_t *owner = NULL;
  size_t *count = ps__calloc(S, sizeof *count);
  if (!count) return ps__fail(PS_ERR_NOMEM, "out of memory");
  size_t single = SIZE_MAX; /* the one server holding every key, if so */
  if (S == 1) {
    count[0] = nkeys;
    single = 0;
  } else if (nkeys) {
    owner = ps__ubuf_get(ctx, nkeys * sizeof *owner);
    if (!owner) {
      free(count);
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < nkeys; i++) {
      owner[i] = (uint32_t)ps__ring_route_index(ring, table, keys[i]);
      count[owner[i]]++;
    }
    for (size_t s = 0; s < S; s++)
      if (count[s] == nkeys) single = s;
  }
  /* Pushes go to every server, or under replicas to every chain's head (empty where no
   * keys): each must count this worker's batch in the round's denominator (mean mode;
   * a head that took a dead one's chains over rebuilds their rounds from the parts sent
   * to them again). Pulls go only where keys are; so do replicated pushes to tables
   * without rounds (async, ssp). */
  int all = is_push && (!repl || ti.sync);
  unsigned nparts = 0;
  for (size_t s = 0; s < S; s++) nparts += (all || count[s]) ? 1 : 0;
  ps_req *r = ps__req_new(ctx, nparts, 2 * nparts);
  if (!r) {
    ps__ubuf_put(ctx, owner, nkeys * sizeof *owner);
    free(count);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  r->kind = is_push ? 1 : 0;
  if (ctx->count) { /* t0_ns 0: no latency recorded (ps__req_observe) */
    r->t0_ns = ps__now_ns();
    __atomic_add_fetch(&ctx->nreq[r->kind], 1, __ATOMIC_RELAXED);
    if (is_push) __atomic_add_fetch(&ctx->bytes_pushed, bytes, __ATOMIC_RELAXED);
    ps__tcount_start(r, &ti, nparts, is_push ? bytes : 0);
  }
  if (is_push) note_batch(ctx, batch);
  const uint64_t *pkeys = keys;
  const float *pvals = grads;
  float *precv = out;
  if (single == SIZE_MAX && nkeys) {
    /* Partition keys (and values or reply slots) by server, contiguous per server. */
    size_t *start = ps__calloc(S, sizeof *start);
    size_t len = nkeys * 8 + nkeys * w * 4 + (is_push ? 0 : nkeys * sizeof(uint32_t));
    uint8_t *block = ps__ubuf_get(ctx, len);
    if (!start || !block) {
      free(start);
      ps__ubuf_put(ctx, block, len);
      ps__ubuf_put(ctx, owner, nkeys * sizeof *owner);
      free(count);
      ps__req_destroy(r);
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
    r->scratch = block;
    r->scratch_len = len;
    uint64_t *k2 = (uint64_t *)block;
    float *v2 = is_push ? (float *)(block + nkeys * 8) : NULL;
    float *rv = !is_push ? (float *)(block + nkeys * 8) : NULL;
    uint32_t *pos = !is_push ? (uint32_t *)(block + nkeys * 8 + nkeys * w * 4) : NULL;
    for (size_t s = 1; s < S; s++) start[s] = start[s - 1] + count[s - 1];
    for (size_t i = 0; i < nkeys; i++) {
      size_t j = start[owner[i]]++;
      k2[j] = keys[i];
      if (is_push)
        memcpy(v2 + j * w, grads + i * w, w * 4);
      else
        pos[j] = (uint32_t)i;
    }
    free(start);
    r->own_recv = rv;
    r->pos = pos;
    r->out = out;
    r->width = (unsigned)w;
    r->nkeys = nkeys;
    pkeys = k2;
    pvals = v2;
    precv = rv;
  }
  size_t base = 0;
  unsigned pi = 0;
  for (size_t s = 0; s < S; s++) {
    size_t n = (single == SIZE_MAX) ? count[s] : (s == single ? nkeys : 0);
    if (!all && n == 0) continue;
    uint32_t chain[PS_MAX_REPLICAS];
    size_t nch = ps__ring_route(ring, s, chain);
    ps__part_init(ctx, r, pi, chain[0], is_push ? PS_MSG_PUSH : PS_MSG_PULL, table, deadline);
    part *p = &r->parts[pi];
    if (repl) {
      memcpy(p->chain, chain, nch * sizeof *chain);
      p->nchain = (unsigned)nch;
      if (ti.sync) p->keep = ti.every; /* keep.c */
    }
    p->hdr.nkeys = (uint32_t)n;
    p->hdr.clock = clock;
    p->send = &r->bufs[2 * pi];
    p->nsend = 0;
    if (n) {
      p->send[p->nsend].base = (char *)(pkeys + base);
      p->send[p->nsend++].len = n * 8;
      if (is_push) {
        p->send[p->nsend].base = (char *)(pvals + base * w);
        p->send[p->nsend++].len = n * w * 4;
      }
    }
    if (is_push) {
      p->hdr.batch = batch;
      p->hdr.lr = lr < 0 ? PS_LR_SCHEDULE : lr;
    } else {
      p->recv = &r->bufs[2 * pi + 1];
      p->recv->base = (char *)(precv + base * w);
      p->recv->len = n * w * 4;
      p->nrecv = 1;
      p->recv_len = n * w * 4;
    }
    base += n;
    pi++;
  }
  if (owner) ps__ubuf_put(ctx, owner, nkeys * sizeof *owner);
  free(count);
  /* A table with a codec: its pushes' values encoded, its replies decoded (cx.c). */
  if ((rc = is_push ? (ti.push_codec.kind ? ps__cx_encode_push(ctx, r, &ti) : 0)
                    : (ti.pull_codec.kind ? ps__cx_setup_pull(r, &ti) : 0))) {
    ps__req_destroy(r);
    return rc;
  }
  *out_req = r;
  return 0;
}

/* A pull of at least DEDUP_MIN_KEYS keys with rows of at least DEDUP_MIN_ROW_BYTES asks
 * for each distinct key once when at most DEDUP_MAX_SHARE of its keys are distinct, and
 * copies the rows to the repeats when the reply is in (ps__req_rows_done): heavy-tailed
 * batches repeat their hot keys (a 100k-key Zipf(1.1) batch of bench_sparse holds 29k
 * distinct keys), and every repeat would cost a lookup on the server and a row on the
 * wire. The answer is the same. `dedup=0` (PSHARD_DEDUP=0) turns it off. */
#define DEDUP_MIN_KEYS 1024u
#define DEDUP_MIN_ROW_BYTES 32u
#define DEDUP_MAX_SHARE 0.8

/* Distinct keys of keys[n] in first-seen order into a pooled block: ukeys[nu], then
 * idx[n] (the distinct index of each key). 1 if worth it (set *blockp, *block_len, *nu),
 * 0 if not (or out of memory: the plain path then runs). */
static int dedup_keys(ps_ctx *ctx, const uint64_t *keys, size_t n, void **blockp, size_t *block_len, size_t *nu_out) {
  size_t cap = 1024;
  while (cap < 2 * n) cap *= 2;
  size_t len = n * 8 + n * 4 + cap * 4;
  uint8_t *block = ps__ubuf_get(ctx, len);
  if (!block) return 0;
  uint64_t *ukeys = (uint64_t *)block;
  uint32_t *idx = (uint32_t *)(block + n * 8), *slot = idx + n; /* slot: distinct index + 1, 0 = empty */
  memset(slot, 0, cap * 4);
  size_t mask = cap - 1, nu = 0, limit = (size_t)(DEDUP_MAX_SHARE * (double)n);
  for (size_t j = 0; j < n; j++) {
    uint64_t k = keys[j];
    size_t h = (size_t)ps__mix64(k) & mask;
    for (;; h = (h + 1) & mask) {
      uint32_t u = slot[h];
      if (!u) {
        slot[h] = (uint32_t)++nu;
        ukeys[nu - 1] = k;
        idx[j] = (uint32_t)(nu - 1);
        break;
      }
      if (ukeys[u - 1] == k) {
        idx[j] = u - 1;
        break;
      }
    }
    if (nu > limit) { /* mostly distinct: not worth a second copy of the rows */
      ps__ubuf_put(ctx, block, len);
      return 0;
    }
  }
  *blockp = block;
  *block_len = len;
  *nu_out = nu;
  return 1;
}

static int sparse_start(ps_ctx *ctx, int is_push, uint32_t table, const uint64_t *keys, size_t nkeys,
                        const float *grads, float *out, uint32_t batch, float lr, uint64_t deadline, ps_req **out_req) {
  unsigned w = 0;
  if (ctx && !is_push && ctx->dedup && nkeys >= DEDUP_MIN_KEYS && nkeys <= UINT32_MAX && keys && out) {
    pthread_mutex_lock(&ctx->mu);
    if (table < ctx->ntables && ctx->tables[table].kind == PS_SPARSE) w = ctx->tables[table].width;
    pthread_mutex_unlock(&ctx->mu);
  }
  void *block;
  size_t block_len, nu;
  if (w * 4u < DEDUP_MIN_ROW_BYTES || !dedup_keys(ctx, keys, nkeys, &block, &block_len, &nu))
    return sparse_start_keys(ctx, is_push, table, keys, nkeys, grads, out, batch, lr, deadline, out_req);
  size_t rows_len = nu * w * 4;
  float *rows = ps__ubuf_get(ctx, rows_len);
  int rc = rows ? sparse_start_keys(ctx, 0, table, (const uint64_t *)block, nu, NULL, rows, 0, 0, deadline, out_req)
                : ps__fail(PS_ERR_NOMEM, "out of memory");
  if (rc) {
    ps__ubuf_put(ctx, rows, rows_len);
    ps__ubuf_put(ctx, block, block_len);
    return rc;
  }
  ps_req *r = *out_req;
  r->dd_block = block;
  r->dd_block_len = block_len;
  r->dd_rows = rows;
  r->dd_rows_len = rows_len;
  r->dd_idx = (const uint32_t *)((uint8_t *)block + nkeys * 8);
  r->dd_n = nkeys;
  r->dd_out = out;
  r->dd_width = w;
  return 0;
}

/* ---- dense */

/* The link of a dense part's server, asked by ps__vx_choose only for a part that could
 * go by peer memory (a lookup under lend_mu). */
typedef struct link_ask {
  ps_ctx *ctx;
  uint32_t target;
  int encoded; /* the part's values are encoded (a codec): they travel inline */
  int is_push;
  const part *p; /* its chain, under replicas */
} link_ask;

/* The pid of the target's server process if peer-memory frames may go to it, else 0.
 * Under replicas, a push only when every member of its chain takes peer memory: a part
 * is sent again to the next member when its head fails, and a server that reads the
 * worker's buffers after the call returned (a copy sent again) reads a push every copy
 * has applied already, which its window drops (a push to a replicated sync table too:
 * the copy kept for a failover, keep.c, holds its values inline). A pull may go by
 * peer memory to its head: a short expiry (PS_VX_CHAIN_PULL_MS) bounds how long that
 * head may write into the caller's buffers, and the pull goes to the next member only
 * once the head no longer may (ps__part_submit), inline. */
static int link_takes_pm(void *arg) {
  const link_ask *a = arg;
  ps_ctx *ctx = a->ctx;
  int repl = __atomic_load_n(&ctx->replicas, __ATOMIC_RELAXED) > 1;
  if (!ctx->peer_mem || a->encoded || (repl && a->p->nchain < 2)) return 0;
  pthread_mutex_lock(&ctx->lend_mu);
  peer *l = ps__link_find(ctx, a->target);
  int pm = l ? __atomic_load_n(&l->pm, __ATOMIC_RELAXED) : 0;
  for (unsigned k = 0; repl && a->is_push && pm && k < a->p->nchain && k < PS_MAX_REPLICAS; k++) {
    peer *m = ps__link_find(ctx, a->p->chain[k]);
    if (!m || !__atomic_load_n(&m->pm, __ATOMIC_RELAXED)) pm = 0;
  }
  pthread_mutex_unlock(&ctx->lend_mu);
  return pm;
}

/* One function for the whole dense request build (segments, parts, each part's value
 * transport): the hot path of every dense call. */
static int dense_start(ps_ctx *ctx, int is_push, uint32_t table, uint64_t offset, uint64_t cnt, const float *grads,
                       float *out, uint32_t batch, float lr, uint64_t deadline, ps_req **out_req) {
  table_info ti = {0};
  ps__ring *ring = NULL;
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = route_state(ctx, table, &ti, &ring))) return rc;
  if (ti.kind != PS_DENSE) return ps__fail(PS_ERR_INVALID, "table %u is sparse: use ps_%s", table, is_push ? "push" : "pull");
  if (cnt == 0 || offset >= ti.size || cnt > ti.size - offset)
    return ps__fail(PS_ERR_RANGE, "range [%llu, %llu) outside a table of %llu floats", (unsigned long long)offset,
                    (unsigned long long)(offset + cnt), (unsigned long long)ti.size);
  if (is_push ? !grads : !out) return ps__fail(PS_ERR_INVALID, "%s is NULL", is_push ? "grads" : "out");
  if (is_push && ti.update == PS__UPDATE_MEAN && batch == 0)
    return ps__fail(PS_ERR_INVALID, "push with batch size 0 to a mean-mode table");
  if (cnt * 4 > ctx->max_payload) return ps__fail(PS_ERR_TOO_LARGE, "range of %llu floats exceeds max_frame_mb", (unsigned long long)cnt);
  size_t S = ps__ring_size(ring);
  uint64_t w = ti.width;
  uint64_t first = offset / w, last = (offset + cnt - 1) / w;
  /* Segments: runs of consecutive slices with the same owner. */
  size_t maxseg = (size_t)(last - first + 1);
  uint64_t *segs = ps__malloc(maxseg * 2 * 8);
  uint32_t *segown = ps__malloc(maxseg * sizeof *segown);
  size_t *nseg_of = ps__calloc(S, sizeof *nseg_of);
  uint32_t *order = ps__malloc(S * sizeof *order);
  if (!segs || !segown || !nseg_of || !order || !ps__ring_dense_order(ring, table, order)) {
    free(segs); free(segown); free(nseg_of); free(order);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  size_t nseg = 0;
  uint64_t nsl = (ti.size + w - 1) / w;
  for (uint64_t sl = first; sl <= last; sl++) {
    uint32_t o = order[ps__dense_run(sl, nsl, S)];
    uint64_t a = sl == first ? offset : sl * w;
    uint64_t b = sl == last ? offset + cnt : (sl + 1) * w;
    if (nseg && segown[nseg - 1] == o && segs[2 * (nseg - 1)] + segs[2 * (nseg - 1) + 1] == a) {
      segs[2 * (nseg - 1) + 1] += b - a;
    } else {
      segs[2 * nseg] = a;
      segs[2 * nseg + 1] = b - a;
      segown[nseg] = o;
      nseg_of[o]++;
      nseg++;
    }
  }
  int repl = ps__ring_replicas(ring) > 1;
  int all = is_push && (!repl || ti.sync); /* as sparse_start_keys: every round counts the batch */
  unsigned nparts = 0;
  for (size_t s = 0; s < S; s++) nparts += (all || nseg_of[s]) ? 1 : 0;
  /* Per part: 1 buffer for its segment list, 1 for its peer-memory tail, plus one
   * region per segment. segbuf: the segment lists, then room for the tails (expiry and
   * hint, then one (address, length) pair per segment). */
  ps_req *r = ps__req_new(ctx, nparts, 2 * nparts + (unsigned)nseg);
  uint64_t *segbuf = ps__malloc(((nseg ? nseg : 1) * 4 + 2 * (size_t)nparts) * 8);
  if (!r || !segbuf) {
    free(segs); free(segown); free(nseg_of); free(segbuf); free(order);
    if (r) ps__req_destroy(r);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  r->own_segs = segbuf;
  r->kind = is_push ? 1 : 0;
  if (ctx->count) { /* t0_ns 0: no latency recorded (ps__req_observe) */
    r->t0_ns = ps__now_ns();
    __atomic_add_fetch(&ctx->nreq[r->kind], 1, __ATOMIC_RELAXED);
    if (is_push) __atomic_add_fetch(&ctx->bytes_pushed, cnt * 4 + nseg * 16, __ATOMIC_RELAXED);
    ps__tcount_start(r, &ti, nparts, is_push ? cnt * 4 + nseg * 16 : 0);
  }
  if (is_push) note_batch(ctx, batch);
  int64_t clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED);
  unsigned pi = 0, bi = 0;
  size_t sb = 0;
  uint64_t *tails = segbuf + 2 * nseg; /* per part: room for its peer-memory tail */
  uint64_t now = ps__now_ms();
  for (size_t s = 0; s < S; s++) {
    if (!all && !nseg_of[s]) continue;
    uint32_t target = ps__ring_server_at(ring, s);
    ps__part_init(ctx, r, pi, target, is_push ? PS_MSG_PUSH_DENSE : PS_MSG_PULL_DENSE, table, deadline);
    part *p = &r->parts[pi];
    if (repl) { /* server s holds one run, j: the run's chain */
      size_t j = 0;
      while (order[j] != s) j++;
      p->nchain = (unsigned)ps__ring_dense_chain(ring, order, j, p->chain);
      if (ti.sync) p->keep = ti.every; /* keep.c */
    }
    p->hdr.clock = clock;
    p->hdr.nkeys = (uint32_t)(2 * nseg_of[s]);
    /* regs: segment list, peer-memory tail, then the values' regions. */
    uv_buf_t *regs = &r->bufs[bi];
    unsigned nreg = 2;
    uint64_t *tail = tails + 2 * (sb + pi);
    regs[0] = uv_buf_init((char *)(segbuf + 2 * sb), (unsigned)(nseg_of[s] * 16));
    size_t bytes = 0;
    for (size_t k = 0; k < nseg; k++) {
      if (segown[k] != s) continue;
      segbuf[2 * sb] = segs[2 * k];
      segbuf[2 * sb + 1] = segs[2 * k + 1];
      uint64_t rel = segs[2 * k] - offset;
      uv_buf_t rb;
      rb.base = is_push ? (char *)(grads + rel) : (char *)(out + rel);
      rb.len = segs[2 * k + 1] * 4;
      sb++;
      bytes += rb.len;
      regs[nreg++] = rb;
    }
    bi += nreg;
    /* A large part to a server on this host goes by peer memory: the frame names the
     * caller's buffers, the server copies from or into them (net/xport.h). */
    link_ask ask = {ctx, target, is_push ? ti.push_codec.kind != PS_CODEC_RAW : ti.pull_codec.kind != PS_CODEC_RAW,
                    is_push, p};
    p->hdr.xport = ps__vx_choose(&p->vx, bytes, deadline, now, link_takes_pm, &ask);
    int pm = p->hdr.xport == PS_XPORT_PEER_MEM;
    if (pm && repl && !is_push && p->vx.until > now + PS_VX_CHAIN_PULL_MS) p->vx.until = now + PS_VX_CHAIN_PULL_MS;
    regs[1] = uv_buf_init((char *)tail, (unsigned)ps__vx_tail(&p->vx, tail, regs + 2, nseg_of[s]));
    if (pm) {
      __atomic_add_fetch(&ctx->pm_parts, 1, __ATOMIC_RELAXED);
      if (p->vx.hint) __atomic_add_fetch(&ctx->shared_parts, 1, __ATOMIC_RELAXED);
    }
    if (is_push) {
      p->send = regs;
      p->nsend = nseg_of[s] ? (pm ? 2 : nreg) : 0;
      if (!pm && nseg_of[s]) { /* the segment list, then the values: drop the descriptors */
        regs[1] = regs[0];
        p->send = regs + 1;
        p->nsend = nreg - 1;
      }
      p->hdr.batch = batch;
      p->hdr.lr = lr < 0 ? PS_LR_SCHEDULE : lr;
    } else {
      p->send = regs;
      p->nsend = pm ? 2 : 1;
      p->recv = regs + 2; /* also where inline values of a peer-memory pull go */
      p->nrecv = nreg - 2;
      p->recv_len = bytes;
    }
    pi++;
  }
  free(order);
  free(segs);
  free(segown);
  free(nseg_of);
  if ((rc = is_push ? (ti.push_codec.kind ? ps__cx_encode_push(ctx, r, &ti) : 0)
                    : (ti.pull_codec.kind ? ps__cx_setup_pull(r, &ti) : 0))) {
    ps__req_destroy(r);
    return rc;
  }
  *out_req = r;
  return 0;
}

#define CTX_DEADLINE(ctx) ps__deadline_for(ctx, -1)

int ps_pull_start(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, float *out, ps_req **req) {
  if (!req) return ps__fail(PS_ERR_INVALID, "req is NULL");
  int rc = sparse_start(ctx, 0, table, keys, nkeys, NULL, out, 0, 0, CTX_DEADLINE(ctx), req);
  if (!rc && (rc = ps__req_post(ctx, *req))) ps__req_destroy(*req);
  return rc;
}

int ps_push_start(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, const float *grads, uint32_t batch,
                  float lr, ps_req **req) {
  if (!req) return ps__fail(PS_ERR_INVALID, "req is NULL");
  int rc = sparse_start(ctx, 1, table, keys, nkeys, grads, NULL, batch, lr, CTX_DEADLINE(ctx), req);
  if (!rc && (rc = ps__req_post(ctx, *req))) ps__req_destroy(*req);
  return rc;
}

int ps_pull_range_start(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, float *out, ps_req **req) {
  if (!req) return ps__fail(PS_ERR_INVALID, "req is NULL");
  int rc = dense_start(ctx, 0, table, offset, count, NULL, out, 0, 0, CTX_DEADLINE(ctx), req);
  if (!rc && (rc = ps__req_post(ctx, *req))) ps__req_destroy(*req);
  return rc;
}

int ps_push_range_start(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, const float *grads,
                        uint32_t batch, float lr, ps_req **req) {
  if (!req) return ps__fail(PS_ERR_INVALID, "req is NULL");
  int rc = dense_start(ctx, 1, table, offset, count, grads, NULL, batch, lr, CTX_DEADLINE(ctx), req);
  if (!rc && (rc = ps__req_post(ctx, *req))) ps__req_destroy(*req);
  return rc;
}

int ps_pull(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, float *out, int timeout_ms) {
  ps_req *r;
  int rc = sparse_start(ctx, 0, table, keys, nkeys, NULL, out, 0, 0, ps__deadline_for(ctx, timeout_ms), &r);
  return rc ? rc : ps__req_run(ctx, r, timeout_ms);
}

int ps_push(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, const float *grads, uint32_t batch,
            float lr, int timeout_ms) {
  ps_req *r;
  int rc = sparse_start(ctx, 1, table, keys, nkeys, grads, NULL, batch, lr, ps__deadline_for(ctx, timeout_ms), &r);
  return rc ? rc : ps__req_run(ctx, r, timeout_ms);
}

int ps_pull_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, float *out, int timeout_ms) {
  ps_req *r;
  int rc = dense_start(ctx, 0, table, offset, count, NULL, out, 0, 0, ps__deadline_for(ctx, timeout_ms), &r);
  return rc ? rc : ps__req_run(ctx, r, timeout_ms);
}

int ps_push_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, const float *grads, uint32_t batch,
                  float lr, int timeout_ms) {
  ps_req *r;
  int rc = dense_start(ctx, 1, table, offset, count, grads, NULL, batch, lr, ps__deadline_for(ctx, timeout_ms), &r);
  return rc ? rc : ps__req_run(ctx, r, timeout_ms);
}

int ps_push_pull(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, const float *grads, uint32_t batch,
                 float lr, float *out, int timeout_ms) {
  ps_req *r[2];
  uint64_t dl = ps__deadline_for(ctx, timeout_ms);
  int rc = sparse_start(ctx, 1, table, keys, nkeys, grads, NULL, batch, lr, dl, &r[0]);
  if (rc) return rc;
  if ((rc = sparse_start(ctx, 0, table, keys, nkeys, NULL, out, 0, 0, dl, &r[1]))) {
    ps__req_destroy(r[0]);
    return rc;
  }
  return ps__req_run_n(ctx, r, 2, timeout_ms);
}

int ps_push_pull_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, const float *grads,
                       uint32_t batch, float lr, float *out, int timeout_ms) {
  ps_req *r[2];
  uint64_t dl = ps__deadline_for(ctx, timeout_ms);
  int rc = dense_start(ctx, 1, table, offset, count, grads, NULL, batch, lr, dl, &r[0]);
  if (rc) return rc;
  if ((rc = dense_start(ctx, 0, table, offset, count, NULL, out, 0, 0, dl, &r[1]))) {
    ps__req_destroy(r[0]);
    return rc;
  }
  return ps__req_run_n(ctx, r, 2, timeout_ms);
}
