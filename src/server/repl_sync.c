/*
 * repl_sync.c - replication of sync rounds: the head of a chain forwards each round's
 * one combined update, not the workers' pushes, and after a failover the new head
 * rebuilds the rounds the dead one had not handed on.
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
 * A failover. When the head of a chain dies, its next member becomes the head: it
 * holds the rounds the dead head forwarded (ver), and its own table may be ahead of
 * them. It stops applying rounds and answering pulls of the table (the engine's hold)
 * and waits for every live worker's REPLAYED frame: the pushes each worker sent to the
 * dead server that it did not know to be on every copy, which the worker also sends
 * again here. Pushes of rounds the chain holds are answered as applied; of rounds this
 * server passed already, accumulated apart per round; of later rounds, accumulated as
 * usual. Once every live worker's list came and every push on it arrived (or at a
 * deadline), the rebuilt rounds are applied in order, each as the dead head would have
 * applied it (its global batch from the workers' lists), and forwarded on; then the
 * hold ends and the rounds after run as usual. The model is then the one no failure
 * would have given.
 *
 * Everything here runs on the server's loop thread.
 */
#include <string.h>

#include "common/common.h"
#include "server/server_int.h"

/* A round being rebuilt after a failover. */
typedef struct cu_round {
  ps__rowmap *acc;
  double batch_sum;
  float lr;
  int has_lr;
} cu_round;

typedef struct cu_push {
  uint32_t worker, seq;
  uint64_t inc;
} cu_push;

typedef struct cu_seen {
  uint32_t worker;
  int64_t clock;
} cu_seen;

typedef struct cu_marker {
  uint32_t dead, worker;
} cu_marker;

#define CU_MAX_DEAD 8

typedef struct srv_catchup {
  uint32_t dead[CU_MAX_DEAD]; /* the servers whose chains this one took over */
  size_t ndead;               /* more than one: another died while it ran */
  int64_t V;            /* the table's version when it began: rounds [from, V) are rebuilt */
  int64_t from;
  uint8_t *taken;       /* per chain index: taken over */
  cu_round *rounds;     /* V - from of them */
  cu_marker *markers;   /* (dead server, worker) whose REPLAYED came */
  size_t nmarkers;
  cu_push *expect, *arrived;
  size_t nexpect, narrived;
  cu_seen *seen;        /* (worker, clock) pairs counted in a round's batch */
  size_t nseen;
  uint64_t deadline_ms;
} srv_catchup;

struct srv_sync {
  srv_sync *next;
  uint32_t table;
  int64_t *ver;          /* per chain index: rounds of the chain held here as a member */
  size_t nver;
  srv_fwd_group **rounds; /* rounds forwarded and not answered, oldest first */
  size_t nrounds, cap;
  srv_catchup *cu;       /* a failover's catch-up, or NULL */
  uint8_t *member;       /* per chain index, before a membership: 1 a member after the head */
  uint32_t *old_head;
};

#define CATCHUP_MIN_MS 5000

static void *grow(void *p, size_t *cap, size_t n, size_t size) {
  if (n < *cap) return p;
  size_t c = *cap ? *cap * 2 : 8;
  void *q = ps__realloc(p, c * size);
  if (q) *cap = c;
  return q;
}

/* ------------------------------------------------------------------ state per table */

static srv_sync *sync_find(ps__server *s, uint32_t table) {
  for (srv_sync *y = s->syncs; y; y = y->next)
    if (y->table == table) return y;
  return NULL;
}

static srv_sync *sync_of(ps__server *s, ps__table *t) {
  srv_sync *y = sync_find(s, t->id);
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

static void durable_update(ps__server *s, srv_sync *y) {
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
  srv_sync *y = sync_find(s, t->id);
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

typedef struct round_rows {
  const ps__rowmap *m;  /* the head's round, or */
  const uint8_t *keys;  /* a frame's keys and rows */
  const float *rows;
  size_t n, w;
} round_rows;

static uint64_t rr_key(const round_rows *a, size_t i) {
  return a->m ? ps__rowmap_key_at(a->m, i) : ps__get_u64(a->keys + 8 * i);
}
static const float *rr_row(const round_rows *a, size_t i) {
  return a->m ? ps__rowmap_row_at(a->m, i) : a->rows + i * a->w;
}

typedef struct round_args {
  int64_t round;
  float lr;
  double denom, batch;
} round_args;

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
    uint8_t *buf = ps__pool_get(s->pool, len);
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
    if (ps__srv_forward_frame(s, to, &fh, buf, len, g)) {
      g->out--;
      return PS_ERR_NOMEM;
    }
    left -= k;
    if (last) return 0;
  }
}

