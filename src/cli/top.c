/*
 * top.c - `pshard top HOST:PORT [--once] [--interval MS]`: a running job at a glance,
 * refreshed in the terminal.
 *
 * Every interval it asks the scheduler at HOST:PORT for its STATS (the nodes with their
 * addresses, the task progress, and the counters each worker reports, "ps.*") and then
 * every live server for its own (ps_cli_stats_text, stats.c). Rates
 * (pushes/s, examples/s, MB/s) and each worker's step split (compute, waiting for pulls,
 * waiting for pushes, as shares of its wall time) are differences between two samples,
 * so --once takes two samples one interval apart. Plain ANSI: the screen is cleared
 * before each frame when stdout is a terminal; --once prints one frame and exits.
 */
#include <getopt.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/common.h"
#include "common/config.h"

#define TOP_MAX_NODES 512
#define TOP_TIMEOUT_MS 2000u

/* One node as the samples see it. */
typedef struct top_node {
  unsigned id, rank, alive, is_server;
  char addr[80];
  /* servers: their STATS; workers: the scheduler's ps.* metrics */
  double rows, payload, pushes, pulls, min_clock, max_clock, tables;
  double clock, examples, uptime, compute, pull_wait, push_wait, bytes_pushed, bytes_pulled;
} top_node;

typedef struct top_sample {
  uint64_t t_ms;
  char head[256];
  top_node n[TOP_MAX_NODES];
  int nn;
} top_sample;

static volatile sig_atomic_t top_stop;
static void on_int(int sig) {
  (void)sig;
  top_stop = 1;
}

static char *fetch(const char *addr) { return ps_cli_stats_text(addr, TOP_TIMEOUT_MS); }

/* The value of "key value" at the start of a line of text, or dflt. */
static double line_value(const char *text, const char *key, double dflt) {
  size_t k = strlen(key);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
    if (!strncmp(p, key, k) && p[k] == ' ') return strtod(p + k + 1, NULL);
  return dflt;
}

static top_node *node_by_id(top_sample *s, unsigned id) {
  for (int i = 0; i < s->nn; i++)
    if (s->n[i].id == id) return &s->n[i];
  return NULL;
}

/* The worker's ps.* metric named in a "metric node=.. name=.. value=.." line. */
static void take_metric(top_node *w, const char *name, double v) {
  static const struct {
    const char *name;
    size_t off;
  } m[] = {{"ps.clock", offsetof(top_node, clock)},           {"ps.examples", offsetof(top_node, examples)},
           {"ps.uptime_s", offsetof(top_node, uptime)},       {"ps.compute_s", offsetof(top_node, compute)},
           {"ps.pull_wait_s", offsetof(top_node, pull_wait)}, {"ps.push_wait_s", offsetof(top_node, push_wait)},
           {"ps.bytes_pushed", offsetof(top_node, bytes_pushed)},
           {"ps.bytes_pulled", offsetof(top_node, bytes_pulled)}};
  for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
    if (!strcmp(name, m[i].name)) *(double *)(void *)((char *)w + m[i].off) = v;
}

