/*
 * apply.c - the update paths the consistency models share: one optimiser step over an
 * accumulator, pushes applied on their own (at once, in pieces after the ack, or on two
 * threads when huge), accumulation into rounds and aggregation buffers, and reading
 * rows for pulls. Every parameter change here goes through ps__shard_write.
 *
 * Huge requests. A sparse pull, or a direct sgd push, of at least PS__PAR_MIN_KEYS keys
 * is served on two threads: the owner's and its helper (hooks.par), while the owner
 * blocks. The threads claim units of work one at a time: a pull's units are runs of
 * positions (the map is only read); a push's are classes of keys, so each row has one
 * writer. Keys not in the map are marked and created afterwards on the owner's thread
 * alone, in request order, so the map and the answer are what one thread would have
 * produced.
 */
#include "shard/shard.h"

#include <stdatomic.h>
#include <string.h>

#include "common/common.h"

/* Batch loops over the keys of a request: on a large table the cache misses, not the
 * work, dominate, so the keys go to the row map in blocks, whose pipelines keep many
 * misses in flight: ps__rowmap_find_many to look rows up, ps__shard_rows_at (the map's
 * upsert_many) to create the rows of the keys not found, new rows of a block at once. */
/* Keys per ps__rowmap_find_many call in the key loops (row pointers on the stack). */
#define FIND_BLOCK 512u

/* ---------------------------------------------------------------- one step over many rows */

/* Start one optimiser step of a table: its step number and learning rate (lr < 0: the
 * table's schedule at this step for a global batch of global_batch). */
static float apply_begin(ps__table *t, float lr, double global_batch, uint64_t *step) {
  /* A sync table takes one step per round, whether or not this shard has rows in it:
   * the step of round v is v + 1 on every shard, so Adam's bias correction and the
   * schedule's position do not depend on which server holds a row (nor the result on
   * the order in which servers registered). Other modes count the updates applied. */
  *step = ps__table_is_sync(t) ? (uint64_t)t->version + 1 : t->step + 1;
  /* A forwarded push (replication) takes the step its head applied it with. */
  if (t->sh->replay_step && !ps__table_is_sync(t)) *step = t->sh->replay_step > t->step ? t->sh->replay_step : *step;
  /* A sync round applied out of the version's order (a copy's, or a catch-up's) names its step. */
  if (t->sh->replay_step && ps__table_is_sync(t)) *step = t->sh->replay_step;
  t->step = *step;
  if (lr < 0) lr = ps__lr_at(&t->spec, *step, global_batch);
  t->last_lr = lr;
  t->last_batch = global_batch;
  return lr;
}

/* One row's step: gradient sum g (scaled in place), denominator d > 0, on row w (number ix). */
static void apply_to(ps__table *t, uint64_t key, uint32_t ix, float *w, float *g, double d, float lr, uint64_t step) {
  uint32_t len = ps__spec_row_len(&t->spec, key);
  if (d != 1.0 && t->spec.opt.kind == PS__OPT_SGD) {
    /* sgd is linear in the gradient: scale the step, not the gradient (one pass less) */
    ps__shard_write(t, key, ix, w, 0, g, len, (float)(lr / d), step);
    return;
  }
  if (d != 1.0) ps__vscale(g, (float)(1.0 / d), len);
  ps__shard_write(t, key, ix, w, 0, g, len, lr, step);
}

static int apply_oom(const ps__table *t) {
  ps__log(PS_LOG_ERROR, "out of memory applying table '%s'", t->decl.name);
  return PS_ERR_NOMEM;
}

int ps__shard_apply_row(ps__table *t, uint64_t key, float *g, double d, float lr, uint64_t step) {
  if (d <= 0) return 0;
  uint32_t ix = PS__ROW_ANY;
  float *w = ps__shard_row_at(t, key, &ix);
  if (!w) return apply_oom(t);
  apply_to(t, key, ix, w, g, d, lr, step);
  return 0;
}

