/*
 * snap.c - the engine's side of checkpoints: where a table is cut, its copy, and rows
 * set back from a checkpoint.
 *
 * A sync table is cut at a round boundary: once the rounds of the clocks before the
 * checkpoint's clock are applied and before the next one is (sync.c calls hooks.cut
 * right after the version moves there). An async or ssp table is cut when asked, after
 * its aggregation buffer is applied, so the snapshot holds every push acknowledged
 * before the request. A cut copies nothing: the owner's writer thread reads the live
 * rows, and a row written before the writer has read it is saved first (below). With
 * tracking on, a table also keeps the set of rows changed since its last cut, which an
 * incremental checkpoint writes instead of every row.
 */
#include "shard/shard.h"

#include <stdatomic.h>
#include <stdlib.h>
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

/* ---------------------------------------------------------------- cuts */

/* A cut: the table's rows [0, n) as they were, read by the owner's writer thread while
 * the owner goes on writing. Each row has a 2-bit state, 32 to a word:
 *   FREE   not read yet: still the cut's value, in place;
 *   BUSY   being copied (by the reader out of the live row, or by the owner into the
 *          save area): the other side waits, a row's copy long;
 *   READ   read by the reader: the owner may write it freely;
 *   SAVED  saved by the owner before it wrote the row (its save slot in slot[i]).
 * Whoever moves a row from FREE to BUSY copies it. The owner calls ps__shard_watch
 * before any change to a row (ps__shard_write), so a row is never written between the
 * cut and its read. The owner's check of a row already read costs one load from a
 * bitmap of n / 4 bytes (2 MB for 8M rows, which stays in cache), not a miss. Memory:
 * that bitmap, a save slot number for each saved row (pages of a lazily zeroed array),
 * and a copy of each row written before it was read (the rows written during the
 * write, not the table). */
#define SAVE_BYTES ((size_t)2 << 20) /* a save chunk, at most */
#define ST_FREE 0u
#define ST_BUSY 1u
#define ST_READ 2u
#define ST_SAVED 3u

struct ps__cut {
  ps__rowmap_view view;
  _Atomic uint64_t *state; /* 2 bits a row */
  uint32_t *slot;          /* row -> save slot, for SAVED rows */
  size_t row_floats;
  size_t save_rows;     /* rows per save chunk */
  _Atomic(float *) *save; /* ceil(n / save_rows) chunks, made as needed (by the owner's
                         * threads: loop and helper, hence atomic) */
  atomic_size_t nsaved;
  atomic_int failed;    /* a row could not be saved: the snapshot is lost */
  ps__rowmap *orphan;   /* the table's map, when the table was dropped during the cut */
};

static void cut_free(ps__cut *c) {
  if (!c) return;
  size_t nch = c->save_rows ? (c->view.n + c->save_rows - 1) / c->save_rows : 0;
  for (size_t i = 0; c->save && i < nch; i++) free(atomic_load_explicit(&c->save[i], memory_order_relaxed));
  free((void *)c->save);
  free((void *)c->state);
  free(c->slot);
  ps__rowmap_view_free(&c->view);
  ps__rowmap_free(c->orphan);
  free(c);
}

/* A cut of map m, or NULL (out of memory). */
static ps__cut *cut_new(const ps__rowmap *m, size_t row_floats) {
  ps__cut *c = ps__calloc(1, sizeof *c);
  if (!c) return NULL;
  if (ps__rowmap_view_take(m, &c->view)) {
    cut_free(c);
    return NULL;
  }
  c->row_floats = row_floats;
  size_t n = c->view.n;
  c->save_rows = SAVE_BYTES / (row_floats * sizeof(float));
  if (c->save_rows > n) c->save_rows = n; /* a small table: one small chunk */
  if (c->save_rows == 0) c->save_rows = 1;
  size_t nch = (n + c->save_rows - 1) / c->save_rows;
  c->state = ps__calloc((n + 31) / 32 + 1, sizeof *c->state);
  c->slot = ps__calloc(n ? n : 1, sizeof *c->slot); /* zero pages: touched where rows are saved */
  c->save = ps__calloc(nch ? nch : 1, sizeof *c->save);
  if (!c->state || !c->slot || !c->save) {
    cut_free(c);
    return NULL;
  }
  return c;
}

static inline unsigned st_of(uint64_t word, size_t i) { return (unsigned)(word >> (2 * (i & 31))) & 3u; }

/* Move row i from FREE to BUSY; its state when that was not possible (ST_BUSY never:
 * a BUSY row is waited for). */