/* The scheduler's view: nodes, the head line, the workers' metrics. */
static void parse_sched(top_sample *s, const char *text) {
  s->nn = 0;
  unsigned parts = 0, epochs = 0, epoch = 0, done = 0;
  const char *tk = strstr(text, "\ntasks partitions=");
  int tasks = tk && sscanf(tk, "\ntasks partitions=%u epochs=%u epoch=%u done=%u", &parts, &epochs, &epoch, &done) == 4;
  snprintf(s->head, sizeof s->head, "epoch %.0f  %s  servers %.0f/%.0f  workers %.0f/%.0f", line_value(text, "epoch", 0),
           line_value(text, "started", 0) > 0 ? "started" : "waiting for registrations",
           line_value(text, "servers_alive", 0), line_value(text, "servers_expected", 0),
           line_value(text, "workers_alive", 0), line_value(text, "workers_expected", 0));
  if (tasks) {
    size_t n = strlen(s->head);
    snprintf(s->head + n, sizeof s->head - n, "  tasks: epoch %u/%u, %u/%u partitions done",
             epoch < epochs ? epoch + 1 : epochs, epochs, epoch < epochs ? done : parts, parts);
  }
  for (const char *p = strstr(text, "node "); p && s->nn < TOP_MAX_NODES; p = strstr(p + 1, "\nnode ")) {
    top_node *n = &s->n[s->nn];
    char role[16];
    memset(n, 0, sizeof *n);
    if (sscanf(p + (*p == '\n'), "node %u role=%15s rank=%u addr=%79s alive=%u", &n->id, role, &n->rank, n->addr,
               &n->alive) != 5)
      continue;
    n->is_server = !strcmp(role, "server");
    s->nn++;
  }
  for (const char *p = strstr(text, "metric node="); p; p = strstr(p + 1, "\nmetric node=")) {
    unsigned id;
    char name[128];
    double v;
    if (sscanf(p + (*p == '\n'), "metric node=%u name=%127s value=%lf", &id, name, &v) != 3) continue;
    top_node *w = node_by_id(s, id);
    if (w && !w->is_server) take_metric(w, name, v);
  }
}

static void parse_server(top_node *n, const char *text) {
  n->rows = line_value(text, "rows", 0);
  n->payload = line_value(text, "payload_bytes", 0);
  n->min_clock = line_value(text, "min_clock", 0);
  n->max_clock = line_value(text, "max_clock", 0);
  n->pushes = n->pulls = n->tables = 0;
  for (const char *p = strstr(text, "table "); p; p = strstr(p + 1, "\ntable ")) {
    const char *a = strstr(p, " pushes="), *b = strstr(p, " pulls="), *e = strchr(p + 1, '\n');
    if (a && (!e || a < e)) n->pushes += strtod(a + 8, NULL);
    if (b && (!e || b < e)) n->pulls += strtod(b + 7, NULL);
    n->tables++;
  }
}

/* One sample of the whole job; 0, or -1 when the scheduler does not answer. */
static int sample(const char *addr, top_sample *s) {
  char *t = fetch(addr);
  if (!t) return -1;
  s->t_ms = ps__now_ms();
  parse_sched(s, t);
  free(t);
  for (int i = 0; i < s->nn; i++) {
    if (!s->n[i].is_server || !s->n[i].alive) continue;
    char *st = fetch(s->n[i].addr);
    if (st) parse_server(&s->n[i], st);
    free(st);
  }
  return 0;
}

static double rate(double now, double before, double secs) { return secs > 0 && now >= before ? (now - before) / secs : 0; }

static void print_frame(FILE *f, const char *addr, const top_sample *a, const top_sample *b, int clear) {
  double secs = (double)(b->t_ms - a->t_ms) / 1000.0;
  if (clear) fputs("\033[H\033[2J", f);
  fprintf(f, "pshard top %s   %s\n\n", addr, b->head);
  fprintf(f, "%-7s %5s %-22s %5s %12s %10s %10s %10s %13s\n", "SERVER", "RANK", "ADDRESS", "ALIVE", "ROWS",
          "MB", "PUSH/S", "PULL/S", "CLOCKS");
  for (int i = 0; i < b->nn; i++) {
    const top_node *n = &b->n[i], *o = node_by_id((top_sample *)a, n->id);
    if (!n->is_server) continue;
    fprintf(f, "%-7u %5u %-22s %5s %12.0f %10.1f %10.1f %10.1f %6.0f..%-6.0f\n", n->id, n->rank, n->addr,
            n->alive ? "yes" : "no", n->rows, n->payload / 1e6, o ? rate(n->pushes, o->pushes, secs) : 0,
            o ? rate(n->pulls, o->pulls, secs) : 0, n->min_clock, n->max_clock);
  }
  fprintf(f, "\n%-7s %5s %5s %8s %12s %9s %9s %9s %10s %10s\n", "WORKER", "RANK", "ALIVE", "CLOCK", "EXAMPLES/S",
          "COMPUTE", "PULLWAIT", "PUSHWAIT", "MB/S OUT", "MB/S IN");
  for (int i = 0; i < b->nn; i++) {
    const top_node *n = &b->n[i], *o = node_by_id((top_sample *)a, n->id);
    if (n->is_server) continue;
    /* over the worker's own time between its two reports (about once a second) */
    double wall = o ? n->uptime - o->uptime : 0;
    if (wall <= 0) {
      fprintf(f, "%-7u %5u %5s %8.0f %12s %9s %9s %9s %10s %10s\n", n->id, n->rank, n->alive ? "yes" : "no", n->clock,
              "-", "-", "-", "-", "-", "-");
      continue;
    }
    double share = 100.0 / wall;
    fprintf(f, "%-7u %5u %5s %8.0f %12.1f %8.0f%% %8.0f%% %8.0f%% %10.2f %10.2f\n", n->id, n->rank,
            n->alive ? "yes" : "no", n->clock, rate(n->examples, o->examples, wall), (n->compute - o->compute) * share,
            (n->pull_wait - o->pull_wait) * share, (n->push_wait - o->push_wait) * share,
            rate(n->bytes_pushed, o->bytes_pushed, wall) / 1e6, rate(n->bytes_pulled, o->bytes_pulled, wall) / 1e6);
  }
  fflush(f);
}

