/*
 * snap.c - the engine's side of checkpoints: where a table is cut, its copy, and rows
 * set back from a checkpoint.
 *
 * A sync table is cut at a round boundary: once the rounds of the clocks before the
 * checkpoint's clock are applied and before the next one is (sync.c calls hooks.cut
 * right after the version moves there). An async or ssp table is cut when asked, after
 * its aggregation buffer is applied, so the copy holds every push acknowledged before
 * the request. The copy is of the whole table, in the loop thread, rows in the order of
 * the row map; the owner's writer thread sorts and writes it.
 */
#include "shard/shard.h"

#include <string.h>

#include "common/common.h"

int64_t ps__shard_cut_clock(const ps__table *t, int64_t clock) {
  if (!ps__table_is_sync(t)) return clock;
  int64_t every = (int64_t)t->spec.every;
  return clock <= 0 ? 0 : (clock + every - 1) / every * every;
}

int64_t ps__shard_table_clock(const ps__table *t) {
  return ps__table_is_sync(t) ? t->version * (int64_t)t->spec.every : 0;
}

int ps__shard_cut_too_late(const ps__table *t, int64_t clock) {
  return ps__table_is_sync(t) && ps__shard_table_clock(t) > ps__shard_cut_clock(t, clock);
}

int ps__shard_cut_at(ps__shard *sh, ps__table *t, int64_t clock) {
  if (!ps__table_is_sync(t)) {
    if (sh->hooks.cut) sh->hooks.cut(sh->hooks.arg, t);
    return 0;
  }
  int64_t at = ps__shard_cut_clock(t, clock), now = ps__shard_table_clock(t);
  if (ps__shard_cut_too_late(t, clock))
    return ps__fail(PS_ERR_CLOCK, "table '%s' is at clock %lld, past the checkpoint's clock %lld", t->decl.name,
                    (long long)now, (long long)at);
  if (now == at) {
    t->cut_at = -1;
    if (sh->hooks.cut) sh->hooks.cut(sh->hooks.arg, t);
    return 0;
  }
  t->cut_at = at;
  return 0;
}

int ps__shard_snap(ps__table *t, ps__snap_table *out) {
  memset(out, 0, sizeof *out);
  ps__shard_flush(t);
  if (!ps__table_is_sync(t)) ps__shard_agg_flush(t);
  size_t n = ps__rowmap_count(t->params), rf = ps__spec_row_floats(&t->spec);
  out->decl = t->decl;
  out->width = t->spec.width;
  out->row_floats = (uint32_t)rf;
  out->step = t->step;
  out->version = t->version;
  out->n = n;
  out->keys = ps__malloc((n ? n : 1) * sizeof *out->keys);
  out->rows = ps__malloc((n ? n : 1) * rf * sizeof *out->rows);
  if (!out->keys || !out->rows) {
    ps__snap_table_free(out);
    return ps__fail(PS_ERR_NOMEM, "out of memory copying table '%s' for a checkpoint", t->decl.name);
  }
  for (size_t i = 0; i < n; i++) {
    out->keys[i] = ps__rowmap_key_at(t->params, i);
    memcpy(out->rows + i * rf, ps__rowmap_row_at(t->params, i), rf * sizeof *out->rows);
  }
  return 0;
}

void ps__snap_table_free(ps__snap_table *s) {
  if (!s) return;
  free(s->keys);
  free(s->rows);
  s->keys = NULL;
  s->rows = NULL;
  s->n = 0;
}

int ps__shard_import(ps__table *t, uint64_t key, const float *row) {
  int created = 0;
  float *w = ps__rowmap_upsert(t->params, key, &created);
  if (!w) return PS_ERR_NOMEM;
  memcpy(w, row, ps__spec_row_floats(&t->spec) * sizeof *w);
  return 0;
}
