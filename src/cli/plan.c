/*
 * plan.c - `pshard plan`: answers before a job runs. Parses flags into the cost model
 * of src/cli/plan_model.h, then prints a table (decimal units unless --binary) or a JSON
 * object (--json, base units: bytes, seconds, bytes per second). Every input is
 * optional; a figure whose inputs are missing prints as n/a with the flag it needs.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/common.h"
#include "cli/plan_model.h"
#include "proto/spec.h"

static const char usage_text[] =
    "usage: pshard plan [options]\n"
    "\n"
    "Estimates memory, traffic, time, global batch and learning rate of a data-parallel\n"
    "job on S servers and K workers. Every option is optional; figures whose inputs are\n"
    "missing print as n/a with the option they need.\n"
    "\n"
    "model\n"
    "  --params N            number of parameters P (7e9 or 7000000000)\n"
    "  --recipe NAME         training-state recipe (default mixed-adam), B/param:\n"
    "%s"
    "  --bytes-per-param B   training-state bytes per parameter (overrides the recipe's)\n"
    "  --weight-precision P  precision of the weights-only figure (default: the recipe's)\n"
    "  --grad-precision P    precision of pushed gradients and pulled parameters\n"
    "                        (default: the recipe's); P is fp64|fp32|tf32|fp16|bf16|\n"
    "                        fp8|int8\n"
    "  --gradient SIZE       one worker's push per step, instead of P x gradient bytes\n"
    "sparse tables (embeddings; repeat --sparse for several)\n"
    "  --sparse ROWSxDIM[:OPT]  a table of ROWS rows of DIM floats (1e9x64:adagrad);\n"
    "                        OPT is sgd (default), momentum, adagrad, adam, ftrl, or a\n"
    "                        table option string ('opt=adam lr=0.001')\n"
    "  --rows-per-batch N[,N...]  distinct rows one worker's step touches, one for all\n"
    "                        tables or one per --sparse in order\n"
    "  --zipf S              ... or from ids drawn Zipf(S) over the rows (0: uniform),\n"
    "                        --batch examples of --ids-per-example ids (default 1)\n"
    "  --ids-per-example N   ids per example and table, for --zipf\n"
    "cluster\n"
    "  --servers S           servers (default 1)\n"
    "  --replicas R          copies of every key range (default 2 when S >= 2, else 1;\n"
    "                        R <= S)\n"
    "  --workers K           workers (default 1)\n"
    "  --link RATE           link rate of every node: 100Gbit/s = 100Gb/s = 12.5GB/s\n"
    "  --server-mem SIZE     memory per server for training state and tables (80GB,\n"
    "                        64GiB): gives the servers needed\n"
    "compute (one worker; K workers ideally take 1/K of it)\n"
    "  --step-time T         one worker's compute time for one step (250ms, 1.5s)\n"
    "  --job-time T          one worker's compute time for the whole job (64d)\n"
    "  --compute-time T      same as --job-time\n"
    "  --steps N             optimiser steps in the job (any two of the three above\n"
    "                        give the third)\n"
    "batch and learning rate\n"
    "  --batch B             local batch per worker\n"
    "  --ref-batch B         batch at which --ref-lr was tuned\n"
    "  --ref-lr X            base learning rate at --ref-batch\n"
    "  --samples N           training examples per epoch (for warm-up in steps)\n"
    "  --warmup-epochs E     warm-up length in epochs (default 5)\n"
    "  --warmup-steps N      warm-up length in steps (overrides --warmup-epochs)\n"
    "output\n"
    "  --binary              print sizes in binary units (GiB = 2^30 B) instead of\n"
    "                        decimal units (GB = 10^9 B); links are always decimal\n"
    "  --json                print one JSON object in base units (B, s, B/s)\n"
    "  --measured SRC        predict from a job's measurements instead: SRC is a file saved by\n"
    "                        `pshard run --stats-out` or a running scheduler's HOST:PORT\n"
    "                        (see `pshard plan --measured x --help`)\n"
    "  -h, --help            this text\n"
    "\n"
    "Units: SIZE is 14GB, 13GiB, 512MiB or a plain number of bytes; RATE needs a unit\n"
    "(bit, b = bits; B = bytes; Gbit = 10^9 bits); T needs a unit (ns us ms s min h d w).\n"
    "\n"
    "Assumptions (strong scaling, ideal links, no protocol overhead):\n"
    "  G = P x gradient bytes               one worker's push per step\n"
    "  push + pull per step = 2 K G         each worker pushes its gradient and pulls\n"
    "                                       the parameters back at the same precision\n"
    "  per server = 2 K G / S               keys spread evenly over the servers\n"
    "  sparse row = 4 DIM (1 + state) + 8 key + its share of the hash index (12 B\n"
    "                                       slots, load <= 3/4); G adds rows x (8 + 4 DIM)\n"
    "  with R replicas a server holds R / S of everything and its link carries\n"
    "  max(G, R K G / S) for the pushes (down the chain) and max(G, K G / S) for pulls\n"
    "  one push = G / link                  on an otherwise idle link\n"
    "  communication per step = 2 max(G, K G / S) / link\n"
    "                                       the busiest link: each worker's while K <= S,\n"
    "                                       each server's beyond; push, then pull\n"
    "  compute per step = T / K             T = one worker's time for one step\n"
    "  step, no overlap = compute + communication; perfect overlap = the larger\n"
    "  communication dominates when communication per step > T / K; the bound is\n"
    "  K = T link / 2G when that is <= S, else sqrt(S T link / 2G)\n"
    "  global batch = K x local batch; learning rate = ref-lr x global / ref-batch\n"
    "  warm-up (Goyal et al. 2017): when the scaled rate exceeds the base rate, ramp it\n"
    "  linearly from ref-lr over the first 5 epochs (in steps if --samples is given);\n"
    "  none when the global batch is <= ref-batch\n";

static void usage(FILE *f) {
  char recipes[1024];
  size_t n = 0;
  recipes[0] = '\0';
  for (size_t i = 0; ps__plan_recipe_at(i) && n < sizeof recipes; i++) {
    const ps__plan_recipe *r = ps__plan_recipe_at(i);
    int w = snprintf(recipes + n, sizeof recipes - n, "      %-14s %2g = %s\n", r->name,
                     r->state_bytes, r->breakdown);
    if (w < 0) break;
    n += (size_t)w;
  }
  fprintf(f, usage_text, recipes);
}

__attribute__((format(printf, 1, 2))) static int usage_error(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "pshard plan: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n(see 'pshard plan --help')\n");
  return 2;
}

/* A finite number, > 0 (or >= 0 with zero_ok); whole also requires an integer. No
 * sign, no hex, no inf or nan. */
