/*
 * measured.c - `pshard plan --measured SRC`: predict a job's speed for other worker and
 * server counts from what it measured.
 *
 * Input: the scheduler's counters, from a file saved by `pshard run --stats-out` (a
 * finished job) or fetched from a running scheduler (HOST:PORT). Every worker reports
 * "ps.*" metrics (pshard.h, ps_ctx_stat): its steps (clock), examples, time computing,
 * time waiting for pulls and pushes, and bytes pushed and pulled.
 *
 * Model (per worker, averaged over the workers; a synchronous step, no overlap):
 *   b  = examples / steps                 local batch
 *   tc = compute_s / steps                compute per step
 *   tw = (pull_wait_s + push_wait_s) / steps   communication per step
 *   B  = (bytes_pushed + bytes_pulled) / steps traffic per step
 * For K' workers and S' servers on C cores:
 *   tc' = tc * max(1, K'/C) / max(1, K/C)          workers share the cores
 *   tw' = tw * max(1, K'/S') / max(1, K/S)         a server serves K'/S' workers
 *   examples/s = K' b / (tc' + tw')
 * The bottleneck is compute when tc' >= tw' ("cores" when K' > C: the workers share too few
 * cores), otherwise the servers when a server has
 * more than one worker to serve, otherwise the network.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/common.h"

#define MAX_NODES 4096
#define STATS_MS 2000 /* deadline for a scheduler's counters */

typedef struct wstat {
  uint32_t node;
  double v[11];
  unsigned have;
} wstat;

static const char *const names[] = {"uptime_s", "compute_s", "pull_wait_s", "push_wait_s", "other_wait_s",
                                    "clock", "examples", "bytes_pushed", "bytes_pulled", "pulls", "pushes"};
enum { UP, COMP, PULLW, PUSHW, OTHERW, CLOCK, EX, BPUSH, BPULL, NPULL, NPUSH, NSTAT };

static void usage(FILE *f) {
  fprintf(f,
          "usage: pshard plan --measured SRC [--json] [--cores N] [--workers LIST] [--servers LIST]\n\n"
          "Predict examples/s for other numbers of workers K and servers S from a job's measurements,\n"
          "and name the bottleneck. SRC is a file saved by `pshard run --stats-out FILE` or the\n"
          "HOST:PORT of a running scheduler.\n\n"
          "  --cores N       cores the workers share (this machine's count)\n"
          "  --workers LIST  worker counts to predict, comma-separated (1,2,4,8,16)\n"
          "  --servers LIST  server counts to predict (1,2,4)\n"
          "  --json          one JSON object\n\n"
          "Model, per worker and step: compute tc and communication tw as measured; with K' workers\n"
          "on C cores compute grows by max(1,K'/C)/max(1,K/C); communication grows with the workers\n"
          "each server serves, max(1,K'/S')/max(1,K/S); examples/s = K' x batch / (tc' + tw').\n");
}

static int parse_list(const char *s, unsigned *out, int max) {
  int n = 0;
  while (*s && n < max) {
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (end == s || v == 0 || v > 100000) return -1;
    out[n++] = (unsigned)v;
    s = end;
    if (*s == ',') s++;
    else if (*s) return -1;
  }
  return n;
}

static int load(const char *src, char *buf, size_t cap) {
  FILE *f = fopen(src, "r");
  if (f) {
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = '\0';
    fclose(f);
    return 0;
  }
  int open_err = errno;
  if (strchr(src, ':')) {
    if (ps_cli_fetch_stats(src, STATS_MS, buf, cap) == 0) return 0;
    fprintf(stderr, "pshard plan: cannot read measurements from '%s': %s\n", src, ps_errmsg());
    return -1;
  }
  fprintf(stderr, "pshard plan: cannot read measurements from '%s': %s\n", src, strerror(open_err));
  return -1;
}

typedef struct pred {
  unsigned k, s;
  double tc, tw, eps;
  const char *bottleneck;
} pred;

static pred predict(double tc, double tw, double b, unsigned K, unsigned S, unsigned k, unsigned s, double cores) {
  pred p = {.k = k, .s = s};
  p.tc = tc * fmax(1.0, k / cores) / fmax(1.0, K / cores);
  p.tw = tw * fmax(1.0, (double)k / s) / fmax(1.0, (double)K / S);
  p.eps = k * b / (p.tc + p.tw);
  if (p.tc >= p.tw)
    p.bottleneck = k > cores ? "cores" : "compute"; /* cores: compute, oversubscribed */
  else
    p.bottleneck = (double)k / s > 1.0 ? "servers" : "network";
  return p;
}

