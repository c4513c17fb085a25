/*
 * stats.c - the STATS request: a server's tables and counters as text lines
 * (protocol.md lists the fields; `pshard run --stats-out` and ps_server_stats read them).
 */
#include <stdio.h>

#include "common/common.h"
#include "common/fault.h"
#include "proto/codec.h"
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
                     "step=%llu version=%lld dropped=%llu rejected=%llu lr=%.9g global_batch=%.0f nonfinite=%llu\n",
                     i, t->decl.name, ps__table_mode_name(t), t->spec.mode_param, n, ps__rowmap_bytes(t->params),
                     (unsigned long long)t->pushes, (unsigned long long)t->pulls, (unsigned long long)t->applied,
                     (unsigned long long)t->step, (long long)t->version, (unsigned long long)t->dropped,
                     (unsigned long long)t->rejected, (double)t->last_lr, t->last_batch,
                     (unsigned long long)t->nonfinite);
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
  m = snprintf(line, sizeof line, "replicas %u\nforwards %llu\nforward_bytes %llu\nforwards_refused %llu\nfenced %d\ncatchups %llu\n",
               s->replicas ? s->replicas : 1, (unsigned long long)s->forwards, (unsigned long long)s->forward_bytes,
               (unsigned long long)s->forwards_refused, s->fenced, (unsigned long long)s->catchups);
  ps__wbuf_bytes(&w, line, (size_t)m);
  ps__srv_repair_stats(s, line, sizeof line);
  ps__wbuf_bytes(&w, line, strlen(line));
  m = snprintf(line, sizeof line, "peer_mem_pushes %llu\npeer_mem_pulls %llu\nfused_pulls %llu\n",
               (unsigned long long)s->pm_pushes, (unsigned long long)s->pm_pulls, (unsigned long long)s->fused_pulls);
  ps__wbuf_bytes(&w, line, (size_t)m);
  uint64_t shm_req, shm_mapped, shm_held;
  ps__shm_counts(s->shm, &shm_req, &shm_mapped, &shm_held);
  m = snprintf(line, sizeof line, "shared_requests %llu\nshared_mapped %llu\nshared_held %llu\n",
               (unsigned long long)shm_req, (unsigned long long)shm_mapped, (unsigned long long)shm_held);
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
