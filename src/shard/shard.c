/*
 * shard.c - the shard engine's tables, workers and clocks, and the entry points that
 * hand a request to its table's consistency model (shard.h).
 *
 * Workers. The engine keeps a vector clock: each worker's last CLOCK. Only the
 * scheduler's membership makes a worker live; an id first seen in a frame is pending
 * until the membership lists it, so a stray or forged sender id (a process that never
 * registered, a worker of an earlier job) never holds a round. A dead worker leaves the
 * live set, so no round waits on it; what it pushed before dying stays in its round.
 *
 * Pushes. A push that carries an identity (worker, incarnation, sequence) is checked
 * against its worker's window (once.c) before anything else: one applied before is
 * answered as applied and changes nothing, so a re-sent push counts once in a round's
 * sum, its batch and its pushers. It is recorded once its mode applied or buffered it.
 */
#include "shard/shard.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"

/* ---------------------------------------------------------------- engine */

ps__shard *ps__shard_new(const ps__shard_hooks *hooks) {
  ps__shard *sh = ps__calloc(1, sizeof *sh);
  if (sh) sh->hooks = *hooks;
  return sh;
}

static void table_free(ps__shard *sh, ps__table *t) {
  if (!t) return;
  sh->mem_used -= t->params_bytes;
  if (t->pend.active) sh->hooks.release(sh->hooks.arg, t->pend.buf, t->pend.len);
  ps__shard_cut_orphan(t);
  ps__rowmap_free(t->params);
  free(t->dirty);
  ps__rowmap_free(t->agg);
  ps__rowmap_free(t->agg_rep);
  ps__rowmap_free(t->round_rep);
  for (int i = 0; i < PS__ROUND_WINDOW; i++) {
    ps__rowmap_free(t->rounds[i].acc);
    free(t->rounds[i].pushers);
  }
  free(t);
}

void ps__shard_free(ps__shard *sh) {
  if (!sh) return;
  for (size_t i = 0; i < sh->ntables; i++) table_free(sh, sh->tables[i]);
  free(sh->tables);
  free(sh->workers);
  ps__once_set_clear(&sh->once);
  free(sh);
}

const ps__mode_ops *ps__shard_mode(const ps__table *t) {
  switch (t->spec.mode) {
  case PS__MODE_SYNC:
  case PS__MODE_SYNC_M: return &ps__mode_sync;
  case PS__MODE_SSP: return &ps__mode_ssp;
  default: return &ps__mode_async;
  }
}

const char *ps__table_mode_name(const ps__table *t) {
  return t->spec.mode == PS__MODE_SYNC_M ? "sync:M" : ps__shard_mode(t)->name;
}

int ps__table_is_sync(const ps__table *t) { return t->spec.mode == PS__MODE_SYNC || t->spec.mode == PS__MODE_SYNC_M; }

int ps__shard_reject(ps__shard *sh, ps__table *t, ps__verdict *v, int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(v->msg, sizeof v->msg, fmt, ap);
  va_end(ap);
  v->status = PS__REJECTED;
  v->err = err;
  if (err == PS_ERR_CLOCK) {
    sh->rejected_clock++;
    if (t) t->rejected++;
  }
  return PS__REJECTED;
}

void ps__shard_stale(uint64_t *hist, int64_t *max, int64_t v) {
  if (v < 0) v = 0;
  hist[v < PS__STALE_BUCKETS - 1 ? v : PS__STALE_BUCKETS - 1]++;
  if (v > *max) *max = v;
}

/* ---------------------------------------------------------------- tables */