static int parse_number(const char *s, int whole, int zero_ok, double *out) {
  char *end;
  if (!s || !((*s >= '0' && *s <= '9') || *s == '.') || strpbrk(s, "xX")) return -1;
  double v = strtod(s, &end);
  if (end == s || *end || !isfinite(v) || v < 0 || (v == 0 && !zero_ok)) return -1;
  if (whole && v != floor(v)) return -1;
  *out = v;
  return 0;
}

/* ---------------------------------------------------------------- formatting */

/* About four significant digits, trailing zeros dropped: 14, 11.2, 0.4, 1.125; an
 * exponent outside [0.001, 10^6). */
static const char *fmt_num(char *buf, size_t n, double v) {
  double a = fabs(v);
  int prec = a >= 1000 ? 0 : a >= 100 ? 1 : a >= 10 ? 2 : a >= 1 ? 3 : 4;
  if (a >= 1e6 || (a != 0 && a < 0.001)) {
    snprintf(buf, n, "%.3g", v);
    return buf;
  }
  snprintf(buf, n, "%.*f", prec, v);
  if (strchr(buf, '.')) {
    char *e = buf + strlen(buf) - 1;
    while (*e == '0') *e-- = '\0';
    if (*e == '.') *e = '\0';
  }
  return buf;
}

/* A whole number with thousands separators: 1,024. */
static const char *fmt_int(char *buf, size_t n, double v) {
  if (!(fabs(v) < 1e18) || v != floor(v)) return fmt_num(buf, n, v);
  char digits[32];
  snprintf(digits, sizeof digits, "%.0f", fabs(v));
  size_t len = strlen(digits), o = 0;
  if (v < 0 && o + 1 < n) buf[o++] = '-';
  for (size_t i = 0; i < len && o + 2 < n; i++) {
    buf[o++] = digits[i];
    if ((len - i - 1) % 3 == 0 && i + 1 < len) buf[o++] = ',';
  }
  buf[o] = '\0';
  return buf;
}