static unsigned claim(ps__cut *c, size_t i) {
  _Atomic uint64_t *w = &c->state[i >> 5];
  unsigned sh = 2 * (unsigned)(i & 31);
  uint64_t word = atomic_load_explicit(w, memory_order_acquire);
  for (;;) {
    unsigned st = st_of(word, i);
    if (st == ST_BUSY) { /* the other side copies it now */
      word = atomic_load_explicit(w, memory_order_acquire);
      continue;
    }
    if (st != ST_FREE) return st;
    if (atomic_compare_exchange_weak_explicit(w, &word, word | ((uint64_t)ST_BUSY << sh), memory_order_acquire,
                                              memory_order_acquire))
      return ST_FREE;
  }
}

/* BUSY -> READ (xor 11) or BUSY -> SAVED (or 10), after the copy. */
static void settle(ps__cut *c, size_t i, unsigned to) {
  unsigned sh = 2 * (unsigned)(i & 31);
  if (to == ST_READ) atomic_fetch_xor_explicit(&c->state[i >> 5], (uint64_t)3 << sh, memory_order_release);
  else atomic_fetch_or_explicit(&c->state[i >> 5], (uint64_t)2 << sh, memory_order_release);
}

/* A save chunk. Plain pages: advised for huge pages, a save that faults one in waits
 * for 2 MiB to be zeroed (measured: p99 push latency during a checkpoint 6.5 ms
 * against 1.2 ms with 4 KiB pages). */
static float *chunk_new(size_t bytes) { return ps__malloc(bytes); }

/* The save chunk ch, made if it is not there yet (the first of two racing threads wins). */
static float *chunk_at(ps__cut *c, size_t ch) {
  float *p = atomic_load_explicit(&c->save[ch], memory_order_acquire);
  if (p) return p;
  float *q = chunk_new(c->save_rows * c->row_floats * sizeof(float));
  if (!q) return NULL;
  if (atomic_compare_exchange_strong_explicit(&c->save[ch], &p, q, memory_order_acq_rel, memory_order_acquire))
    return q;
  free(q);
  return p;
}

/* Row i, claimed (BUSY), into the save area. */
static void save_row(ps__cut *c, size_t i) {
  size_t slot = atomic_fetch_add_explicit(&c->nsaved, 1, memory_order_relaxed);
  float *base = slot < UINT32_MAX ? chunk_at(c, slot / c->save_rows) : NULL;
  float *dst = base ? base + (slot % c->save_rows) * c->row_floats : NULL;
  if (dst) {
    memcpy(dst, ps__rowmap_view_row(&c->view, i), c->row_floats * sizeof *dst);
    c->slot[i] = (uint32_t)slot;
  } else {
    atomic_store_explicit(&c->failed, 1, memory_order_relaxed);
  }
  settle(c, i, dst ? ST_SAVED : ST_READ);
}

/* The owner, before row i changes. */
static void cut_before_write(ps__cut *c, size_t i) {
  if (i >= c->view.n) return; /* created after the cut */
  if (st_of(atomic_load_explicit(&c->state[i >> 5], memory_order_acquire), i) >= ST_READ) return; /* the common case */
  if (claim(c, i) == ST_FREE) save_row(c, i);
}

/* The reader: row i into dst. */
static int cut_read(ps__cut *c, size_t i, float *dst) {
  size_t bytes = c->row_floats * sizeof *dst;
  unsigned st = claim(c, i);
  if (st == ST_FREE) {
    memcpy(dst, ps__rowmap_view_row(&c->view, i), bytes);
    settle(c, i, ST_READ);
    return 0;
  }
  if (st == ST_READ) /* read twice, or lost by the owner */
    return atomic_load_explicit(&c->failed, memory_order_relaxed) ? PS_ERR_NOMEM : PS_ERR_INVALID;
  size_t slot = c->slot[i]; /* written before SAVED was released */
  const float *base = atomic_load_explicit(&c->save[slot / c->save_rows], memory_order_acquire);
  memcpy(dst, base + (slot % c->save_rows) * c->row_floats, bytes);
  return 0;
}

/* ---------------------------------------------------------------- dirty rows */

/* Room in t->dirty for every row of the table; 0 or PS_ERR_NOMEM. */
static int dirty_fit(ps__table *t) {
  size_t need = (ps__rowmap_count(t->params) + 64) / 64;
  if (need <= t->dirty_words) return 0;
  size_t cap = t->dirty_words ? t->dirty_words : 64;
  while (cap < need) cap *= 2;
  uint64_t *d = ps__realloc(t->dirty, cap * sizeof *d);
  if (!d) return PS_ERR_NOMEM;
  memset(d + t->dirty_words, 0, (cap - t->dirty_words) * sizeof *d);
  t->dirty = d;
  t->dirty_words = cap;
  return 0;
}

static inline void dirty_set(ps__table *t, size_t i) {
  /* atomic: a huge push writes rows from the owner's two threads */
  atomic_fetch_or_explicit((_Atomic uint64_t *)&t->dirty[i >> 6], (uint64_t)1 << (i & 63), memory_order_relaxed);
}

