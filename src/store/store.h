/*
 * store.h - parameter storage: table specs, row maps, initialisers and optimisers.
 *
 * No I/O, no threads: everything here is called from one server event-loop thread and
 * is testable on its own.
 *
 * A server keeps every table as a row map. A sparse table's rows are its embedding
 * rows; a dense table of n floats is cut into slices of `slice` elements and each
 * slice is one row (key = slice index, the last slice may be shorter but is stored at
 * full width). A row is `row_floats` contiguous floats: the parameters (width floats)
 * followed by the optimiser state, one block of `width` floats per state variable.
 * Rows live in large chunks that never move, so a row pointer stays valid until the
 * map is cleared or freed, and memory per row is the payload plus the hash index.
 */
#ifndef PS_STORE_H
#define PS_STORE_H

#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------- table spec */

typedef enum { PS__OPT_SGD, PS__OPT_MOMENTUM, PS__OPT_ADAGRAD, PS__OPT_ADAM, PS__OPT_FTRL } ps__opt_kind;
typedef enum { PS__INIT_ZERO, PS__INIT_CONST, PS__INIT_UNIFORM, PS__INIT_NORMAL } ps__init_kind;
typedef enum { PS__UPDATE_MEAN, PS__UPDATE_SUM } ps__update_mode;

typedef struct ps__optim {
  ps__opt_kind kind;
  float lr;       /* base learning rate (lr=, default 0.01) */
  float momentum; /* momentum= (0.9) */
  float beta1;    /* beta1= (0.9) */
  float beta2;    /* beta2= (0.999) */
  float eps;      /* eps= (adam 1e-8, adagrad 1e-10) */
  float acc0;     /* acc0= adagrad initial accumulator (0) */
  float l1, l2;   /* l1= l2= ftrl (0, 0) */
  float beta;     /* beta= ftrl (1) */
} ps__optim;

typedef struct ps__init {
  ps__init_kind kind;
  float a;       /* const value, uniform bound A, or normal standard deviation */
  uint64_t seed; /* seed= (0) */
} ps__init;

typedef struct ps__table_spec {
  int kind;            /* PS_DENSE or PS_SPARSE (pshard.h values) */
  uint64_t size;       /* dense: number of floats; sparse: row dimension */
  uint32_t width;      /* floats of parameters per row: dim, or the dense slice size */
  uint64_t nrows;      /* dense: number of slices; sparse: 0 (unbounded) */
  ps__optim opt;
  ps__init init;
  ps__update_mode update;
  uint64_t name_hash;  /* xxh64 of the table name; seeds the initialiser */
  uint32_t mode;       /* ps__mode_kind (common/config.h): mode= (sync) */
  uint32_t mode_param; /* M of sync:M, S of ssp:S */
  uint32_t every;      /* every=N: sync modes apply a round every N clocks (1) */
  uint32_t agg_n;      /* agg_n=N: async/ssp buffer N pushes before applying (0 = off) */
  uint32_t agg_ms;     /* agg_ms=T: ... or T milliseconds after the first (0 = off) */
  /* learning-rate schedule (DESIGN 4): lr = base * (B_global / ref_batch if ref_batch)
   * * warm-up factor * decay factor */
  uint32_t ref_batch;  /* ref_batch=B: linear scaling with the global batch (0 = off) */
  uint32_t warmup;     /* warmup=N: linear warm-up over the first N steps (0 = off) */
  uint32_t decay;      /* PS__DECAY_* from decay=const|step:S:G|cos:T */
  uint32_t decay_every;/* step: every S steps ... */
  float decay_gamma;   /* ... multiply by G; cos: lr_min as a fraction of the peak */
  uint32_t decay_steps;/* cos: steps T of the cosine after warm-up */
} ps__table_spec;

enum { PS__DECAY_CONST = 0, PS__DECAY_STEP = 1, PS__DECAY_COS = 2 };

/* The learning rate of the table's schedule for 1-based update `step` when the global
 * batch (examples behind the update, over all workers) is global_batch. */
float ps__lr_at(const ps__table_spec *spec, uint64_t step, double global_batch);

/* Parse `options` (see ps_table_declare in pshard.h) for a table of the given kind and
 * size. On failure returns PS_ERR_CONFIG (or PS_ERR_INVALID for a bad kind/size) and
 * writes a message naming the offending option into err (if errlen > 0). The name is
 * hashed into spec->name_hash. */
int ps__table_spec_parse(ps__table_spec *spec, const char *name, int kind, uint64_t size,
                         const char *options, char *err, size_t errlen);
/* Number of optimiser state floats per parameter: sgd 0, momentum 1, adagrad 1,
 * adam 2, ftrl 2. */