/* Send round ra's rows (a) of chains cks (this server's place in each: `place`) on to
 * the live member after this server in each. Rows of other chains are not sent. */
static int round_send(ps__server *s, ps__table *t, const round_rows *a, const uint32_t *cks, size_t ncks,
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
  srv_sync *y = sync_find(s, (uint32_t)(uintptr_t)g->arg);
  if (!y) return;
  for (size_t i = 0; i < y->nrounds; i++)
    if (y->rounds[i] == g) {
      memmove(y->rounds + i, y->rounds + i + 1, (y->nrounds - i - 1) * sizeof *y->rounds);
      y->nrounds--;
      break;
    }
  if (g->status && g->status != PS_ERR_UNAVAILABLE)
    ps__log(PS_LOG_WARN, "table %u: round %lld was not applied by a copy: %s", y->table, (long long)g->round, g->msg);
  durable_update(s, y);
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

static srv_fwd_group *round_group(ps__server *s, srv_sync *y, int64_t round) {
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
  srv_fwd_group *g = y && cks ? round_group(s, y, round) : NULL;
  if (!g) {
    free(cks);
    ps__log(PS_LOG_ERROR, "table '%s': out of memory forwarding round %lld; its copies are behind", t->decl.name,
            (long long)round);
    return;
  }
  round_rows a = {.m = acc, .n = acc ? ps__rowmap_count(acc) : 0, .w = t->spec.width};
  round_args ra = {.round = round, .lr = lr, .denom = denom, .batch = batch};
  (void)round_send(s, t, &a, cks, n, &ra, g);
  free(cks);
  g->building = 0;
  ps__srv_group_maybe_done(s, g);
  durable_update(s, y);
}

/* ------------------------------------------------------------------ a member */

void ps__srv_on_forward_round(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__fwd fw;
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
  const float *rows = (const float *)(const void *)(keys + 8 * (size_t)h->nkeys);
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
  ps__srv_chains_free(&x);
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
    (void)round_send(s, t, &a, cks, nc, &ra, g);
  } else if (h->nkeys) {
    /* rows only (a round's first frames): the chains are those of its rows */
    uint32_t ck;
    if (ps__srv_chains_init(&x, s, t) == 0) {
      ck = ps__srv_row_chain(&x, ps__get_u64(keys));
      ps__srv_chains_free(&x);
      (void)round_send(s, t, &a, &ck, 1, &ra, g);
    }
  }
  free(cks);
  g->building = 0;
  ps__srv_group_maybe_done(s, g);
}

/* ------------------------------------------------------------------ failover: the catch-up */

static void cu_free(srv_catchup *cu, size_t nrounds) {
  if (!cu) return;
  for (size_t i = 0; i < nrounds; i++) ps__rowmap_free(cu->rounds[i].acc);
  free(cu->rounds), free(cu->taken), free(cu->markers), free(cu->expect), free(cu->arrived), free(cu->seen);
  free(cu);
}

static int cu_has_dead(const srv_catchup *cu, uint32_t dead) {
  for (size_t i = 0; i < cu->ndead; i++)
    if (cu->dead[i] == dead) return 1;
  return 0;
}

/* The dead servers, as "1" or "1, 3", into buf. */
static const char *cu_deads(const srv_catchup *cu, char *buf, size_t cap) {
  size_t at = 0;
  buf[0] = 0;
  for (size_t i = 0; i < cu->ndead && at + 12 < cap; i++)
    at += (size_t)snprintf(buf + at, cap - at, "%s%u", i ? ", " : "", cu->dead[i]);
  return buf;
}

static int push_eq(const cu_push *a, uint32_t worker, uint64_t inc, uint32_t seq) {
  return a->worker == worker && a->inc == inc && a->seq == seq;
}

