/*
 * repl_catchup.c - a failover of replicated sync rounds (repl_sync.c): the new head of
 * a dead head's chains rebuilds the rounds the dead one had not handed on, from the
 * pushes the workers list (REPLAYED) and send again.
 *
 * When the head of a chain dies, its next member becomes the head: it holds the rounds
 * the dead head forwarded (ver), and its own table may be ahead of them. It stops
 * applying rounds and answering pulls of the table (the engine's hold) and waits for
 * every live worker's REPLAYED frame: the pushes each worker sent to the dead server
 * that it did not know to be on every copy, which the worker also sends again here.
 * Pushes of rounds the chain holds are answered as applied; of rounds this server
 * passed already, accumulated apart per round; of later rounds, accumulated as usual.
 * Once every live worker's list came and every push on it arrived (or at a deadline),
 * the rebuilt rounds are applied in order, each as the dead head would have applied it
 * (its global batch from the workers' lists), and forwarded on; then the hold ends and
 * the rounds after run as usual. The model is then the one no failure would have given.
 * A second death while a catch-up runs joins it.
 *
 * Everything here runs on the server's loop thread.
 */
#include <string.h>

#include "common/common.h"
#include "server/repl_sync_int.h"
#include "server/server_int.h"

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
    srv_fwd_group *g = ps__rs_round_group(s, y, r);
    if (!g) continue;
    round_rows a = {.m = did ? cr->acc : NULL, .n = did ? ps__rowmap_count(cr->acc) : 0, .w = t->spec.width};
    round_args ra = {.round = r, .lr = did ? t->last_lr : 0, .denom = ps__shard_acc_divided(t) ? 1.0 : denom,
                     .batch = batch};
    (void)ps__rs_round_send(s, t, &a, cks, ncks, &ra, g);
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
  ps__rs_durable_update(s, y);
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
  srv_sync *y = ps__rs_find(s, t->id);
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

void ps__srv_sync_refused(ps__server *s, ps__table *t, const ps__push *p, const ps__verdict *v) {
  if (v->err != PS_ERR_CLOCK) return;
  int64_t every = t->spec.every ? (int64_t)t->spec.every : 1, round = p->clock >= 0 ? p->clock / every : -1;
  if (round >= 0 && round < t->version && round < t->durable) {
    /* Its round is on every copy: most likely the copy a worker kept of a push to a
     * table it seldom pushes to, sent again at a failover (applied with that round);
     * else a push that came too late, which its worker hears of. Not a chain's fault. */
    ps__log(PS_LOG_DEBUG, "table '%s': push %u of worker %u for round %lld refused: every copy holds that round",
            t->decl.name, p->seq, p->sender, (long long)round);
    return;
  }
  if (s->sync_refusals_logged >= 20) return;
  s->sync_refusals_logged++;
  srv_sync *y = ps__rs_find(s, t->id);
  ps__srv_chains x;
  uint32_t nx = 0, ck = 0;
  size_t idx = SIZE_MAX;
  int place = -1;
  if (y && p->nkeys && !ps__srv_chains_init(&x, s, t)) {
    ck = ps__srv_push_chain(&x, p);
    idx = ps__srv_chain_index(&x, ck);
    place = ps__srv_chain_place(&x, ck, &nx);
    ps__srv_chains_free(&x);
  }
  srv_catchup *cu = y ? y->cu : NULL;
  ps__log(PS_LOG_WARN,
          "table '%s': push of worker %u (incarnation %llu, push %u) for clock %lld refused at round %lld (epoch %llu): "
          "chain %u, place %d, rounds held %lld; catch-up %s (at round %lld, from %lld, chain taken %d)",
          t->decl.name, p->sender, (unsigned long long)p->inc, p->seq, (long long)p->clock, (long long)t->version,
          (unsigned long long)s->epoch, ck, place, y && idx < y->nver ? (long long)y->ver[idx] : -1LL,
          cu ? "running" : "none", cu ? (long long)cu->V : -1LL, cu ? (long long)cu->from : -1LL,
          cu && idx < y->nver ? cu->taken[idx] : 0);
}

void ps__srv_sync_pushed(ps__server *s, ps__table *t) {
  srv_sync *y = ps__rs_find(s, t->id);
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

void ps__rs_catchup_free(srv_catchup *cu) { cu_free(cu, (size_t)(cu->V - cu->from)); }

void ps__rs_early_free(ps__server *s) {
  while (s->early) {
    srv_early *e = s->early;
    s->early = e->next;
    free(e);
  }
  s->nearly = s->early_bytes = 0;
}