static void top_usage(FILE *f) {
  fprintf(f,
          "usage: pshard top HOST:PORT [--once] [--interval MS]\n\n"
          "Show a running job: its servers (rows, memory, pushes and pulls per second, clocks)\n"
          "and workers (clock, examples per second, the split of their time between compute\n"
          "and waiting for pulls and pushes, traffic), refreshed every interval. HOST:PORT is\n"
          "the scheduler's. Rates are measured over one interval (workers: between their\n"
          "reports, about once a second), so --once waits 2.2 s.\n\n"
          "options:\n"
          "  --once          print one frame (no screen clearing) and exit\n"
          "  --interval MS   time between frames (1000)\n"
          "  -h, --help      this text\n");
}

int ps_cli_top(int argc, char **argv) {
  static const struct option opts[] = {{"once", no_argument, 0, 'o'},
                                       {"interval", required_argument, 0, 'i'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  uint64_t interval = 1000;
  int once = 0, c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
    case 'o': once = 1; break;
    case 'i':
      if (ps__parse_u64(optarg, &interval) || interval < 100 || interval > 3600000) {
        fprintf(stderr, "pshard top: bad value '%s' for --interval (milliseconds, 100..3600000)\n", optarg);
        return 2;
      }
      break;
    case 'h': top_usage(stdout); return 0;
    default:
      fprintf(stderr, "pshard top: unknown or incomplete option '%s'\n", argv[optind - 1]);
      top_usage(stderr);
      return 2;
    }
  }
  char host[PS_CFG_HOST_MAX];
  int port;
  if (optind + 1 != argc || ps__parse_hostport(argv[optind], host, sizeof host, &port) || port == 0) {
    fprintf(stderr, "pshard top: the scheduler's HOST:PORT is required\n");
    top_usage(stderr);
    return 2;
  }
  const char *addr = argv[optind];
  top_sample *a = ps__calloc(2, sizeof *a);
  if (!a) return 1;
  top_sample *b = a + 1;
  signal(SIGINT, on_int);
  int rc = 0, clear = !once && isatty(1);
  if (sample(addr, a)) {
    fprintf(stderr, "pshard top: the scheduler at %s does not answer: %s\n", addr, ps_errmsg());
    free(a);
    return 1;
  }
  /* workers report about once a second: one frame alone waits long enough for two reports */
  if (once && interval < 2200) interval = 2200;
  while (!top_stop) {
    usleep((useconds_t)(interval * 1000));
    if (sample(addr, b)) {
      fprintf(stderr, "pshard top: the scheduler at %s does not answer (the job ended?): %s\n", addr, ps_errmsg());
      rc = 1;
      break;
    }
    print_frame(stdout, addr, a, b, clear);
    if (once) break;
    top_sample t = *a;
    *a = *b;
    *b = t;
  }
  free(a);
  return rc;
}