/* One optimiser step over n rows: those of acc, or else keys[i] (little-endian) with
 * the gradient rows + i * width, which are only read (the caller passes them only with
 * none to scale: apply_to writes into a gradient for that alone). 0, or PS_ERR_NOMEM
 * (logged) when memory ran out part way. */
static int apply_step(ps__table *t, ps__rowmap *acc, const uint8_t *keys, const float *grads, size_t n, double denom,
                      int per_row_denom, float lr, double global_batch) {
  ps__shard_flush(t);
  if (n == 0) return 0;
  uint64_t step;
  lr = apply_begin(t, lr, global_batch, &step);
  unsigned width = t->spec.width;
  uint64_t k64[PS__ROWS_BATCH];
  float *gs[PS__ROWS_BATCH], *rows[PS__ROWS_BATCH];
  uint32_t ix[PS__ROWS_BATCH];
  ps__shard_expect(t, n);
  /* Blocks of rows with a step to take (a row whose denominator is 0 takes none and is
   * not created), their parameter rows looked up or created at once. */
  for (size_t i = 0; i < n;) {
    size_t nb = 0;
    for (; i < n && nb < PS__ROWS_BATCH; i++) {
      float *g = acc ? ps__rowmap_row_at(acc, i) : (float *)(uintptr_t)(grads + i * width);
      if ((per_row_denom ? g[width] : denom) <= 0) continue;
      k64[nb] = acc ? ps__rowmap_key_at(acc, i) : ps__get_u64(keys + 8 * i);
      gs[nb++] = g;
    }
    size_t got = ps__shard_rows_at(t, k64, NULL, nb, rows, ix);
    for (size_t q = 0; q < got; q++)
      apply_to(t, k64[q], ix[q], rows[q], gs[q], per_row_denom ? gs[q][width] : denom, lr, step);
    if (got < nb) return apply_oom(t);
  }
  t->applied++;
  return 0;
}

void ps__shard_apply_acc(ps__table *t, ps__rowmap *acc, double denom, int per_row_denom, float lr, double global_batch) {
  (void)apply_step(t, acc, NULL, NULL, ps__rowmap_count(acc), denom, per_row_denom, lr, global_batch);
}

void ps__shard_apply_round_at(ps__table *t, ps__rowmap *acc, int64_t round, float lr, double denom, double batch) {
  t->sh->replay_step = (uint64_t)round + 1;
  ps__shard_apply_acc(t, acc, denom, 0, lr, batch);
  t->sh->replay_step = 0;
}

int ps__shard_round_replica(ps__shard *sh, ps__table *t, const uint8_t *keys, const float *rows, uint32_t n,
                            int64_t round, float lr, double denom, double batch, ps__verdict *v) {
  v->status = PS__APPLIED;
  v->later = v->dup = 0;
  if (!ps__table_is_sync(t)) return ps__shard_reject(sh, t, v, PS_ERR_INVALID, "table '%s' is not synchronous", t->decl.name);
  size_t w = t->spec.width;
  if (denom == 1.0 || (t->spec.opt.kind == PS__OPT_SGD && denom > 0)) {
    /* No gradient to scale (apply_to): a step straight from the rows, which are the
     * head's accumulator's, one per key, as the head applied them. */
    sh->replay_step = (uint64_t)round + 1;
    int rc = apply_step(t, NULL, keys, rows, n, denom, 0, lr, batch);
    sh->replay_step = 0;
    return rc ? ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory") : PS__APPLIED;
  }
  if (!t->round_rep && !(t->round_rep = ps__rowmap_new(w)))
    return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
  for (uint32_t i = 0; i < n; i++) {
    int created;
    float *r = ps__rowmap_upsert(t->round_rep, ps__get_u64(keys + 8 * (size_t)i), &created);
    if (!r) {
      ps__rowmap_clear(t->round_rep);
      return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
    }
    for (size_t j = 0; j < w; j++) r[j] += rows[(size_t)i * w + j];
  }
  ps__shard_apply_round_at(t, t->round_rep, round, lr, denom, batch);
  ps__rowmap_clear(t->round_rep);
  return PS__APPLIED;
}