int ps__shard_create(ps__shard *sh, const ps__declare *d, ps__verdict *v) {
  ps__table_spec spec;
  v->status = PS__APPLIED;
  if (d->id == 0 || d->id >= PS__MAX_TABLES) return ps__shard_reject(sh, NULL, v, PS_ERR_INVALID, "bad table id %u", d->id);
  char err[sizeof v->msg];
  int rc = ps__table_spec_parse(&spec, d->name, d->kind, d->size, d->options, err, sizeof err);
  if (rc) return ps__shard_reject(sh, NULL, v, rc, "%s", err);
  ps__table *t = ps__shard_table(sh, d->id);
  if (t) {
    if (memcmp(&t->spec, &spec, sizeof spec) || strcmp(t->decl.name, d->name))
      return ps__shard_reject(sh, NULL, v, PS_ERR_CONFLICT, "table %u exists as '%s' with other options", d->id,
                              t->decl.name);
    return PS__APPLIED;
  }
  if (d->id >= sh->ntables) {
    size_t n = d->id + 1u;
    ps__table **nt = ps__realloc(sh->tables, n * sizeof *nt);
    if (!nt) return ps__shard_reject(sh, NULL, v, PS_ERR_NOMEM, "server out of memory");
    memset(nt + sh->ntables, 0, (n - sh->ntables) * sizeof *nt);
    sh->tables = nt;
    sh->ntables = n;
  }
  t = ps__calloc(1, sizeof *t);
  if (!t || !(t->params = ps__rowmap_new(ps__spec_row_floats(&spec)))) {
    free(t);
    return ps__shard_reject(sh, NULL, v, PS_ERR_NOMEM, "server out of memory");
  }
  t->sh = sh;
  t->id = d->id;
  t->spec = spec;
  t->params_bytes = ps__rowmap_bytes(t->params);
  sh->mem_used += t->params_bytes;
  t->decl = *d;
  for (int i = 0; i < PS__ROUND_WINDOW; i++) t->rounds[i].round = -1;
  t->cut_at = -1;
  t->durable = INT64_MAX;
  /* A table created after the job ran starts at the current round. */
  int64_t minc, maxc;
  ps__shard_live_clocks(sh, &minc, &maxc);
  t->version = minc / (int64_t)spec.every;
  sh->tables[d->id] = t;
  ps__log(PS_LOG_INFO, "table %u '%s' created (%s, size %llu)", d->id, d->name, d->kind == PS_DENSE ? "dense" : "sparse",
          (unsigned long long)d->size);
  return PS__APPLIED;
}

void ps__shard_drop(ps__shard *sh, uint32_t id) {
  ps__table *t = ps__shard_table(sh, id);
  if (!t) return;
  if (t->pend.active) sh->npending--;
  table_free(sh, t);
  sh->tables[id] = NULL;
}

float *ps__shard_row(ps__table *t, uint64_t key) { return ps__shard_row_at(t, key, NULL); }

float *ps__shard_row_at(ps__table *t, uint64_t key, uint32_t *idx) {
  int created = 0;
  float *row = ps__rowmap_upsert_at(t->params, key, &created, idx);
  if (row && created) {
    ps__row_init(&t->spec, key, row);
    if (t->track) ps__shard_created(t, key);
    ps__shard_grown(t);
  }
  return row;
}

size_t ps__shard_rows_at(ps__table *t, const uint64_t *keys64, const uint8_t *keys_le, size_t n, float **rows,
                         uint32_t *idx) {
  uint8_t made[PS__ROWS_BATCH];
  PS_ASSERT(n <= PS__ROWS_BATCH);
  size_t got = ps__rowmap_upsert_many(t->params, keys64, keys_le, n, rows, idx, made, 0);
  int any = 0;
  for (size_t i = 0; i < got; i++) {
    if (!made[i]) continue;
    uint64_t key = keys64 ? keys64[i] : ps__get_u64(keys_le + 8 * i);
    ps__row_init(&t->spec, key, rows[i]);
    if (t->track) ps__shard_created(t, key);
    any = 1;
  }
  if (any) ps__shard_grown(t);
  return got;
}

void ps__shard_expect(ps__table *t, size_t n) {
  size_t have = ps__rowmap_count(t->params);
  if (n < 4096 || n < have) return; /* small requests grow the index as usual */
  if (ps__rowmap_reserve(t->params, have + n) == 0) ps__shard_grown(t);
}

void ps__shard_grown(ps__table *t) {
  size_t nb = ps__rowmap_bytes(t->params);
  t->sh->mem_used += nb - t->params_bytes;
  t->params_bytes = nb;
}

static int slice_exists(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  (void)within, (void)n, (void)pos;
  ps__table *t = arg;
  return ps__rowmap_index(t->params, slice) == SIZE_MAX ? 1 : 0;
}