static const char *fmt_bytes(char *buf, size_t n, double v, int binary) {
  static const char *const dec[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  static const char *const bin[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double base = binary ? 1024 : 1000;
  size_t u = 0;
  while (u < 6 && fabs(v) >= base) {
    v /= base;
    u++;
  }
  char num[64];
  snprintf(buf, n, "%s %s", fmt_num(num, sizeof num, v), binary ? bin[u] : dec[u]);
  return buf;
}

static const char *fmt_time(char *buf, size_t n, double s) {
  static const struct {
    double sec;
    const char *unit;
  } units[] = {{86400, "d"}, {3600, "h"}, {60, "min"}, {1, "s"}, {1e-3, "ms"}, {1e-6, "us"}};
  size_t i = 0;
  while (i + 1 < sizeof units / sizeof units[0] && s < units[i].sec) i++;
  char num[64];
  snprintf(buf, n, "%s %s", fmt_num(num, sizeof num, s / units[i].sec), units[i].unit);
  return buf;
}

static const char *fmt_rate(char *buf, size_t n, double bytes_per_s) {
  char a[64], b[64];
  double v = bytes_per_s;
  fmt_bytes(a, sizeof a, v, 0);
  v *= 8;
  static const char *const units[] = {"bit/s", "kbit/s", "Mbit/s", "Gbit/s", "Tbit/s",
                                      "Pbit/s", "Ebit/s"};
  size_t u = 0;
  while (u < 6 && v >= 1000) {
    v /= 1000;
    u++;
  }
  snprintf(buf, n, "%s/s = %s %s", a, fmt_num(b, sizeof b, v), units[u]);
  return buf;
}

/* ---------------------------------------------------------------- output */

#define LABEL_W 38

static void row(const char *label, const char *value) {
  printf("  %-*s %s\n", LABEL_W, label, value);
}

/* A figure, or n/a naming the options it needs. */
static void row_v(const char *label, double v, const char *value, const char *needs) {
  char na[160];
  if (isnan(v)) {
    snprintf(na, sizeof na, "n/a (needs %s)", needs);
    row(label, na);
  } else {
    row(label, value);
  }
}

typedef struct plan_opts {
  ps__plan_in in;
  char sparse_opt[PS__PLAN_MAX_SPARSE][64]; /* each sparse table's optimiser, as given */
  const char *rows_per_batch;               /* --rows-per-batch, parsed after the tables */
  const ps__plan_recipe *recipe;
  const char *weight_prec, *grad_prec;
  int state_overridden;
  int binary, json;
} plan_opts;

/* The table's sections, in order. v holds a row's value; a row whose figure is NaN
 * prints n/a instead, so v may then hold anything. */
static void print_inputs(const plan_opts *po) {
  const ps__plan_in *in = &po->in;
  char v[512], a[64], r[256];
  if (in->params > 0) {
    snprintf(v, sizeof v, "%s", fmt_int(a, sizeof a, in->params));
    row("parameters P", v);
  } else if (in->nsparse == 0) {
    row("parameters P", "not given (--params)");
  }
  if (in->nsparse && in->params <= 0) goto cluster; /* the recipe is for dense parameters */
  if (po->state_overridden)
    snprintf(v, sizeof v, "custom: %g B/param (weights %s, gradients %s)", in->state_bytes,
             po->weight_prec, po->grad_prec);
  else
    snprintf(v, sizeof v, "%s: %g B/param = %s", po->recipe->name, in->state_bytes,
             po->recipe->breakdown);
  row("recipe", v);
cluster:
  snprintf(v, sizeof v, "S = %g, K = %g", in->servers, in->workers);
  if (in->replicas > 1) snprintf(v + strlen(v), sizeof v - strlen(v), ", R = %g", in->replicas);
  row(in->replicas > 1 ? "servers, workers, replicas" : "servers, workers", v);
  for (size_t t = 0; t < in->nsparse; t++) {
    char l[64];
    snprintf(l, sizeof l, "sparse table %zu", t + 1);
    snprintf(v, sizeof v, "%s rows x %g, %s", fmt_int(a, sizeof a, in->sparse[t].rows),
             in->sparse[t].dim, po->sparse_opt[t]);
    row(l, v);
  }
  row("link", in->link > 0 ? fmt_rate(r, sizeof r, in->link) : "not given (--link)");
}

/* One block per sparse table: its row, its share of each server, its rows per step. */
static void print_sparse(const plan_opts *po, const ps__plan_out *o) {
  const ps__plan_in *in = &po->in;
  char v[512], a[64], b[64], c[64], l[128];
  int bin = po->binary;
  for (size_t t = 0; t < in->nsparse; t++) {
    const ps__plan_sparse *sp = &in->sparse[t];
    const ps__plan_sparse_out *so = &o->sparse[t];
    printf("\nsparse table %zu: %s rows x %g, %s\n", t + 1, fmt_int(a, sizeof a, sp->rows),
           sp->dim, po->sparse_opt[t]);
    snprintf(v, sizeof v, "%g floats (%g x dim)", sp->nstate * sp->dim, sp->nstate);
    row("optimiser state per row", v);
    if (so->row_floats == 1)
      snprintf(v, sizeof v, "%s (8 B key + 4 B slot number + index slots of 16 B holding the value)",
               fmt_bytes(a, sizeof a, so->row_bytes, 0));
    else
      snprintf(v, sizeof v, "%s = %s payload + 8 B key + %s index", fmt_bytes(a, sizeof a, so->row_bytes, 0),
               fmt_bytes(b, sizeof b, so->payload_bytes, 0),
               fmt_bytes(c, sizeof c, so->row_bytes - so->payload_bytes - 8, 0));
    row("bytes per row, in the row map", v);
    snprintf(l, sizeof l, "rows per server (S = %g, R = %g)", in->servers, in->replicas);
    row(l, fmt_int(v, sizeof v, so->rows_per_server));
    snprintf(v, sizeof v, "%s (%s while its index doubles)", fmt_bytes(a, sizeof a, so->bytes_per_server, bin),
             fmt_bytes(b, sizeof b, so->peak_per_server, bin));
    row("memory per server", v);
    if (!isnan(so->touched)) {
      if (sp->touched > 0)
        snprintf(v, sizeof v, "%s (given)", fmt_int(a, sizeof a, so->touched));
      else
        snprintf(v, sizeof v, "%s (Zipf %g, %s draws)", fmt_int(a, sizeof a, round(so->touched)),
                 in->zipf, fmt_int(b, sizeof b, in->batch * in->ids_per_example));
    }
    row_v("rows touched per worker step", so->touched, v, "--rows-per-batch, or --zipf and --batch");
    if (!isnan(so->push_bytes))
      snprintf(v, sizeof v, "%s each (rows x (8 + 4 x %g) B)", fmt_bytes(a, sizeof a, so->push_bytes, bin),
               sp->dim);
    row_v("push, and pull, per worker step", so->push_bytes, v, "--rows-per-batch, or --zipf and --batch");
  }
}

static void print_memory_traffic(const plan_opts *po, const ps__plan_out *o) {
  const ps__plan_in *in = &po->in;
  char v[512], a[64], l[128];
  int bin = po->binary;
  int dense = in->nsparse == 0 || in->params > 0; /* dense rows, or n/a naming --params */
  printf("\nmemory\n");
  snprintf(l, sizeof l, "weights only (%s)", po->weight_prec);
  if (dense) row_v(l, o->weights_bytes, fmt_bytes(v, sizeof v, o->weights_bytes, bin), "--params");
  snprintf(l, sizeof l, "training state (%g B/param)", in->state_bytes);
  if (dense) row_v(l, o->state_bytes, fmt_bytes(v, sizeof v, o->state_bytes, bin), "--params");
  if (in->replicas > 1)
    snprintf(l, sizeof l, "state per server (S = %g, R = %g)", in->servers, in->replicas);
  else
    snprintf(l, sizeof l, "state per server (S = %g)", in->servers);
  if (dense)
    row_v(l, o->state_per_server, fmt_bytes(v, sizeof v, o->state_per_server, bin), "--params");
  if (in->nsparse) {
    char p[64];
    snprintf(v, sizeof v, "%s (%s while an index doubles)",
             fmt_bytes(a, sizeof a, o->sparse_per_server, bin),
             fmt_bytes(p, sizeof p, o->sparse_peak_per_server, bin));
    row("sparse tables per server", v);
    if (in->params > 0) row("memory per server, all", fmt_bytes(v, sizeof v, o->memory_per_server, bin));
  }
  if (in->server_mem > 0) {
    if (in->replicas > 1)
      snprintf(l, sizeof l, "servers needed (%s each, R = %g)", fmt_bytes(a, sizeof a, in->server_mem, bin),
               in->replicas);
    else
      snprintf(l, sizeof l, "servers needed (%s each)", fmt_bytes(a, sizeof a, in->server_mem, bin));
    row_v(l, o->servers_needed, fmt_int(v, sizeof v, o->servers_needed),
          in->nsparse ? "fewer than 10^15 servers" : "--params");
  }
  print_sparse(po, o);

  printf("\ntraffic per step\n");
  snprintf(l, sizeof l, "push, one worker (G, %s)", in->push_bytes > 0 ? "given" : po->grad_prec);
  if (in->nsparse && in->params <= 0 && in->push_bytes <= 0) snprintf(l, sizeof l, "push, one worker (G, sparse rows)");
  row_v(l, o->push_bytes, fmt_bytes(v, sizeof v, o->push_bytes, bin),
        in->nsparse ? "--rows-per-batch, or --zipf and --batch" : "--params or --gradient");
  const char *needs = in->nsparse ? "--rows-per-batch, or --zipf and --batch"
                                   : "--params or --gradient";
  if (in->nsparse && (in->params > 0 || in->push_bytes > 0))
    row_v("of which sparse rows", o->sparse_push_bytes,
          fmt_bytes(v, sizeof v, o->sparse_push_bytes, bin), needs);
  int r1 = in->replicas == 1;
  row_v(r1 ? "push + pull, all workers (2 K G)" : "push, forwards, pull ((R + 1) K G)",
        o->traffic_bytes, fmt_bytes(v, sizeof v, o->traffic_bytes, bin), needs);
  row_v(r1 ? "push + pull, per server (2 K G / S)" : "per server ((R + 1) K G / S)",
        o->traffic_per_server, fmt_bytes(v, sizeof v, o->traffic_per_server, bin), needs);
}

static void print_time(const plan_opts *po, const ps__plan_out *o) {
  const ps__plan_in *in = &po->in;
  char v[512] = "", a[64], b[64], c[64], l[128];
  printf("\ntime\n");
  row_v("one push on the link (G / link)", o->push_time, fmt_time(v, sizeof v, o->push_time),
        "--link and --params");
  row_v("communication per step", o->comm_time, fmt_time(v, sizeof v, o->comm_time),
        "--link and --params");
  snprintf(l, sizeof l, "compute per step on K = %g", in->workers);
  row_v(l, o->step_compute, fmt_time(v, sizeof v, o->step_compute),
        "--step-time, or --job-time and --steps");
  row_v("step, no overlap", o->step_serial, fmt_time(v, sizeof v, o->step_serial),
        "--step-time and --link");
  row_v("step, perfect overlap", o->step_overlap, fmt_time(v, sizeof v, o->step_overlap),
        "--step-time and --link");
  snprintf(l, sizeof l, "compute for the job on K = %g", in->workers);
  if (!isnan(o->job_compute))
    snprintf(v, sizeof v, "%s (%s on 1 worker)", fmt_time(a, sizeof a, o->job_compute),
             fmt_time(b, sizeof b, o->job_time_1));
  row_v(l, o->job_compute, v, "--job-time, or --step-time and --steps");
  if (!isnan(o->job_serial)) {
    snprintf(v, sizeof v, "%s no overlap, %s perfect overlap (%s steps)",
             fmt_time(a, sizeof a, o->job_serial), fmt_time(b, sizeof b, o->job_overlap),
             fmt_int(c, sizeof c, o->steps));
    row("job with communication", v);
  }
  if (!isnan(o->k_comm)) {
    double from = floor(o->k_comm) + 1;
    snprintf(v, sizeof v, "K > %s (from K = %s on)", fmt_num(a, sizeof a, o->k_comm),
             fmt_int(b, sizeof b, from));
  }
  row_v("communication dominates for", o->k_comm, v, "step time, --link and --params");
}

static void print_batch(const plan_opts *po, const ps__plan_out *o) {
  const ps__plan_in *in = &po->in;
  char v[512] = "", a[64], b[64], c[64], l[128];
  printf("\nbatch and learning rate\n");
  if (!isnan(o->global_batch))
    snprintf(v, sizeof v, "%s (K = %g x %s)", fmt_int(a, sizeof a, o->global_batch),
             in->workers, fmt_int(b, sizeof b, in->batch));
  row_v("global batch", o->global_batch, v, "--batch");
  if (!isnan(o->lr))
    snprintf(v, sizeof v, "%s (%s x %s / %s)", fmt_num(a, sizeof a, o->lr),
             fmt_num(b, sizeof b, in->ref_lr), fmt_int(c, sizeof c, o->global_batch),
             fmt_int(l, sizeof l, in->ref_batch));
  row_v("learning rate (linear scaling)", o->lr, v, "--batch, --ref-batch and --ref-lr");
  if (!isnan(o->steps_per_epoch)) row("steps per epoch", fmt_int(v, sizeof v, o->steps_per_epoch));
  if (isnan(o->warmup_epochs) && isnan(o->warmup_steps)) {
    row("warm-up", "n/a (needs --batch and --ref-batch)");
  } else if (in->warmup_steps == 0 && in->ref_batch > 0 && o->global_batch <= in->ref_batch) {
    row("warm-up", "none (global batch <= --ref-batch: the rate is not scaled up)");
  } else if (o->warmup_steps == 0) {
    row("warm-up", "none (--warmup-epochs 0)");
  } else {
    char ep[64], st[64];
    snprintf(ep, sizeof ep, "%s epochs", fmt_num(a, sizeof a, o->warmup_epochs));
    if (isnan(o->warmup_steps))
      snprintf(st, sizeof st, "steps: needs --samples");
    else
      snprintf(st, sizeof st, "%s steps", fmt_int(a, sizeof a, o->warmup_steps));
    if (isnan(o->warmup_epochs))
      snprintf(v, sizeof v, "%s, linear from the base rate (Goyal et al. 2017)", st);
    else
      snprintf(v, sizeof v, "%s (%s), linear from the base rate (Goyal et al. 2017)", ep, st);
    row("warm-up", v);
  }
}

static void print_table(const plan_opts *po, const ps__plan_out *o) {
  int bin = po->binary;
  printf("pshard plan (sizes in %s units: 1 %s = %s B; links in decimal: 1 Gbit/s = 10^9 "
         "bit/s)\n",
         bin ? "binary" : "decimal", bin ? "GiB" : "GB", bin ? "2^30" : "10^9");
  printf("\ninputs\n");
  print_inputs(po);
  print_memory_traffic(po, o);
  print_time(po, o);
  print_batch(po, o);
}

/* A JSON number, or null for an unknown figure. */
static void jnum(const char *key, double v, int last) {
  if (isnan(v))
    printf("  \"%s\": null%s\n", key, last ? "" : ",");
  else
    printf("  \"%s\": %.15g%s\n", key, v, last ? "" : ",");
}

static void print_json(const plan_opts *po, const ps__plan_out *o) {
  const ps__plan_in *in = &po->in;
  printf("{\n");
  printf("  \"units\": {\"size\": \"B\", \"time\": \"s\", \"rate\": \"B/s\"},\n");
  printf("  \"recipe\": \"%s\",\n", po->state_overridden ? "custom" : po->recipe->name);
  printf("  \"weight_precision\": \"%s\",\n", po->weight_prec);
  printf("  \"grad_precision\": \"%s\",\n", po->grad_prec);
  jnum("params", in->params > 0 ? in->params : NAN, 0);
  jnum("bytes_per_param", in->state_bytes, 0);
  jnum("servers", in->servers, 0);
  jnum("workers", in->workers, 0);
  jnum("link_bytes_per_s", in->link > 0 ? in->link : NAN, 0);
  jnum("weights_bytes", o->weights_bytes, 0);
  jnum("state_bytes", o->state_bytes, 0);
  jnum("state_per_server_bytes", o->state_per_server, 0);
  jnum("servers_needed", o->servers_needed, 0);
  jnum("replicas", in->replicas, 0);
  jnum("sparse_bytes_per_server", o->sparse_per_server, 0);
  jnum("sparse_peak_bytes_per_server", o->sparse_peak_per_server, 0);
  jnum("memory_per_server_bytes", o->memory_per_server, 0);
  jnum("sparse_push_bytes", o->sparse_push_bytes, 0);
  printf("  \"sparse\": [");
  for (size_t t = 0; t < in->nsparse; t++) {
    const ps__plan_sparse *sp = &in->sparse[t];
    const ps__plan_sparse_out *so = &o->sparse[t];
    printf("%s\n    {\"rows\": %.15g, \"dim\": %.15g, \"opt\": \"%s\", \"state_floats_per_row\": %.15g, "
           "\"payload_bytes_per_row\": %.15g, \"bytes_per_row\": %.15g, \"rows_per_server\": %.15g, "
           "\"bytes_per_server\": %.15g, \"peak_bytes_per_server\": %.15g, ",
           t ? "," : "", sp->rows, sp->dim, po->sparse_opt[t], sp->nstate * sp->dim, so->payload_bytes,
           so->row_bytes, so->rows_per_server, so->bytes_per_server, so->peak_per_server);
    if (isnan(so->touched))
      printf("\"rows_touched_per_step\": null, \"push_bytes\": null, \"pull_bytes\": null}");
    else
      printf("\"rows_touched_per_step\": %.15g, \"push_bytes\": %.15g, \"pull_bytes\": %.15g}",
             so->touched, so->push_bytes, so->pull_bytes);
  }
  printf("%s],\n", in->nsparse ? "\n  " : "");
  jnum("push_bytes", o->push_bytes, 0);
  jnum("traffic_bytes_per_step", o->traffic_bytes, 0);
  jnum("traffic_per_server_bytes_per_step", o->traffic_per_server, 0);
  jnum("push_time_s", o->push_time, 0);
  jnum("comm_time_per_step_s", o->comm_time, 0);
  jnum("step_time_1_worker_s", o->step_time_1, 0);
  jnum("compute_per_step_s", o->step_compute, 0);
  jnum("step_no_overlap_s", o->step_serial, 0);
  jnum("step_overlap_s", o->step_overlap, 0);
  jnum("job_time_1_worker_s", o->job_time_1, 0);
  jnum("job_compute_s", o->job_compute, 0);
  jnum("job_no_overlap_s", o->job_serial, 0);
  jnum("job_overlap_s", o->job_overlap, 0);
  jnum("steps", o->steps, 0);
  jnum("comm_dominates_above_k", o->k_comm, 0);
  jnum("global_batch", o->global_batch, 0);
  jnum("lr", o->lr, 0);
  jnum("steps_per_epoch", o->steps_per_epoch, 0);
  jnum("warmup_epochs", o->warmup_epochs, 0);
  jnum("warmup_steps", o->warmup_steps, 1);
  printf("}\n");
}

/* ---------------------------------------------------------------- flags */

#define PRECISIONS "fp64, fp32, tf32, fp16, bf16, fp8, int8"

enum { V_COUNT, V_REAL, V_SIZE, V_RATE, V_TIME, V_NONNEG };

static const char *const hints[] = {
    [V_COUNT] = "a whole number >= 1",
    [V_REAL] = "a positive number",
    [V_SIZE] = "a size such as 14GB, 13GiB, 512MiB or a number of bytes",
    [V_RATE] = "a rate with its unit, such as 100Gbit/s or 12.5GB/s",
    [V_TIME] = "a duration with its unit, such as 250ms, 1.5s, 3h or 64d",
    [V_NONNEG] = "a number >= 0",
};

/* A numeric option: its name, the kind of value it takes, where the value goes. */
typedef struct num_opt {
  const char *name;
  int kind;
  double *dst;
} num_opt;

/* val as option name's value of the given kind, into *dst. 0, or 2 (said why). */
static int parse_value(const char *name, int kind, const char *val, double *dst) {
  double v = 0;
  int rc;
  switch (kind) {
  case V_COUNT: rc = parse_number(val, 1, 0, &v); break;
  case V_REAL: rc = parse_number(val, 0, 0, &v); break;
  case V_SIZE: rc = ps__parse_bytes(val, &v) || v <= 0 ? -1 : 0; break;
  case V_RATE: rc = ps__parse_rate(val, &v) || v <= 0 ? -1 : 0; break;
  case V_TIME: rc = ps__parse_duration(val, &v) || v <= 0 ? -1 : 0; break;
  default: rc = parse_number(val, 0, 1, &v); break;
  }
  if (rc) {
    fprintf(stderr, "pshard plan: %s: cannot parse '%s': expected %s\n", name, val, hints[kind]);
    return 2;
  }
  *dst = v;
  return 0;
}

/* --sparse ROWSxDIM[:OPT] into the next table of po->in. 0, or 2 (said why). */
static int parse_sparse(plan_opts *po, const char *val) {
  ps__plan_in *in = &po->in;
  char buf[256], options[256], err[160];
  if (in->nsparse == PS__PLAN_MAX_SPARSE) {
    fprintf(stderr, "pshard plan: --sparse: at most %d tables\n", PS__PLAN_MAX_SPARSE);
    return 2;
  }
  ps__plan_sparse *sp = &in->sparse[in->nsparse];
  snprintf(buf, sizeof buf, "%s", val);
  char *opt = strchr(buf, ':'), *x = strpbrk(buf, "xX");
  if (opt) *opt++ = '\0';
  if (x && (!opt || x < opt)) *x++ = '\0';
  if (strlen(val) >= sizeof buf || !x || parse_number(buf, 1, 0, &sp->rows) ||
      parse_number(x, 1, 0, &sp->dim) || sp->rows > 1e15 || sp->dim > 1e9) {
    fprintf(stderr,
            "pshard plan: --sparse: cannot parse '%s': expected ROWSxDIM[:OPT] such as "
            "1e9x64:adagrad\n",
            val);
    return 2;
  }
  /* The optimiser through the tables' own parser: its state is what the servers store. */
  if (!opt || !*opt) opt = "sgd";
  snprintf(options, sizeof options, strchr(opt, '=') ? "%s" : "opt=%s", opt);
  ps__table_spec spec;
  if (ps__table_spec_parse(&spec, "plan", PS_SPARSE, (uint64_t)sp->dim, options, err, sizeof err)) {
    fprintf(stderr, "pshard plan: --sparse %s: %s\n", val, err);
    return 2;
  }
  sp->nstate = ps__optim_nstate(spec.opt.kind);
  const char *eq = strstr(options, "opt=");
  snprintf(po->sparse_opt[in->nsparse], sizeof po->sparse_opt[0], "%.*s",
           eq ? (int)strcspn(eq + 4, " ") : 3, eq ? eq + 4 : "sgd");
  in->nsparse++;
  return 0;
}

/* --rows-per-batch N[,N...]: one value for every table, or one per table. */
static int parse_rows_per_batch(plan_opts *po) {
  ps__plan_in *in = &po->in;
  char buf[512];
  double v[PS__PLAN_MAX_SPARSE];
  size_t n = 0;
  snprintf(buf, sizeof buf, "%s", po->rows_per_batch);
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    if (n == PS__PLAN_MAX_SPARSE || parse_number(t, 1, 0, &v[n])) {
      fprintf(stderr, "pshard plan: --rows-per-batch: cannot parse '%s': expected whole "
              "numbers >= 1, separated by commas\n", po->rows_per_batch);
      return 2;
    }
    n++;
  }
  if (in->nsparse == 0 || (n != 1 && n != in->nsparse)) {
    fprintf(stderr, "pshard plan: --rows-per-batch: %zu value%s for %zu --sparse table%s "
            "(give one for all, or one per table)\n", n, n == 1 ? "" : "s", in->nsparse,
            in->nsparse == 1 ? "" : "s");
    return 2;
  }
  if (in->zipf >= 0) {
    fprintf(stderr, "pshard plan: --rows-per-batch: give it or --zipf, not both\n");
    return 2;
  }
  for (size_t t = 0; t < in->nsparse; t++) in->sparse[t].touched = v[n == 1 ? 0 : t];
  return 0;
}

/* The flags into po; --recipe into *recipe, --bytes-per-param into *state_bytes. -1 to
 * go on, or the exit status. */
static int plan_parse_flags(int argc, char **argv, plan_opts *po, const char **recipe, double *state_bytes) {
  ps__plan_in *in = &po->in;
  const num_opt numeric[] = {
      {"--params", V_REAL, &in->params},
      {"--bytes-per-param", V_REAL, state_bytes},
      {"--gradient", V_SIZE, &in->push_bytes},
      {"--servers", V_COUNT, &in->servers},
      {"--workers", V_COUNT, &in->workers},
      {"--link", V_RATE, &in->link},
      {"--server-mem", V_SIZE, &in->server_mem},
      {"--step-time", V_TIME, &in->step_time},
      {"--job-time", V_TIME, &in->job_time},
      {"--compute-time", V_TIME, &in->job_time},
      {"--steps", V_COUNT, &in->steps},
      {"--batch", V_COUNT, &in->batch},
      {"--ref-batch", V_COUNT, &in->ref_batch},
      {"--ref-lr", V_REAL, &in->ref_lr},
      {"--samples", V_COUNT, &in->samples},
      {"--warmup-epochs", V_NONNEG, &in->warmup_epochs},
      {"--warmup-steps", V_COUNT, &in->warmup_steps},
      {"--replicas", V_COUNT, &in->replicas},
      {"--zipf", V_NONNEG, &in->zipf},
      {"--ids-per-example", V_COUNT, &in->ids_per_example},
  };
  const size_t nnum = sizeof numeric / sizeof numeric[0];
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(arg, "--json")) {
      po->json = 1;
      continue;
    }
    if (!strcmp(arg, "--binary")) {
      po->binary = 1;
      continue;
    }
    if (strncmp(arg, "--", 2) != 0) return usage_error("unexpected argument '%s'", arg);

    /* --flag value or --flag=value */
    char name[64];
    const char *val = NULL, *eq = strchr(arg, '=');
    size_t nlen = eq ? (size_t)(eq - arg) : strlen(arg);
    if (nlen >= sizeof name) return usage_error("unknown option '%s'", arg);
    memcpy(name, arg, nlen);
    name[nlen] = '\0';
    if (eq) val = eq + 1;

    const char *sparse = NULL;
    const char **sval = !strcmp(name, "--recipe")             ? recipe
                        : !strcmp(name, "--weight-precision") ? &po->weight_prec
                        : !strcmp(name, "--grad-precision")   ? &po->grad_prec
                        : !strcmp(name, "--rows-per-batch")   ? &po->rows_per_batch
                        : !strcmp(name, "--sparse")           ? &sparse
                                                              : NULL;
    size_t k = 0;
    if (!sval)
      while (k < nnum && strcmp(name, numeric[k].name)) k++;
    if (!sval && k == nnum) return usage_error("unknown option '%s'", name);
    if (!val) {
      if (i + 1 >= argc) return usage_error("%s needs a value", name);
      val = argv[++i];
    }
    if (sval) *sval = val;
    else if (parse_value(name, numeric[k].kind, val, numeric[k].dst)) return 2;
    if (sparse && parse_sparse(po, sparse)) return 2;
  }
  return po->rows_per_batch && parse_rows_per_batch(po) ? 2 : -1;
}

