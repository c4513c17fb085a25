/*
 * async.c - the async (eventual) consistency model, with server-side aggregation.
 *
 * A push is applied on arrival. With aggregation (table options agg_n=N, agg_ms=T) the
 * pushes are buffered instead, and the buffer is applied as one update with, per row,
 * the batch-weighted mean of the pushes that touched it (or their sum in sum mode),
 * after N pushes or T milliseconds after the first, whichever comes first. The timer is
 * the owner's (hooks.arm_flush), which calls ps__shard_agg_flush when it fires. Pulls
 * are answered at once. The staleness of every push (the fastest live worker's clock
 * minus the push's) is recorded in a histogram. ssp.c shares this push path.
 */
#include "shard/shard.h"

#include "common/common.h"

int ps__async_admit(ps__shard *sh, ps__table *t, ps__worker *w, const ps__push *p, int64_t fastest, ps__verdict *v) {
  (void)t, (void)w, (void)v;
  ps__shard_stale(sh->push_stale, &sh->push_stale_max, fastest - p->clock);
  return PS__APPLIED;
}

void ps__shard_agg_flush(ps__table *t) {
  ps__shard *sh = t->sh;
  if (t->agg_armed) {
    t->agg_armed = 0;
    if (sh->hooks.arm_flush) sh->hooks.arm_flush(sh->hooks.arg, t, 0);
  }
  if (!t->agg || t->agg_count == 0) return;
  /* The global batch is estimated as the mean buffered batch times the live workers
   * (what a sync round over the same workers would combine). */
  int64_t minc, maxc;
  size_t k = ps__shard_live_clocks(sh, &minc, &maxc);
  double gb = t->agg_batch / t->agg_count * (double)(k ? k : 1);
  int per_row = t->spec.update == PS__UPDATE_MEAN;
  uint64_t applied = t->applied;
  ps__shard_apply_acc(t, t->agg, 1.0, per_row, t->agg_has_lr ? t->agg_lr : -1.0f, gb);
  /* The buffer as applied: rows divided in place by their weights already take none. */
  if (t->applied != applied && sh->hooks.agg_applied)
    sh->hooks.agg_applied(sh->hooks.arg, t, t->agg, per_row && !ps__shard_acc_divided(t), t->last_lr, gb, t->step);
  t->agg_batch = 0;
  ps__rowmap_clear(t->agg);
  t->agg_count = 0;
  t->agg_has_lr = 0;
}

int ps__async_push(ps__shard *sh, ps__table *t, const ps__push *p, ps__owned *body, ps__verdict *v) {
  const ps__table_spec *sp = &t->spec;
  /* A push forwarded by its chain's head on its own (a copy sent again after a failure:
   * the buffers it was combined into travel as ps__shard_agg_replica) is applied at once. */
  if (!ps__table_aggregates(t) || p->replica) return ps__shard_apply_direct(sh, t, p, body, v);
  /* Buffered: rows carry one more float, the row's weight sum. */
  if (!t->agg && !(t->agg = ps__rowmap_new((size_t)sp->width + 1)))
    return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
  if (p->lr >= 0) {
    t->agg_lr = p->lr;
    t->agg_has_lr = 1;
  }
  if (ps__shard_accumulate(t, t->agg, p, sp->update == PS__UPDATE_MEAN ? (float)p->batch : 1.0f, 1))
    return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
  t->pushes++;
  t->agg_count++;
  t->agg_batch += p->batch;
  uint32_t n = sp->agg_n ? sp->agg_n : UINT32_MAX;
  if (t->agg_count >= n) {
    ps__shard_agg_flush(t);
  } else if (sp->agg_ms && !t->agg_armed && sh->hooks.arm_flush) {
    sh->hooks.arm_flush(sh->hooks.arg, t, sp->agg_ms);
    t->agg_armed = 1;
  }
  return PS__APPLIED;
}

int ps__shard_agg_replica(ps__shard *sh, ps__table *t, const uint8_t *keys, const float *rows, uint32_t n,
                          int per_row, float lr, double gb, uint64_t step, const ps__push_id *ids, uint32_t nids,
                          ps__verdict *v) {
  v->status = PS__APPLIED;
  v->later = v->dup = 0;
  if (!ps__table_aggregates(t))
    return ps__shard_reject(sh, t, v, PS_ERR_INVALID, "table '%s' does not aggregate pushes", t->decl.name);
  /* The buffer's pushes against the windows: a frame that came twice (sent again after
   * its answer was lost, or duplicated on the way) finds all of them applied, and
   * changes nothing; one that finds only some applied (they came on their own first:
   * their workers sent them again while the buffer was on its way) cannot take them out
   * of its combined rows, so it is refused, and its pushes are sent again on their own. */
  uint32_t seen = 0;
  for (uint32_t i = 0; i < nids; i++) {
    const ps__once *o = ps__once_find(&sh->once, ids[i].worker, ids[i].unit);
    seen += o && ps__once_check(o, ids[i].inc, ids[i].seq) != PS__ONCE_NEW;
  }
  if (nids && seen == nids) {
    sh->once.dups += nids;
    v->dup = 1;
    return PS__APPLIED;
  }
  if (seen)
    return ps__shard_reject(sh, t, v, PS_ERR_UNAVAILABLE,
                            "an aggregation buffer of table '%s' with %u of its %u pushes applied here already: "
                            "its pushes are to be sent again on their own",
                            t->decl.name, seen, nids);
  size_t w = (size_t)t->spec.width + 1;
  if (!t->agg_rep && !(t->agg_rep = ps__rowmap_new(w))) return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
  for (uint32_t i = 0; i < n; i++) {
    int created;
    float *r = ps__rowmap_upsert(t->agg_rep, ps__get_u64(keys + 8 * (size_t)i), &created);
    if (!r) {
      ps__rowmap_clear(t->agg_rep);
      return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
    }
    for (size_t j = 0; j < w; j++) r[j] += rows[(size_t)i * w + j]; /* a key twice: combined */
  }
  sh->replay_step = step;
  ps__shard_apply_acc(t, t->agg_rep, 1.0, per_row, lr, gb);
  sh->replay_step = 0;
  ps__rowmap_clear(t->agg_rep);
  for (uint32_t i = 0; i < nids; i++) {
    ps__once *o = ps__once_get(&sh->once, ids[i].worker, ids[i].unit);
    if (o && ps__once_check(o, ids[i].inc, ids[i].seq) == PS__ONCE_NEW) ps__once_mark(o, ids[i].inc, ids[i].seq);
  }
  t->pushes += nids;
  return PS__APPLIED;
}

static int async_pull_ready(ps__shard *sh, ps__table *t, int64_t c) {
  (void)sh, (void)t, (void)c;
  return 1;
}

static void async_advance(ps__shard *sh, ps__table *t) { (void)sh, (void)t; }

const ps__mode_ops ps__mode_async = {"async", ps__async_admit, ps__async_push, async_pull_ready, async_advance};
