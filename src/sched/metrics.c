/*
 * metrics.c - the scheduler's view of the job's metrics: the job's /metrics, the
 * dashboard and its JSON API (docs/operations.md, "Monitoring").
 *
 * Every node sends its own metrics about once a second as Prometheus text
 * (PS_MSG_NODE_METRICS, proto/prom.h); the scheduler keeps each node's latest text,
 * checked line by line when it comes. Once a second, on the loop, it renders:
 *   /metrics        every node's families merged, each sample with a node label, and
 *                   the scheduler's own (ps_sched_*, ps_node_info, ps_user_metric): one
 *                   scrape target for the whole job;
 *   /api/snapshot   the nodes (role, state, address) and their current figures;
 *   /api/history    the last PS__HIST_SAMPLES samples of each node's figures (one a
 *                   second): rates of its counters and its gauges, as the dashboard
 *                   plots them;
 * and publishes them to the HTTP thread (net/http.h), which also serves the
 * dashboard's page, script and style, built into the binary (web/, sched/web_assets).
 * A node that left or died keeps its last text: the job's totals stay whole.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/prom.h"
#include "sched/sched_int.h"
#include "sched/web_assets.h"

#define SAMPLE_MS 1000u
#define HISTORY_ALWAYS 64         /* nodes up to which /api/history is rendered every second */
#define HISTORY_WANTED_MS 60000u  /* beyond: while it was asked for within this */

/* ------------------------------------------------------------------ the figures of a node */

enum { RATE, GAUGE, RATIO, USER };

/* A figure of the history: from the sums of samples named a (and b) in the node's text. */
typedef struct field {
  const char *key;
  int kind;
  const char *a, *b; /* RATE, GAUGE: a + b (b may be NULL); RATIO: delta a / delta b; USER: ps_metric a */
} field;

static const field fields[] = {
    {"examples_per_s", RATE, "ps_worker_examples_total", NULL},
    {"pushes_per_s", RATE, "ps_client_push_requests_total", "ps_server_push_requests_total"},
    {"pulls_per_s", RATE, "ps_client_pull_requests_total", "ps_server_pull_requests_total"},
    {"loss", USER, "loss", NULL},
    {"compute", RATE, "ps_worker_compute_seconds_total", NULL},
    {"pull_wait", RATE, "ps_worker_pull_wait_seconds_total", NULL},
    {"push_wait", RATE, "ps_worker_push_wait_seconds_total", NULL},
    {"bytes_in_per_s", RATE, "ps_client_pulled_bytes_total", "ps_server_received_bytes_total"},
    {"bytes_out_per_s", RATE, "ps_client_pushed_bytes_total", "ps_server_sent_bytes_total"},
    {"resident_bytes", GAUGE, "ps_process_resident_memory_bytes", NULL},
    {"table_bytes", GAUGE, "ps_server_table_parameter_bytes", "ps_server_table_optimizer_bytes"},
    {"staleness", RATIO, "ps_server_push_staleness_clocks_sum", "ps_server_push_staleness_clocks_count"},
    {"push_latency_s", RATIO, "ps_client_push_seconds_sum", "ps_client_push_seconds_count"},
    {"pull_latency_s", RATIO, "ps_client_pull_seconds_sum", "ps_client_pull_seconds_count"},
};
#define NFIELDS (sizeof fields / sizeof fields[0])

typedef struct ps__node_hist {
  double v[NFIELDS][PS__HIST_SAMPLES]; /* by the ring's slots; NaN: none */
  double raw[NFIELDS][2];              /* the sums at the last sample */
  uint64_t raw_ms;                     /* its time (0: none yet) */
  double now[NFIELDS];                 /* the latest figures */
} ps__node_hist;

static double user_metric(ps__sched *s, uint32_t node, const char *name) {
  for (size_t i = 0; i < s->nmetrics; i++)
    if (s->metrics[i].node == node && !strcmp(s->metrics[i].name, name)) return s->metrics[i].value;
  return NAN;
}

