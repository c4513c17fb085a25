/*
 * plan_model.h - the cost model behind `pshard plan`: memory, traffic, time, batch and
 * learning rate of a data-parallel job on a parameter server, from a few numbers the
 * user knows before the job runs. Pure arithmetic, no I/O; the CLI in src/cli/plan.c
 * parses flags into a ps__plan_in and prints a ps__plan_out. docs/plan.md has the
 * formulas.
 *
 * Units are SI base units throughout: bytes, seconds, bytes per second. Byte counts
 * are doubles, exact for every integer below 2^53 (9 PB).
 *
 * Model (strong scaling, no overlap unless stated):
 *   G  = P x gradient bytes             one worker's push per step
 *   aggregate traffic per step = 2 K G  every worker pushes G and pulls G back
 *   per-server traffic         = 2 K G / S
 *   communication per step     = 2 max(G, K G / S) / link  (the busiest link: a worker's
 *                                while K <= S, a server's beyond)
 *   compute per step on K      = T1 / K  (T1: one worker's time for one step of the
 *                                global batch; a whole job scales the same way)
 *   communication dominates when communication per step > T1 / K.
 *
 * Sparse tables (embeddings) add rows held by the servers and rows touched per step:
 *   a row of dim d with n optimiser state floats per parameter holds 4 d (1 + n) bytes,
 *   plus its 8-byte key, plus its share of the row map's hash index (ps__plan_rowmap_bytes,
 *   the one place that mirrors src/store/rowmap.c's layout);
 *   a worker touching u distinct rows of it per step pushes u (8 + 4 d) bytes (keys and
 *   gradients) and pulls as many (keys out, values back); that adds to G;
 *   with R replicas every server holds R / S of each table (a key's chain is R servers)
 *   and receives every push of its chains: communication per step becomes
 *   (max(G, R K G / S) + max(G, K G / S)) / link (push through the chain, then pull).
 */
#ifndef PS_PLAN_MODEL_H
#define PS_PLAN_MODEL_H

#include <stddef.h>

/* A training-state recipe: what one parameter costs in memory. */
typedef struct ps__plan_recipe {
  const char *name;         /* "mixed-adam" */
  double state_bytes;       /* bytes per parameter of training state */
  double weight_bytes;      /* bytes per parameter of the weights alone */
  double grad_bytes;        /* bytes per gradient element sent */
  const char *weight_prec;  /* "fp16" */
  const char *grad_prec;    /* "fp16" */
  const char *breakdown;    /* "2 fp16 weights + 2 fp16 gradient + 12 fp32 master/m/v" */
} ps__plan_recipe;

/* The recipe named `name`, or NULL. The table is static and read-only. */
const ps__plan_recipe *ps__plan_recipe_find(const char *name);
/* The i-th known recipe, or NULL past the end (for help texts). */
const ps__plan_recipe *ps__plan_recipe_at(size_t i);
/* Bytes of one element of a precision name (fp32 4, fp16 2, bf16 2, int8 1, fp64 8);
 * 0 for an unknown name. */
double ps__plan_precision_bytes(const char *name);

/* One sparse table to plan for. */
typedef struct ps__plan_sparse {
  double rows;        /* rows the table will hold (distinct keys) */
  double dim;         /* floats per row */
  double nstate;      /* optimiser state floats per parameter (sgd 0, adagrad 1, adam 2, ftrl 2) */
  double touched;     /* distinct rows one worker's step touches; 0: from zipf, or unknown */
} ps__plan_sparse;

#define PS__PLAN_MAX_SPARSE 16

/* Inputs. A value of 0 means "not given"; outputs that need it are then NaN. */
typedef struct ps__plan_in {
  double params;          /* P, number of parameters */
  double state_bytes;     /* training-state bytes per parameter */
  double weight_bytes;    /* bytes per weight for the weights-only figure */
  double grad_bytes;      /* bytes per gradient element on the wire */
  double push_bytes;      /* one worker's push per step, overriding P x grad_bytes */
  double servers;         /* S >= 1 (default 1) */
  double workers;         /* K >= 1 (default 1) */
  double link;            /* link rate, bytes per second */
  double step_time;       /* one worker's compute time for one step of the work, s */
  double job_time;        /* one worker's compute time for the whole job, s */
  double steps;           /* optimiser steps in the job */
  double server_mem;      /* memory available per server for training state, bytes */
  double batch;           /* local batch per worker */
  double ref_batch;       /* reference batch of the base learning rate */
  double ref_lr;          /* base learning rate at ref_batch */
  double samples;         /* training examples per epoch */
  double warmup_epochs;   /* warm-up length in epochs (default 5, Goyal et al.) */
  double warmup_steps;    /* warm-up length in steps, overriding warmup_epochs */
  double replicas;        /* R >= 1 copies of every key range, R <= S (default 1) */
  size_t nsparse;         /* sparse tables in sparse[] */
  ps__plan_sparse sparse[PS__PLAN_MAX_SPARSE];
  double zipf;            /* Zipf exponent of the row ids (0: not given) ... */
  double ids_per_example; /* ... with this many ids per example and table (default 1) */
} ps__plan_in;

