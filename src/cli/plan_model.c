/*
 * plan_model.c - the cost model behind `pshard plan` and the unit parsers it reads its
 * inputs with (see plan_model.h for the model). Pure arithmetic: no I/O, no allocation.
 */
#include "cli/plan_model.h"

#include <math.h>
#include <string.h>

#include "common/common.h"

/* Bytes per parameter of training state. The gradient is the server's aggregation
 * buffer (where a sync round combines the workers' pushes); mixed-precision Adam is
 * the 2 + 2 + 12 accounting of Rajbhandari et al., ZeRO (2020). */
static const ps__plan_recipe recipes[] = {
    {"fp32-sgd", 8, 4, 4, "fp32", "fp32", "4 fp32 weights + 4 fp32 gradient"},
    {"fp32-momentum", 12, 4, 4, "fp32", "fp32", "4 fp32 weights + 4 fp32 gradient + 4 momentum"},
    {"fp32-adam", 16, 4, 4, "fp32", "fp32", "4 fp32 weights + 4 fp32 gradient + 4 m + 4 v"},
    {"mixed-adam", 16, 2, 2, "fp16", "fp16",
     "2 fp16 weights + 2 fp16 gradient + 4 fp32 master weights + 4 m + 4 v"},
    {"fp16-weights", 2, 2, 2, "fp16", "fp16", "2 fp16 weights (inference, no optimiser)"},
};

const ps__plan_recipe *ps__plan_recipe_find(const char *name) {
  for (size_t i = 0; name && i < sizeof recipes / sizeof recipes[0]; i++)
    if (!strcmp(name, recipes[i].name)) return &recipes[i];
  return NULL;
}

const ps__plan_recipe *ps__plan_recipe_at(size_t i) {
  return i < sizeof recipes / sizeof recipes[0] ? &recipes[i] : NULL;
}

double ps__plan_precision_bytes(const char *name) {
  static const struct {
    const char *name;
    double bytes;
  } precs[] = {{"fp64", 8}, {"fp32", 4}, {"tf32", 4}, {"fp16", 2}, {"bf16", 2},
               {"fp8", 1},  {"int8", 1}};
  for (size_t i = 0; name && i < sizeof precs / sizeof precs[0]; i++)
    if (!strcmp(name, precs[i].name)) return precs[i].bytes;
  return 0;
}

void ps__plan_in_init(ps__plan_in *in) {
  memset(in, 0, sizeof *in);
  in->servers = 1;
  in->workers = 1;
  in->replicas = 1;
  in->warmup_epochs = 5;
  in->zipf = -1;
  in->ids_per_example = 1;
}

/* ---------------------------------------------------------------- sparse tables */

/* The row map's layout (src/store/rowmap.c, its header comment and KEY_BYTES,
 * MIN_INDEX, MAX_ROWS): the one place the plan knows it. Records are the key then the
 * row, in chunks; the index has 4-byte entries at a load of at most 7/8 and doubles when
 * it is reached; while rows move to a grown index the old one (half the size) stays. */
#define MAP_ENTRY 4.0        /* an index entry: row number and tag */
#define MAP_MIN_INDEX 16.0
#define MAP_KEY 8.0          /* each row's key, beside it in its record */
#define MAP_MAX_ROWS 4294967295.0 /* rows of one map (row numbers are 32-bit) */

double ps__plan_rowmap_bytes(double n, double row_floats, double *peak) {
  if (!(n > 0)) {
    if (peak) *peak = 0;
    return 0;
  }
  double icap = MAP_MIN_INDEX; /* doubled when the rows would pass 7/8 of it */
  while (n > floor(icap * 7 / 8)) icap *= 2;
  double bytes = n * (4 * row_floats + MAP_KEY) + icap * MAP_ENTRY;
  /* the peak: the old index beside the new one while its rows move */
  if (peak) *peak = bytes + (icap > MAP_MIN_INDEX ? icap / 2 * MAP_ENTRY : 0);
  return bytes;
}

/* 1 - (1 - p)^n without cancellation. */
static double hit(double p, double n) { return -expm1(n * log1p(-p)); }