/* A row was created: it belongs to the next increment. Out of memory for the bitmap:
 * tracking stops, and the next checkpoint is whole (a snapshot without dirty rows). */
void ps__shard_created(ps__table *t, uint64_t key) {
  if (!t->track) return;
  if (dirty_fit(t)) {
    free(t->dirty);
    t->dirty = NULL;
    t->dirty_words = 0;
    t->track = 0;
    t->watch = t->cut != NULL;
    t->dirty_inline = 0;
    return;
  }
  size_t i = ps__rowmap_index(t->params, key);
  if (i != SIZE_MAX) dirty_set(t, i);
}

void ps__shard_watch(ps__table *t, uint64_t key, uint32_t idx) {
  size_t i = idx != PS__ROW_ANY ? idx : ps__rowmap_index(t->params, key);
  if (i == SIZE_MAX) return;
  if (t->track && i < t->dirty_words * 64) dirty_set(t, i);
  if (t->cut) cut_before_write(t->cut, i);
}

/* ---------------------------------------------------------------- snapshots */

int ps__shard_snap(ps__table *t, ps__snap_table *out, int track) {
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
  if (t->cut) return ps__fail(PS_ERR_UNAVAILABLE, "table '%s' is being written by a checkpoint", t->decl.name);
  out->cut = cut_new(t->params, rf);
  if (!out->cut) return ps__fail(PS_ERR_NOMEM, "out of memory cutting table '%s' for a checkpoint", t->decl.name);
  /* The rows changed since the cut before go with the snapshot; a fresh set starts. */
  out->dirty = t->track ? t->dirty : NULL;
  t->dirty = NULL;
  t->dirty_words = 0;
  t->track = track && !dirty_fit(t);
  t->cut = out->cut;
  t->watch = t->track || t->cut;
  t->dirty_inline = t->track && !t->cut;
  return 0;
}

int ps__shard_snap_keep(ps__table *t, ps__snap_table *out) {
  memset(out, 0, sizeof *out);
  ps__shard_flush(t); /* an aggregation buffer is not applied: its rows reach the copy as forwards */
  size_t rf = ps__spec_row_floats(&t->spec);
  out->decl = t->decl;
  out->width = t->spec.width;
  out->row_floats = (uint32_t)rf;
  out->step = t->step;
  out->version = t->version;
  out->n = ps__rowmap_count(t->params);
  if (t->cut) return ps__fail(PS_ERR_UNAVAILABLE, "table '%s' is being written by a checkpoint", t->decl.name);
  out->cut = cut_new(t->params, rf);
  if (!out->cut) return ps__fail(PS_ERR_NOMEM, "out of memory cutting table '%s' for a copy", t->decl.name);
  t->cut = out->cut;
  t->watch = 1;
  t->dirty_inline = 0;
  return 0;
}

uint64_t ps__snap_key(const ps__snap_table *s, uint64_t i) { return ps__rowmap_view_key(&s->cut->view, i); }

void ps__snap_prefetch(const ps__snap_table *s, uint64_t i) {
  const char *row = (const char *)ps__rowmap_view_row(&s->cut->view, i);
  __builtin_prefetch(row);
  if (s->row_floats > 16) __builtin_prefetch(row + 64);
  __builtin_prefetch((const void *)&s->cut->state[i >> 5], 1);
}

int ps__snap_read(ps__snap_table *s, uint64_t i, float *dst) { return cut_read(s->cut, i, dst); }

void ps__shard_snap_release(ps__shard *sh, ps__snap_table *s) {
  ps__table *t = ps__shard_table(sh, s->decl.id);
  if (t && s->cut && t->cut == s->cut) {
    t->cut = NULL;
    t->watch = t->track;
    t->dirty_inline = t->track;
  }
  ps__snap_table_free(s);
}

/* Called by table_free (shard.c): a table dropped while its cut is read leaves its map
 * to the cut, which frees it. */
void ps__shard_cut_orphan(ps__table *t) {
  if (!t->cut) return;
  t->cut->orphan = t->params; /* no row is added to it again: nothing moves */
  t->params = NULL;
  t->cut = NULL;
}

void ps__snap_table_free(ps__snap_table *s) {
  if (!s) return;
  cut_free(s->cut);
  free(s->dirty);
  s->cut = NULL;
  s->dirty = NULL;
  s->n = 0;
}

int ps__shard_import(ps__table *t, uint64_t key, const float *row) {
  int created = 0;
  float *w = ps__rowmap_upsert(t->params, key, &created);
  if (!w) return PS_ERR_NOMEM;
  if (!created && t->watch) ps__shard_watch(t, key, PS__ROW_ANY);
  memcpy(w, row, ps__spec_row_floats(&t->spec) * sizeof *w);
  if (created) {
    ps__shard_created(t, key);
    ps__shard_grown(t);
  }
  return 0;
}