int ps__shard_round_begin(ps__table *t, ps__round *r, float *lr, uint64_t *step, double *denom) {
  ps__shard_flush(t);
  double batch = r->batch_sum / (double)t->spec.every; /* the round's global batch per clock */
  *denom = t->spec.update == PS__UPDATE_MEAN ? batch : 1.0;
  *step = 0;
  *lr = 0;
  if (ps__rowmap_count(r->acc) == 0) return 0;
  *lr = apply_begin(t, r->has_lr ? r->lr : -1.0f, batch, step);
  return 1;
}

/* ---------------------------------------------------------------- accumulation */

typedef struct acc_arg {
  ps__rowmap *acc;
  const float *vals;
  float weight;
  unsigned width;
  int count_weight, have_last;
  uint64_t last;
} acc_arg;

static int acc_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  acc_arg *a = arg;
  int created;
  float *row = ps__rowmap_upsert_uninit(a->acc, slice, &created);
  if (!row) return PS_ERR_NOMEM;
  if (created) { /* the first gradient of this slice: written, not added to zeros */
    memset(row, 0, within * 4);
    memset(row + within + n, 0, (a->width + (size_t)a->count_weight - within - n) * 4);
    ps__vset(row + within, a->weight, a->vals + pos, n);
  } else {
    ps__axpy(row + within, a->weight, a->vals + pos, n);
  }
  if (a->count_weight && (!a->have_last || slice != a->last)) {
    row[a->width] += a->weight;
    a->last = slice;
    a->have_last = 1;
  }
  return 0;
}

int ps__shard_accumulate(ps__table *t, ps__rowmap *acc, const ps__push *p, float weight, int count_weight) {
  unsigned width = t->spec.width;
  if (t->spec.kind == PS_DENSE) {
    acc_arg a = {acc, p->vals, weight, width, count_weight, 0, 0};
    return ps__walk_slices(p->keys, p->nkeys, width, acc_slice, &a);
  }
  float *rows[FIND_BLOCK];
  for (uint32_t b = 0; b < p->nkeys; b += FIND_BLOCK) {
    uint32_t n = p->nkeys - b < FIND_BLOCK ? p->nkeys - b : FIND_BLOCK;
    size_t got = ps__rowmap_upsert_many(acc, NULL, p->keys + 8 * (size_t)b, n, rows, NULL, NULL, 1);
    for (size_t i = 0; i < got; i++) ps__axpy(rows[i], weight, p->vals + (b + i) * (size_t)width, width);
    if (got < n) return PS_ERR_NOMEM;
  }
  if (count_weight) {
    /* Add this push's weight once to every row it touched, even for keys repeated in
     * the push: a first pass marks counted rows negative (weights are >= 0), a second
     * restores them. */
    for (uint32_t i = 0; i < p->nkeys; i++) {
      float *row = ps__rowmap_get(acc, ps__get_u64(p->keys + 8 * (size_t)i));
      if (row[width] >= 0) row[width] = -(row[width] + weight) - 1.0f;
    }
    for (uint32_t i = 0; i < p->nkeys; i++) {
      float *row = ps__rowmap_get(acc, ps__get_u64(p->keys + 8 * (size_t)i));
      if (row[width] < 0) row[width] = -(row[width] + 1.0f);
    }
  }
  return 0;
}

/* ---------------------------------------------------------------- pending applies */

