/*
 * stats.c - the STATS request: a server's tables and counters as text lines
 * (protocol.md lists the fields; `pshard run --stats-out` and ps_server_stats read them);
 * and the server's metrics in the Prometheus text format (docs/operations.md,
 * "Monitoring"): rendered on the loop once a second, served on /metrics by the HTTP
 * thread (net/http.h) and sent to the scheduler, which serves the whole job's.
 */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "common/config.h"
#include "common/fault.h"
#include "proto/codec.h"
#include "proto/prom.h"
#include "server/server_int.h"

static void hist_line(ps__wbuf *w, const char *name, const uint64_t *hist, int64_t max) {
  char line[64];
  int n = snprintf(line, sizeof line, "%s_max %lld\n%s", name, (long long)max, name);
  ps__wbuf_bytes(w, line, (size_t)n);
  int last = PS__STALE_BUCKETS - 1;
  while (last > 0 && !hist[last]) last--;
  for (int i = 0; i <= last; i++) {
    n = snprintf(line, sizeof line, " %llu", (unsigned long long)hist[i]);
    ps__wbuf_bytes(w, line, (size_t)n);
  }
  ps__wbuf_bytes(w, "\n", 1);
}

void ps__srv_on_stats(ps__server *s, ps__conn *c, const ps__frame_hdr *h) {
  ps__wbuf w;
  char line[384];
  size_t rows = 0, bytes = 0, payload = 0;
  uint64_t dropped = 0;
  ps__shard *sh = s->sh;
  ps__wbuf_init(&w);
  for (size_t i = 0; i < sh->ntables; i++) {
    ps__table *t = sh->tables[i];
    if (!t) continue;
    size_t n = ps__rowmap_count(t->params);
    rows += n;
    bytes += ps__rowmap_bytes(t->params);
    payload += n * ps__spec_row_floats(&t->spec) * 4;
    dropped += t->dropped;
    int m = snprintf(line, sizeof line,
                     "table %zu name=%s mode=%s param=%u rows=%zu bytes=%zu pushes=%llu pulls=%llu applied=%llu "
                     "step=%llu version=%lld dropped=%llu rejected=%llu lr=%.9g global_batch=%.0f nonfinite=%llu",
                     i, t->decl.name, ps__table_mode_name(t), t->spec.mode_param, n, ps__rowmap_bytes(t->params),
                     (unsigned long long)t->pushes, (unsigned long long)t->pulls, (unsigned long long)t->applied,
                     (unsigned long long)t->step, (long long)t->version, (unsigned long long)t->dropped,
                     (unsigned long long)t->rejected, (double)t->last_lr, t->last_batch,
                     (unsigned long long)t->nonfinite);
    ps__wbuf_bytes(&w, line, (size_t)m);
    /* The table's memory apart (store.h): parameters, optimiser state, keys, index (both
     * while rows move to a bigger one), spare chunk room; they sum to bytes=. */
    ps__rowmap_use u;
    ps__rowmap_usage(t->params, &u);
    size_t pb = n * t->spec.width * sizeof(float);
    m = snprintf(line, sizeof line,
                 " param_bytes=%zu state_bytes=%zu key_bytes=%zu index_bytes=%zu spare_bytes=%zu moving_rows=%zu\n", pb,
                 u.payload - pb, u.keys, u.index, u.spare, ps__rowmap_moving(t->params));
    ps__wbuf_bytes(&w, line, (size_t)m);
    if (t->spec.push_codec.kind || t->spec.pull_codec.kind) { /* value bytes as f32 and as sent */
      char pc[PS_CODEC_NAME_MAX], lc[PS_CODEC_NAME_MAX];
      ps__codec_format(&t->spec.push_codec, pc, sizeof pc);
      ps__codec_format(&t->spec.pull_codec, lc, sizeof lc);
      m = snprintf(line, sizeof line,
                   "codec %zu name=%s push=%s push_raw_bytes=%llu push_wire_bytes=%llu pull=%s pull_raw_bytes=%llu "
                   "pull_wire_bytes=%llu\n",
                   i, t->decl.name, pc, (unsigned long long)t->codec_push_raw, (unsigned long long)t->codec_push_wire,
                   lc, (unsigned long long)t->codec_pull_raw, (unsigned long long)t->codec_pull_wire);
      ps__wbuf_bytes(&w, line, (size_t)m);
    }
  }
  int64_t minc, maxc;
  ps__shard_live_clocks(sh, &minc, &maxc);
  int m = snprintf(line, sizeof line,
                   "server %u\nrank %u\npid %d\nepoch %llu\nmin_clock %lld\nmax_clock %lld\nrows %zu\n"
                   "store_bytes %zu\npayload_bytes %zu\nrejected_clock %llu\ndropped_pushes %llu\n",
                   s->id, s->rank, s->pid, (unsigned long long)s->epoch, (long long)minc, (long long)maxc, rows, bytes,
                   payload, (unsigned long long)sh->rejected_clock, (unsigned long long)dropped);
  ps__wbuf_bytes(&w, line, (size_t)m);
  m = snprintf(line, sizeof line, "duplicate_pushes %llu\nrefused_pushes %llu\n", (unsigned long long)sh->once.dups,
               (unsigned long long)sh->once.stale);
  ps__wbuf_bytes(&w, line, (size_t)m);
  m = snprintf(line, sizeof line, "nonfinite_refused %llu\nnonfinite_skipped %llu\n",
               (unsigned long long)sh->nonfinite_refused, (unsigned long long)sh->nonfinite_skipped);
  ps__wbuf_bytes(&w, line, (size_t)m);
  m = snprintf(line, sizeof line,
               "memory_budget %llu\nmemory_used %llu\nmemory_refused %llu\nframe_budget %llu\nframe_bytes %llu\n"
               "frame_bytes_peak %llu\nframes_refused %llu\nframes_expired %llu\n",
               (unsigned long long)sh->mem_limit, (unsigned long long)sh->mem_used,
               (unsigned long long)sh->mem_refused, (unsigned long long)s->fb.limit, (unsigned long long)s->fb.used,
               (unsigned long long)s->fb.peak, (unsigned long long)s->fb.refused, (unsigned long long)s->fb.expired);
  ps__wbuf_bytes(&w, line, (size_t)m);
  uint64_t nf, bf, lag;
  ps__srv_repl_lag(s, &nf, &bf, &lag);
  m = snprintf(line, sizeof line, "replicas %u\nforwards %llu\nforward_bytes %llu\nforwards_refused %llu\nfenced %d\ncatchups %llu\n"
               "held_ahead %llu\ntail_answers %llu\nforwards_inflight %llu\nforward_inflight_bytes %llu\nreplication_lag_ms %llu\n",
               s->replicas ? s->replicas : 1, (unsigned long long)s->forwards, (unsigned long long)s->forward_bytes,
               (unsigned long long)s->forwards_refused, s->fenced, (unsigned long long)s->catchups,
               (unsigned long long)s->held_ahead, (unsigned long long)s->tail_answers, (unsigned long long)nf, (unsigned long long)bf,
               (unsigned long long)lag);
  ps__wbuf_bytes(&w, line, (size_t)m);
  m = snprintf(line, sizeof line, "round_gaps %llu\n", (unsigned long long)s->round_gaps);
  ps__wbuf_bytes(&w, line, (size_t)m);
  ps__srv_repair_stats(s, line, sizeof line);
  ps__wbuf_bytes(&w, line, strlen(line));
  struct mallinfo2 mi = mallinfo2(); /* the allocator's bytes handed out: a leak shows here, not in RSS alone */
  m = snprintf(line, sizeof line, "connections %zu\nheap_in_use %zu\n", ps__conn_live(), mi.uordblks + mi.hblkhd);
  ps__wbuf_bytes(&w, line, (size_t)m);
  m = snprintf(line, sizeof line, "metrics_counting %d\n", s->count);
  ps__wbuf_bytes(&w, line, (size_t)m);
  m = snprintf(line, sizeof line,
               "peer_mem_pushes %llu\npeer_mem_pulls %llu\nfused_pulls %llu\npeer_mem_forwards_out %llu\n"
               "peer_mem_forwards_in %llu\npeer_mem_forwards_resent %llu\npeer_mem_kept_in_place %llu\n",
               (unsigned long long)s->pm_pushes, (unsigned long long)s->pm_pulls, (unsigned long long)s->fused_pulls,
               (unsigned long long)s->pm_fwd_out, (unsigned long long)s->pm_fwd_in, (unsigned long long)s->pm_fwd_inline,
               (unsigned long long)s->kept_in_place);
  ps__wbuf_bytes(&w, line, (size_t)m);
  uint64_t shm_req, shm_mapped, shm_held;
  ps__shm_counts(s->shm, &shm_req, &shm_mapped, &shm_held);
  m = snprintf(line, sizeof line, "shared_requests %llu\nshared_mapped %llu\nshared_held %llu\n",
               (unsigned long long)shm_req, (unsigned long long)shm_mapped, (unsigned long long)shm_held);
  ps__wbuf_bytes(&w, line, (size_t)m);
  size_t fb, fb_busy;
  ps__srv_fwd_buf_counts(s, &fb, &fb_busy);
  m = snprintf(line, sizeof line, "forward_buffers %zu\nforward_buffers_busy %zu\n", fb, fb_busy);
  ps__wbuf_bytes(&w, line, (size_t)m);
  hist_line(&w, "push_staleness", sh->push_stale, sh->push_stale_max);
  hist_line(&w, "pull_staleness", sh->pull_stale, sh->pull_stale_max);
  if (ps__fault_on()) { /* the fault rules' counters (common/fault.h) */
    char f[1024];
    size_t n = ps__fault_report(f, sizeof f);
    ps__wbuf_bytes(&w, f, n < sizeof f ? n : sizeof f - 1);
  }
  ps__frame_hdr r = {.type = PS_MSG_STATS | PS_FRAME_REPLY, .req_id = h->req_id};
  if (!w.oom) ps__conn_send_ctrl(c, &r, w.data, w.len);
  ps__wbuf_free(&w);
}