static double sum_of(const ps__sched_node *n, const char *name, int *found) {
  int f = 0;
  double v = name ? ps__prom_sum(n->prom, n->prom_len, name, NULL, &f) : 0;
  if (found) *found += f;
  return v;
}

/* Sample node n at now_ms into slot. */
static void sample_node(ps__sched *s, ps__sched_node *n, size_t slot, uint64_t now_ms) {
  if (!n->hist) {
    if (!(n->hist = ps__malloc(sizeof *n->hist))) return;
    for (size_t f = 0; f < NFIELDS; f++) {
      for (size_t i = 0; i < PS__HIST_SAMPLES; i++) n->hist->v[f][i] = NAN;
      n->hist->now[f] = NAN;
    }
    n->hist->raw_ms = 0;
  }
  ps__node_hist *h = n->hist;
  int fresh = n->prom && n->m.alive;
  double dt = h->raw_ms && now_ms > h->raw_ms ? (double)(now_ms - h->raw_ms) / 1000.0 : 0;
  for (size_t f = 0; f < NFIELDS; f++) {
    const field *x = &fields[f];
    double v = NAN;
    if (fresh && x->kind == USER) {
      v = user_metric(s, n->m.id, x->a);
    } else if (fresh) {
      int found = 0;
      double a = sum_of(n, x->a, &found), b = x->b ? sum_of(n, x->b, &found) : 0;
      if (found) {
        if (x->kind == GAUGE) {
          v = a + b;
        } else if (x->kind == RATE) {
          if (dt > 0) v = (a + b - h->raw[f][0] - h->raw[f][1]) / dt;
        } else if (dt > 0 && b > h->raw[f][1]) {
          v = (a - h->raw[f][0]) / (b - h->raw[f][1]);
        }
        if (v < 0) v = NAN; /* a counter went back: the node restarted */
        h->raw[f][0] = a;
        h->raw[f][1] = b;
      }
    }
    h->v[f][slot] = v;
    if (x->kind != RATIO || !isnan(v) || !fresh) h->now[f] = v; /* a ratio holds its last value while idle */
  }
  h->raw_ms = fresh ? now_ms : 0;
}

/* ------------------------------------------------------------------ taking a node's text */

static int name_char(char c, int first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' || (!first && c >= '0' && c <= '9');
}

/* Check a sample line's "name{labels} value": 0 or -1. The name must begin with fam. */
static int check_sample(const char *p, const char *e, const char *fam, size_t famlen) {
  const char *q = p;
  if (q == e || !name_char(*q, 1)) return -1;
  while (q < e && name_char(*q, 0)) q++;
  if ((size_t)(q - p) < famlen || memcmp(p, fam, famlen)) return -1;
  if (q < e && *q == '{') {
    q++;
    while (q < e && *q != '}') {
      const char *ln = q;
      if (!name_char(*q, 1)) return -1;
      while (q < e && name_char(*q, 0)) q++;
      if ((size_t)(q - ln) == 4 && !memcmp(ln, "node", 4)) return -1; /* the scheduler's label */
      if (q + 1 >= e || q[0] != '=' || q[1] != '"') return -1;
      q += 2;
      while (q < e && *q != '"') q += *q == '\\' ? 2 : 1;
      if (q >= e) return -1;
      q++;
      if (q < e && *q == ',') q++;
    }
    if (q >= e) return -1;
    q++;
  }
  if (q >= e || *q != ' ') return -1;
  q++;
  if (q == e) return -1;
  char num[48];
  size_t k = (size_t)(e - q);
  if (k >= sizeof num) return -1;
  memcpy(num, q, k);
  num[k] = '\0';
  char *end;
  strtod(num, &end);
  return *end == '\0' ? 0 : -1;
}

