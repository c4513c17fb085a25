/*
 * sync.c - the sync (BSP) and sync:M (first M of K, backup workers) consistency models.
 *
 * A push for clock c is accumulated into round c / every's accumulator of its table
 * (batch-weighted: acc += b_k * g_k in mean mode, acc += g_k in sum mode); the batch
 * of a worker's first push to (table, round, clock) is added to the round's
 * denominator. Each worker sends CLOCK c+1 to every server when it finishes clock c;
 * frames on one connection arrive in order, so all of a worker's pushes for c are in
 * once its CLOCK is. The table's version v is the number of rounds applied; round v is
 * applied when every live worker's clock (sync), or the first M of them (sync:M), has
 * passed the round's last clock: each touched row gets g = acc / denominator (mean) or
 * acc (sum) and one optimiser step. A pull at clock c is answered once the round of c
 * is applied. Under sync:M, a push for a round already applied is counted and dropped.
 */
#include "shard/shard.h"

#include <string.h>

#include "common/common.h"

static ps__round *get_round(ps__table *t, int64_t round) {
  ps__round *r = &t->rounds[round % PS__ROUND_WINDOW];
  if (r->round != round) {
    PS_ASSERT(r->round < round);
    /* An idle slot's accumulator (cleared when its round was applied) is reused before a
     * new one is made: its pages are warm, where a new one faults in fresh zeroed pages
     * (2.3% of the time of 1M-float rounds while the window's eight slots filled). */
    for (int i = 0; i < PS__ROUND_WINDOW && !r->acc; i++) {
      ps__round *o = &t->rounds[i];
      if (o->round == -1 && o->acc) r->acc = o->acc, o->acc = NULL;
    }
    if (!r->acc) {
      r->acc = ps__rowmap_new(t->spec.width);
      if (!r->acc) return NULL;
    } else {
      ps__rowmap_clear(r->acc);
    }
    r->round = round;
    r->batch_sum = 0;
    r->has_lr = 0;
    r->npushers = 0;
  }
  return r;
}

/* Record a worker's batch in the round, once per worker and clock (a round of a table
 * with every=N spans N clocks, each with its own batch). 0 or NOMEM. */
static int round_add_pusher(ps__round *r, uint32_t worker_id, int64_t clock, uint32_t batch) {
  for (size_t i = 0; i < r->npushers; i++)
    if (r->pushers[i].worker == worker_id && r->pushers[i].clock == clock) return 0;
  if (r->npushers == r->cap) {
    size_t cap = r->cap ? r->cap * 2 : 8;
    ps__pusher *p = ps__realloc(r->pushers, cap * sizeof *p);
    if (!p) return PS_ERR_NOMEM;
    r->pushers = p;
    r->cap = cap;
  }
  r->pushers[r->npushers].worker = worker_id;
  r->pushers[r->npushers].clock = clock;
  r->npushers++;
  r->batch_sum += batch;
  return 0;
}

static int sync_admit(ps__shard *sh, ps__table *t, ps__worker *w, const ps__push *p, int64_t fastest, ps__verdict *v) {
  (void)w, (void)fastest;
  int64_t round = p->clock / (int64_t)t->spec.every;
  if (round < t->version) {
    if (t->spec.mode == PS__MODE_SYNC_M) {
      t->dropped++;
      v->status = PS__DROPPED;
      return PS__DROPPED;
    }
    return ps__shard_reject(sh, t, v, PS_ERR_CLOCK, "push for clock %lld rejected: table '%s' already applied round %lld",
                            (long long)p->clock, t->decl.name, (long long)t->version - 1);
  }
  if (round >= t->version + PS__ROUND_WINDOW)
    return ps__shard_reject(sh, t, v, PS_ERR_CLOCK, "push for clock %lld rejected: table '%s' is at round %lld (window %d)",
                            (long long)p->clock, t->decl.name, (long long)t->version, PS__ROUND_WINDOW);
  return PS__APPLIED;
}

/* The accumulator of an admitted push's round, with the pusher and its rate recorded. */
ps__rowmap *ps__sync_round_acc(ps__shard *sh, ps__table *t, const ps__push *p, ps__verdict *v) {
  ps__round *r = get_round(t, p->clock / (int64_t)t->spec.every);
  if (!r || round_add_pusher(r, p->sender, p->clock, p->batch)) {
    ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
    return NULL;
  }
  if (p->lr >= 0) {
    r->lr = p->lr;
    r->has_lr = 1;
  }
  return r->acc;
}

static int sync_push(ps__shard *sh, ps__table *t, const ps__push *p, ps__owned *body, ps__verdict *v) {
  (void)body;
  ps__rowmap *acc = ps__sync_round_acc(sh, t, p, v);
  if (!acc) return v->status;
  if (ps__shard_accumulate(t, acc, p, t->spec.update == PS__UPDATE_MEAN ? (float)p->batch : 1.0f, 0))
    return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
  t->pushes++;
  return PS__APPLIED;
}