int ps__shard_room(ps__shard *sh, ps__table *t, const uint8_t *keys, uint32_t nkeys, ps__verdict *v) {
  v->status = PS__APPLIED;
  if (!sh->mem_limit || sh->mem_used < sh->mem_limit) return PS__APPLIED;
  if (t->spec.kind == PS_DENSE) {
    if (!ps__walk_slices(keys, nkeys, t->spec.width, slice_exists, t)) return PS__APPLIED;
  } else {
    uint32_t i = 0;
    while (i < nkeys && ps__rowmap_index(t->params, ps__get_u64(keys + 8 * (size_t)i)) != SIZE_MAX) i++;
    if (i == nkeys) return PS__APPLIED;
  }
  sh->mem_refused++;
  if (sh->mem_refused == 1)
    ps__log(PS_LOG_WARN, "the server's rows reached its memory budget (%llu MiB, server_memory_mb): requests for "
            "new rows are refused from now on", (unsigned long long)(sh->mem_limit >> 20));
  return ps__shard_reject(sh, t, v, PS_ERR_NOMEM,
                          "table '%s': new rows refused: the server's rows use %llu MiB of its memory budget of %llu "
                          "MiB (server_memory_mb); existing rows are still served",
                          t->decl.name, (unsigned long long)(sh->mem_used >> 20),
                          (unsigned long long)(sh->mem_limit >> 20));
}

/* ---------------------------------------------------------------- workers and clocks */

ps__worker *ps__shard_worker(ps__shard *sh, uint32_t id) {
  for (size_t i = 0; i < sh->nworkers; i++)
    if (sh->workers[i].id == id) return &sh->workers[i];
  return NULL;
}

size_t ps__shard_live_clocks(const ps__shard *sh, int64_t *minc, int64_t *maxc) {
  size_t n = 0;
  *minc = INT64_MAX;
  *maxc = 0;
  for (size_t i = 0; i < sh->nworkers; i++) {
    const ps__worker *w = &sh->workers[i];
    if (!w->alive) continue;
    n++;
    if (w->clock < *minc) *minc = w->clock;
    if (w->clock > *maxc) *maxc = w->clock;
  }
  if (!n) *minc = 0;
  return n;
}

static ps__worker *add_worker(ps__shard *sh, uint32_t id, int64_t clock, int live) {
  if (sh->nworkers == sh->wcap) {
    size_t cap = sh->wcap ? sh->wcap * 2 : 8;
    ps__worker *w = ps__realloc(sh->workers, cap * sizeof *w);
    if (!w) return NULL;
    sh->workers = w;
    sh->wcap = cap;
  }
  ps__worker *w = &sh->workers[sh->nworkers++];
  w->id = id;
  w->alive = live;
  w->pending = !live;
  w->clock = clock;
  w->clocked_ms = ps__now_ms();
  w->clocked = 0;
  return w;
}

void ps__shard_member(ps__shard *sh, uint32_t id, int alive) {
  ps__worker *w = ps__shard_worker(sh, id);
  int64_t minc, maxc;
  if (!w && alive) {
    ps__shard_live_clocks(sh, &minc, &maxc);
    int64_t start = sh->started ? minc : 0;
    w = add_worker(sh, id, start > sh->base_clock ? start : sh->base_clock, 1);
  } else if (w && alive && w->pending) { /* the scheduler vouches for it now */
    ps__shard_live_clocks(sh, &minc, &maxc);
    w->pending = 0;
    w->alive = 1;
    w->clocked_ms = ps__now_ms(); /* a round waits for it from now on */
    if (sh->started && w->clock < minc) w->clock = minc;
  }
  if (w && !alive && (w->alive || w->pending)) {
    w->pending = 0;
    w->alive = 0;
    ps__log(PS_LOG_INFO, "worker %u left the active set", id);
  }
}

void ps__shard_set_started(ps__shard *sh, int started) {
  sh->started = started;
  ps__shard_advance(sh);
}

void ps__shard_clock(ps__shard *sh, uint32_t id, int64_t clock) {
  ps__worker *w = ps__shard_worker(sh, id);
  if (!w) w = add_worker(sh, id, 0, 0);
  if (!w || (!w->alive && !w->pending)) return;
  if (clock > w->clock) {
    w->clock = clock;
    w->clocked_ms = ps__now_ms();
    w->clocked = 1;
  }
  ps__shard_advance(sh);
}

