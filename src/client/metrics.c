/*
 * metrics.c - a worker's metrics in the Prometheus text format (proto/prom.h), sent to
 * the scheduler, which serves them on the job's /metrics with a node label and plots
 * them on its dashboard (docs/operations.md, "Monitoring"). Workers serve no HTTP of
 * their own: the scheduler is the job's one scrape target.
 *
 * The counters are the context's atomics (ps_ctx_stat), its tables' traffic
 * (ps__tcount) and the latency histograms of its pushes and pulls, recorded as each
 * request completes (req.c). Runs on the loop.
 */
#include <stdio.h>

#include "client/client_int.h"
#include "proto/prom.h"

static uint64_t ld(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

static void counter(ps__wbuf *w, const char *name, const char *help, double v) {
  ps__prom_family(w, name, "counter", help);
  ps__prom_f64(w, name, NULL, v);
}

static void gauge(ps__wbuf *w, const char *name, const char *help, double v) {
  ps__prom_family(w, name, "gauge", help);
  ps__prom_f64(w, name, NULL, v);
}

/* The traffic of every declared table, with a table label. */
static void per_table(ps_ctx *ctx, ps__wbuf *w) {
  static const char *const names[4] = {"ps_client_table_pushed_bytes_total", "ps_client_table_pulled_bytes_total",
                                       "ps_client_table_sent_frames_total", "ps_client_table_received_frames_total"};
  static const char *const helps[4] = {"Payload bytes pushed to each table (keys and values).",
                                       "Payload bytes pulled from each table (values).",
                                       "Request frames sent for each table: one per server a push or pull went to.",
                                       "Answers taken for each table's pushes and pulls."};
  char l[PS__PROM_LABELS_MAX];
  for (int k = 0; k < 4; k++) {
    ps__prom_family(w, names[k], "counter", helps[k]);
    pthread_mutex_lock(&ctx->mu);
    for (size_t i = 1; i < ctx->ntables; i++) {
      const ps__tcount *tc = ctx->tables[i].tc;
      if (!tc || !ctx->tables[i].kind) continue;
      const uint64_t *f[4] = {&tc->pushed_bytes, &tc->pulled_bytes, &tc->sent, &tc->received};
      l[0] = '\0';
      ps__prom_label(l, sizeof l, "table", tc->name);
      ps__prom_u64(w, names[k], l, ld(f[k]));
    }
    pthread_mutex_unlock(&ctx->mu);
  }
}

static void render(ps_ctx *ctx, ps__wbuf *w) {
  char l[PS__PROM_LABELS_MAX], v[32];
  double up, comp, pw, sw, ow;
  ps_ctx_stat(ctx, "uptime_s", &up);
  ps_ctx_stat(ctx, "compute_s", &comp);
  ps_ctx_stat(ctx, "pull_wait_s", &pw);
  ps_ctx_stat(ctx, "push_wait_s", &sw);
  ps_ctx_stat(ctx, "other_wait_s", &ow);
  ps__prom_family(w, "ps_worker_info", "gauge", "This worker: its node id and rank (always 1).");
  l[0] = '\0';
  snprintf(v, sizeof v, "%u", ctx->id);
  ps__prom_label(l, sizeof l, "worker", v);
  snprintf(v, sizeof v, "%d", ctx->rank);
  ps__prom_label(l, sizeof l, "rank", v);
  ps__prom_u64(w, "ps_worker_info", l, 1);
  gauge(w, "ps_metrics_counting", "1 while the request path counts (metrics=on), 0 when it does not: flat latencies and bytes.",
        ctx->count);
  ps__prom_family(w, "ps_client_push_seconds", "histogram", "Push latency as the worker sees it: start to completion.");
  ps__prom_hist(w, "ps_client_push_seconds", NULL, &ctx->lat[1]);
  ps__prom_family(w, "ps_client_pull_seconds", "histogram", "Pull latency as the worker sees it: start to completion.");
  ps__prom_hist(w, "ps_client_pull_seconds", NULL, &ctx->lat[0]);
  counter(w, "ps_client_push_requests_total", "Push requests started.", (double)ld(&ctx->nreq[1]));
  counter(w, "ps_client_pull_requests_total", "Pull requests started.", (double)ld(&ctx->nreq[0]));
  counter(w, "ps_client_pushed_bytes_total", "Payload bytes pushed (keys and values).", (double)ld(&ctx->bytes_pushed));
  counter(w, "ps_client_pulled_bytes_total", "Payload bytes pulled (values).", (double)ld(&ctx->bytes_pulled));
  per_table(ctx, w);
  counter(w, "ps_client_dropped_pushes_total", "Pushes acknowledged but not applied (late under sync:M).",
          (double)ld(&ctx->dropped_pushes));
  counter(w, "ps_client_resent_parts_total", "Request parts sent again after a timeout or a failover.",
          (double)ld(&ctx->resent));
  gauge(w, "ps_client_outstanding_requests", "Requests and frames handed to the I/O thread and not finished.",
        (double)ld(&ctx->outstanding));
  counter(w, "ps_worker_compute_seconds_total", "Time spent on the worker's own work (uptime minus every wait).",
          comp < 0 ? 0 : comp);
  counter(w, "ps_worker_pull_wait_seconds_total", "Time blocked waiting for pulls.", pw);
  counter(w, "ps_worker_push_wait_seconds_total", "Time blocked waiting for pushes.", sw);
  counter(w, "ps_worker_other_wait_seconds_total", "Time blocked in control calls (declare, barrier, tasks).", ow);
  gauge(w, "ps_worker_uptime_seconds", "Seconds since the context was opened.", up);
  gauge(w, "ps_worker_clock", "The worker's clock (its ps_clock calls).", (double)__atomic_load_n(&ctx->clock, __ATOMIC_RELAXED));
  counter(w, "ps_worker_examples_total", "Examples behind the worker's pushes (per clock, the largest batch pushed).",
          (double)ld(&ctx->examples));
  gauge(w, "ps_process_resident_memory_bytes", "Resident memory of the process.", (double)ps__rss_bytes());
}

void ps__ctx_send_metrics(ps_ctx *ctx) {
  if (!ctx->sched || !ctx->sched->conn || !ctx->registered) return;
  ps__wbuf w;
  ps__wbuf_init(&w);
  render(ctx, &w);
  ps__frame_hdr h = {.type = PS_MSG_NODE_METRICS, .sender = ctx->id};
  if (!w.oom) ps__conn_send_ctrl(ctx->sched->conn, &h, w.data, w.len);
  ps__wbuf_free(&w);
}