/* The recipe and the precisions, defaults filled in. -1 to go on, or the exit status. */
static int plan_resolve(plan_opts *po, const char *recipe, double state_bytes) {
  ps__plan_in *in = &po->in;
  if (isnan(in->replicas)) in->replicas = in->servers >= 2 ? 2 : 1; /* the launchers' default */
  if (in->zipf >= 0 && in->nsparse == 0) return usage_error("--zipf needs a --sparse table");
  po->recipe = ps__plan_recipe_find(recipe);
  if (!po->recipe) {
    fprintf(stderr, "pshard plan: --recipe: unknown recipe '%s' (known:", recipe);
    for (size_t i = 0; ps__plan_recipe_at(i); i++)
      fprintf(stderr, " %s", ps__plan_recipe_at(i)->name);
    fprintf(stderr, ")\n");
    return 2;
  }
  in->state_bytes = state_bytes > 0 ? state_bytes : po->recipe->state_bytes;
  po->state_overridden = state_bytes > 0;
  if (!po->weight_prec) po->weight_prec = po->recipe->weight_prec;
  if (!po->grad_prec) po->grad_prec = po->recipe->grad_prec;
  in->weight_bytes = ps__plan_precision_bytes(po->weight_prec);
  if (in->weight_bytes == 0)
    return usage_error("--weight-precision: unknown precision '%s' (%s)", po->weight_prec,
                       PRECISIONS);
  in->grad_bytes = ps__plan_precision_bytes(po->grad_prec);
  if (in->grad_bytes == 0)
    return usage_error("--grad-precision: unknown precision '%s' (%s)", po->grad_prec,
                       PRECISIONS);
  return -1;
}

int ps_cli_plan(int argc, char **argv) {
  plan_opts po;
  memset(&po, 0, sizeof po);
  ps__plan_in_init(&po.in);
  po.in.replicas = NAN; /* not given: as a job would run (plan_resolve) */
  const char *recipe = "mixed-adam";
  double state_bytes = 0;
  int rc;

  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "--measured") || !strncmp(argv[i], "--measured=", 11)) return ps_cli_plan_measured(argc, argv);
  if ((rc = plan_parse_flags(argc, argv, &po, &recipe, &state_bytes)) >= 0 ||
      (rc = plan_resolve(&po, recipe, state_bytes)) >= 0)
    return rc;

  ps__plan_out out;
  if (ps__plan_compute(&po.in, &out)) {
    fprintf(stderr, "pshard %s\n", ps_errmsg());
    return 2;
  }
  if (po.json)
    print_json(&po, &out);
  else
    print_table(&po, &out);
  return 0;
}