int ps__sched_metrics_check(const char *t, size_t len, const char **why) {
  const char *p = t, *end = t + len, *fam = NULL, *help = NULL;
  size_t famlen = 0, help_len = 0;
  int have_help = 0; /* the last line was a HELP: this one must be its TYPE */
  if (len && t[len - 1] != '\n') return *why = "does not end with a newline", -1;
  while (p < end) {
    const char *e = memchr(p, '\n', (size_t)(end - p));
    for (const char *q = p; q < e; q++)
      if ((unsigned char)*q < 0x20 || (unsigned char)*q == 0x7f) return *why = "holds a control character", -1;
    if (e - p > 7 && !memcmp(p, "# HELP ", 7)) {
      const char *n = p + 7, *sp = memchr(n, ' ', (size_t)(e - n));
      if (have_help) return *why = "has a HELP line not followed by its TYPE", -1;
      if (!sp || sp == n) return *why = "has a HELP line without a name and text", -1;
      help = n;
      help_len = (size_t)(sp - n);
      have_help = 1;
      p = e + 1;
      continue; /* the next line must be its TYPE */
    } else if (e - p > 7 && !memcmp(p, "# TYPE ", 7)) {
      const char *n = p + 7, *sp = memchr(n, ' ', (size_t)(e - n));
      if (!have_help || !sp || (size_t)(sp - n) != help_len || memcmp(n, help, help_len))
        return *why = "has a TYPE line not right after its family's HELP", -1;
      size_t tl = (size_t)(e - sp - 1);
      if (!((tl == 7 && !memcmp(sp + 1, "counter", 7)) || (tl == 5 && !memcmp(sp + 1, "gauge", 5)) ||
            (tl == 9 && !memcmp(sp + 1, "histogram", 9))))
        return *why = "has a family of an unknown type", -1;
      fam = n;
      famlen = (size_t)(sp - n);
      if (famlen < 4 || memcmp(fam, "ps_", 3) || (famlen >= 9 && !memcmp(fam, "ps_sched_", 9)) ||
          (famlen == 12 && !memcmp(fam, "ps_node_info", 12)) || (famlen == 14 && !memcmp(fam, "ps_user_metric", 14)))
        return *why = "has a family not named ps_... or named as the scheduler's own", -1;
      for (size_t i = 0; i < famlen; i++)
        if (!name_char(fam[i], i == 0)) return *why = "has a bad family name", -1;
      have_help = 0;
    } else if (have_help) {
      return *why = "has a HELP line not followed by its TYPE", -1;
    } else if (e > p && *p == '#') {
      return *why = "has an unknown comment line", -1;
    } else if (!fam || check_sample(p, e, fam, famlen)) {
      return *why = "has a malformed sample line", -1;
    }
    p = e + 1;
  }
  return have_help ? (*why = "ends with a HELP line", -1) : 0;
}

void ps__sched_metrics_frame(ps__sched *s, ps__sched_node *n, const ps__body *b) {
  const char *why = "is larger than 1 MiB";
  if (b->len > PS__NODE_METRICS_MAX || ps__sched_metrics_check(b->buf, b->len, &why)) {
    if (!s->node_metrics_refused++)
      ps__log(PS_LOG_WARN, "node %u: metrics refused: the text %s (counted as ps_sched_node_metrics_refused_total)",
              n->m.id, why);
    return;
  }
  char *t = ps__malloc(b->len ? b->len : 1);
  if (!t) return;
  if (b->len) memcpy(t, b->buf, b->len);
  free(n->prom);
  n->prom = t;
  n->prom_len = b->len;
  n->prom_ms = ps__now_ms();
  s->node_metrics++;
}

/* ------------------------------------------------------------------ the job's /metrics */

typedef struct section {
  const char *name; /* the family name (in the node's text) */
  size_t name_len;
  const char *head; /* its HELP and TYPE lines */
  size_t head_len;
  const char *body; /* its samples */
  size_t body_len;
} section;