double ps__plan_zipf_distinct(double rows, double s, double draws) {
  if (!(rows >= 1) || !(draws > 0) || !(s >= 0)) return 0;
  const double head = fmin(rows, 10000);
  /* H = sum of i^-s: exact over the head, the integral over the tail (with the
   * midpoint correction: sum_{a<i<=b} f(i) ~ integral from a + 1/2 to b + 1/2). */
  double h = 0;
  for (double i = 1; i <= head; i++) h += pow(i, -s);
  const double a = head + 0.5, b = rows + 0.5;
  if (rows > head)
    h += fabs(s - 1) < 1e-12 ? log(b / a) : (pow(b, 1 - s) - pow(a, 1 - s)) / (1 - s);
  double d = 0;
  for (double i = 1; i <= head; i++) d += hit(pow(i, -s) / h, draws);
  if (rows > head) {
    /* Simpson's rule in u = ln x over [ln a, ln b]: the integrand x (1 - (1 - p(x))^n)
     * is smooth there, and even panels in u follow its scale. */
    const int panels = 4000;
    double u0 = log(a), step = (log(b) - u0) / panels, sum = 0;
    for (int k = 0; k <= panels; k++) {
      double x = exp(u0 + k * step);
      double f = x * hit(pow(x, -s) / h, draws);
      sum += (k == 0 || k == panels ? 1 : k % 2 ? 4 : 2) * f;
    }
    d += sum * step / 3;
  }
  return fmin(d, fmin(rows, draws));
}

/* Memory and traffic of the sparse tables. Returns their push bytes per worker step:
 * 0 without tables, NaN if some table's touched rows are unknown. */
static double plan_sparse(const ps__plan_in *in, ps__plan_out *o) {
  const double S = in->servers, R = in->replicas, nan = NAN;
  double push = 0, bytes = 0, extra = 0;
  for (size_t t = 0; t < in->nsparse; t++) {
    const ps__plan_sparse *sp = &in->sparse[t];
    ps__plan_sparse_out *so = &o->sparse[t];
    so->row_floats = sp->dim * (1 + sp->nstate);
    so->payload_bytes = 4 * so->row_floats;
    so->rows_per_server = ceil(R * sp->rows / S);
    so->bytes_per_server = ps__plan_rowmap_bytes(so->rows_per_server, so->row_floats,
                                                 &so->peak_per_server);
    so->row_bytes = so->bytes_per_server / so->rows_per_server;
    bytes += so->bytes_per_server;
    extra = fmax(extra, so->peak_per_server - so->bytes_per_server);
    so->touched = sp->touched > 0 ? sp->touched
                  : in->zipf >= 0 && in->batch > 0
                      ? ps__plan_zipf_distinct(sp->rows, in->zipf, in->batch * in->ids_per_example)
                      : nan;
    so->push_bytes = so->touched * (MAP_KEY + 4 * sp->dim);
    so->pull_bytes = so->push_bytes;
    push += so->push_bytes;
  }
  if (in->nsparse) {
    o->sparse_push_bytes = push;
    o->sparse_per_server = bytes;
    o->sparse_peak_per_server = bytes + extra;
  }
  return in->nsparse ? push : 0;
}

/* Does the job fit S servers of server_mem each? Dense state R/S each, the sparse
 * tables' maps at their peak, and no map above the row limit. */
static int fits(const ps__plan_in *in, double state, double S) {
  const double R = in->replicas;
  double bytes = state > 0 ? R * state / S : 0, extra = 0;
  for (size_t t = 0; t < in->nsparse; t++) {
    const ps__plan_sparse *sp = &in->sparse[t];
    double n = ceil(R * sp->rows / S), peak;
    if (n > MAP_MAX_ROWS) return 0;
    double b = ps__plan_rowmap_bytes(n, sp->dim * (1 + sp->nstate), &peak);
    bytes += b;
    extra = fmax(extra, peak - b);
  }
  return bytes + extra <= in->server_mem;
}

/* The fewest servers (at least R) that hold everything: per-server memory only falls
 * as S grows, so a search between powers of two. NaN beyond 10^15 servers. */
static double servers_for(const ps__plan_in *in, double state) {
  double lo = in->replicas, hi = lo;
  if (fits(in, state, lo)) return lo;
  while (!fits(in, state, hi)) {
    lo = hi;
    hi *= 2;
    if (hi > 1e15) return NAN;
  }
  while (hi - lo > 1) { /* fits(hi), !fits(lo) */
    double mid = floor((lo + hi) / 2);
    if (fits(in, state, mid)) hi = mid;
    else lo = mid;
  }
  return hi;
}