/* Count (worker, clock)'s batch once in its rebuilt round. */
static void cu_batch(srv_catchup *cu, ps__table *t, uint32_t worker, int64_t clock, uint32_t batch) {
  int64_t r = clock / (int64_t)t->spec.every;
  if (r < cu->from || r >= cu->V) return;
  for (size_t i = 0; i < cu->nseen; i++)
    if (cu->seen[i].worker == worker && cu->seen[i].clock == clock) return;
  cu_seen *n = ps__realloc(cu->seen, (cu->nseen + 1) * sizeof *n);
  if (!n) return;
  cu->seen = n;
  cu->seen[cu->nseen++] = (cu_seen){worker, clock};
  cu->rounds[r - cu->from].batch_sum += batch;
}

static void cu_arrived(srv_catchup *cu, uint32_t worker, uint64_t inc, uint32_t seq) {
  for (size_t i = 0; i < cu->narrived; i++)
    if (push_eq(&cu->arrived[i], worker, inc, seq)) return;
  cu_push *n = ps__realloc(cu->arrived, (cu->narrived + 1) * sizeof *n);
  if (!n) return;
  cu->arrived = n;
  cu->arrived[cu->narrived++] = (cu_push){worker, seq, inc};
}

/* Every live worker's list about each dead server came, and every push on them (or the deadline passed). *missing:
 * the lists and pushes not come, *lists of them lists; with who, what they are, named
 * into who[cap]. */
static int cu_complete(ps__server *s, srv_catchup *cu, size_t *missing, size_t *lists, char *who, size_t cap) {
  size_t at = 0;
  *missing = *lists = 0;
  for (size_t k = 0; k < s->sh->nworkers; k++) {
    ps__worker *w = &s->sh->workers[k];
    if (!w->alive) continue;
    for (size_t d = 0; d < cu->ndead; d++) {
      int have = 0;
      for (size_t i = 0; i < cu->nmarkers && !have; i++)
        have = cu->markers[i].worker == w->id && cu->markers[i].dead == cu->dead[d];
      if (have) continue;
      (*lists)++;
      if (who && at + 48 < cap)
        at += (size_t)snprintf(who + at, cap - at, " list of worker %u for server %u;", w->id, cu->dead[d]);
    }
  }
  *missing = *lists;
  for (size_t i = 0; i < cu->nexpect; i++) {
    int got = 0;
    for (size_t j = 0; j < cu->narrived && !got; j++)
      got = push_eq(&cu->arrived[j], cu->expect[i].worker, cu->expect[i].inc, cu->expect[i].seq);
    if (got) continue;
    (*missing)++;
    if (who && at + 40 < cap)
      at += (size_t)snprintf(who + at, cap - at, " push %u of worker %u;", cu->expect[i].seq, cu->expect[i].worker);
  }
  return *missing == 0;
}

/* Apply the rebuilt rounds in order, forward them, and end the hold. */
static void cu_finish(ps__server *s, srv_sync *y, ps__table *t, const char *how) {
  srv_catchup *cu = y->cu;
  size_t nr = (size_t)(cu->V - cu->from);
  ps__srv_chains x;
  int have_x = ps__srv_chains_init(&x, s, t) == 0;
  uint32_t *cks = ps__malloc((y->nver + 1) * sizeof *cks);
  for (size_t i = 0; i < nr; i++) {
    int64_t r = cu->from + (int64_t)i;
    cu_round *cr = &cu->rounds[i];
    size_t ncks = 0;
    for (size_t j = 0; have_x && cks && j < y->nver; j++)
      if (cu->taken[j] && y->ver[j] <= r) cks[ncks++] = ps__srv_chain_name(&x, j);
    if (!ncks) continue;
    double batch = cr->batch_sum / (double)t->spec.every;
    double denom = t->spec.update == PS__UPDATE_MEAN ? batch : 1.0;
    uint64_t applied = t->applied;
    if (cr->acc && ps__rowmap_count(cr->acc)) ps__shard_apply_round_at(t, cr->acc, r, cr->has_lr ? cr->lr : -1.0f, denom, batch);
    int did = t->applied != applied;
    srv_fwd_group *g = round_group(s, y, r);
    if (!g) continue;
    round_rows a = {.m = did ? cr->acc : NULL, .n = did ? ps__rowmap_count(cr->acc) : 0, .w = t->spec.width};
    round_args ra = {.round = r, .lr = did ? t->last_lr : 0, .denom = ps__shard_acc_divided(t) ? 1.0 : denom,
                     .batch = batch};
    (void)round_send(s, t, &a, cks, ncks, &ra, g);
    g->building = 0;
    ps__srv_group_maybe_done(s, g);
  }
  free(cks);
  for (size_t j = 0; j < y->nver; j++)
    if (cu->taken[j] && y->ver[j] < cu->V) y->ver[j] = cu->V;
  if (have_x) ps__srv_chains_free(&x);
  char deads[96];
  ps__log(PS_LOG_INFO, "table '%s': took over the chains of server%s %s; rounds %lld..%lld rebuilt (%s)", t->decl.name,
          cu->ndead > 1 ? "s" : "", cu_deads(cu, deads, sizeof deads), (long long)cu->from, (long long)cu->V - 1, how);
  cu_free(cu, nr);
  y->cu = NULL;
  t->hold--;
  s->catchups++;
  durable_update(s, y);
  ps__shard_advance(s->sh);
  ps__srv_answer_ready_pulls(s);
}