/* Cut a checked text into its families' sections; the number found (at most cap). */
static size_t sections_of(const char *t, size_t len, section *out, size_t cap) {
  const char *p = t, *end = t + len;
  size_t n = 0;
  while (p < end && n < cap) {
    const char *help = p, *e = memchr(p, '\n', (size_t)(end - p));
    if (memcmp(p, "# HELP ", 7)) { /* skip to the next family */
      p = e + 1;
      continue;
    }
    const char *type = e + 1;
    if (type >= end) break;
    const char *te = memchr(type, '\n', (size_t)(end - type));
    section *s = &out[n++];
    s->name = type + 7;
    s->name_len = (size_t)((const char *)memchr(s->name, ' ', (size_t)(te - s->name)) - s->name);
    s->head = help;
    s->head_len = (size_t)(te + 1 - help);
    s->body = te + 1;
    p = te + 1;
    while (p < end && *p != '#') p = (const char *)memchr(p, '\n', (size_t)(end - p)) + 1;
    s->body_len = (size_t)(p - s->body);
  }
  return n;
}

/* The samples of one section, each with node="id" as its first label. */
static void relabel(ps__wbuf *w, const section *sec, uint32_t node) {
  char lab[32];
  int ln = snprintf(lab, sizeof lab, "node=\"%u\"", node);
  const char *p = sec->body, *end = sec->body + sec->body_len;
  while (p < end) {
    const char *e = memchr(p, '\n', (size_t)(end - p));
    const char *q = p;
    while (q < e && *q != '{' && *q != ' ') q++;
    ps__wbuf_bytes(w, p, (size_t)(q - p));
    ps__wbuf_bytes(w, "{", 1);
    ps__wbuf_bytes(w, lab, (size_t)ln);
    if (*q == '{') {
      if (q[1] != '}') ps__wbuf_bytes(w, ",", 1);
      q++;
    } else {
      ps__wbuf_bytes(w, "}", 1);
    }
    ps__wbuf_bytes(w, q, (size_t)(e + 1 - q));
    p = e + 1;
  }
}

#define MAX_SECTIONS 256

static const char *role_name(uint8_t role) { return role == PS_ROLE_SERVER ? "server" : "worker"; }
static const char *state_name(const ps__sched_node *n) { return n->m.alive ? "alive" : n->left ? "left" : "dead"; }

static void own_metrics(ps__sched *s, ps__wbuf *w) {
  char l[PS__PROM_LABELS_MAX], v[64];
  ps__prom_family(w, "ps_node_info", "gauge", "The job's nodes: role, rank, address and state (always 1).");
  for (size_t i = 0; i < s->nnodes; i++) {
    ps__sched_node *n = &s->nodes[i];
    l[0] = '\0';
    snprintf(v, sizeof v, "%u", n->m.id);
    ps__prom_label(l, sizeof l, "node", v);
    ps__prom_label(l, sizeof l, "role", role_name(n->m.role));
    snprintf(v, sizeof v, "%u", n->m.rank);
    ps__prom_label(l, sizeof l, "rank", v);
    snprintf(v, sizeof v, "%s:%u", n->m.host, n->m.port);
    ps__prom_label(l, sizeof l, "addr", n->m.role == PS_ROLE_SERVER ? v : "");
    ps__prom_label(l, sizeof l, "state", state_name(n));
    ps__prom_u64(w, "ps_node_info", l, 1);
  }
  ps__prom_family(w, "ps_sched_nodes", "gauge", "Nodes of the job by role and state.");
  static const char *const states[] = {"alive", "left", "dead"};
  for (int r = 0; r < 2; r++)
    for (int k = 0; k < 3; k++) {
      uint64_t c = 0;
      for (size_t i = 0; i < s->nnodes; i++)
        if ((s->nodes[i].m.role == PS_ROLE_SERVER) == (r == 1) && !strcmp(state_name(&s->nodes[i]), states[k])) c++;
      l[0] = '\0';
      ps__prom_label(l, sizeof l, "role", r ? "server" : "worker");
      ps__prom_label(l, sizeof l, "state", states[k]);
      ps__prom_u64(w, "ps_sched_nodes", l, c);
    }
  ps__prom_family(w, "ps_sched_epoch", "gauge", "The membership epoch (it grows with every join, leave or death).");
  ps__prom_u64(w, "ps_sched_epoch", NULL, s->epoch);
  ps__prom_family(w, "ps_sched_node_metrics_total", "counter", "Metrics texts taken from the nodes.");
  ps__prom_u64(w, "ps_sched_node_metrics_total", NULL, s->node_metrics);
  ps__prom_family(w, "ps_sched_node_metrics_refused_total", "counter", "Metrics texts refused as malformed or too large.");
  ps__prom_u64(w, "ps_sched_node_metrics_refused_total", NULL, s->node_metrics_refused);
  ps__prom_family(w, "ps_sched_metrics_refused_total", "counter", "ps_metric reports of a new name past the caps.");
  ps__prom_u64(w, "ps_sched_metrics_refused_total", NULL, s->metrics_refused);
  ps__prom_family(w, "ps_sched_resident_memory_bytes", "gauge", "Resident memory of the scheduler.");
  ps__prom_u64(w, "ps_sched_resident_memory_bytes", NULL, ps__rss_bytes());
  ps__prom_family(w, "ps_user_metric", "gauge", "The last value each worker reported with ps_metric, by name.");
  for (size_t i = 0; i < s->nmetrics && i < PS__STATS_METRICS; i++) {
    const ps__sched_metric *m = &s->metrics[i];
    if (!strncmp(m->name, "ps.", 3)) continue; /* the library's own: in the node's families */
    l[0] = '\0';
    snprintf(v, sizeof v, "%u", m->node);
    ps__prom_label(l, sizeof l, "node", v);
    ps__prom_label(l, sizeof l, "name", m->name);
    ps__prom_f64(w, "ps_user_metric", l, m->value);
  }
}