/* ------------------------------------------------------------------ metrics */

#define METRICS_MS 1000u
#define IO_CLOSED_MAX 4096 /* peers remembered after their connections closed */

void ps__srv_metrics_accept(ps__server *s, ps__conn *c) {
  srv_metlink *l = ps__calloc(1, sizeof *l);
  if (!l) return; /* not counted by peer */
  l->conn = c;
  l->next = s->links;
  if (s->links) s->links->prev = l;
  s->links = l;
  c->udata = l;
}

static srv_io *io_of(ps__server *s, uint32_t node) {
  for (size_t i = 0; i < s->nio_closed; i++)
    if (s->io_closed[i].node == node) return &s->io_closed[i];
  if (s->nio_closed >= IO_CLOSED_MAX) return &s->io_closed[0]; /* folded into the first */
  srv_io *n = ps__realloc(s->io_closed, (s->nio_closed + 1) * sizeof *n);
  if (!n) return NULL;
  s->io_closed = n;
  n[s->nio_closed] = (srv_io){.node = node};
  return &n[s->nio_closed++];
}

void ps__srv_metrics_close(ps__server *s, ps__conn *c) {
  srv_metlink *l = c->udata;
  if (!l || l->conn != c) return;
  srv_io *io = io_of(s, l->node);
  if (io) {
    io->bytes_in += c->bytes_in + l->mem_in;
    io->bytes_out += c->bytes_out + l->mem_out;
    io->frames_in += c->frames_in;
    io->frames_out += c->frames_out;
  }
  if (l->prev)
    l->prev->next = l->next;
  else
    s->links = l->next;
  if (l->next) l->next->prev = l->prev;
  c->udata = NULL;
  free(l);
}