void ps__shard_advance(ps__shard *sh) {
  if (!sh->started) return;
  for (size_t i = 0; i < sh->ntables; i++) {
    ps__table *t = sh->tables[i];
    if (t) ps__shard_mode(t)->advance(sh, t);
  }
}

/* ---------------------------------------------------------------- requests */

/* A push with an identity against its sender's window (once.h): the window (created
 * when missing) to record it in once applied, or NULL with v set: a duplicate, answered
 * as applied before any other check (its first copy passed them, and a round may have
 * moved on since), or a push refused. */
static ps__once *push_window(ps__shard *sh, ps__table *t, const ps__push *p, ps__verdict *v) {
  ps__once *o = ps__once_get(&sh->once, p->sender, p->unit);
  if (!o) {
    ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
    return NULL;
  }
  switch (ps__once_check(o, p->inc, p->seq)) {
  case PS__ONCE_NEW: return o;
  case PS__ONCE_DUP:
    sh->once.dups++;
    v->dup = 1;
    return NULL;
  case PS__ONCE_STALE:
    sh->once.stale++;
    ps__shard_reject(sh, t, v, PS_ERR_CONFLICT,
                     "push from an earlier process of worker %u refused (incarnation %llu; this server has seen %llu)",
                     p->sender, (unsigned long long)p->inc, (unsigned long long)o->inc);
    return NULL;
  default:
    sh->once.stale++;
    ps__shard_reject(sh, t, v, PS_ERR_CONFLICT,
                     "push %u of worker %u refused: more than %u pushes older than its latest (%u), it may have been applied",
                     p->seq, p->sender, PS__ONCE_WINDOW, o->high);
    return NULL;
  }
}

/* ---------------------------------------------------------------- non-finite values */

uint64_t ps__first_nonfinite(const float *v, uint64_t n) {
  /* A float is NaN or infinite when its exponent bits are all set, that is when its
   * magnitude bits (sign cleared) are at least 0x7f800000: adding 0x00800000 then
   * carries into bit 31, which no finite value reaches. OR-ing those sums over a block
   * (an and, an add and an or per vector) tells whether the block holds one; only
   * then is it searched. */
  enum { BLOCK = 2048 };
  for (uint64_t i = 0; i < n; i += BLOCK) {
    uint64_t m = n - i < BLOCK ? n - i : BLOCK;
    uint32_t any = 0;
    for (uint64_t k = 0; k < m; k++) {
      uint32_t u;
      memcpy(&u, v + i + k, 4);
      any |= (u & 0x7fffffffu) + 0x00800000u;
    }
    if (__builtin_expect(any >> 31, 0))
      for (uint64_t k = 0; k < m; k++)
        if (!isfinite(v[i + k])) return i + k;
  }
  return UINT64_MAX;
}

/* Where value pos of push p lies in its table, for the message: "key K element E" of a
 * sparse table, "element E" (its offset) of a dense one. */
static void value_place(const ps__table *t, const ps__push *p, uint64_t pos, char *out, size_t len) {
  if (t->spec.kind != PS_DENSE) {
    uint64_t i = pos / t->spec.width;
    snprintf(out, len, "value %llu (key %llu, element %llu)", (unsigned long long)pos,
             (unsigned long long)ps__get_u64(p->keys + 8 * i), (unsigned long long)(pos % t->spec.width));
    return;
  }
  uint64_t at = 0;
  for (uint32_t i = 0; i + 1 < p->nkeys; i += 2) {
    uint64_t off = ps__get_u64(p->keys + 8 * (size_t)i), cnt = ps__get_u64(p->keys + 8 * (size_t)(i + 1));
    if (pos < at + cnt) {
      snprintf(out, len, "value %llu (element %llu)", (unsigned long long)pos, (unsigned long long)(off + pos - at));
      return;
    }
    at += cnt;
  }
  snprintf(out, len, "value %llu", (unsigned long long)pos);
}

/* A push holding a NaN or an infinity (or a header rate that is not finite), under the
 * table's nonfinite option: refused (PS_ERR_INVALID) or dropped whole, counted. 0 when
 * it is finite (or the table allows anything). */