void ps__shard_pending_step(ps__table *t, uint64_t budget) {
  ps__pending_apply *p = &t->pend;
  unsigned width = t->spec.width;
  while (p->active && budget > 0 && p->done < p->total) {
    uint64_t off = ps__get_u64(p->keys + 8 * (size_t)p->seg), cnt = ps__get_u64(p->keys + 8 * (size_t)(p->seg + 1));
    uint64_t o = off + p->seg_off, within = o % width, n = width - within;
    if (n > cnt - p->seg_off) n = cnt - p->seg_off;
    if (n > budget) n = budget;
    float *row = ps__rowmap_get(t->params, o / width);
    PS_ASSERT(row != NULL); /* created before the push was acknowledged */
    ps__shard_write(t, o / width, PS__ROW_ANY, row, (uint32_t)within, p->vals + p->done, n, p->lr, p->step);
    p->done += n;
    budget -= n;
    p->seg_off += n;
    if (p->seg_off == cnt) {
      p->seg += 2;
      p->seg_off = 0;
    }
  }
  if (p->active && p->done == p->total) {
    ps__shard *sh = t->sh;
    if (p->buf) sh->hooks.release(sh->hooks.arg, p->buf, p->len);
    memset(p, 0, sizeof *p);
    sh->npending--;
  }
}

void ps__shard_pending_idle(ps__shard *sh, uint64_t budget) {
  for (size_t i = 0; i < sh->ntables && sh->npending; i++)
    if (sh->tables[i] && sh->tables[i]->pend.active) ps__shard_pending_step(sh->tables[i], budget);
}

static int touch_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  (void)within, (void)n, (void)pos;
  return ps__shard_row(arg, slice) ? 0 : PS_ERR_NOMEM;
}

/* A dense push applied on its own. Once its rows exist the update cannot fail: the
 * caller acknowledges it at once, and the engine takes the body and applies it a
 * step at a time, so the worker's next request travels meanwhile. Whatever reads or
 * updates the table next finishes it first (ps__shard_flush), or, a pull of the same
 * ranges, while its reply goes out: no request sees it half done. Without a body to
 * take (values the caller lends, such as a member's read in place), it is applied at
 * once. */
static int apply_dense_later(ps__shard *sh, ps__table *t, const ps__push *p, ps__owned *body, ps__verdict *v) {
  if (ps__walk_slices(p->keys, p->nkeys, t->spec.width, touch_slice, t))
    return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
  t->pushes++;
  uint64_t step;
  float lr = apply_begin(t, p->lr >= 0 ? p->lr : -1.0f, ps__shard_direct_batch(sh, p->batch), &step);
  t->applied++;
  ps__pending_apply *q = &t->pend;
  PS_ASSERT(!q->active);
  if (p->nvals == 0) return PS__APPLIED;
  q->active = 1;
  q->buf = body ? body->buf : NULL;
  q->len = body ? body->len : 0;
  q->keys = p->keys;
  q->nkeys = p->nkeys;
  q->vals = p->vals;
  q->total = p->nvals;
  q->lr = lr;
  q->step = step;
  sh->npending++;
  if (!q->buf) { /* values the caller does not own (read in place): applied now */
    ps__shard_pending_step(t, q->total);
    return PS__APPLIED;
  }
  body->buf = NULL; /* taken */
  v->later = 1;
  return PS__APPLIED;
}

void ps__shard_pending_first(ps__table *t) {
  /* A small push is applied at once: a pull could not overlap much of it. */
  if (t->pend.active) ps__shard_pending_step(t, t->pend.total <= PS__PRODUCE_STEP ? t->pend.total : PS__APPLY_STEP);
}

/* ---------------------------------------------------------------- huge requests */

#define PULL_UNIT 16384u  /* positions per unit of a pull */
#define PUSH_CLASS_BITS 1 /* a push's keys fall into 2 classes, one unit each */
#define PUSH_CLASSES (1u << PUSH_CLASS_BITS)