void ps__srv_metrics_free(ps__server *s) {
  while (s->links) {
    srv_metlink *l = s->links;
    s->links = l->next;
    free(l);
  }
  ps__http_stop(s->http);
  s->http = NULL;
  free(s->io_closed);
  free(s->table_in);
  free(s->table_out);
}

static void fam(ps__wbuf *w, const char *name, const char *type, const char *help) { ps__prom_family(w, name, type, help); }

static void table_label(char *l, size_t cap, const ps__table *t) {
  l[0] = '\0';
  ps__prom_label(l, cap, "table", t->decl.name);
}

/* One counter or gauge family with a sample per table. */
typedef uint64_t (*table_fn)(const ps__server *s, const ps__table *t);
static void per_table(ps__wbuf *w, const ps__server *s, const char *name, const char *type, const char *help,
                      table_fn fn) {
  char l[PS__PROM_LABELS_MAX];
  fam(w, name, type, help);
  for (size_t i = 0; i < s->sh->ntables; i++) {
    const ps__table *t = s->sh->tables[i];
    if (!t) continue;
    table_label(l, sizeof l, t);
    ps__prom_u64(w, name, l, fn(s, t));
  }
}

static uint64_t t_pushes(const ps__server *s, const ps__table *t) { (void)s; return t->pushes; }
static uint64_t t_pulls(const ps__server *s, const ps__table *t) { (void)s; return t->pulls; }
static uint64_t t_applied(const ps__server *s, const ps__table *t) { (void)s; return t->applied; }
static uint64_t t_dropped(const ps__server *s, const ps__table *t) { (void)s; return t->dropped; }
static uint64_t t_rejected(const ps__server *s, const ps__table *t) { (void)s; return t->rejected; }
static uint64_t t_rows(const ps__server *s, const ps__table *t) { (void)s; return ps__rowmap_count(t->params); }
static uint64_t t_param_bytes(const ps__server *s, const ps__table *t) {
  (void)s;
  return (uint64_t)ps__rowmap_count(t->params) * t->spec.width * 4u;
}
static uint64_t t_opt_bytes(const ps__server *s, const ps__table *t) {
  (void)s;
  return (uint64_t)ps__rowmap_count(t->params) * t->spec.width * ps__optim_nstate(t->spec.opt.kind) * 4u;
}
static uint64_t t_store_bytes(const ps__server *s, const ps__table *t) { (void)s; return ps__rowmap_bytes(t->params); }
static uint64_t t_in_bytes(const ps__server *s, const ps__table *t) {
  return s->table_in && t->id < PS__MAX_TABLES ? s->table_in[t->id] : 0;
}
static uint64_t t_out_bytes(const ps__server *s, const ps__table *t) {
  return s->table_out && t->id < PS__MAX_TABLES ? s->table_out[t->id] : 0;
}

