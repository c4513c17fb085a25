/*
 * repl_sync.c - replication of sync rounds: the head of a chain forwards each round's
 * one combined update, not the workers' pushes.
 *
 * In the rounds. The head accumulates the workers' pushes for a round as without
 * replicas (shard/sync.c) and answers them at once. When the round is applied, the
 * engine's round_applied hook hands its rows over, as applied (divided by the round's
 * denominator where the optimiser needs it), with the rate, the denominator and the
 * global batch: they are cut by the chain of each row and sent, as FORWARD_ROUND frames
 * (proto/frame.h), to the live member after this server in each chain. A frame names
 * the chains it covers, rows or not, so each member knows, per chain, how many rounds
 * it holds (srv_sync.ver). A member applies the rows as the same round with the same
 * numbers (ps__shard_round_replica: step round + 1), so every copy comes out the same,
 * forwards them on and answers once the members after it answered. The head counts the
 * rounds not yet answered: a pull waits until its round is on every copy (the table's
 * `durable`), and each push answer tells the worker, in its clock field, the clock
 * before which every round is on every copy, so the worker can let go of its copies
 * of those pushes (client/keep.c). A frame that cannot be delivered is sent again, to
 * the same member (a lost connection) or to the next one (the member died).
 *
 * A failover: when the head of a chain dies, its next member rebuilds the rounds the
 * dead one had not handed on (repl_catchup.c).
 *
 * Everything here runs on the server's loop thread.
 */
#include <string.h>

#include "common/common.h"
#include "server/repl_sync_int.h"
#include "server/server_int.h"

static void *grow(void *p, size_t *cap, size_t n, size_t size) {
  if (n < *cap) return p;
  size_t c = *cap ? *cap * 2 : 8;
  void *q = ps__realloc(p, c * size);
  if (q) *cap = c;
  return q;
}

/* ------------------------------------------------------------------ state per table */

srv_sync *ps__rs_find(ps__server *s, uint32_t table) {
  for (srv_sync *y = s->syncs; y; y = y->next)
    if (y->table == table) return y;
  return NULL;
}

static srv_sync *sync_of(ps__server *s, ps__table *t) {
  srv_sync *y = ps__rs_find(s, t->id);
  if (y) return y;
  ps__srv_chains x;
  if (ps__srv_chains_init(&x, s, t)) return NULL;
  size_t n = ps__srv_nchains(&x);
  ps__srv_chains_free(&x);
  y = ps__calloc(1, sizeof *y);
  if (y) {
    y->ver = ps__malloc((n ? n : 1) * sizeof *y->ver);
    y->member = ps__calloc(n ? n : 1, 1);
    y->old_head = ps__calloc(n ? n : 1, sizeof *y->old_head);
  }
  if (!y || !y->ver || !y->member || !y->old_head) {
    if (y) free(y->ver), free(y->member), free(y->old_head);
    free(y);
    return NULL;
  }
  y->table = t->id;
  y->nver = n;
  for (size_t i = 0; i < n; i++) y->ver[i] = t->version; /* the copies start together */
  y->next = s->syncs;
  s->syncs = y;
  return y;
}

void ps__srv_sync_table(ps__server *s, ps__table *t) {
  if (s->replicas > 1 && ps__table_is_sync(t) && s->ring && ps__ring_size(s->ring) > 1 && !sync_of(s, t))
    ps__log(PS_LOG_ERROR, "table '%s': out of memory for its replication state", t->decl.name);
}

void ps__rs_durable_update(ps__server *s, srv_sync *y) {
  ps__table *t = ps__shard_table(s->sh, y->table);
  if (!t) return;
  int64_t d = INT64_MAX;
  for (size_t i = 0; i < y->nrounds; i++)
    if (y->rounds[i]->round < d) d = y->rounds[i]->round;
  if (t->durable != d) {
    t->durable = d;
    ps__srv_answer_ready_pulls(s);
  }
}

int64_t ps__srv_sync_chain_rounds(ps__server *s, ps__table *t, uint32_t ck) {
  srv_sync *y = ps__rs_find(s, t->id);
  ps__srv_chains x;
  if (!y || ps__srv_chains_init(&x, s, t)) return t->version;
  uint32_t nx;
  size_t idx = ps__srv_chain_index(&x, ck);
  int place = ps__srv_chain_place(&x, ck, &nx);
  ps__srv_chains_free(&x);
  if (idx >= y->nver) return t->version;
  /* a head applies every round of its chains, but not those a catch-up rebuilds yet */
  if (place == 1 && !(y->cu && y->cu->taken[idx])) return t->version;
  return y->ver[idx];
}