#define MAX_FAMILIES 1024 /* distinct families in the job's text, at most */

static int same_family(const section *a, const section *b) {
  return a->name_len == b->name_len && !memcmp(a->name, b->name, a->name_len);
}

static void job_metrics(ps__sched *s, ps__wbuf *w) {
  own_metrics(s, w);
  size_t nn = s->nnodes, nf = 0;
  section **secs = ps__calloc(nn ? nn : 1, sizeof *secs);
  size_t *nsec = ps__calloc(nn ? nn : 1, sizeof *nsec), *cur = ps__calloc(nn ? nn : 1, sizeof *cur);
  const section **fams = ps__malloc(MAX_FAMILIES * sizeof *fams);
  if (!secs || !nsec || !cur || !fams) {
    w->oom = 1;
    goto done;
  }
  for (size_t i = 0; i < nn; i++) {
    if (!s->nodes[i].prom) continue;
    secs[i] = ps__malloc(MAX_SECTIONS * sizeof **secs);
    if (secs[i]) nsec[i] = sections_of(s->nodes[i].prom, s->nodes[i].prom_len, secs[i], MAX_SECTIONS);
  }
  /* The distinct families, in the order first seen (the nodes of a role list theirs in
   * the same order, so this stays short). */
  for (size_t i = 0; i < nn; i++)
    for (size_t j = 0; j < nsec[i]; j++) {
      size_t k = 0;
      while (k < nf && !same_family(fams[k], &secs[i][j])) k++;
      if (k == nf && nf < MAX_FAMILIES) fams[nf++] = &secs[i][j];
    }
  /* Each family once, with every node's samples of it; a node's search for the next
   * family starts after its last match, where it almost always is. */
  for (size_t k = 0; k < nf; k++) {
    ps__wbuf_bytes(w, fams[k]->head, fams[k]->head_len);
    for (size_t a = 0; a < nn; a++)
      for (size_t step = 0; step < nsec[a]; step++) {
        size_t b = (cur[a] + step) % nsec[a];
        if (same_family(&secs[a][b], fams[k])) {
          relabel(w, &secs[a][b], s->nodes[a].m.id);
          cur[a] = b + 1;
          break;
        }
      }
  }
done:
  for (size_t i = 0; secs && i < nn; i++) free(secs[i]);
  free(secs);
  free(nsec);
  free(cur);
  free(fams);
}