/* What `pshard plan --measured` was asked to do. */
typedef struct m_opts {
  const char *src;
  int json;
  double cores;
  unsigned ks[32], ss[32]; /* worker and server counts to predict */
  int nk, ns;
} m_opts;

/* The flags, into o. -1 to go on, or the exit status (usage printed as needed). */
static int parse_flags(int argc, char **argv, m_opts *o) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strncmp(a, "--measured=", 11)) {
      o->src = a + 11;
      continue;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--json")) {
      o->json = 1;
      continue;
    }
    if (!v) {
      fprintf(stderr, "pshard plan: option %s needs a value\n", a);
      usage(stderr);
      return 2;
    }
    i++;
    if (!strcmp(a, "--measured")) {
      o->src = v;
    } else if (!strcmp(a, "--cores")) {
      char *end;
      o->cores = strtod(v, &end);
      if (*end || !(o->cores >= 1)) {
        fprintf(stderr, "pshard plan: bad --cores '%s'\n", v);
        return 2;
      }
    } else if (!strcmp(a, "--workers") && (o->nk = parse_list(v, o->ks, 32)) > 0) {
    } else if (!strcmp(a, "--servers") && (o->ns = parse_list(v, o->ss, 32)) > 0) {
    } else {
      fprintf(stderr, "pshard plan: bad option or value: %s %s\n", a, v);
      usage(stderr);
      return 2;
    }
  }
  if (!o->src) {
    usage(stderr);
    return 2;
  }
  return -1;
}

/* The "ps.*" metrics of each node in the counters text (which strtok cuts up), into
 * w[0..*nw), and the number of servers the scheduler expected into *S. */
static void read_metrics(char *text, wstat *w, int *nw, unsigned *S) {
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    unsigned u;
    if (sscanf(line, "servers_expected %u", &u) == 1) *S = u;
    unsigned node;
    char name[64];
    double val;
    if (sscanf(line, "metric node=%u name=%63s value=%lf", &node, name, &val) != 3) continue;
    if (strncmp(name, "ps.", 3)) continue;
    int idx = -1;
    for (int j = 0; j < NSTAT; j++)
      if (!strcmp(name + 3, names[j])) idx = j;
    if (idx < 0) continue;
    int k;
    for (k = 0; k < *nw && w[k].node != node; k++) {}
    if (k == *nw) {
      if (*nw == MAX_NODES) continue;
      memset(&w[*nw], 0, sizeof w[*nw]);
      w[(*nw)++].node = node;
    }
    w[k].v[idx] = val;
    w[k].have |= 1u << idx;
  }
}

/* The measured job, averaged over the workers that trained (per worker and step). */
typedef struct job {
  unsigned K, S;
  double tc, tw, b, B;    /* compute, communication, batch, bytes */
  double pullw, pushw;    /* the two parts of tw */
  double measured;        /* examples per second, all workers */
} job;

/* Average the workers that trained (steps and examples reported). K = 0 if none. */
static job summarize(const wstat *w, int nw, unsigned S) {
  double sum_tc = 0, sum_tw = 0, sum_b = 0, sum_B = 0, sum_ex = 0, sum_train = 0, sum_pullw = 0, sum_pushw = 0;
  job j = {.S = S};
  for (int k = 0; k < nw; k++) {
    const double *v = w[k].v;
    if (v[CLOCK] < 1 || v[EX] <= 0) continue;
    j.K++;
    sum_tc += v[COMP] / v[CLOCK];
    sum_tw += (v[PULLW] + v[PUSHW]) / v[CLOCK];
    sum_pullw += v[PULLW] / v[CLOCK];
    sum_pushw += v[PUSHW] / v[CLOCK];
    sum_b += v[EX] / v[CLOCK];
    sum_B += (v[BPUSH] + v[BPULL]) / v[CLOCK];
    sum_ex += v[EX];
    sum_train += v[COMP] + v[PULLW] + v[PUSHW];
  }
  if (j.K == 0) return j;
  unsigned K = j.K;
  j.tc = sum_tc / K;
  j.tw = sum_tw / K;
  j.b = sum_b / K;
  j.B = sum_B / K;
  j.pullw = sum_pullw / K;
  j.pushw = sum_pushw / K;
  j.measured = sum_ex / (sum_train / K);
  return j;
}