size_t ps__srv_sync_catchups_running(ps__server *s) {
  size_t n = 0;
  for (srv_sync *y = s->syncs; y; y = y->next) n += y->cu != NULL;
  return n;
}

void ps__srv_sync_set_chain_rounds(ps__server *s, ps__table *t, uint32_t ck, int64_t rounds) {
  srv_sync *y = ps__table_is_sync(t) && s->ring ? sync_of(s, t) : NULL;
  ps__srv_chains x;
  if (!y || ps__srv_chains_init(&x, s, t)) {
    ps__log(PS_LOG_ERROR, "table '%s': out of memory for its replication state", t->decl.name);
    return;
  }
  size_t idx = ps__srv_chain_index(&x, ck);
  ps__srv_chains_free(&x);
  if (idx < y->nver) y->ver[idx] = rounds;
}

int64_t ps__srv_sync_durable_clock(ps__server *s, ps__table *t) {
  (void)s;
  int64_t v = t->durable < t->version ? t->durable : t->version;
  return v * (int64_t)t->spec.every;
}

/* ------------------------------------------------------------------ frames */

static uint64_t rr_key(const round_rows *a, size_t i) {
  return a->m ? ps__rowmap_key_at(a->m, i) : ps__get_u64(a->keys + 8 * i);
}
static const float *rr_row(const round_rows *a, size_t i) {
  return a->m ? ps__rowmap_row_at(a->m, i) : a->rows + i * a->w;
}

/* One frame (or several within the payload limit, the last naming the chains) of round
 * ra to server `to`: the rows i with nexts[i] == to, the chains cks[j] with cnext[j] ==
 * to. 0 or an error. */
static int round_frames_to(ps__server *s, ps__table *t, const round_rows *a, const uint32_t *nexts,
                           const uint32_t *cks, const uint32_t *cnext, size_t ncks, uint32_t to,
                           const round_args *ra, srv_fwd_group *g) {
  size_t nr = 0, nc = 0;
  for (size_t i = 0; i < a->n; i++) nr += nexts[i] == to;
  for (size_t j = 0; j < ncks; j++) nc += cnext[j] == to;
  size_t nc_pad = (nc + 1) & ~(size_t)1;
  size_t head = PS_FWD_PREFIX + PS_FWD_ROUND_PREFIX, per = 8 + 4 * a->w;
  uint64_t room = s->o.max_payload > head + 4 * nc_pad ? s->o.max_payload - head - 4 * nc_pad : 0;
  size_t chunk = room / per;
  if (chunk == 0) return ps__fail(PS_ERR_TOO_LARGE, "a round's chain list exceeds the frame limit");
  if (chunk > UINT32_MAX) chunk = UINT32_MAX;
  size_t i = 0, left = nr;
  for (;;) {
    size_t k = left < chunk ? left : chunk;
    int last = k == left;
    size_t ncl = last ? nc_pad : 0;
    size_t len = head + 4 * ncl + k * per;
    /* large values may be read where they are by a member on this host */
    int by_mem = 4 * k * a->w >= PS_VX_PEER_MIN_BYTES;
    uint8_t *buf = ps__srv_fwd_buf(s, len, by_mem);
    if (!buf) return ps__fail(PS_ERR_NOMEM, "out of memory forwarding a round");
    ps__fwd fw = {.epoch = s->epoch, .worker = 0, .step = (uint64_t)ra->round + 1};
    ps__fwd_put(buf, &fw);
    uint8_t *p = buf + PS_FWD_PREFIX;
    uint64_t bits;
    ps__put_u64(p, (uint64_t)ra->round);
    memcpy(&bits, &ra->denom, 8);
    ps__put_u64(p + 8, bits);
    memcpy(&bits, &ra->batch, 8);
    ps__put_u64(p + 16, bits);
    ps__put_u32(p + 24, last ? (uint32_t)nc : 0);
    ps__put_u32(p + 28, 0);
    p += PS_FWD_ROUND_PREFIX;
    if (last) {
      size_t o = 0;
      for (size_t j = 0; j < ncks; j++)
        if (cnext[j] == to) ps__put_u32(p + 4 * o++, cks[j]);
      if (o < nc_pad) ps__put_u32(p + 4 * o, 0);
      p += 4 * nc_pad;
    }
    float *vo = (float *)(void *)(p + 8 * k);
    size_t got = 0;
    for (; i < a->n && got < k; i++) {
      if (nexts[i] != to) continue;
      ps__put_u64(p + 8 * got, rr_key(a, i));
      memcpy(vo + got * a->w, rr_row(a, i), 4 * a->w);
      got++;
    }
    ps__frame_hdr fh = {.type = PS_MSG_FORWARD_ROUND, .table = t->id, .nkeys = (uint32_t)k, .lr = ra->lr};
    g->out++;
    size_t pm_off = by_mem ? (size_t)((uint8_t *)vo - buf) : 0;
    if (ps__srv_forward_frame(s, to, &fh, buf, len, pm_off, g)) {
      g->out--;
      return PS_ERR_NOMEM;
    }
    left -= k;
    if (last) return 0;
  }
}