/* ------------------------------------------------------------------ JSON */

static void jbytes(ps__wbuf *w, const char *s) { ps__wbuf_bytes(w, s, strlen(s)); }

static void jstr(ps__wbuf *w, const char *s) {
  ps__wbuf_bytes(w, "\"", 1);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      char e[2] = {'\\', (char)c};
      ps__wbuf_bytes(w, e, 2);
    } else if (c < 0x20) {
      char e[8];
      snprintf(e, sizeof e, "\\u%04x", c);
      ps__wbuf_bytes(w, e, 6);
    } else {
      ps__wbuf_bytes(w, s, 1);
    }
  }
  ps__wbuf_bytes(w, "\"", 1);
}

static void jnum(ps__wbuf *w, double v) {
  char b[40];
  if (isnan(v) || isinf(v))
    snprintf(b, sizeof b, "null");
  else
    snprintf(b, sizeof b, "%.6g", v);
  jbytes(w, b);
}

static void node_head(ps__wbuf *w, const ps__sched_node *n) {
  char b[300];
  snprintf(b, sizeof b, "{\"id\":%u,\"role\":\"%s\",\"rank\":%u,\"state\":\"%s\",\"addr\":", n->m.id, role_name(n->m.role),
           n->m.rank, state_name(n));
  jbytes(w, b);
  if (n->m.role == PS_ROLE_SERVER) {
    snprintf(b, sizeof b, "%s:%u", n->m.host, n->m.port);
    jstr(w, b);
  } else {
    jstr(w, "");
  }
  jbytes(w, ",\"host\":");
  jstr(w, n->m.hostid);
}

static void snapshot(ps__sched *s, ps__wbuf *w, uint64_t now_ms) {
  char b[256];
  size_t alive[2] = {0, 0};
  for (size_t i = 0; i < s->nnodes; i++)
    if (s->nodes[i].m.alive) alive[s->nodes[i].m.role == PS_ROLE_SERVER]++;
  snprintf(b, sizeof b,
           "{\"job\":{\"epoch\":%llu,\"started\":%d,\"servers_expected\":%u,\"workers_expected\":%u,"
           "\"servers_alive\":%zu,\"workers_alive\":%zu,\"uptime_s\":%.3f},\"nodes\":[",
           (unsigned long long)s->epoch, s->started, s->o.servers, s->o.workers, alive[1], alive[0],
           (double)(now_ms - s->created_ms) / 1000.0);
  jbytes(w, b);
  for (size_t i = 0; i < s->nnodes; i++) {
    ps__sched_node *n = &s->nodes[i];
    if (i) jbytes(w, ",");
    node_head(w, n);
    snprintf(b, sizeof b, ",\"metrics_age_s\":");
    jbytes(w, b);
    jnum(w, n->prom ? (double)(now_ms - n->prom_ms) / 1000.0 : NAN);
    jbytes(w, ",\"figures\":{");
    for (size_t f = 0; f < NFIELDS; f++) {
      if (f) jbytes(w, ",");
      jstr(w, fields[f].key);
      jbytes(w, ":");
      jnum(w, n->hist ? n->hist->now[f] : NAN);
    }
    jbytes(w, "}}");
  }
  jbytes(w, "]}");
}