static pred predict_for(const job *j, unsigned k, unsigned s, double cores) {
  return predict(j->tc, j->tw, j->b, j->K, j->S, k, s, cores);
}

static void print_json(const m_opts *o, const job *j) {
  pred self = predict_for(j, j->K, j->S, o->cores);
  printf("{\"measured\":{\"workers\":%u,\"servers\":%u,\"cores\":%g,\"batch\":%.6g,\"compute_s_per_step\":%.6g,"
         "\"pull_wait_s_per_step\":%.6g,\"push_wait_s_per_step\":%.6g,\"bytes_per_step\":%.6g,"
         "\"bandwidth_Bps\":%.6g,\"examples_per_s\":%.6g,\"predicted_examples_per_s\":%.6g,\"bottleneck\":\"%s\"},"
         "\"predictions\":[",
         j->K, j->S, o->cores, j->b, j->tc, j->pullw, j->pushw, j->B, j->tw > 0 ? j->B / j->tw : 0.0, j->measured,
         self.eps, self.bottleneck);
  int first = 1;
  for (int i = 0; i < o->nk; i++)
    for (int k = 0; k < o->ns; k++) {
      pred p = predict_for(j, o->ks[i], o->ss[k], o->cores);
      printf("%s{\"workers\":%u,\"servers\":%u,\"examples_per_s\":%.6g,\"compute_s_per_step\":%.6g,"
             "\"comm_s_per_step\":%.6g,\"bottleneck\":\"%s\"}",
             first ? "" : ",", p.k, p.s, p.eps, p.tc, p.tw, p.bottleneck);
      first = 0;
    }
  printf("]}\n");
}

static void print_text(const m_opts *o, const job *j) {
  pred self = predict_for(j, j->K, j->S, o->cores);
  printf("measured job: %u workers, %u servers, %g cores\n", j->K, j->S, o->cores);
  printf("  per worker and step: %.0f examples; compute %.3f ms; waiting %.3f ms (pull %.3f, push %.3f)\n", j->b,
         j->tc * 1e3, j->tw * 1e3, j->pullw * 1e3, j->pushw * 1e3);
  printf("  traffic %.1f kB per step per worker (decimal units); %.3f GB/s while waiting\n", j->B / 1e3,
         j->tw > 0 ? j->B / j->tw / 1e9 : 0.0);
  printf("  measured %.0f examples/s; the model gives %.0f for this configuration (%+.1f%%); bottleneck: %s\n",
         j->measured, self.eps, (self.eps / j->measured - 1) * 100, self.bottleneck);
  printf("\npredicted examples/s (bottleneck)\n%8s", "K \\ S");
  for (int k = 0; k < o->ns; k++) printf("  %24u", o->ss[k]);
  printf("\n");
  for (int i = 0; i < o->nk; i++) {
    printf("%8u", o->ks[i]);
    for (int k = 0; k < o->ns; k++) {
      pred p = predict_for(j, o->ks[i], o->ss[k], o->cores);
      char cell[64];
      snprintf(cell, sizeof cell, "%.0f (%s)", p.eps, p.bottleneck);
      printf("  %24s", cell);
    }
    printf("\n");
  }
}

int ps_cli_plan_measured(int argc, char **argv) {
  m_opts o = {.cores = (double)sysconf(_SC_NPROCESSORS_ONLN), .ks = {1, 2, 4, 8, 16}, .ss = {1, 2, 4}, .nk = 5, .ns = 3};
  int rc = parse_flags(argc, argv, &o);
  if (rc >= 0) return rc;
  static char text[1 << 20];
  if (load(o.src, text, sizeof text)) return 1;

  static wstat w[MAX_NODES];
  int nw = 0;
  unsigned S = 0;
  read_metrics(text, w, &nw, &S);
  job j = summarize(w, nw, S);
  if (j.K == 0 || S == 0) {
    fprintf(stderr, "pshard plan: no worker measurements in '%s' (workers report them about once a second; "
                    "a job must run at least one step)\n", o.src);
    return 1;
  }
  if (o.json)
    print_json(&o, &j);
  else
    print_text(&o, &j);
  return 0;
}