/* Figures of one sparse table. */
typedef struct ps__plan_sparse_out {
  double row_floats;        /* d (1 + n): parameters and optimiser state */
  double payload_bytes;     /* 4 d (1 + n) */
  double rows_per_server;   /* ceil(R rows / S) */
  double bytes_per_server;  /* the table's row map on one server */
  double peak_per_server;   /* the same while its index doubles (both indexes held) */
  double row_bytes;         /* bytes_per_server / rows_per_server */
  double touched;           /* distinct rows per worker step (given or from zipf) */
  double push_bytes;        /* touched x (8 + 4 d), one worker's push per step */
  double pull_bytes;        /* the same: keys out, values back */
} ps__plan_sparse_out;

/* Outputs; NaN where the inputs do not determine the value. */
typedef struct ps__plan_out {
  double weights_bytes;         /* P x weight_bytes */
  double state_bytes;           /* P x state_bytes */
  double state_per_server;      /* state / S */
  double servers_needed;        /* ceil(state / server_mem) */
  double push_bytes;            /* G: one worker's gradient push per step */
  double traffic_bytes;         /* 2 K G: aggregate push + pull per step */
  double traffic_per_server;    /* 2 K G / S */
  double push_time;             /* G / link: one push on an idle link, s */
  double comm_time;             /* 2 max(G, K G / S) / link per step, s */
  double step_time_1;           /* one worker's compute per step (given or job/steps), s */
  double step_compute;          /* step_time_1 / K, s */
  double step_serial;           /* step_compute + comm_time (no overlap), s */
  double step_overlap;          /* max(step_compute, comm_time) (perfect overlap), s */
  double job_time_1;            /* one worker's compute for the job, s */
  double job_compute;           /* job_time_1 / K, s */
  double job_serial;            /* steps x step_serial, s */
  double job_overlap;           /* steps x step_overlap, s */
  double steps;                 /* steps in the job (given or job/step time) */
  double k_comm;                /* communication dominates for K > k_comm */
  double global_batch;          /* K x batch */
  double lr;                    /* ref_lr x global_batch / ref_batch */
  double steps_per_epoch;       /* samples / global_batch, rounded up */
  double warmup_epochs;         /* 0 when the rate is not scaled up */
  double warmup_steps;
  ps__plan_sparse_out sparse[PS__PLAN_MAX_SPARSE];
  double sparse_push_bytes;     /* sum of the tables' push_bytes (part of push_bytes) */
  double sparse_per_server;     /* sum of the tables' bytes_per_server */
  double sparse_peak_per_server;/* the same, one table's index doubling at a time */
  double memory_per_server;     /* R state / S + sparse_per_server */
  double servers_for_sparse;    /* fewest S whose peak fits server_mem (with R copies) */
} ps__plan_out;

/* Bytes a row map (src/store/rowmap.c) holds with n rows of row_floats floats: rows and
 * keys in chunks, and the index at its load (<= 3/4, a power of two >= 16 slots of 12
 * bytes, 16 when one-float rows live in it). *peak (if not NULL): the same while the
 * index is rebuilt at twice its size, when the old one is still held. The chunks'
 * rounding (at most one partly used chunk of <= 2 MiB) is left out. */
double ps__plan_rowmap_bytes(double n, double row_floats, double *peak);

/* Expected distinct ids in `draws` independent draws from Zipf(s) over 1..rows
 * (P(i) proportional to i^-s): sum of 1 - (1 - p_i)^draws, exact for the first ids and
 * integrated over the smooth tail (relative error below 1e-3). */
double ps__plan_zipf_distinct(double rows, double s, double draws);

/* Default inputs: all unknown, S = K = R = 1, warm-up 5 epochs, one id per example. */
void ps__plan_in_init(ps__plan_in *in);

/* Compute every output the inputs determine. Returns 0, or PS_ERR_INVALID (message in
 * ps_errmsg) for a negative, non-finite or inconsistent input: S or K below 1, a
 * fractional S or K, R above S, or step time, job time and steps all given. */
int ps__plan_compute(const ps__plan_in *in, ps__plan_out *out);

/* Unit parsers; each returns 0 and stores the value, or -1 leaving *out unchanged.
 * A number may be written with an exponent (7e9) and one space before its unit.
 *
 * ps__parse_bytes: a size in bytes. "14GB" (10^9), "13GiB" (2^30), "512MiB", "1.5TB",
 *   "100B", or a plain number of bytes. Prefixes k K M G T P E (decimal) and Ki Mi Gi
 *   Ti Pi Ei (binary). Bits ("Gb", "Gbit") are rejected: a size is never in bits.
 * ps__parse_rate: a link rate in bytes per second. "100Gbit/s", "100Gb/s", "100Gbps"
 *   are gigabits (10^9 bits); "12.5GB/s", "12.5GBps" are gigabytes (10^9 bytes);
 *   binary prefixes work with bytes ("1GiB/s"). A unit is required.
 * ps__parse_duration: seconds. Units ns, us, ms, s, min (or m), h, d, w; "64d",
 *   "1.5s", "250ms". A unit is required. */
int ps__parse_bytes(const char *s, double *out);
int ps__parse_rate(const char *s, double *out);
int ps__parse_duration(const char *s, double *out);

#endif