unsigned ps__optim_nstate(ps__opt_kind kind);
/* Floats per stored row: width * (1 + nstate). */
size_t ps__spec_row_floats(const ps__table_spec *spec);
/* Parameters actually used in row `row` (dense: the last slice may be short). */
uint32_t ps__spec_row_len(const ps__table_spec *spec, uint64_t row);

/* ---------------------------------------------------------------- initialiser */

/* Fill the parameters of a new row deterministically from (seed, name_hash, row key,
 * element index), so that any server creates the same row. Fills `len` floats of w,
 * and sets the optimiser state (state floats after the width block) to its start
 * value (adagrad: acc0; others 0). `row` points to ps__spec_row_floats floats. */
void ps__row_init(const ps__table_spec *spec, uint64_t key, float *row);

/* ---------------------------------------------------------------- optimisers */

/* Apply one optimiser step to n parameters w with gradient g (already combined: the
 * batch-weighted mean or the sum). state points to nstate blocks of `stride` floats
 * (block k at state + k*stride); for a row, stride = width. `step` is the 1-based
 * number of this update of the table (adam bias correction). lr is the rate to use. */
void ps__optim_apply(const ps__optim *o, float lr, uint64_t step, float *restrict w,
                     float *restrict state, size_t stride, const float *restrict g,
                     size_t n);

/* ---------------------------------------------------------------- vector helpers */

/* y[i] += a * x[i] for i < n; written to vectorise. */
void ps__axpy(float *restrict y, float a, const float *restrict x, size_t n);
/* y[i] += x[i]. */
void ps__vadd(float *restrict y, const float *restrict x, size_t n);
/* y[i] *= a. */
void ps__vscale(float *y, float a, size_t n);
/* y = a * x (a plain copy for a = 1). */
void ps__vset(float *restrict y, float a, const float *restrict x, size_t n);

/* ---------------------------------------------------------------- row map */

typedef struct ps__rowmap ps__rowmap;

/* A map from uint64 key to a row of row_floats floats. Rows are stored in chunks of
 * (1 << chunk_shift) rows, index entries in one open-addressing array (load <= 0.75).
 * A row pointer stays valid until the map is cleared or freed. Returns NULL on
 * allocation failure. */
ps__rowmap *ps__rowmap_new(size_t row_floats);
/* The same, except that when row_floats == 1 the rows live in the index slots, so a
 * lookup costs one cache miss instead of two; a row pointer is then valid only until
 * the next insert (an upsert that creates a row), which may move every row. */
ps__rowmap *ps__rowmap_new_in_index(size_t row_floats);
void ps__rowmap_free(ps__rowmap *m);
/* The row for key, or NULL if absent. */
float *ps__rowmap_get(const ps__rowmap *m, uint64_t key);
/* Rows of keys[0 .. n) into rows[] (NULL where a key is absent), each key hashed once:
 * a software pipeline prefetches the index slot of the key 16 ahead and the row of the
 * key 8 ahead, so a batch of cold keys keeps many misses in flight. keys64 is an array
 * of host-order keys; keys_le the wire's little-endian bytes (8 per key). */
void ps__rowmap_find_many(const ps__rowmap *m, const uint64_t *keys64, size_t n, float **rows);
void ps__rowmap_find_many_le(const ps__rowmap *m, const uint8_t *keys_le, size_t n, float **rows);
/* Hints for callers walking many keys of a large map, where cache misses rather than
 * work dominate: prefetch the index slot of key; or look key up (its slot prefetched a
 * few keys earlier) and prefetch its row. Neither changes the map. */
void ps__rowmap_prefetch(const ps__rowmap *m, uint64_t key);
void ps__rowmap_prefetch_row(const ps__rowmap *m, uint64_t key);
/* The row for key, created if absent (*created set to 1 then, row zero-filled).
 * NULL only on allocation failure (the map is unchanged then). */
float *ps__rowmap_upsert(ps__rowmap *m, uint64_t key, int *created);
/* Like ps__rowmap_upsert, but a created row's floats are undefined: the caller writes
 * every one of them (saves a pass over rows filled at once, e.g. accumulators). */
float *ps__rowmap_upsert_uninit(ps__rowmap *m, uint64_t key, int *created);
/* Number of rows. Rows are numbered 0..count-1 in insertion order. */
size_t ps__rowmap_count(const ps__rowmap *m);
/* Key and row of the i-th inserted row (i < count). */
uint64_t ps__rowmap_key_at(const ps__rowmap *m, size_t i);
float *ps__rowmap_row_at(const ps__rowmap *m, size_t i);
/* Remove every row but keep the memory for reuse (used for per-round accumulators). */
void ps__rowmap_clear(ps__rowmap *m);
/* Bytes held: row chunks + index. */
size_t ps__rowmap_bytes(const ps__rowmap *m);

#endif /* PS_STORE_H */
