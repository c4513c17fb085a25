/*
 * spec.h - a table's spec: its kind and size, optimiser, initialiser, update rule,
 * consistency mode and learning-rate schedule, parsed from the option string that
 * DECLARE and CREATE carry (ps_table_declare in pshard.h lists the options).
 *
 * Pure functions, no I/O: the worker, the scheduler and every server parse the same
 * string with this code, and the scheduler compares the results byte for byte to tell
 * a repeated declaration from a conflicting one. The row layout the store builds from
 * a spec is described in store/store.h.
 */
#ifndef PS_SPEC_H
#define PS_SPEC_H

#include <stddef.h>
#include <stdint.h>

#include "proto/codec.h"

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
  uint32_t nonfinite;  /* PS__NONFINITE_*: what a push holding NaN or Inf gets (refuse) */
  ps__codec push_codec;/* push_codec=: how workers encode pushes (none: raw f32) */
  ps__codec pull_codec;/* pull_codec=: how servers encode pull replies (none; never topk) */
} ps__table_spec;

enum { PS__DECAY_CONST = 0, PS__DECAY_STEP = 1, PS__DECAY_COS = 2 };
/* nonfinite=refuse (PS_ERR_INVALID, nothing applied), skip (answered as dropped, nothing
 * applied) or allow (not checked: values go to the optimiser as they are). */
enum { PS__NONFINITE_REFUSE = 0, PS__NONFINITE_SKIP = 1, PS__NONFINITE_ALLOW = 2 };

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

#endif /* PS_SPEC_H */