static void history(ps__sched *s, ps__wbuf *w) {
  char b[64];
  size_t first = (s->hist_head + PS__HIST_SAMPLES - s->hist_n) % PS__HIST_SAMPLES;
  jbytes(w, "{\"interval_s\":1,\"fields\":[");
  for (size_t f = 0; f < NFIELDS; f++) {
    if (f) jbytes(w, ",");
    jstr(w, fields[f].key);
  }
  jbytes(w, "],\"t\":[");
  for (size_t k = 0; k < s->hist_n; k++) {
    snprintf(b, sizeof b, "%s%.3f", k ? "," : "", (double)s->hist_ms[(first + k) % PS__HIST_SAMPLES] / 1000.0);
    jbytes(w, b);
  }
  jbytes(w, "],\"nodes\":[");
  int any = 0;
  for (size_t i = 0; i < s->nnodes; i++) {
    ps__sched_node *n = &s->nodes[i];
    if (!n->hist) continue;
    if (any++) jbytes(w, ",");
    node_head(w, n);
    jbytes(w, ",\"series\":{");
    for (size_t f = 0; f < NFIELDS; f++) {
      if (f) jbytes(w, ",");
      jstr(w, fields[f].key);
      jbytes(w, ":[");
      for (size_t k = 0; k < s->hist_n; k++) {
        if (k) jbytes(w, ",");
        jnum(w, n->hist->v[f][(first + k) % PS__HIST_SAMPLES]);
      }
      jbytes(w, "]");
    }
    jbytes(w, "}}");
  }
  jbytes(w, "]}");
}

/* ------------------------------------------------------------------ the timer */

static void publish(ps__sched *s, const char *path, const char *ctype, ps__wbuf *w) {
  if (!w->oom && ps__http_set(s->http, path, ctype, w->data, w->len, 0))
    ps__log(PS_LOG_WARN, "%s not published: %s", path, ps_errmsg());
  ps__wbuf_free(w);
  ps__wbuf_init(w);
}

static void metrics_tick(uv_timer_t *t) {
  ps__sched *s = t->data;
  uint64_t now = ps__now_ms();
  size_t slot = s->hist_head;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts); /* the plots' time axis is wall-clock time */
  s->hist_ms[slot] = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
  for (size_t i = 0; i < s->nnodes; i++) sample_node(s, &s->nodes[i], slot, now);
  s->hist_head = (slot + 1) % PS__HIST_SAMPLES;
  if (s->hist_n < PS__HIST_SAMPLES) s->hist_n++;
  ps__wbuf w;
  ps__wbuf_init(&w);
  job_metrics(s, &w);
  publish(s, "/metrics", PS__PROM_CTYPE, &w);
  snapshot(s, &w, now);
  publish(s, "/api/snapshot", "application/json", &w);
  /* The history of a large job is rendered only while someone reads it. */
  uint64_t asked = ps__http_asked_ms(s->http, "/api/history");
  if (s->nnodes <= HISTORY_ALWAYS || (asked && now - asked < HISTORY_WANTED_MS) || !s->history_published) {
    history(s, &w);
    publish(s, "/api/history", "application/json", &w);
    s->history_published = 1;
  }
  ps__wbuf_free(&w);
}

int ps__sched_metrics_start(ps__sched *s) {
  s->created_ms = ps__now_ms();
  if (!s->o.http) return 0;
  if (!(s->hist_ms = ps__calloc(PS__HIST_SAMPLES, sizeof *s->hist_ms))) return ps__fail(PS_ERR_NOMEM, "out of memory");
  ps__http_opts o = {.host = s->o.http_host, .port = s->o.http_port};
  int rc = ps__http_start(&o, &s->http);
  if (rc) return rc;
  for (size_t i = 0; i < ps__web_nassets; i++) {
    const ps__web_asset *a = &ps__web_assets[i];
    if ((rc = ps__http_set(s->http, a->path, a->ctype, a->data, a->len, 1))) return rc;
  }
  uv_timer_init(&s->loop, &s->metrics_timer);
  s->metrics_timer.data = s;
  metrics_tick(&s->metrics_timer); /* every path answers from the start */
  uv_timer_start(&s->metrics_timer, metrics_tick, SAMPLE_MS, SAMPLE_MS);
  return 0;
}

void ps__sched_metrics_free(ps__sched *s) {
  ps__http_stop(s->http); /* first: the HTTP thread reads nothing of s, but stop it before freeing */
  s->http = NULL;
  for (size_t i = 0; i < s->nnodes; i++) {
    free(s->nodes[i].prom);
    free(s->nodes[i].hist);
  }
  free(s->hist_ms);
}