static int push_nonfinite(ps__shard *sh, ps__table *t, const ps__push *p, ps__verdict *v) {
  if (t->spec.nonfinite == PS__NONFINITE_ALLOW) return 0;
  char where[128];
  if (!(p->lr < 0) && !isfinite(p->lr)) {
    snprintf(where, sizeof where, "its learning rate (%g)", (double)p->lr);
  } else {
    uint64_t bad = p->vals ? ps__first_nonfinite(p->vals, p->nvals) : UINT64_MAX;
    if (bad == UINT64_MAX) return 0;
    char place[96];
    value_place(t, p, bad, place, sizeof place);
    snprintf(where, sizeof where, "%s %s", isnan(p->vals[bad]) ? "NaN at" : "an infinity at", place);
  }
  t->nonfinite++;
  if (t->nonfinite == 1)
    ps__log(PS_LOG_WARN, "table '%s': a push of worker %u holds %s; %s (counted in STATS as nonfinite)",
            t->decl.name, p->sender, where, t->spec.nonfinite == PS__NONFINITE_SKIP ? "dropped" : "refused");
  if (t->spec.nonfinite == PS__NONFINITE_SKIP) {
    sh->nonfinite_skipped++;
    v->status = PS__DROPPED;
    return 1;
  }
  sh->nonfinite_refused++;
  ps__shard_reject(sh, t, v, PS_ERR_INVALID, "push to table '%s' refused: %s is not finite; nothing was applied",
                   t->decl.name, where);
  return 1;
}

/* The checks every push passes before it changes anything: its identity, its values
 * (finite), the batch of a mean-mode table, the sender, and the clock against the
 * table's mode. */
int ps__shard_push_identity(ps__shard *sh, ps__table *t, const ps__push *p, ps__verdict *v) {
  v->status = PS__APPLIED;
  v->later = v->dup = 0;
  if (p->inc && !push_window(sh, t, p, v)) return v->status;
  return PS__APPLIED;
}

static ps__table *push_admit(ps__shard *sh, const ps__push *p, ps__verdict *v) {
  ps__table *t = ps__shard_table(sh, p->table);
  v->status = PS__APPLIED;
  v->later = v->dup = 0;
  if (!t) {
    ps__shard_reject(sh, NULL, v, PS_ERR_NO_TABLE, "unknown table %u", p->table);
    return NULL;
  }
  if (p->inc && !push_window(sh, t, p, v)) return NULL;
  ps__shard_flush(t); /* an earlier push is in before this one */
  if (p->replica) return t; /* admitted by the head of its chain (the clocks are the head's) */
  if (push_nonfinite(sh, t, p, v)) return NULL;
  if (sh->mem_limit && ps__shard_room(sh, t, p->keys, p->nkeys, v) != PS__APPLIED) return NULL;
  if (t->spec.update == PS__UPDATE_MEAN && p->batch == 0 && p->nkeys > 0) {
    ps__shard_reject(sh, t, v, PS_ERR_INVALID, "push with batch size 0 to mean-mode table '%s'", t->decl.name);
    return NULL;
  }
  ps__worker *w = ps__shard_worker(sh, p->sender);
  if (w && !w->alive && !w->pending) {
    ps__shard_reject(sh, t, v, PS_ERR_UNAVAILABLE, "worker %u was removed from the job", p->sender);
    return NULL;
  }
  int64_t lo, hi;
  ps__shard_live_clocks(sh, &lo, &hi);
  if (!w && !(w = add_worker(sh, p->sender, lo, 0))) {
    ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
    return NULL;
  }
  /* From the future: ahead of every live worker's clock. (A worker may be ahead of its
   * own last CLOCK here: a sync:M straggler fast-forwards to the servers' round.) */
  int64_t front = w->clock > hi ? w->clock : hi;
  if (p->clock < 0 || p->clock > front) {
    ps__shard_reject(sh, t, v, PS_ERR_CLOCK, "push for clock %lld is from the future: the fastest worker is at %lld",
                     (long long)p->clock, (long long)front);
    return NULL;
  }
  /* Far in the past, in every mode: more than PS__MAX_DELAY clocks behind the fastest
   * live worker. (Under sync:M a late push would otherwise be dropped with a success.) */
  if (hi - p->clock > PS__MAX_DELAY) {
    ps__shard_reject(sh, t, v, PS_ERR_CLOCK, "push for clock %lld is more than %d clocks behind the fastest worker (%lld)",
                     (long long)p->clock, PS__MAX_DELAY, (long long)hi);
    return NULL;
  }
  if (ps__shard_mode(t)->admit(sh, t, w, p, hi, v) != PS__APPLIED) return NULL;
  return t;
}