/* The staleness histogram (counts by clocks 0..PS__STALE_BUCKETS-1) in coarse buckets. */
static void staleness(ps__wbuf *w, const char *name, const char *help, const uint64_t *hist) {
  static const double bounds[] = {0, 1, 2, 4, 8, 16, 32};
  uint64_t counts[8] = {0};
  double sum = 0;
  for (int i = 0; i < PS__STALE_BUCKETS; i++) {
    size_t b = 0;
    while (b < 7 && (double)i > bounds[b]) b++;
    counts[b] += hist[i];
    sum += (double)i * (double)hist[i];
  }
  fam(w, name, "histogram", help);
  ps__prom_hist_counts(w, name, NULL, bounds, counts, 8, sum);
}

/* Bytes and frames by peer: the live connections' counters plus the closed ones'. */
typedef struct peer_sum {
  uint32_t node;
  uint64_t v[4];
} peer_sum;

static void per_peer(ps__wbuf *w, ps__server *s) {
  size_t cap = s->nio_closed + 8, n = 0;
  peer_sum *p = ps__calloc(cap, sizeof *p);
  if (!p) return;
  for (size_t i = 0; i < s->nio_closed; i++) {
    srv_io *io = &s->io_closed[i];
    p[n++] = (peer_sum){io->node, {io->bytes_in, io->bytes_out, io->frames_in, io->frames_out}};
  }
  for (srv_metlink *l = s->links; l; l = l->next) {
    size_t j = 0;
    while (j < n && p[j].node != l->node) j++;
    if (j == n) {
      if (n == cap) {
        peer_sum *q = ps__realloc(p, (cap *= 2) * sizeof *q);
        if (!q) break;
        p = q;
      }
      p[n++] = (peer_sum){.node = l->node};
    }
    p[j].v[0] += l->conn->bytes_in + l->mem_in;
    p[j].v[1] += l->conn->bytes_out + l->mem_out;
    p[j].v[2] += l->conn->frames_in;
    p[j].v[3] += l->conn->frames_out;
  }
  static const char *const names[4] = {"ps_server_received_bytes_total", "ps_server_sent_bytes_total",
                                       "ps_server_received_frames_total", "ps_server_sent_frames_total"};
  static const char *const helps[4] = {
      "Bytes received from each peer (a worker, or a server forwarding to this one; peer 0: before its first frame), "
      "values read from a same-host worker's memory included.",
      "Bytes sent to each peer, values written into a same-host worker's memory included.", "Frames received from each peer.", "Frames sent to each peer."};
  for (int k = 0; k < 4; k++) {
    fam(w, names[k], "counter", helps[k]);
    for (size_t j = 0; j < n; j++) {
      char l[64], id[16];
      l[0] = '\0';
      snprintf(id, sizeof id, "%u", p[j].node);
      ps__prom_label(l, sizeof l, "peer", id);
      ps__prom_u64(w, names[k], l, p[j].v[k]);
    }
  }
  free(p);
}