static int bad(const char *what, double v) {
  return ps__fail(PS_ERR_INVALID, "plan: %s must be a finite number >= 0, not %g", what, v);
}

static int is_count(double v) { return v >= 1 && v == floor(v) && v <= 1e15; }

/* Every input finite and >= 0, the counts whole, at most two of the three compute
 * figures. 0 or PS_ERR_INVALID with the reason. */
static int check_inputs(const ps__plan_in *in) {
  const struct {
    const char *name;
    double v;
  } fields[] = {
      {"params", in->params},         {"state bytes per parameter", in->state_bytes},
      {"weight bytes", in->weight_bytes}, {"gradient bytes", in->grad_bytes},
      {"push bytes", in->push_bytes}, {"servers", in->servers},
      {"workers", in->workers},       {"link rate", in->link},
      {"step time", in->step_time},   {"job time", in->job_time},
      {"steps", in->steps},           {"server memory", in->server_mem},
      {"batch", in->batch},           {"reference batch", in->ref_batch},
      {"reference learning rate", in->ref_lr}, {"samples", in->samples},
      {"warm-up epochs", in->warmup_epochs},   {"warm-up steps", in->warmup_steps},
      {"replicas", in->replicas},     {"ids per example", in->ids_per_example},
  };
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
    if (!isfinite(fields[i].v) || fields[i].v < 0) return bad(fields[i].name, fields[i].v);
  if (!is_count(in->servers))
    return ps__fail(PS_ERR_INVALID, "plan: servers must be a whole number >= 1, not %g",
                    in->servers);
  if (!is_count(in->workers))
    return ps__fail(PS_ERR_INVALID, "plan: workers must be a whole number >= 1, not %g",
                    in->workers);
  if (!is_count(in->replicas) || in->replicas > in->servers)
    return ps__fail(PS_ERR_INVALID,
                    "plan: replicas must be a whole number from 1 to the servers (%g), not %g",
                    in->servers, in->replicas);
  if (!isfinite(in->zipf)) return bad("zipf exponent", in->zipf);
  if (in->nsparse > PS__PLAN_MAX_SPARSE)
    return ps__fail(PS_ERR_INVALID, "plan: at most %d sparse tables", PS__PLAN_MAX_SPARSE);
  for (size_t t = 0; t < in->nsparse; t++) {
    const ps__plan_sparse *sp = &in->sparse[t];
    if (!is_count(sp->rows) || !is_count(sp->dim) || !isfinite(sp->nstate) || sp->nstate < 0 ||
        !isfinite(sp->touched) || sp->touched < 0)
      return ps__fail(PS_ERR_INVALID,
                      "plan: sparse table %zu needs whole rows and dim >= 1 (up to 1e15)", t + 1);
    if (sp->touched > sp->rows)
      return ps__fail(PS_ERR_INVALID,
                      "plan: sparse table %zu: %g rows touched per batch, but it has %g rows",
                      t + 1, sp->touched, sp->rows);
  }
  if (in->step_time > 0 && in->job_time > 0 && in->steps > 0)
    return ps__fail(PS_ERR_INVALID,
                    "plan: give at most two of step time, job time and steps (the third "
                    "follows from them)");
  return 0;
}

/* Memory and traffic. Returns G, one worker's push per step (NaN if unknown). */
static double plan_memory_traffic(const ps__plan_in *in, ps__plan_out *o) {
  const double S = in->servers, K = in->workers, R = in->replicas, nan = NAN;
  if (in->params > 0) {
    if (in->weight_bytes > 0) o->weights_bytes = in->params * in->weight_bytes;
    if (in->state_bytes > 0) {
      o->state_bytes = in->params * in->state_bytes;
      o->state_per_server = R * o->state_bytes / S;
      if (in->server_mem > 0 && in->nsparse == 0)
        o->servers_needed = fmax(R, ceil(R * o->state_bytes / in->server_mem));
    }
  }
  double sparse = plan_sparse(in, o);
  if (in->nsparse) {
    o->memory_per_server = (isnan(o->state_per_server) ? 0 : o->state_per_server) +
                           o->sparse_per_server;
    if (in->server_mem > 0) {
      o->servers_for_sparse = servers_for(in, isnan(o->state_bytes) ? 0 : o->state_bytes);
      o->servers_needed = o->servers_for_sparse;
    }
  }
  /* G: the dense gradient (if any) and the sparse rows' keys and gradients. */
  double dense = in->push_bytes > 0 ? in->push_bytes
                 : in->params > 0 && in->grad_bytes > 0 ? in->params * in->grad_bytes
                 : in->nsparse ? 0
                               : nan;
  double G = dense + sparse;
  if (!isnan(G)) {
    o->push_bytes = G;
    o->traffic_bytes = (R + 1) * K * G; /* pushes, their R - 1 forwards, pulls */
    o->traffic_per_server = (R + 1) * K * G / S;
    if (in->link > 0) {
      o->push_time = G / in->link;
      o->comm_time = (fmax(G, R * K * G / S) + fmax(G, K * G / S)) / in->link;
    }
  }
  return G;
}