static void cu_check(ps__server *s, srv_sync *y) {
  ps__table *t = ps__shard_table(s->sh, y->table);
  size_t missing, lists;
  if (!t || !y->cu) return;
  if (cu_complete(s, y->cu, &missing, &lists, NULL, 0)) {
    cu_finish(s, y, t, "every push came");
  } else if (uv_now(&s->loop) >= y->cu->deadline_ms) {
    char who[200] = ""; /* which: the workers whose list never came, and whose listed pushes did not */
    char deads[96];
    (void)cu_complete(s, y->cu, &missing, &lists, who, sizeof who);
    ps__log(PS_LOG_WARN,
            "table '%s': the catch-up after the death of server%s %s ends at its deadline, %zu push%s or lists missing "
            "(%zu lists):%s",
            t->decl.name, y->cu->ndead > 1 ? "s" : "", cu_deads(y->cu, deads, sizeof deads), missing,
            missing == 1 ? "" : "es", lists, who);
    cu_finish(s, y, t, "at the deadline");
  }
}

void ps__srv_sync_before(ps__server *s) {
  for (srv_sync *y = s->syncs; y; y = y->next) {
    ps__table *t = ps__shard_table(s->sh, y->table);
    ps__srv_chains x;
    memset(y->member, 0, y->nver);
    if (!t || ps__srv_chains_init(&x, s, t)) continue;
    for (size_t i = 0; i < y->nver && i < ps__srv_nchains(&x); i++) {
      uint32_t ch[PS_MAX_REPLICAS], head, nx;
      int mine;
      size_t n = ps__srv_chain_servers(&x, ps__srv_chain_name(&x, i), ch);
      ps__srv_chain_places(s, ch, n, &head, &mine, &nx);
      y->member[i] = mine && head != s->id;
      y->old_head[i] = head;
    }
    ps__srv_chains_free(&x);
  }
}

/* Rounds [from, cu->V) to rebuild, from [cu->from, cu->V): the new rounds in front. */
static int cu_widen(srv_catchup *cu, int64_t from) {
  if (from >= cu->from) return 0;
  size_t had = (size_t)(cu->V - cu->from), more = (size_t)(cu->from - from);
  cu_round *r = ps__calloc(had + more, sizeof *r);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  if (had) memcpy(r + more, cu->rounds, had * sizeof *r);
  free(cu->rounds);
  cu->rounds = r;
  cu->from = from;
  return 0;
}