/* Send round ra's rows (a) of chains cks (this server's place in each: `place`) on to
 * the live member after this server in each. Rows of other chains are not sent. */
int ps__rs_round_send(ps__server *s, ps__table *t, const round_rows *a, const uint32_t *cks, size_t ncks,
                      const round_args *ra, srv_fwd_group *g) {
  ps__srv_chains x;
  if (ps__srv_chains_init(&x, s, t)) return PS_ERR_NOMEM;
  uint32_t *nexts = ps__calloc(a->n + ncks + 1, sizeof *nexts);
  if (!nexts) {
    ps__srv_chains_free(&x);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  uint32_t *cnext = nexts + a->n;
  for (size_t j = 0; j < ncks; j++) (void)ps__srv_chain_place(&x, cks[j], &cnext[j]);
  for (size_t i = 0; i < a->n; i++) {
    uint32_t ck = ps__srv_row_chain(&x, rr_key(a, i));
    for (size_t j = 0; j < ncks; j++)
      if (cks[j] == ck) {
        nexts[i] = cnext[j];
        break;
      }
  }
  int rc = 0;
  for (size_t j = 0; j < ncks && !rc; j++) {
    uint32_t to = cnext[j];
    if (!to) continue;
    int seen = 0;
    for (size_t q = 0; q < j && !seen; q++) seen = cnext[q] == to;
    if (!seen) rc = round_frames_to(s, t, a, nexts, cks, cnext, ncks, to, ra, g);
  }
  free(nexts);
  ps__srv_chains_free(&x);
  if (rc && !g->status) {
    g->status = rc;
    snprintf(g->msg, sizeof g->msg, "%s", ps_errmsg());
  }
  return rc;
}

/* ------------------------------------------------------------------ round groups */

static void round_done(ps__server *s, srv_fwd_group *g) {
  srv_sync *y = ps__rs_find(s, (uint32_t)(uintptr_t)g->arg);
  if (!y) return;
  for (size_t i = 0; i < y->nrounds; i++)
    if (y->rounds[i] == g) {
      memmove(y->rounds + i, y->rounds + i + 1, (y->nrounds - i - 1) * sizeof *y->rounds);
      y->nrounds--;
      break;
    }
  if (g->status && g->status != PS_ERR_UNAVAILABLE)
    ps__log(PS_LOG_WARN, "table %u: round %lld was not applied by a copy: %s", y->table, (long long)g->round, g->msg);
  ps__rs_durable_update(s, y);
}

/* A round frame not delivered: to the same member again (its connection was lost, or it
 * was at another epoch), or to the member now after this server in its chains (the
 * member died); 0 (answered: that copy is gone) when no member follows, or the chains
 * part ways (R = 3 with several chains: those copies are behind). */
static int round_redirect(ps__server *s, srv_fwd_group *g, const uint8_t *buf, size_t len, int status, uint32_t *to) {
  (void)status;
  ps__table *t = ps__shard_table(s->sh, (uint32_t)(uintptr_t)g->arg);
  if (!t || len < PS_FWD_PREFIX + PS_FWD_ROUND_PREFIX) return 0;
  uint32_t nc = ps__get_u32(buf + PS_FWD_PREFIX + 24);
  ps__srv_chains x;
  if (ps__srv_chains_init(&x, s, t)) return 0;
  uint32_t next = 0;
  int ok = 1;
  if (nc == 0) {
    /* rows only: their first row's chain decides */
    const uint8_t *keys = buf + PS_FWD_PREFIX + PS_FWD_ROUND_PREFIX;
    uint32_t nx;
    if (len >= PS_FWD_PREFIX + PS_FWD_ROUND_PREFIX + 8 &&
        ps__srv_chain_place(&x, ps__srv_row_chain(&x, ps__get_u64(keys)), &nx))
      next = nx;
  }
  for (uint32_t j = 0; j < nc && ok; j++) {
    uint32_t nx;
    if (!ps__srv_chain_place(&x, ps__get_u32(buf + PS_FWD_PREFIX + PS_FWD_ROUND_PREFIX + 4 * j), &nx)) continue;
    if (j == 0 || !next) next = nx;
    ok = nx == next;
  }
  ps__srv_chains_free(&x);
  if (!ok || !next) return 0;
  *to = next;
  return 1;
}

srv_fwd_group *ps__rs_round_group(ps__server *s, srv_sync *y, int64_t round) {
  srv_fwd_group **r = grow(y->rounds, &y->cap, y->nrounds, sizeof *y->rounds);
  if (!r) return NULL;
  y->rounds = r;
  srv_fwd_group *g = ps__srv_group_new(s);
  if (!g) return NULL;
  g->done = round_done;
  g->redirect = round_redirect;
  g->arg = (void *)(uintptr_t)y->table;
  g->round = round;
  y->rounds[y->nrounds++] = g;
  return g;
}

/* The chains of t this server heads (place 1) or is a member of (2), as names. */
static size_t chains_at(ps__server *s, ps__table *t, int place, uint32_t **out) {
  ps__srv_chains x;
  *out = NULL;
  if (ps__srv_chains_init(&x, s, t)) return 0;
  size_t n = ps__srv_nchains(&x), k = 0;
  uint32_t *v = ps__malloc((n ? n : 1) * sizeof *v);
  for (size_t i = 0; v && i < n; i++) {
    uint32_t nx, ck = ps__srv_chain_name(&x, i);
    if (ps__srv_chain_place(&x, ck, &nx) == place) v[k++] = ck;
  }
  ps__srv_chains_free(&x);
  *out = v;
  return k;
}

void ps__srv_round_applied(void *arg, ps__table *t, ps__rowmap *acc, int64_t round, float lr, double denom,
                           double batch) {
  ps__server *s = arg;
  if (s->replicas < 2 || !s->ring || ps__ring_size(s->ring) <= 1) return;
  srv_sync *y = sync_of(s, t);
  uint32_t *cks;
  size_t n = chains_at(s, t, 1, &cks);
  srv_fwd_group *g = y && cks ? ps__rs_round_group(s, y, round) : NULL;
  if (!g) {
    free(cks);
    ps__log(PS_LOG_ERROR, "table '%s': out of memory forwarding round %lld; its copies are behind", t->decl.name,
            (long long)round);
    return;
  }
  round_rows a = {.m = acc, .n = acc ? ps__rowmap_count(acc) : 0, .w = t->spec.width};
  round_args ra = {.round = round, .lr = lr, .denom = denom, .batch = batch};
  (void)ps__rs_round_send(s, t, &a, cks, n, &ra, g);
  free(cks);
  g->building = 0;
  ps__srv_group_maybe_done(s, g);
  ps__rs_durable_update(s, y);
}

/* ------------------------------------------------------------------ a member */

/* A round frame naming its rows' values in the sender's memory (the member before this
 * one, on this host): admitted first (a frame of another epoch is refused unread), then
 * its values where they are (*rows) or inline (ps__srv_fwd_values). 0, or -1
 * (answered). */
static int round_values(ps__server *s, ps__conn *c, ps__frame_hdr *h, ps__body *b, const float **rows) {
  ps__fwd fw;
  size_t head = PS_FWD_PREFIX + PS_FWD_ROUND_PREFIX;
  if (b->len < head) {
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "round forward of %zu bytes", b->len);
    return -1;
  }
  if (ps__srv_forward_admit(s, c, h, b, &fw)) return -1;
  uint64_t nc = ps__get_u32((const uint8_t *)b->buf + PS_FWD_PREFIX + 24);
  uint64_t pre = head + 4 * ((nc + 1) & ~(uint64_t)1) + 8 * (uint64_t)h->nkeys;
  if (pre > b->len) {
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "round forward of %zu bytes for %llu chains and %u rows", b->len,
                      (unsigned long long)nc, h->nkeys);
    return -1;
  }
  const void *at;
  if (ps__srv_fwd_values(s, c, h, b, (size_t)pre, &at)) return -1;
  *rows = at;
  return 0;
}