/* Compute and time, after plan_memory_traffic (comm_time; G its result). */
static void plan_time(const ps__plan_in *in, double G, ps__plan_out *o) {
  const double S = in->servers, K = in->workers, nan = NAN;
  /* Any two of step time, job time and steps give the third. */
  o->step_time_1 = in->step_time > 0 ? in->step_time
                   : in->job_time > 0 && in->steps > 0 ? in->job_time / in->steps
                                                       : nan;
  o->job_time_1 = in->job_time > 0 ? in->job_time
                  : in->step_time > 0 && in->steps > 0 ? in->step_time * in->steps
                                                       : nan;
  o->steps = in->steps > 0 ? in->steps
             : in->step_time > 0 && in->job_time > 0 ? in->job_time / in->step_time
                                                     : nan;
  o->step_compute = o->step_time_1 / K;
  o->job_compute = o->job_time_1 / K;
  o->step_serial = o->step_compute + o->comm_time;
  o->step_overlap = isnan(o->step_compute) || isnan(o->comm_time) ? nan
                                                                  : fmax(o->step_compute, o->comm_time);
  o->job_serial = o->steps * o->step_serial;
  o->job_overlap = o->steps * o->step_overlap;

  /* comm(K) = (G/L) (max(1, RK/S) + max(1, K/S)); compute(K) = T1/K. comm grows with K
   * and compute falls, so they cross once: at Ka = T1 L / 2G if that is <= S/R; else
   * where (G/L)(RK/S + 1) = T1/K if that is <= S; else at sqrt(2 S Ka / (R + 1)). With
   * R = 1: Ka if Ka <= S, else sqrt(S Ka). */
  if (!isnan(o->step_time_1) && !isnan(G) && G > 0 && in->link > 0) {
    const double R = in->replicas, a = G / in->link, T1 = o->step_time_1;
    double ka = T1 / (2 * a);
    if (ka <= S / R) {
      o->k_comm = ka;
    } else {
      double q = a * R / S, k2 = (-a + sqrt(a * a + 4 * q * T1)) / (2 * q);
      o->k_comm = k2 <= S ? k2 : sqrt(2 * S * ka / (R + 1));
    }
  }
}

/* Batch, learning rate, warm-up (Goyal et al. 2017: ramp linearly from the base rate
 * to the scaled rate over the first 5 epochs, when the rate is scaled up). */
static void plan_batch(const ps__plan_in *in, ps__plan_out *o) {
  const double K = in->workers, nan = NAN;
  if (in->batch > 0) {
    o->global_batch = K * in->batch;
    if (in->samples > 0) o->steps_per_epoch = ceil(in->samples / o->global_batch);
    if (in->ref_batch > 0 && in->ref_lr > 0)
      o->lr = in->ref_lr * o->global_batch / in->ref_batch;
    if (in->warmup_steps > 0) {
      o->warmup_steps = in->warmup_steps;
      o->warmup_epochs = in->warmup_steps / o->steps_per_epoch;
    } else if (in->ref_batch > 0 && o->global_batch <= in->ref_batch) {
      o->warmup_epochs = 0;
      o->warmup_steps = 0;
    } else if (in->ref_batch > 0) {
      o->warmup_epochs = in->warmup_epochs;
      o->warmup_steps = in->warmup_epochs == 0 ? 0
                        : in->samples > 0 ? ceil(in->warmup_epochs * in->samples / o->global_batch)
                                          : nan;
    }
  } else if (in->warmup_steps > 0) {
    o->warmup_steps = in->warmup_steps;
  }
}