void ps__srv_sync_after(ps__server *s) {
  for (srv_sync *y = s->syncs; y; y = y->next) {
    ps__table *t = ps__shard_table(s->sh, y->table);
    ps__srv_chains x;
    if (!t || ps__srv_chains_init(&x, s, t)) continue;
    /* the chains this server heads now and followed the head of before, not yet taken
     * over, and their dead heads */
    uint8_t *mine = ps__calloc(y->nver ? y->nver : 1, 1);
    uint32_t dead[CU_MAX_DEAD];
    size_t n = 0, ndead = 0;
    int64_t from = t->version;
    for (size_t i = 0; mine && i < y->nver && i < ps__srv_nchains(&x); i++) {
      uint32_t nx;
      if (!y->member[i] || ps__srv_chain_place(&x, ps__srv_chain_name(&x, i), &nx) != 1) continue;
      if (y->cu && y->cu->taken[i]) continue;
      mine[i] = 1;
      n++;
      if (y->ver[i] < from) from = y->ver[i];
      int seen = 0;
      for (size_t d = 0; d < ndead && !seen; d++) seen = dead[d] == y->old_head[i];
      if (!seen && ndead < CU_MAX_DEAD) dead[ndead++] = y->old_head[i];
    }
    ps__srv_chains_free(&x);
    if (!mine) {
      ps__log(PS_LOG_ERROR, "table '%s': out of memory taking over chains", t->decl.name);
      continue;
    }
    if (!n) {
      free(mine);
      continue;
    }
    char deads[96];
    uint64_t wait = 10ull * s->o.heartbeat_ms + 2000;
    uint64_t deadline = uv_now(&s->loop) + (wait > CATCHUP_MIN_MS ? wait : CATCHUP_MIN_MS);
    srv_catchup *cu = y->cu;
    if (cu && cu->V == t->version && cu->ndead + ndead <= CU_MAX_DEAD && cu_widen(cu, from) == 0) {
      /* Another death during a catch-up: this one takes the new chains in, waits for
       * the lists about every dead server, and rebuilds from the oldest round any of
       * its chains lacks. (The table, held, has not moved since it began.) */
      for (size_t i = 0; i < y->nver; i++) cu->taken[i] |= mine[i];
      for (size_t d = 0; d < ndead; d++)
        if (!cu_has_dead(cu, dead[d])) cu->dead[cu->ndead++] = dead[d];
      if (deadline > cu->deadline_ms) cu->deadline_ms = deadline;
      free(mine);
      ps__log(PS_LOG_INFO, "table '%s': taking over %zu more chain%s, of server%s %s, during a catch-up at round %lld "
              "(rebuilding from %lld)", t->decl.name, n, n == 1 ? "" : "s", cu->ndead > 1 ? "s" : "",
              cu_deads(cu, deads, sizeof deads), (long long)cu->V, (long long)cu->from);
      cu_check(s, y);
      continue;
    }
    if (cu) {
      /* the table moved, or too many dead: finish this one with what came, then start anew */
      cu_finish(s, y, t, "another server died meanwhile");
    }
    cu = ps__calloc(1, sizeof *cu);
    if (cu) cu->taken = mine;
    if (!cu || !cu->taken) {
      if (cu) cu->taken = NULL;
      free(mine);
      cu_free(cu, 0);
      ps__log(PS_LOG_ERROR, "table '%s': out of memory taking over server %u's chains", t->decl.name, dead[0]);
      continue;
    }
    memcpy(cu->dead, dead, ndead * sizeof *dead);
    cu->ndead = ndead;
    cu->V = t->version;
    cu->from = from < cu->V ? from : cu->V;
    size_t nr = (size_t)(cu->V - cu->from);
    cu->rounds = ps__calloc(nr ? nr : 1, sizeof *cu->rounds);
    if (!cu->rounds) {
      cu_free(cu, 0);
      continue;
    }
    cu->deadline_ms = deadline;
    y->cu = cu;
    t->hold++;
    ps__log(PS_LOG_INFO, "table '%s': taking over %zu chain%s of server%s %s at round %lld (rebuilding from %lld)",
            t->decl.name, n, n == 1 ? "" : "s", ndead > 1 ? "s" : "", cu_deads(cu, deads, sizeof deads),
            (long long)cu->V, (long long)cu->from);
    cu_check(s, y);
  }
}

void ps__srv_sync_tick(ps__server *s) {
  for (srv_sync *y = s->syncs; y; y = y->next)
    if (y->cu) cu_check(s, y);
}