typedef struct huge_job huge_job;
struct huge_job {
  void (*unit)(huge_job *a, uint32_t u);
  ps__table *t;
  const uint8_t *keys;
  uint32_t nkeys;
  uint8_t *left;         /* a byte per position: 1 = left to the owner's thread */
  atomic_uint next;      /* next unit to claim */
  uint32_t nunits;
  atomic_int mostly_new; /* a unit gave up: later ones leave all their keys */
  float *out;            /* pull: the answer */
  const float *vals;     /* push: the gradients, rate and step */
  float lr;
  uint64_t step;
};

/* A unit gives up, leaving the rest of its keys (and later units all theirs) to the
 * owner's thread, once more than a quarter of the keys it looked up were missing, after
 * at least GIVE_UP_MIN: a request of mostly new keys is bound by the serial inserts,
 * and looking its keys up twice would only add cache misses. */
#define GIVE_UP_MIN 4096u
static inline int give_up(uint32_t missed, uint32_t done) { return done >= GIVE_UP_MIN && missed > done / 4; }

static void huge_work(void *arg, unsigned part) {
  huge_job *a = arg;
  (void)part;
  for (;;) {
    unsigned u = atomic_fetch_add_explicit(&a->next, 1, memory_order_relaxed);
    if (u >= a->nunits) break;
    a->unit(a, u);
  }
}

/* Run a huge job on both threads and return the `left` flags (nkeys bytes, the
 * caller frees them), or NULL if they cannot be allocated. */
static uint8_t *huge_run(ps__shard *sh, ps__par *par, huge_job *a) {
  a->left = sh->hooks.alloc(sh->hooks.arg, a->nkeys);
  if (!a->left) return NULL;
  memset(a->left, 0, a->nkeys);
  atomic_init(&a->next, 0);
  atomic_init(&a->mostly_new, 0);
  ps__par_run(par, huge_work, a);
  return a->left;
}

/* The keys of a block that a lookup did not find (rows[i] NULL; keys64, or the wire's
 * keys_le) created, in the block's order, their rows (and row numbers into idx if it is
 * not NULL) filled in. Returns n, or the place of the first key whose row memory did not
 * run to (the keys before it have rows). */
static uint32_t fill_missing(ps__table *t, const uint64_t *keys64, const uint8_t *keys_le, uint32_t n, float **rows,
                             uint32_t *idx) {
  uint32_t miss[FIND_BLOCK], nm = 0;
  uint64_t k64[FIND_BLOCK];
  float *mrows[FIND_BLOCK];
  uint32_t mix[FIND_BLOCK];
  PS_ASSERT(n <= FIND_BLOCK && FIND_BLOCK <= PS__ROWS_BATCH);
  for (uint32_t i = 0; i < n; i++) {
    miss[nm] = i;
    k64[nm] = keys64 ? keys64[i] : ps__get_u64(keys_le + 8 * (size_t)i);
    nm += rows[i] == NULL;
  }
  if (nm == 0) return n;
  size_t got = ps__shard_rows_at(t, k64, NULL, nm, mrows, mix);
  for (size_t q = 0; q < got; q++) {
    rows[miss[q]] = mrows[q];
    if (idx) idx[miss[q]] = mix[q];
  }
  return got < nm ? miss[got] : n;
}

/* The positions flagged in left (n flags), in order, into pos; returns their number. */
static uint32_t left_positions(const uint8_t *left, uint32_t n, uint32_t *pos) {
  uint32_t k = 0;
  for (const uint8_t *p = left; (p = memchr(p, 1, (size_t)(left + n - p))); p++) pos[k++] = (uint32_t)(p - left);
  return k;
}

/* The keys at positions pos[j .. j + n) of a request, into k64. */
static void gather_keys(const uint8_t *keys, const uint32_t *pos, uint32_t j, uint32_t n, uint64_t *k64) {
  for (uint32_t q = 0; q < n; q++) k64[q] = ps__get_u64(keys + 8 * (size_t)pos[j + q]);
}

/* The class of a key in a huge push: the top bits of a multiplicative hash (balanced
 * for sequential keys as well). */