int ps__shard_push(ps__shard *sh, const ps__push *p, ps__owned *body, ps__verdict *v) {
  ps__table *t = push_admit(sh, p, v);
  if (!t) return v->status;
  sh->replay_step = p->replica ? p->step : 0;
  int st = ps__shard_mode(t)->push(sh, t, p, body, v);
  sh->replay_step = 0;
  /* A dropped push is not recorded: a copy of it is as late, and dropped again. */
  if (st == PS__APPLIED) ps__shard_push_done(sh, p);
  return st;
}

void ps__shard_push_done(ps__shard *sh, const ps__push *p) {
  ps__once *o = p->inc ? ps__once_find(&sh->once, p->sender, p->unit) : NULL; /* made by push_window */
  if (o) ps__once_mark(o, p->inc, p->seq);
}

ps__rowmap *ps__shard_push_acc(ps__shard *sh, const ps__push *p, ps__verdict *v) {
  ps__table *t = push_admit(sh, p, v);
  if (!t) return NULL;
  if (!ps__table_is_sync(t)) {
    ps__shard_reject(sh, t, v, PS_ERR_INVALID, "table '%s' is not synchronous", t->decl.name);
    return NULL;
  }
  return ps__sync_round_acc(sh, t, p, v);
}

int ps__shard_pull(ps__shard *sh, uint32_t table, int64_t c, ps__verdict *v) {
  ps__table *t = ps__shard_table(sh, table);
  v->status = PS__APPLIED;
  if (!t) return ps__shard_reject(sh, NULL, v, PS_ERR_NO_TABLE, "unknown table %u", table);
  if (!ps__shard_pull_ready(sh, t, c)) v->status = PS__WAIT;
  return v->status;
}

int ps__shard_pull_ready(ps__shard *sh, ps__table *t, int64_t c) {
  /* Before the job started (this server has not heard so from the scheduler), no round
   * is applied: a sync pull waits like any other for the rounds before its clock, which
   * may be under way elsewhere already (a server can hear of the start last). */
  return (!sh->started && !ps__table_is_sync(t)) || ps__shard_mode(t)->pull_ready(sh, t, c);
}

int64_t ps__shard_pull_answered(ps__shard *sh, ps__table *t, uint32_t sender, int64_t c) {
  int64_t minc, maxc;
  if (!ps__table_is_sync(t)) {
    ps__shard_live_clocks(sh, &minc, &maxc);
    ps__shard_stale(sh->pull_stale, &sh->pull_stale_max, c - minc);
    return c;
  }
  int64_t at = t->version * (int64_t)t->spec.every;
  if (at > c) {
    /* The worker fast-forwards to `at` on this reply (client): it is there now. */
    ps__worker *w = ps__shard_worker(sh, sender);
    if (w && w->alive && w->clock < at) w->clock = at;
  }
  return at;
}

double ps__shard_direct_batch(const ps__shard *sh, uint32_t batch) {
  int64_t minc, maxc;
  size_t k = ps__shard_live_clocks(sh, &minc, &maxc);
  return (double)batch * (double)(k ? k : 1);
}

int ps__walk_slices(const uint8_t *keys, uint32_t nkeys, unsigned width, ps__slice_fn fn, void *arg) {
  uint64_t pos = 0;
  for (uint32_t i = 0; i + 1 < nkeys; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * (size_t)i), cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
    while (cnt > 0) {
      uint64_t within = off % width, n = width - within < cnt ? width - within : cnt;
      int rc = fn(arg, off / width, within, n, pos);
      if (rc) return rc;
      pos += n;
      off += n;
      cnt -= n;
    }
  }
  return 0;
}