int ps__srv_sync_push(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const ps__push *p) {
  srv_sync *y = sync_find(s, t->id);
  if (!y || !p->nkeys) return 0;
  srv_catchup *cu = y->cu;
  if (!cu) { /* the usual case: no catch-up, and no chain here ahead of the table */
    int ahead = 0;
    for (size_t i = 0; i < y->nver && !ahead; i++) ahead = y->ver[i] > t->version;
    if (!ahead) return 0;
  }
  ps__srv_chains x;
  if (ps__srv_chains_init(&x, s, t)) return 0;
  uint32_t nx, ck = ps__srv_push_chain(&x, p);
  size_t idx = ps__srv_chain_index(&x, ck);
  int head = ps__srv_chain_place(&x, ck, &nx) == 1;
  ps__srv_chains_free(&x);
  if (idx >= y->nver) return 0;
  int64_t r = p->clock / (int64_t)t->spec.every;
  /* A round this server's table has not passed, but the chain holds already: it took the
   * chain over while a member a round ahead of its own table (the dead head forwarded
   * the round before this server had every worker's CLOCK). Such a push, sent again,
   * must not go into the table's round, which would apply it to the chain twice. */
  int ahead = head && r >= t->version && r < y->ver[idx];
  int catching = cu && cu->taken[idx];
  if (!catching && !ahead) return 0;
  if (catching) {
    if (p->inc) cu_arrived(cu, p->sender, p->inc, p->seq);
    cu_batch(cu, t, p->sender, p->clock, p->batch);
    if (r >= cu->V && !ahead) return 0; /* a later round: as usual (the caller checks the catch-up after) */
  }
  ps__verdict v;
  if (ps__shard_push_identity(s->sh, t, p, &v) != PS__APPLIED) {
    ps__srv_reply_verdict(c, h, &v);
    return 1;
  }
  if (ahead) s->held_ahead++;
  if (!v.dup && catching && r >= y->ver[idx]) {
    cu_round *cr = &cu->rounds[r - cu->from];
    if (!cr->acc && !(cr->acc = ps__rowmap_new(t->spec.width))) {
      ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
      return 1;
    }
    if (ps__shard_accumulate(t, cr->acc, p, t->spec.update == PS__UPDATE_MEAN ? (float)p->batch : 1.0f, 0)) {
      ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
      return 1;
    }
    if (p->lr >= 0) cr->lr = p->lr, cr->has_lr = 1;
  }
  /* held by the chain already (an earlier round), or now in its rebuilt round */
  if (!v.dup) ps__shard_push_done(s->sh, p);
  ps__frame_hdr r0 = {.type = (uint8_t)(h->type | PS_FRAME_REPLY), .req_id = h->req_id, .table = h->table,
                      .clock = ps__srv_sync_durable_clock(s, t)};
  ps__conn_send_ctrl(c, &r0, NULL, 0);
  if (catching) cu_check(s, y);
  return 1;
}

void ps__srv_sync_pushed(ps__server *s, ps__table *t) {
  srv_sync *y = sync_find(s, t->id);
  if (y && y->cu) cu_check(s, y);
}

/* A worker's REPLAYED list (validated): its marker and expected pushes, in the catch-up
 * of every table that takes over chains of `dead`. */
static void replayed_apply(ps__server *s, uint32_t sender, const uint8_t *p) {
  uint32_t dead = ps__get_u32(p), n = ps__get_u32(p + 4);
  for (srv_sync *y = s->syncs; y; y = y->next) {
    srv_catchup *cu = y->cu;
    ps__table *t = ps__shard_table(s->sh, y->table);
    if (!cu || !t || !cu_has_dead(cu, dead)) continue;
    int have = 0;
    for (size_t i = 0; i < cu->nmarkers && !have; i++) have = cu->markers[i].worker == sender && cu->markers[i].dead == dead;
    if (!have) {
      cu_marker *m = ps__realloc(cu->markers, (cu->nmarkers + 1) * sizeof *m);
      if (m) cu->markers = m, cu->markers[cu->nmarkers++] = (cu_marker){dead, sender};
    }
    ps__srv_chains x;
    if (ps__srv_chains_init(&x, s, t)) continue;
    for (uint32_t e = 0; e < n; e++) {
      const uint8_t *q = p + 8 + (size_t)e * PS_REPLAYED_ENTRY;
      if (ps__get_u32(q) != t->id) continue;
      uint32_t batch = ps__get_u32(q + 4), seq = ps__get_u32(q + 24), nch = ps__get_u32(q + 28);
      int64_t clock = (int64_t)ps__get_u64(q + 8);
      uint64_t inc = ps__get_u64(q + 16);
      cu_batch(cu, t, sender, clock, batch);
      if (nch == 0 || nch > PS_MAX_REPLICAS || clock < 0) continue;
      /* the entry's chain, by its servers: one of those taken over here? */
      for (size_t i = 0; i < y->nver && i < ps__srv_nchains(&x); i++) {
        if (!cu->taken[i]) continue;
        uint32_t ch[PS_MAX_REPLICAS];
        size_t cn = ps__srv_chain_servers(&x, ps__srv_chain_name(&x, i), ch);
        int same = cn == nch;
        for (size_t k = 0; same && k < cn; k++) same = ch[k] == ps__get_u32(q + 32 + 4 * k);
        if (!same) continue;
        if (clock / (int64_t)t->spec.every >= y->ver[i]) {
          cu_push *np = ps__realloc(cu->expect, (cu->nexpect + 1) * sizeof *np);
          if (np) cu->expect = np, cu->expect[cu->nexpect++] = (cu_push){sender, seq, inc};
        }
        break;
      }
    }
    ps__srv_chains_free(&x);
    cu_check(s, y);
  }
}