static inline unsigned key_class(uint64_t key) {
  return (unsigned)((key * 0x9e3779b97f4a7c15ull) >> (64 - PUSH_CLASS_BITS));
}

/* One class of a huge sgd push: walk the whole request, and for the keys of class c,
 * in request order, apply the gradients of those in the map. Every row has one class,
 * so one writer, and gets its keys in request order. */
static void push_unit(huge_job *a, uint32_t c) {
  ps__table *t = a->t;
  const ps__rowmap *m = t->params;
  unsigned width = t->spec.width;
  const uint8_t *keys = a->keys;
  uint32_t n = a->nkeys, i = 0, done = 0, missed = 0;
  uint32_t pos[FIND_BLOCK];
  uint64_t k64[FIND_BLOCK];
  float *rows[FIND_BLOCK];
  uint32_t ix[FIND_BLOCK];
  int stop = atomic_load_explicit(&a->mostly_new, memory_order_relaxed);
  while (!stop && i < n) {
    /* The next FIND_BLOCK keys of the class (no branch on the class: it is random). */
    uint32_t nb = 0;
    for (; i < n && nb < FIND_BLOCK; i++) {
      uint64_t k = ps__get_u64(keys + 8 * (size_t)i);
      pos[nb] = i;
      k64[nb] = k;
      nb += key_class(k) == c;
    }
    ps__rowmap_find_many_at(m, k64, NULL, nb, rows, t->watch ? ix : NULL);
    for (uint32_t q = 0; q < nb; q++) {
      if (rows[q]) {
        ps__shard_write(t, k64[q], t->watch ? ix[q] : PS__ROW_ANY, rows[q], 0, a->vals + (size_t)pos[q] * width, width,
                        a->lr, a->step);
        continue;
      }
      a->left[pos[q]] = 1;
      if (give_up(++missed, done + q + 1)) {
        atomic_store_explicit(&a->mostly_new, 1, memory_order_relaxed);
        for (q++; q < nb; q++) a->left[pos[q]] = 1;
        stop = 1;
      }
    }
    done += nb;
  }
  for (; i < n; i++)
    if (key_class(ps__get_u64(keys + 8 * (size_t)i)) == c) a->left[i] = 1;
}

/* A huge sgd push: apply on both threads, then the keys left over (new rows) in
 * request order. */
static int push_huge(ps__par *par, ps__table *t, const ps__push *p, float lr, uint64_t step) {
  huge_job a = {.unit = push_unit, .t = t, .keys = p->keys, .nkeys = p->nkeys, .nunits = PUSH_CLASSES,
                .vals = p->vals, .lr = lr, .step = step};
  size_t width = t->spec.width;
  ps__shard *sh = t->sh;
  size_t plen = (size_t)p->nkeys * 4;
  uint32_t *pos = sh->hooks.alloc(sh->hooks.arg, plen);
  uint8_t *left = NULL;
  int rc = PS_ERR_NOMEM;
  int inl = t->dirty_inline; /* two writer threads: the bits are set atomically meanwhile */
  t->dirty_inline = 0;
  left = pos ? huge_run(sh, par, &a) : NULL;
  t->dirty_inline = inl;
  if (!left) goto out;
  rc = 0;
  uint32_t nleft = left_positions(left, p->nkeys, pos);
  uint64_t k64[PS__ROWS_BATCH];
  float *rows[PS__ROWS_BATCH];
  uint32_t ix[PS__ROWS_BATCH];
  ps__shard_expect(t, nleft);
  for (uint32_t j = 0; j < nleft && !rc; j += PS__ROWS_BATCH) {
    uint32_t nb = nleft - j < PS__ROWS_BATCH ? nleft - j : PS__ROWS_BATCH;
    gather_keys(p->keys, pos, j, nb, k64);
    size_t got = ps__shard_rows_at(t, k64, NULL, nb, rows, ix);
    for (size_t q = 0; q < got; q++)
      ps__shard_write(t, k64[q], ix[q], rows[q], 0, p->vals + pos[j + q] * width, width, lr, step);
    if (got < nb) rc = PS_ERR_NOMEM;
  }
out:
  if (left) sh->hooks.release(sh->hooks.arg, left, p->nkeys);
  if (pos) sh->hooks.release(sh->hooks.arg, pos, plen);
  return rc;
}