static void render(ps__server *s, ps__wbuf *w) {
  ps__shard *sh = s->sh;
  char l[PS__PROM_LABELS_MAX], v[32];
  fam(w, "ps_server_info", "gauge", "This server: its node id, rank, process and /metrics address (always 1).");
  l[0] = '\0';
  snprintf(v, sizeof v, "%u", s->id);
  ps__prom_label(l, sizeof l, "server", v);
  snprintf(v, sizeof v, "%u", s->rank);
  ps__prom_label(l, sizeof l, "rank", v);
  snprintf(v, sizeof v, "%d", s->pid);
  ps__prom_label(l, sizeof l, "pid", v);
  if (s->http_addr[0]) ps__prom_label(l, sizeof l, "http", s->http_addr); /* a colocated server's is found here */
  ps__prom_u64(w, "ps_server_info", l, 1);
  fam(w, "ps_metrics_counting", "gauge", "1 while the request path counts (metrics=on), 0 when it does not: flat latencies and bytes.");
  ps__prom_u64(w, "ps_metrics_counting", NULL, (uint64_t)s->count);
  fam(w, "ps_server_push_seconds", "histogram", "Time a push (or a replica's forward) spent in the server's handler.");
  ps__prom_hist(w, "ps_server_push_seconds", NULL, &s->lat_push);
  fam(w, "ps_server_pull_seconds", "histogram",
      "Time a pull spent in the server's handler (a pull waiting for its clock is answered later, outside it).");
  ps__prom_hist(w, "ps_server_pull_seconds", NULL, &s->lat_pull);
  per_table(w, s, "ps_server_push_requests_total", "counter", "Push requests taken, by table.", t_pushes);
  per_table(w, s, "ps_server_pull_requests_total", "counter", "Pull requests taken, by table.", t_pulls);
  per_table(w, s, "ps_server_applied_pushes_total", "counter", "Pushes applied to the rows, by table.", t_applied);
  per_table(w, s, "ps_server_dropped_pushes_total", "counter", "Pushes acknowledged but not applied (late under sync:M).",
            t_dropped);
  per_table(w, s, "ps_server_rejected_pushes_total", "counter", "Pushes refused (clock, non-finite values, memory).",
            t_rejected);
  per_table(w, s, "ps_server_table_received_bytes_total", "counter", "Payload bytes of push and pull requests, by table.",
            t_in_bytes);
  per_table(w, s, "ps_server_table_sent_bytes_total", "counter", "Bytes of pull answers queued, by table.", t_out_bytes);
  per_table(w, s, "ps_server_table_rows", "gauge", "Rows held, by table.", t_rows);
  per_table(w, s, "ps_server_table_parameter_bytes", "gauge", "Bytes of parameter values held, by table.", t_param_bytes);
  per_table(w, s, "ps_server_table_optimizer_bytes", "gauge", "Bytes of optimiser state held (e.g. Adam's moments), by table.",
            t_opt_bytes);
  per_table(w, s, "ps_server_table_store_bytes", "gauge", "Bytes the table's store takes, index and slack included.",
            t_store_bytes);
  per_peer(w, s);
  size_t pending = 0;
  for (pending_pull *p = s->pulls; p; p = p->next) pending++;
  uint64_t sendq = 0;
  for (srv_metlink *k = s->links; k; k = k->next) sendq += k->conn->write_queue_bytes;
  fam(w, "ps_server_pending_pulls", "gauge", "Pulls waiting for their table to reach their clock.");
  ps__prom_u64(w, "ps_server_pending_pulls", NULL, pending);
  fam(w, "ps_server_pending_applies", "gauge", "Tables with an update being applied in steps between requests.");
  ps__prom_u64(w, "ps_server_pending_applies", NULL, sh->npending);
  fam(w, "ps_server_send_queue_bytes", "gauge", "Bytes queued to be sent to the peers.");
  ps__prom_u64(w, "ps_server_send_queue_bytes", NULL, sendq);
  fam(w, "ps_server_partial_frame_bytes", "gauge", "Bytes of frames still arriving (the frame budget in use).");
  ps__prom_u64(w, "ps_server_partial_frame_bytes", NULL, s->fb.used);
  fam(w, "ps_server_memory_used_bytes", "gauge", "Bytes of table rows counted against the memory budget.");
  ps__prom_u64(w, "ps_server_memory_used_bytes", NULL, sh->mem_used);
  fam(w, "ps_server_memory_budget_bytes", "gauge", "The memory budget of table rows (0: none).");
  ps__prom_u64(w, "ps_server_memory_budget_bytes", NULL, sh->mem_limit);
  fam(w, "ps_process_resident_memory_bytes", "gauge", "Resident memory of the process.");
  ps__prom_u64(w, "ps_process_resident_memory_bytes", NULL, ps__rss_bytes());
  int64_t minc, maxc;
  ps__shard_live_clocks(sh, &minc, &maxc);
  fam(w, "ps_server_min_clock", "gauge", "The slowest live worker's clock, as this server knows it.");
  ps__prom_f64(w, "ps_server_min_clock", NULL, (double)minc);
  fam(w, "ps_server_max_clock", "gauge", "The fastest live worker's clock, as this server knows it.");
  ps__prom_f64(w, "ps_server_max_clock", NULL, (double)maxc);
  staleness(w, "ps_server_push_staleness_clocks", "Applied async/ssp pushes by staleness (clocks behind the table).",
            sh->push_stale);
  staleness(w, "ps_server_pull_staleness_clocks", "Pulls by staleness (their clock minus the slowest live worker's).",
            sh->pull_stale);
  fam(w, "ps_server_duplicate_pushes_total", "counter", "Pushes received again (a retry) and not applied twice.");
  ps__prom_u64(w, "ps_server_duplicate_pushes_total", NULL, sh->once.dups);
  fam(w, "ps_server_refused_frames_total", "counter", "Frames refused because the frame budget was full.");
  ps__prom_u64(w, "ps_server_refused_frames_total", NULL, s->fb.refused);
  fam(w, "ps_server_expired_frames_total", "counter", "Frames that did not arrive whole within the frame deadline.");
  ps__prom_u64(w, "ps_server_expired_frames_total", NULL, s->fb.expired);
  fam(w, "ps_server_memory_refused_total", "counter", "Requests refused by the memory budget.");
  ps__prom_u64(w, "ps_server_memory_refused_total", NULL, sh->mem_refused);
  fam(w, "ps_server_forwards_total", "counter", "Pushes forwarded down a replica chain.");
  ps__prom_u64(w, "ps_server_forwards_total", NULL, s->forwards);
  fam(w, "ps_server_forward_bytes_total", "counter", "Bytes of the frames forwarded down the replica chains.");
  ps__prom_u64(w, "ps_server_forward_bytes_total", NULL, s->forward_bytes);
  uint64_t nf, bf, age;
  ps__srv_repl_lag(s, &nf, &bf, &age);
  fam(w, "ps_server_replication_inflight_forwards", "gauge", "Forwards sent down the chains and not answered yet.");
  ps__prom_u64(w, "ps_server_replication_inflight_forwards", NULL, nf);
  fam(w, "ps_server_replication_inflight_bytes", "gauge", "Bytes of the forwards not answered yet.");
  ps__prom_u64(w, "ps_server_replication_inflight_bytes", NULL, bf);
  fam(w, "ps_server_replication_lag_seconds", "gauge",
      "How long the oldest forward not answered yet has waited for the next copy (0: none waits).");
  ps__prom_f64(w, "ps_server_replication_lag_seconds", NULL, (double)age / 1e3);
}

