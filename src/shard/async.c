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
  ps__shard_apply_acc(t, t->agg, 1.0, t->spec.update == PS__UPDATE_MEAN, t->agg_has_lr ? t->agg_lr : -1.0f, gb);
  t->agg_batch = 0;
  ps__rowmap_clear(t->agg);
  t->agg_count = 0;
  t->agg_has_lr = 0;
}

int ps__async_push(ps__shard *sh, ps__table *t, const ps__push *p, ps__owned *body, ps__verdict *v) {
  const ps__table_spec *sp = &t->spec;
  if (sp->agg_n == 1 || (sp->agg_n == 0 && sp->agg_ms == 0)) return ps__shard_apply_direct(sh, t, p, body, v);
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

static int async_pull_ready(ps__shard *sh, ps__table *t, int64_t c) {
  (void)sh, (void)t, (void)c;
  return 1;
}

static void async_advance(ps__shard *sh, ps__table *t) { (void)sh, (void)t; }

const ps__mode_ops ps__mode_async = {"async", ps__async_admit, ps__async_push, async_pull_ready, async_advance};