int ps__plan_compute(const ps__plan_in *in, ps__plan_out *out) {
  int rc = check_inputs(in);
  if (rc) return rc;
  const double nan = NAN;
  ps__plan_out o = {
      .weights_bytes = nan, .state_bytes = nan,  .state_per_server = nan,
      .servers_needed = nan, .push_bytes = nan,  .traffic_bytes = nan,
      .traffic_per_server = nan, .push_time = nan, .comm_time = nan,
      .step_time_1 = nan,   .step_compute = nan, .step_serial = nan,
      .step_overlap = nan,  .job_time_1 = nan,   .job_compute = nan,
      .job_serial = nan,    .job_overlap = nan,  .steps = nan,
      .k_comm = nan,        .global_batch = nan, .lr = nan,
      .steps_per_epoch = nan, .warmup_epochs = nan, .warmup_steps = nan,
      .sparse_push_bytes = nan, .sparse_per_server = nan, .sparse_peak_per_server = nan,
      .memory_per_server = nan, .servers_for_sparse = nan,
  };
  double G = plan_memory_traffic(in, &o);
  plan_time(in, G, &o);
  plan_batch(in, &o);
  *out = o;
  return 0;
}

/* ---------------------------------------------------------------- unit parsers */

/* A non-negative decimal number (exponent allowed, no sign, no hex, no inf/nan),
 * followed by at most one space. *rest points at the unit. */
static int parse_number(const char *s, double *v, const char **rest) {
  if (!s || !((*s >= '0' && *s <= '9') || (*s == '.' && s[1] >= '0' && s[1] <= '9')))
    return -1;
  for (const char *p = s; *p && *p != ' '; p++)
    if (*p == 'x' || *p == 'X') return -1; /* strtod would read 0x10 as hex */
  char *end;
  double x = strtod(s, &end);
  if (end == s || !isfinite(x) || x < 0) return -1;
  if (*end == ' ' && end[1]) end++;
  *v = x;
  *rest = end;
  return 0;
}

/* An optional SI prefix (k K M G T P E) or binary prefix (Ki Mi Gi Ti Pi Ei). */
static double parse_prefix(const char *u, const char **rest) {
  static const char letters[] = "kMGTPE";
  const char *l = *u ? strchr(letters, *u == 'K' ? 'k' : *u) : NULL;
  if (!l) {
    *rest = u;
    return 1;
  }
  int power = (int)(l - letters) + 1;
  if (u[1] == 'i') {
    *rest = u + 2;
    return ldexp(1.0, 10 * power);
  }
  *rest = u + 1;
  return pow(10.0, 3 * power);
}

int ps__parse_bytes(const char *s, double *out) {
  const char *u;
  double v;
  if (parse_number(s, &v, &u)) return -1;
  if (!*u) {
    *out = v;
    return 0;
  }
  double mult = parse_prefix(u, &u);
  if (strcmp(u, "B") != 0) return -1;
  *out = v * mult;
  return 0;
}

int ps__parse_rate(const char *s, double *out) {
  static const struct {
    const char *unit;
    double bytes; /* bytes per unit */
  } units[] = {{"bit/s", 0.125}, {"b/s", 0.125}, {"bps", 0.125}, {"B/s", 1}, {"Bps", 1}};
  const char *u;
  double v;
  if (parse_number(s, &v, &u) || !*u) return -1;
  double mult = parse_prefix(u, &u);
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
    if (!strcmp(u, units[i].unit)) {
      *out = v * mult * units[i].bytes;
      return 0;
    }
  }
  return -1;
}

int ps__parse_duration(const char *s, double *out) {
  static const struct {
    const char *unit;
    double seconds;
  } units[] = {{"ns", 1e-9}, {"us", 1e-6},  {"\xc2\xb5s", 1e-6}, {"ms", 1e-3},
               {"s", 1},     {"m", 60},     {"min", 60},         {"h", 3600},
               {"d", 86400}, {"w", 604800}};
  const char *u;
  double v;
  if (parse_number(s, &v, &u) || !*u) return -1;
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
    if (!strcmp(u, units[i].unit)) {
      *out = v * units[i].seconds;
      return 0;
    }
  }
  return -1;
}