/* One run of positions of a huge pull: copy the rows that are in the map. */
static void pull_unit(huge_job *a, uint32_t u) {
  const ps__rowmap *m = a->t->params;
  unsigned width = a->t->spec.width;
  uint32_t lo = u * PULL_UNIT, n = a->nkeys - lo < PULL_UNIT ? a->nkeys - lo : PULL_UNIT, i = 0, missed = 0;
  const uint8_t *keys = a->keys + 8 * (size_t)lo;
  float *o = a->out + (size_t)lo * width;
  uint8_t *left = a->left + lo;
  float *rows[FIND_BLOCK];
  int stop = atomic_load_explicit(&a->mostly_new, memory_order_relaxed);
  while (!stop && i < n) {
    uint32_t nb = n - i < FIND_BLOCK ? n - i : FIND_BLOCK;
    ps__rowmap_find_many_le(m, keys + 8 * (size_t)i, nb, rows);
    for (uint32_t q = 0; q < nb; q++, i++, o += width) {
      const float *row = rows[q];
      if (row) {
        if (width == 1)
          *o = *row;
        else
          memcpy(o, row, (size_t)width * 4);
        continue;
      }
      left[i] = 1;
      if (give_up(++missed, i + 1)) {
        atomic_store_explicit(&a->mostly_new, 1, memory_order_relaxed);
        i++;
        stop = 1;
        break;
      }
    }
  }
  if (i < n) memset(left + i, 1, n - i);
}

int ps__shard_read_huge(ps__table *t, ps__par *par, const uint8_t *keys, uint32_t nkeys, float *out) {
  if (ps__rowmap_settle(t->params, nkeys)) ps__shard_grown(t); /* one index to look in */
  huge_job a = {.unit = pull_unit, .t = t, .keys = keys, .nkeys = nkeys,
                .nunits = (nkeys + PULL_UNIT - 1) / PULL_UNIT, .out = out};
  size_t width = t->spec.width;
  ps__shard *sh = t->sh;
  size_t plen = (size_t)nkeys * 4;
  uint32_t *pos = sh->hooks.alloc(sh->hooks.arg, plen);
  if (!pos) return PS_ERR_NOMEM;
  uint8_t *left = huge_run(sh, par, &a);
  int rc = left ? 0 : PS_ERR_NOMEM;
  uint32_t nleft = left ? left_positions(left, nkeys, pos) : 0;
  uint64_t k64[PS__ROWS_BATCH];
  float *rows[PS__ROWS_BATCH];
  ps__shard_expect(t, nleft);
  for (uint32_t j = 0; j < nleft && !rc; j += PS__ROWS_BATCH) {
    uint32_t nb = nleft - j < PS__ROWS_BATCH ? nleft - j : PS__ROWS_BATCH;
    gather_keys(keys, pos, j, nb, k64);
    size_t got = ps__shard_rows_at(t, k64, NULL, nb, rows, NULL);
    for (size_t q = 0; q < got; q++) memcpy(out + pos[j + q] * width, rows[q], width * 4);
    if (got < nb) rc = PS_ERR_NOMEM;
  }
  if (left) sh->hooks.release(sh->hooks.arg, left, nkeys);
  sh->hooks.release(sh->hooks.arg, pos, plen);
  return rc;
}