void ps__srv_on_forward_round(ps__server *s, ps__conn *c, const ps__frame_hdr *hdr, ps__body *b) {
  ps__fwd fw;
  ps__frame_hdr ih = *hdr, *h = &ih;
  const float *in_place = NULL;
  if (h->xport == PS_XPORT_PEER_MEM && round_values(s, c, h, b, &in_place)) return;
  ps__table *t = ps__srv_forward_table(s, c, h, b, &fw);
  if (!t) return;
  srv_sync *y = ps__table_is_sync(t) && s->replicas > 1 && s->ring && ps__ring_size(s->ring) > 1 ? sync_of(s, t) : NULL;
  if (!y) {
    ps__srv_reply_err(c, h, PS_ERR_INVALID, "table '%s' is not a replicated sync table here", t->decl.name);
    return;
  }
  const uint8_t *p = b->buf;
  size_t head = PS_FWD_PREFIX + PS_FWD_ROUND_PREFIX;
  if (h->payload_len < head) {
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "round forward of %llu bytes", (unsigned long long)h->payload_len);
    return;
  }
  round_args ra;
  uint64_t bits;
  ra.round = (int64_t)ps__get_u64(p + PS_FWD_PREFIX);
  bits = ps__get_u64(p + PS_FWD_PREFIX + 8);
  memcpy(&ra.denom, &bits, 8);
  bits = ps__get_u64(p + PS_FWD_PREFIX + 16);
  memcpy(&ra.batch, &bits, 8);
  ra.lr = h->lr;
  uint32_t nc = ps__get_u32(p + PS_FWD_PREFIX + 24);
  size_t nc_pad = ((size_t)nc + 1) & ~(size_t)1;
  size_t w = t->spec.width;
  uint64_t need = head + 4 * (uint64_t)nc_pad + (uint64_t)h->nkeys * (8 + 4 * w);
  if (need != h->payload_len || ra.round < 0 || !(ra.denom >= 0) || !(ra.batch >= 0)) {
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "round forward of %llu bytes for %u chains and %u rows of dim %zu",
                      (unsigned long long)h->payload_len, nc, h->nkeys, w);
    return;
  }
  const uint8_t *cl = p + head, *keys = cl + 4 * nc_pad;
  const float *rows = in_place ? in_place : (const float *)(const void *)(keys + 8 * (size_t)h->nkeys);
  ps__srv_chains x;
  if (ps__srv_chains_init(&x, s, t)) {
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  /* Every chain named, and every row's, must be one this server follows the head of; a
   * row is applied when its chain is at this round here (else it is a copy sent again). */
  uint32_t *cks = ps__malloc(((size_t)nc + 1) * sizeof *cks);
  uint8_t *take = ps__malloc((size_t)h->nkeys + 1);
  int bad = !cks || !take;
  uint64_t moved = 0;
  size_t ntake = 0;
  for (uint32_t j = 0; !bad && j < nc; j++) {
    uint32_t nx;
    cks[j] = ps__get_u32(cl + 4 * j);
    if (ps__srv_chain_place(&x, cks[j], &nx) != 2) bad = 2, moved = cks[j];
  }
  for (uint32_t i = 0; !bad && i < h->nkeys; i++) {
    uint64_t key = ps__get_u64(keys + 8 * (size_t)i);
    uint32_t nx, ck = x.order && key >= x.nsl ? 0 : ps__srv_row_chain(&x, key);
    if ((x.order && key >= x.nsl) || ps__srv_chain_place(&x, ck, &nx) != 2) {
      bad = 3, moved = key;
      break;
    }
    size_t idx = ps__srv_chain_index(&x, ck);
    take[i] = idx < y->nver && y->ver[idx] <= ra.round;
    ntake += take[i];
  }
  /* A chain's rounds are applied in order: a round past the next one means an earlier
   * round has not come (it was refused at another epoch, and is being sent again while
   * the head sent the next): applied now, the earlier one would be skipped when it
   * comes, as a copy held already, and this copy would miss it. It is to be sent again. */
  int64_t gap_at = -1;
  uint32_t gap_ck = 0;
  for (uint32_t j = 0; !bad && j < nc && gap_at < 0; j++) {
    size_t idx = ps__srv_chain_index(&x, cks[j]);
    if (idx < y->nver && y->ver[idx] < ra.round) gap_at = y->ver[idx], gap_ck = cks[j];
  }
  for (uint32_t i = 0; !bad && i < h->nkeys && gap_at < 0; i++) {
    uint32_t ck = ps__srv_row_chain(&x, ps__get_u64(keys + 8 * (size_t)i));
    size_t idx = ps__srv_chain_index(&x, ck);
    if (idx < y->nver && y->ver[idx] < ra.round) gap_at = y->ver[idx], gap_ck = ck;
  }
  ps__srv_chains_free(&x);
  if (!bad && gap_at >= 0) {
    free(cks), free(take);
    if (s->round_gaps++ == 0)
      ps__log(PS_LOG_WARN, "table '%s': round %lld came before round %lld of its chain %u; refused until that one "
              "comes (counted in STATS as round_gaps)", t->decl.name, (long long)ra.round, (long long)gap_at, gap_ck);
    ps__srv_reply_err(c, h, PS_ERR_UNAVAILABLE,
                      "round %lld of table '%s' came before round %lld of its chain %u; send it again",
                      (long long)ra.round, t->decl.name, (long long)gap_at, gap_ck);
    return;
  }
  if (bad) {
    free(cks), free(take);
    if (bad == 1)
      ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    else
      ps__srv_reply_err(c, h, PS_ERR_MOVED, "%s %llu of table '%s' is not replicated on this server (epoch %llu)",
                        bad == 2 ? "chain" : "row", (unsigned long long)moved, t->decl.name,
                        (unsigned long long)s->epoch);
    return;
  }
  ps__verdict v = {.status = PS__APPLIED};
  if (ntake == h->nkeys) {
    (void)ps__shard_round_replica(s->sh, t, keys, rows, h->nkeys, ra.round, ra.lr, ra.denom, ra.batch, &v);
  } else if (ntake) {
    uint8_t *k2 = ps__malloc(8 * ntake);
    float *r2 = ps__malloc(4 * w * ntake);
    if (!k2 || !r2) {
      v.status = PS__REJECTED;
      v.err = PS_ERR_NOMEM;
      snprintf(v.msg, sizeof v.msg, "server out of memory");
    } else {
      size_t o = 0;
      for (uint32_t i = 0; i < h->nkeys; i++)
        if (take[i]) {
          memcpy(k2 + 8 * o, keys + 8 * (size_t)i, 8);
          memcpy(r2 + w * o, rows + w * i, 4 * w);
          o++;
        }
      (void)ps__shard_round_replica(s->sh, t, k2, r2, (uint32_t)ntake, ra.round, ra.lr, ra.denom, ra.batch, &v);
    }
    free(k2), free(r2);
  }
  free(take);
  if (v.status != PS__APPLIED) {
    free(cks);
    ps__srv_reply_verdict(c, h, &v);
    return;
  }
  if (ps__srv_chains_init(&x, s, t) == 0) {
    for (uint32_t j = 0; j < nc; j++) {
      size_t idx = ps__srv_chain_index(&x, cks[j]);
      if (idx < y->nver && y->ver[idx] <= ra.round) y->ver[idx] = ra.round + 1;
    }
    ps__srv_chains_free(&x);
  }
  /* On down the chains (R = 3), rows and chains alike; answered when those are. */
  srv_fwd_group *g = ps__srv_group_new(s);
  if (!g) {
    free(cks);
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  g->up = c;
  g->up_hdr = *h;
  round_rows a = {.keys = keys, .rows = rows, .n = h->nkeys, .w = w};
  if (nc) {
    (void)ps__rs_round_send(s, t, &a, cks, nc, &ra, g);
  } else if (h->nkeys) {
    /* rows only (a round's first frames): the chains are those of its rows */
    uint32_t ck;
    if (ps__srv_chains_init(&x, s, t) == 0) {
      ck = ps__srv_row_chain(&x, ps__get_u64(keys));
      ps__srv_chains_free(&x);
      (void)ps__rs_round_send(s, t, &a, &ck, 1, &ra, g);
    }
  }
  free(cks);
  g->building = 0;
  ps__srv_group_maybe_done(s, g);
}

void ps__srv_sync_free(ps__server *s) {
  ps__rs_early_free(s);
  while (s->syncs) {
    srv_sync *y = s->syncs;
    s->syncs = y->next;
    if (y->cu) ps__rs_catchup_free(y->cu);
    free(y->ver), free(y->member), free(y->old_head), free(y->rounds);
    free(y);
  }
}