void ps__srv_metrics_tick(ps__server *s) {
  ps__wbuf w;
  ps__wbuf_init(&w);
  render(s, &w);
  if (!w.oom) {
    if (s->http && ps__http_set(s->http, "/metrics", PS__PROM_CTYPE, w.data, w.len, 0))
      ps__log(PS_LOG_WARN, "metrics not published: %s", ps_errmsg());
    if (s->agent_inited && s->agent.conn && s->agent.registered) {
      ps__frame_hdr h = {.type = PS_MSG_NODE_METRICS, .sender = s->id};
      ps__conn_send_ctrl(s->agent.conn, &h, w.data, w.len);
    }
  }
  ps__wbuf_free(&w);
}

static void metrics_timeout(uv_timer_t *t) { ps__srv_metrics_tick(t->data); }

int ps__srv_metrics_start(ps__server *s) {
  s->count = s->o.metrics > 0;
  if (!s->o.metrics) {
    const char *v = getenv("PSHARD_METRICS");
    int on = v && *v ? ps__parse_switch(v) : 1;
    if (on < 0) return ps__fail(PS_ERR_CONFIG, "bad PSHARD_METRICS '%s' (on or off)", v);
    s->count = on;
  }
  s->table_in = ps__calloc(PS__MAX_TABLES, sizeof *s->table_in); /* without them, no bytes by table */
  s->table_out = ps__calloc(PS__MAX_TABLES, sizeof *s->table_out);
  if (s->o.http) {
    ps__http_opts o = {.host = s->o.http_host ? s->o.http_host : s->o.host, .port = s->o.http_port};
    int rc = ps__http_start(&o, &s->http);
    if (rc) return rc;
    snprintf(s->http_addr, sizeof s->http_addr, "%s:%d", o.host, ps__server_http_port(s)); /* o.host: the caller's */
    ps__http_set(s->http, "/", "text/plain; charset=utf-8", "pshard server: the metrics are on /metrics\n",
                  strlen("pshard server: the metrics are on /metrics\n"), 1);
  }
  uv_timer_init(&s->loop, &s->metrics_timer);
  s->metrics_timer.data = s;
  uv_timer_start(&s->metrics_timer, metrics_timeout, 0, METRICS_MS);
  s->metrics_on = 1;
  return 0;
}