/* One optimiser step for round r of t with every row of its accumulator. A round of
 * every=N clocks is one step with N times the batch-weighted mean over all its pushes:
 * with equal batches, the sum of the N clocks' means (as N sgd steps on parameters held
 * for N clocks). The round's global batch is the batches of the workers that pushed to
 * it: it shrinks when a worker leaves, and the scaled learning rate with it. */
static void apply_round(ps__table *t, ps__round *r) {
  double batch = r->batch_sum / (double)t->spec.every;
  double denom = t->spec.update == PS__UPDATE_MEAN ? batch : 1.0;
  ps__shard_apply_acc(t, r->acc, denom, 0, r->has_lr ? r->lr : -1.0f, batch);
}

/* Live workers past round t->version, and how many must be for it to be applied. */
static size_t round_past(const ps__shard *sh, const ps__table *t, size_t alive, size_t *quorum) {
  int64_t need = (t->version + 1) * (int64_t)t->spec.every; /* clocks past the round's last clock */
  size_t past = 0;
  *quorum = alive;
  if (t->spec.mode == PS__MODE_SYNC_M && t->spec.mode_param < alive) *quorum = t->spec.mode_param;
  for (size_t k = 0; k < sh->nworkers; k++) past += sh->workers[k].alive && sh->workers[k].clock >= need;
  return past;
}

static void sync_advance(ps__shard *sh, ps__table *t) {
  if (t->hold) return;
  int64_t minc, maxc;
  size_t alive = ps__shard_live_clocks(sh, &minc, &maxc);
  if (alive == 0) {
    t->blocked_ms = 0;
    return;
  }
  int64_t every = (int64_t)t->spec.every;
  for (;;) {
    size_t quorum, past = round_past(sh, t, alive, &quorum);
    if (past < quorum) {
      /* Someone waits for this round from now on (or did already). */
      if (past == 0) t->blocked_ms = 0;
      else if (!t->blocked_ms) t->blocked_ms = ps__now_ms();
      break;
    }
    t->blocked_ms = 0;
    ps__round *r = &t->rounds[t->version % PS__ROUND_WINDOW];
    void *token = NULL;
    int have = r->round == t->version;
    double batch = have ? r->batch_sum / (double)every : 0, denom = t->spec.update == PS__UPDATE_MEAN ? batch : 1.0;
    if (have) {
      uint64_t applied = t->applied;
      if (!sh->hooks.round_apply || !sh->hooks.round_apply(sh->hooks.arg, t, r, &token)) apply_round(t, r);
      /* rows divided in place by the denominator (ps__shard_acc_divided) take none again */
      if (sh->hooks.round_applied)
        sh->hooks.round_applied(sh->hooks.arg, t, t->applied != applied ? r->acc : NULL, t->version, t->last_lr,
                                ps__shard_acc_divided(t) ? 1.0 : denom, batch);
      r->round = -1;
      ps__rowmap_clear(r->acc);
    } else if (sh->hooks.round_applied) {
      sh->hooks.round_applied(sh->hooks.arg, t, NULL, t->version, 0, 1.0, 0);
    }
    t->version++;
    if (have && sh->hooks.round_done) sh->hooks.round_done(sh->hooks.arg, t, token);
    if (t->cut_at >= 0 && t->version * every >= t->cut_at) { /* before the next round changes it */
      t->cut_at = -1;
      if (sh->hooks.cut) sh->hooks.cut(sh->hooks.arg, t);
    }
  }
}

static int sync_pull_ready(ps__shard *sh, ps__table *t, int64_t c) {
  (void)sh;
  int64_t need = c / (int64_t)t->spec.every;
  return t->version >= need && t->durable >= need && !t->hold;
}

size_t ps__sync_laggards(ps__shard *sh, uint64_t now_ms, uint64_t min_ms, ps__stall *out, size_t cap) {
  int64_t minc, maxc;
  size_t alive = ps__shard_live_clocks(sh, &minc, &maxc), n = 0;
  if (!sh->started || alive == 0) return 0;
  for (size_t i = 0; i < sh->ntables; i++) {
    ps__table *t = sh->tables[i];
    size_t quorum;
    if (!t || !ps__table_is_sync(t) || !t->blocked_ms) continue;
    size_t past = round_past(sh, t, alive, &quorum);
    if (past == 0 || past >= quorum) continue;
    int64_t need = (t->version + 1) * (int64_t)t->spec.every;
    for (size_t k = 0; k < sh->nworkers; k++) {
      const ps__worker *w = &sh->workers[k];
      if (!w->alive || w->clock >= need) continue;
      uint64_t since = w->clocked_ms > t->blocked_ms ? w->clocked_ms : t->blocked_ms;
      uint64_t held = now_ms > since ? now_ms - since : 0;
      if (held < min_ms) continue;
      size_t j = 0;
      while (j < n && out[j].worker != w->id) j++;
      if (j == n) {
        if (n == cap) continue;
        n++;
      } else if (out[j].held_ms >= held) {
        continue;
      }
      out[j] = (ps__stall){.worker = w->id, .table = t->id, .round = t->version, .held_ms = held,
                           .clocked = (uint32_t)w->clocked};
    }
  }
  return n;
}

const ps__mode_ops ps__mode_sync = {"sync", sync_admit, sync_push, sync_pull_ready, sync_advance};