/* Lists that came before the membership they answer (a worker may hear of a death
 * before this server does, over another connection): kept until this server is at
 * their epoch, when the catch-ups they are for have begun. At most EARLY_MAX of them
 * and EARLY_MAX_BYTES in all; beyond, the oldest is let go (its catch-up then ends at
 * its deadline). */
struct srv_early {
  srv_early *next;
  uint64_t epoch;
  uint32_t sender;
  size_t len;
  uint8_t body[];
};

#define EARLY_MAX 64
#define EARLY_MAX_BYTES ((size_t)16 << 20)

static void early_drop_oldest(ps__server *s) {
  srv_early **pp = &s->early;
  while (*pp && (*pp)->next) pp = &(*pp)->next;
  srv_early *e = *pp;
  if (!e) return;
  *pp = NULL;
  s->nearly--;
  s->early_bytes -= e->len;
  ps__log(PS_LOG_WARN, "a REPLAYED list from node %u for epoch %llu let go: too many wait for a membership",
          e->sender, (unsigned long long)e->epoch);
  free(e);
}

static void early_keep(ps__server *s, const ps__frame_hdr *h, const uint8_t *p) {
  while (s->early && (s->nearly >= EARLY_MAX || s->early_bytes + h->payload_len > EARLY_MAX_BYTES))
    early_drop_oldest(s);
  srv_early *e = h->payload_len <= EARLY_MAX_BYTES ? ps__malloc(sizeof *e + h->payload_len) : NULL;
  if (!e) {
    ps__log(PS_LOG_WARN, "a REPLAYED list from node %u for epoch %llu let go: out of memory", h->sender,
            (unsigned long long)h->epoch);
    return;
  }
  e->epoch = h->epoch;
  e->sender = h->sender;
  e->len = h->payload_len;
  memcpy(e->body, p, h->payload_len);
  e->next = s->early; /* newest first */
  s->early = e;
  s->nearly++;
  s->early_bytes += e->len;
}

void ps__srv_sync_epoch(ps__server *s) {
  /* oldest first, in the order they came */
  while (s->early) {
    srv_early **pp = &s->early, **at = NULL;
    for (; *pp; pp = &(*pp)->next)
      if ((*pp)->epoch <= s->epoch) at = pp;
    if (!at) return;
    srv_early *e = *at;
    *at = e->next;
    s->nearly--;
    s->early_bytes -= e->len;
    replayed_apply(s, e->sender, e->body);
    free(e);
  }
}

void ps__srv_on_replayed(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c;
  if (h->payload_len < 8) return;
  const uint8_t *p = b->buf;
  uint32_t n = ps__get_u32(p + 4);
  if ((h->payload_len - 8) / PS_REPLAYED_ENTRY < n || 8 + (uint64_t)n * PS_REPLAYED_ENTRY != h->payload_len) {
    ps__log(PS_LOG_WARN, "a REPLAYED frame of %llu bytes for %u entries from node %u ignored",
            (unsigned long long)h->payload_len, n, h->sender);
    return;
  }
  ps__log(PS_LOG_INFO, "worker %u's list of %u push%s to server %u (epoch %llu, this server's %llu)%s", h->sender, n,
          n == 1 ? "" : "es", ps__get_u32(p), (unsigned long long)h->epoch, (unsigned long long)s->epoch,
          h->epoch > s->epoch ? ": kept until this server is at that epoch" : "");
  if (h->epoch > s->epoch) {
    early_keep(s, h, p); /* this server has not heard of that death yet */
    return;
  }
  replayed_apply(s, h->sender, p);
}

void ps__srv_sync_free(ps__server *s) {
  while (s->early) {
    srv_early *e = s->early;
    s->early = e->next;
    free(e);
  }
  s->nearly = s->early_bytes = 0;
  while (s->syncs) {
    srv_sync *y = s->syncs;
    s->syncs = y->next;
    if (y->cu) cu_free(y->cu, (size_t)(y->cu->V - y->cu->from));
    free(y->ver), free(y->member), free(y->old_head), free(y->rounds);
    free(y);
  }
}