int ps__shard_read_rows(ps__table *t, const uint8_t *keys, uint32_t lo, uint32_t hi, float *out) {
  size_t width = t->spec.width;
  float *rows[FIND_BLOCK];
  int oom = 0;
  for (uint32_t b = lo; b < hi; b += FIND_BLOCK) {
    uint32_t n = hi - b < FIND_BLOCK ? hi - b : FIND_BLOCK;
    ps__rowmap_find_many_le(t->params, keys + 8 * (size_t)b, n, rows);
    fill_missing(t, NULL, keys + 8 * (size_t)b, n, rows, NULL); /* a key left without a row: out of memory */
    for (uint32_t i = 0; i < n; i++) {
      float *o = out + (size_t)(b + i) * width;
      const float *row = rows[i];
      if (!row) {
        memset(o, 0, width * 4);
        oom = 1;
      } else if (width == 1) {
        *o = *row;
      } else {
        memcpy(o, row, width * 4);
      }
    }
  }
  return oom;
}

/* ---------------------------------------------------------------- direct pushes */

/* Async/ssp without server-side aggregation applies every push at once, so the
 * batch-weighted mean of the one push is its own gradient: apply it straight from the
 * frame, skipping the aggregation buffer. Sparse rows repeated in a push must be summed
 * before a non-linear optimiser steps, so only sgd applies sparse rows directly; the
 * others sum them in the buffer first. */
int ps__shard_apply_direct(ps__shard *sh, ps__table *t, const ps__push *p, ps__owned *body, ps__verdict *v) {
  unsigned width = t->spec.width;
  if (t->spec.kind == PS_DENSE) return apply_dense_later(sh, t, p, body, v);
  if (p->nkeys == 0) goto done;
  double gb = ps__shard_direct_batch(sh, p->batch);
  if (t->spec.opt.kind != PS__OPT_SGD) {
    if (!t->agg && !(t->agg = ps__rowmap_new((size_t)width + 1))) goto oom;
    if (ps__shard_accumulate(t, t->agg, p, 1.0f, 0)) {
      ps__rowmap_clear(t->agg);
      goto oom;
    }
    ps__shard_apply_acc(t, t->agg, 1.0, 0, p->lr >= 0 ? p->lr : -1.0f, gb);
    ps__rowmap_clear(t->agg);
    goto done;
  }
  uint64_t step;
  float lr = apply_begin(t, p->lr >= 0 ? p->lr : -1.0f, gb, &step);
  ps__par *par = p->nkeys >= PS__PAR_MIN_KEYS && sh->hooks.par ? sh->hooks.par(sh->hooks.arg, p->nkeys) : NULL;
  if (par) {
    if (ps__rowmap_settle(t->params, p->nkeys)) ps__shard_grown(t); /* one index to look in */
    if (push_huge(par, t, p, lr, step)) goto oom;
  } else {
    float *rows[FIND_BLOCK];
    uint32_t ix[FIND_BLOCK];
    ps__shard_expect(t, p->nkeys);
    for (uint32_t b = 0; b < p->nkeys; b += FIND_BLOCK) {
      uint32_t n = p->nkeys - b < FIND_BLOCK ? p->nkeys - b : FIND_BLOCK;
      const uint8_t *kb = p->keys + 8 * (size_t)b;
      ps__rowmap_find_many_at(t->params, NULL, kb, n, rows, t->watch ? ix : NULL);
      uint32_t done = fill_missing(t, NULL, kb, n, rows, t->watch ? ix : NULL);
      for (uint32_t i = 0; i < done; i++)
        ps__shard_write(t, ps__get_u64(kb + 8 * (size_t)i), t->watch ? ix[i] : PS__ROW_ANY, rows[i], 0,
                        p->vals + (size_t)(b + i) * width, width, lr, step);
      if (done < n) goto oom;
    }
  }
  t->applied++;
done:
  t->pushes++;
  return PS__APPLIED;
oom:
  return ps__shard_reject(sh, t, v, PS_ERR_NOMEM, "server out of memory");
}
