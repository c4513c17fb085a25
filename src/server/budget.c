/*
 * budget.c - a server's limits: the memory budget of its tables' rows (a dense table
 * too large for it is refused at CREATE; past it, requests for new rows are refused
 * by the engine, shard.h ps__shard_room), and the frame budget of its workers'
 * connections (net.h ps__frame_budget: bytes of partial frames, and a deadline).
 *
 * Each limit comes from the server's options, else from the environment
 * (PSHARD_SERVER_MEMORY_MB, PSHARD_FRAME_BUDGET_MB, PSHARD_FRAME_DEADLINE_MS, the
 * names ps_config_from_env reads for server_memory_mb, frame_budget_mb and
 * frame_deadline_ms), else a default scaled to the machine.
 */
#include <stdlib.h>
#include <unistd.h>

#include "common/common.h"
#include "server/server_int.h"

#define DEFAULT_DEADLINE_MS 60000u

/* An unsigned environment value in [1, max]: 0 (unset leaves *out), or PS_ERR_CONFIG. */
static int env_u64(const char *name, uint64_t max, uint64_t *out) {
  const char *v = getenv(name);
  uint64_t u;
  if (!v || !*v) return 0;
  if (ps__parse_u64(v, &u) || u == 0 || u > max)
    return ps__fail(PS_ERR_CONFIG, "bad %s '%s' (an integer in [1, %llu] is expected)", name, v,
                    (unsigned long long)max);
  *out = u;
  return 0;
}

/* Half of the machine's memory, or 4 GiB when it cannot be told. */
static uint64_t default_memory(void) {
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || psz <= 0) return 4ull << 30;
  return (uint64_t)pages * (uint64_t)psz / 2;
}

int ps__srv_limits(ps__server *s) {
  uint64_t mb = 0, fmb = 0, ms = 0;
  int rc;
  if (!s->o.memory_budget) {
    if ((rc = env_u64("PSHARD_SERVER_MEMORY_MB", 1ull << 30, &mb))) return rc;
    s->o.memory_budget = mb ? mb << 20 : default_memory();
  }
  if (!s->o.frame_budget) {
    if ((rc = env_u64("PSHARD_FRAME_BUDGET_MB", 1ull << 30, &fmb))) return rc;
    uint64_t q = s->o.memory_budget / 4;
    s->o.frame_budget = fmb ? fmb << 20 : q > s->o.max_payload ? q : s->o.max_payload;
  }
  if (!s->o.frame_deadline_ms) {
    if ((rc = env_u64("PSHARD_FRAME_DEADLINE_MS", 86400000u, &ms))) return rc;
    s->o.frame_deadline_ms = ms ? (uint32_t)ms : DEFAULT_DEADLINE_MS;
  }
  return 0;
}

int ps__srv_create_fits(ps__server *s, ps__table *t, char *msg, size_t len) {
  ps__shard *sh = s->sh;
  if (t->spec.kind != PS_DENSE || !sh->mem_limit) return 0;
  /* The slices this server holds: its run of the ring, and under replicas R >= 2 the
   * runs of the R - 1 servers before it (an upper bound: R runs). */
  uint64_t nsl = t->spec.nrows, lo = 0, hi = nsl;
  size_t S = s->ring ? ps__ring_size(s->ring) : 1;
  if (S > 1 && s->replicas <= 1 && ps__srv_dense_mine(s, t, &lo, &hi)) lo = 0, hi = nsl;
  uint64_t mine = hi - lo;
  if (S > 1 && s->replicas > 1) {
    uint64_t run = (nsl + S - 1) / S, r = s->replicas < S ? s->replicas : S;
    mine = run * r < nsl ? run * r : nsl;
  }
  long double need = (long double)mine * (long double)ps__spec_row_floats(&t->spec) * 4.0L;
  if (need + (long double)sh->mem_used <= (long double)sh->mem_limit) return 0;
  snprintf(msg, len,
           "dense table '%s' of %llu floats needs %.0Lf MiB on this server (%llu of its %llu slices), more than "
           "the %llu MiB left of its memory budget of %llu MiB (server_memory_mb)",
           t->decl.name, (unsigned long long)t->spec.size, need / 1048576.0L, (unsigned long long)mine,
           (unsigned long long)nsl, (unsigned long long)((sh->mem_limit - (sh->mem_used < sh->mem_limit ? sh->mem_used : sh->mem_limit)) >> 20),
           (unsigned long long)(sh->mem_limit >> 20));
  return PS_ERR_NOMEM;
}
