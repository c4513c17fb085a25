/*
 * ssp.c - stale synchronous parallel (ssp:S, bounded staleness).
 *
 * Pushes are applied on arrival, as in async mode (and may be aggregated the same
 * way: async.c). A pull at clock c waits until the slowest live worker's clock is at
 * least c - S, so no worker runs more than S clocks ahead of the slowest; the owner
 * re-asks ps__shard_pull_ready whenever a clock or the live set changes.
 */
#include "shard/shard.h"

static int ssp_pull_ready(ps__shard *sh, ps__table *t, int64_t c) {
  int64_t minc, maxc;
  if (!ps__shard_live_clocks(sh, &minc, &maxc)) return 1;
  return minc >= c - (int64_t)t->spec.mode_param;
}

static void ssp_advance(ps__shard *sh, ps__table *t) { (void)sh, (void)t; }

const ps__mode_ops ps__mode_ssp = {"ssp", ps__async_admit, ps__async_push, ssp_pull_ready, ssp_advance};
