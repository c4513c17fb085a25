/*
 * control.c - control calls: table declaration, clock, checkpoints, barrier, metrics,
 * data-partition tasks and statistics.
 *
 * Runs on callers' threads. Each call is a small request to the scheduler or to every
 * server (ps__ctrl_req), or a fire-and-forget frame (clock, metric, the checkpoints of
 * checkpoint_every) that goes on lent links when they are idle and through the loop
 * otherwise.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "client/client_int.h"

/* ---- control requests */

/* One request with a single control part to `target` carrying body (copied). */
ps_req *ps__ctrl_req(ps_ctx *ctx, uint32_t target, uint8_t type, const void *body, size_t len, uint64_t deadline) {
  ps_req *r = ps__req_new(ctx, 1, 1);
  if (!r) return NULL;
  if (len) {
    r->own_keys = ps__malloc(len);
    if (!r->own_keys) {
      ps__req_destroy(r);
      return NULL;
    }
    memcpy(r->own_keys, body, len);
  }
  ps__part_init(ctx, r, 0, target, type, 0, deadline);
  r->kind = 2;
  r->bufs[0] = uv_buf_init(r->own_keys, (unsigned)len);
  r->parts[0].send = r->bufs;
  r->parts[0].nsend = len ? 1 : 0;
  return r;
}

/* Long because it is two round trips in order (declare at the scheduler, create on
 * every server) and then the local table record, each step with its own errors. */
int ps_table_declare(ps_ctx *ctx, const char *name, ps_table_kind kind, uint64_t size, const char *options,
                     uint32_t *id_out) {
  ps__declare d;
  ps__table_spec spec;
  char err[256];
  ps__wbuf w;
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  if (!name || !*name || strlen(name) >= PS_NAME_MAX) return ps__fail(PS_ERR_INVALID, "table name must be 1..%d bytes", PS_NAME_MAX - 1);
  if (options && strlen(options) >= PS_OPTS_MAX) return ps__fail(PS_ERR_CONFIG, "table options longer than %d bytes", PS_OPTS_MAX - 1);
  /* A table without its own mode= gets the job's (config key `mode`). */
  char opts[PS_OPTS_MAX];
  const char *o = options ? options : "";
  int has_mode = !strncmp(o, "mode=", 5) || strstr(o, " mode=") || strstr(o, "\tmode=");
  if (!has_mode && ctx->mode[0]) {
    if ((size_t)snprintf(opts, sizeof opts, "%s%smode=%s", o, *o ? " " : "", ctx->mode) >= sizeof opts)
      return ps__fail(PS_ERR_CONFIG, "table options too long");
  } else {
    snprintf(opts, sizeof opts, "%s", o);
  }
  rc = ps__table_spec_parse(&spec, name, (int)kind, size, opts, err, sizeof err);
  if (rc) return ps__fail(rc, "table '%s': %s", name, err);
  memset(&d, 0, sizeof d);
  d.kind = (uint8_t)kind;
  d.size = size;
  snprintf(d.name, sizeof d.name, "%s", name);
  snprintf(d.options, sizeof d.options, "%s", opts);
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &d);
  if (w.oom) return ps__fail(PS_ERR_NOMEM, "out of memory");
  ps_req *r = ps__ctrl_req(ctx, SCHED_LINK, PS_MSG_DECLARE, w.data, w.len, ps__deadline_for(ctx, -1));
  ps__wbuf_free(&w);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  rc = ps__req_post(ctx, r);
  if (rc) {
    ps__req_destroy(r);
    return rc;
  }
  rc = ps__req_wait_call(r, -1);
  uint32_t id = r->parts[0].reply_table;
  char msg[256];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ps_req_free(r);
  if (rc) return ps__fail(rc, "%s", msg);
  if (id == 0 || id >= 65536) return ps__fail(PS_ERR_PROTO, "scheduler returned a bad table id %u", id);

  /* Create it on every server (idempotent). */
  d.id = id;
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &d);
  pthread_mutex_lock(&ctx->mu);
  ps__ring *ring = ctx->ring;
  pthread_mutex_unlock(&ctx->mu);
  size_t S = ring ? ps__ring_size(ring) : 0, n = 0;
  /* Under replicas, not on a server that has left the job: its replacement takes the
   * table from the servers it copies its rows from (server/repair.c). */
  uint32_t *to = ps__malloc((S ? S : 1) * sizeof *to);
  int repl = __atomic_load_n(&ctx->replicas, __ATOMIC_RELAXED) > 1;
  pthread_mutex_lock(&ctx->lend_mu);
  for (size_t s = 0; to && s < S; s++) {
    uint32_t id = ps__ring_server_at(ring, s);
    peer *l = repl ? ps__link_find(ctx, id) : NULL;
    if (!repl || !l || l->alive) to[n++] = id;
  }
  pthread_mutex_unlock(&ctx->lend_mu);
  if (to && S && !n) {
    free(to);
    ps__wbuf_free(&w);
    return ps__fail(PS_ERR_UNAVAILABLE, "every server has left the job: table '%s' cannot be created", name);
  }
  r = to ? ps__req_new(ctx, (unsigned)n, 1) : NULL;
  if (w.oom || !r || !(r->own_keys = ps__malloc(w.len))) {
    free(to);
    ps__wbuf_free(&w);
    if (r) ps__req_destroy(r);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  memcpy(r->own_keys, w.data, w.len);
  r->bufs[0] = uv_buf_init(r->own_keys, (unsigned)w.len);
  ps__wbuf_free(&w);
  for (size_t s = 0; s < n; s++) {
    ps__part_init(ctx, r, (unsigned)s, to[s], PS_MSG_CREATE, id, ps__deadline_for(ctx, -1));
    r->parts[s].send = r->bufs;
    r->parts[s].nsend = 1;
  }
  free(to);
  rc = ps__req_run(ctx, r, -1);
  if (rc) return rc;
  pthread_mutex_lock(&ctx->mu);
  if (id >= ctx->ntables) {
    table_info *nt = ps__realloc(ctx->tables, (id + 1u) * sizeof *nt);
    if (!nt) {
      pthread_mutex_unlock(&ctx->mu);
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
    memset(nt + ctx->ntables, 0, (id + 1u - ctx->ntables) * sizeof *nt);
    ctx->tables = nt;
    ctx->ntables = id + 1u;
  }
  ctx->tables[id].kind = (int)kind;
  ctx->tables[id].size = size;
  ctx->tables[id].width = spec.width;
  ctx->tables[id].nrows = spec.nrows;
  ctx->tables[id].update = spec.update;
  ctx->tables[id].push_codec = spec.push_codec;
  ctx->tables[id].pull_codec = spec.pull_codec;
  if ((spec.push_codec.kind || spec.pull_codec.kind) && !ctx->tables[id].cx &&
      !(ctx->tables[id].cx = ps__cx_table_new(&spec))) {
    ctx->tables[id].kind = 0;
    pthread_mutex_unlock(&ctx->mu);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  if (!ctx->tables[id].tc) {
    if (!(ctx->tables[id].tc = ps__calloc(1, sizeof *ctx->tables[id].tc))) {
      ctx->tables[id].kind = 0;
      pthread_mutex_unlock(&ctx->mu);
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
    snprintf(ctx->tables[id].tc->name, sizeof ctx->tables[id].tc->name, "%s", name);
  }
  ctx->tables[id].sync = spec.mode == PS__MODE_SYNC || spec.mode == PS__MODE_SYNC_M;
  ctx->tables[id].every = spec.every ? spec.every : 1;
  pthread_mutex_unlock(&ctx->mu);
  if (id_out) *id_out = id;
  return 0;
}

static int post_fire(ps_ctx *ctx, uint32_t target, const ps__frame_hdr *h, const void *body, size_t len) {
  fire *f = ps__malloc(sizeof *f + len);
  if (!f) return ps__fail(PS_ERR_NOMEM, "out of memory");
  f->ctx = ctx;
  f->target = target;
  f->h = *h;
  f->len = len;
  if (len) memcpy(f->body, body, len);
  __atomic_add_fetch(&ctx->outstanding, 1, __ATOMIC_ACQ_REL);
  if (ps__mailbox_post(ctx->mail, ps__mail_fire, f)) {
    __atomic_sub_fetch(&ctx->outstanding, 1, __ATOMIC_RELEASE);
    free(f);
    return ps__fail(PS_ERR_CLOSED, "context is closed");
  }
  return 0;
}

int ps_clock(ps_ctx *ctx) {
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  int64_t c = __atomic_add_fetch(&ctx->clock, 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&ctx->examples, __atomic_exchange_n(&ctx->clock_batch, 0, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
  ps__frame_hdr h = {.type = PS_MSG_CLOCK, .clock = c};
  if (!ps__direct_fire(ctx, &h) && (rc = post_fire(ctx, 0xffffffffu, &h, NULL, 0))) return rc;
  /* checkpoint_every: rank 0 asks for a checkpoint cut at every N-th clock and goes on
   * (req_id 0: no answer). A failed one is the scheduler's to log; this clock stands. */
  uint64_t every = ctx->ckpt_every, now = ctx->ckpt_every_ms ? ps__now_ms() : 0;
  int due = every ? c > 0 && (uint64_t)c % every == 0 : ctx->ckpt_every_ms && now - ctx->ckpt_last_ms >= ctx->ckpt_every_ms;
  if (due && ps_ctx_rank(ctx) == 0) {
    ctx->ckpt_last_ms = now;
    ps__frame_hdr ck = {.type = PS_MSG_CHECKPOINT, .clock = c};
    if (post_fire(ctx, SCHED_LINK, &ck, NULL, 0))
      ps__log(PS_LOG_WARN, "cannot ask for the checkpoint at clock %lld: %s", (long long)c, ps_errmsg());
  }
  return 0;
}

/* A CHECKPOINT to the scheduler, cut at this worker's clock; the scheduler answers once
 * the checkpoint's manifest is written, with its id and directory. A named directory
 * travels as the body, made absolute here: the scheduler's working directory need not
 * be the caller's. */
int ps_checkpoint_to(ps_ctx *ctx, const char *dir, uint64_t *id, int timeout_ms) {
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  char path[PS_CKPT_DIR_MAX];
  ps__wbuf req;
  ps__wbuf_init(&req);
  if (dir) {
    size_t n = strlen(dir);
    char cwd[PS_CKPT_DIR_MAX] = "";
    if (n == 0) return ps__fail(PS_ERR_INVALID, "checkpoint directory is empty");
    if (dir[0] != '/' && !getcwd(cwd, sizeof cwd))
      return ps__fail(PS_ERR_INVALID, "checkpoint directory %s: cannot get the working directory: %s", dir,
                      strerror(errno));
    /* The scheduler appends /ckpt-<id>: leave room for it. */
    if ((size_t)snprintf(path, sizeof path, "%s%s%s", cwd, cwd[0] ? "/" : "", dir) + 32 >= sizeof path)
      return ps__fail(PS_ERR_INVALID, "checkpoint directory path too long (at most %d bytes)", PS_CKPT_DIR_MAX - 33);
    ps__wbuf_str(&req, path);
    if (req.oom) {
      ps__wbuf_free(&req);
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
  }
  char body[sizeof(ps__ckpt_info) + 64];
  ps_req *r = ps__ctrl_req(ctx, SCHED_LINK, PS_MSG_CHECKPOINT, req.data, req.len, ps__deadline_for(ctx, timeout_ms));
  ps__wbuf_free(&req);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  int64_t clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED);
  r->parts[0].hdr.clock = clock;
  r->parts[0].stats_buf = body;
  r->parts[0].stats_cap = sizeof body;
  rc = ps__req_post(ctx, r);
  if (rc) {
    ps__req_destroy(r);
    return rc;
  }
  rc = ps__req_wait_call(r, timeout_ms);
  size_t len = r->parts[0].stats_len;
  char msg[256];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ps_req_free(r);
  if (rc) return ps__fail(rc, "checkpoint at clock %lld: %s", (long long)clock, msg);
  ps__ckpt_info info;
  if (len >= sizeof body || ps__ckpt_info_decode(body, len, &info))
    return ps__fail(PS_ERR_PROTO, "checkpoint at clock %lld: malformed answer from the scheduler", (long long)clock);
  if (id) *id = info.id;
  return 0;
}

int ps_checkpoint(ps_ctx *ctx, uint64_t *id, int timeout_ms) { return ps_checkpoint_to(ctx, NULL, id, timeout_ms); }

int ps_barrier(ps_ctx *ctx, int timeout_ms) {
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  ps_req *r = ps__ctrl_req(ctx, SCHED_LINK, PS_MSG_BARRIER, NULL, 0, ps__deadline_for(ctx, timeout_ms));
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  /* The sequence advances only when a barrier is passed: a call after a failed one
   * (timeout) enters the same barrier again. The scheduler may have completed it in
   * the meantime; it then answers at once. */
  int64_t seq = __atomic_load_n(&ctx->barrier_seq, __ATOMIC_RELAXED) + 1;
  r->parts[0].hdr.clock = seq;
  rc = ps__req_run(ctx, r, timeout_ms);
  if (rc == 0) __atomic_store_n(&ctx->barrier_seq, seq, __ATOMIC_RELAXED);
  return rc;
}

int ps_metric(ps_ctx *ctx, const char *name, double value) {
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  if (!name || !*name || strlen(name) >= 64) return ps__fail(PS_ERR_INVALID, "metric name must be 1..63 bytes");
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__wbuf_str(&w, name);
  ps__wbuf_f64(&w, value);
  ps__frame_hdr h = {.type = PS_MSG_METRIC, .clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED)};
  rc = w.oom ? ps__fail(PS_ERR_NOMEM, "out of memory") : post_fire(ctx, SCHED_LINK, &h, w.data, w.len);
  ps__wbuf_free(&w);
  return rc;
}

/* ---- data-partition tasks */

int ps_tasks_init(ps_ctx *ctx, uint32_t partitions, uint32_t epochs) {
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  if (partitions == 0 || epochs == 0) return ps__fail(PS_ERR_INVALID, "tasks need at least one partition and one epoch");
  ps_req *r = ps__ctrl_req(ctx, SCHED_LINK, PS_MSG_TASK_INIT, NULL, 0, ps__deadline_for(ctx, -1));
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  r->parts[0].hdr.table = partitions;
  r->parts[0].hdr.batch = epochs;
  return ps__req_run(ctx, r, -1);
}

int ps_task_next(ps_ctx *ctx, ps_task *task, int timeout_ms) {
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  if (!task) return ps__fail(PS_ERR_INVALID, "task is NULL");
  uint64_t tmo = timeout_ms < 0 ? ctx->timeout_ms : (uint64_t)timeout_ms;
  if (tmo > UINT32_MAX) tmo = UINT32_MAX;
  /* The scheduler answers TIMEOUT itself after tmo; our deadline comes later. */
  ps_req *r = ps__ctrl_req(ctx, SCHED_LINK, PS_MSG_TASK_NEXT, NULL, 0, ps__now_ms() + tmo + 2000);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  r->parts[0].hdr.batch = (uint32_t)tmo;
  rc = ps__req_post(ctx, r);
  if (rc) {
    ps__req_destroy(r);
    return rc;
  }
  rc = ps__req_wait_call(r, (int)(tmo + 2000 > INT32_MAX ? INT32_MAX : tmo + 2000));
  char msg[256];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  if (rc == 0) {
    task->partition = r->parts[0].reply_table;
    task->epoch = (uint32_t)r->parts[0].reply_clock;
  }
  ps_req_free(r);
  if (rc) return ps__fail(rc, "%s", rc == PS_ERR_DONE ? "every epoch is finished" : msg);
  return 0;
}

int ps_task_done(ps_ctx *ctx, const ps_task *task) {
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  if (!task) return ps__fail(PS_ERR_INVALID, "task is NULL");
  ps_req *r = ps__ctrl_req(ctx, SCHED_LINK, PS_MSG_TASK_DONE, NULL, 0, ps__deadline_for(ctx, -1));
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  r->parts[0].hdr.table = task->partition;
  r->parts[0].hdr.clock = task->epoch;
  return ps__req_run(ctx, r, -1);
}

/* ---- statistics */

/* Per-table statistics; NAME:T for table T alone, NAME the sum over the tables.
 * push_raw_bytes, push_wire_bytes, pull_raw_bytes, pull_wire_bytes: value bytes of the
 * tables with a codec, as f32 and as encoded. table_pushed_bytes, table_pulled_bytes,
 * table_sent_frames, table_received_frames: a table's traffic (ps__tcount). 1 if name
 * is one of them (*value set), 0 if not, -1 (with a message) for an unknown table. */
static double tcount_of(const ps__tcount *tc, int k) {
  if (!tc) return 0;
  const uint64_t *f[4] = {&tc->pushed_bytes, &tc->pulled_bytes, &tc->sent, &tc->received};
  return (double)__atomic_load_n(f[k], __ATOMIC_RELAXED);
}

static int codec_stat(ps_ctx *c, const char *name, double *value, int *err) {
  static const char *const names[] = {"push_raw_bytes",     "push_wire_bytes",    "pull_raw_bytes",
                                      "pull_wire_bytes",    "table_pushed_bytes", "table_pulled_bytes",
                                      "table_sent_frames",  "table_received_frames"};
  char base[32];
  const char *colon = strchr(name, ':');
  size_t n = colon ? (size_t)(colon - name) : strlen(name);
  int known = -1;
  for (int i = 0; i < 8 && n < sizeof base; i++)
    if (strlen(names[i]) == n && !memcmp(names[i], name, n)) known = i;
  if (known < 0) return 0;
  memcpy(base, name, n);
  base[n] = '\0';
  uint64_t only = 0;
  if (colon && (ps__parse_u64(colon + 1, &only) || only == 0)) {
    *err = ps__fail(PS_ERR_INVALID, "bad table in statistic '%s': expected NAME:ID", name);
    return -1;
  }
  double sum = 0, v;
  int found = !colon;
  pthread_mutex_lock(&c->mu);
  for (size_t i = 1; i < c->ntables; i++) {
    if (colon && i != only) continue;
    if (colon && c->tables[i].kind) found = 1;
    if (known >= 4) sum += tcount_of(c->tables[i].tc, known - 4);
    else if (c->tables[i].cx && ps__cx_stat(c->tables[i].cx, base, &v) == 0) sum += v;
  }
  pthread_mutex_unlock(&c->mu);
  if (!found) {
    *err = ps__fail(PS_ERR_NO_TABLE, "statistic '%s': no table %llu", name, (unsigned long long)only);
    return -1;
  }
  *value = sum;
  return 1;
}

int ps_ctx_stat(const ps_ctx *ctx, const char *name, double *value) {
  if (!ctx || !name || !value) return ps__fail(PS_ERR_INVALID, "NULL argument");
  ps_ctx *c = (ps_ctx *)ctx;
  double up = (double)(ps__now_ns() - c->opened_ns) * 1e-9;
  double wp = (double)__atomic_load_n(&c->wait_ns[0], __ATOMIC_RELAXED) * 1e-9;
  double ws = (double)__atomic_load_n(&c->wait_ns[1], __ATOMIC_RELAXED) * 1e-9;
  double wo = (double)__atomic_load_n(&c->wait_ns[2], __ATOMIC_RELAXED) * 1e-9;
  if (!strcmp(name, "uptime_s")) *value = up;
  else if (!strcmp(name, "pull_wait_s")) *value = wp;
  else if (!strcmp(name, "push_wait_s")) *value = ws;
  else if (!strcmp(name, "other_wait_s")) *value = wo;
  else if (!strcmp(name, "compute_s")) *value = up - wp - ws - wo;
  else if (!strcmp(name, "pulls")) *value = (double)__atomic_load_n(&c->nreq[0], __ATOMIC_RELAXED);
  else if (!strcmp(name, "pushes")) *value = (double)__atomic_load_n(&c->nreq[1], __ATOMIC_RELAXED);
  else if (!strcmp(name, "bytes_pushed")) *value = (double)__atomic_load_n(&c->bytes_pushed, __ATOMIC_RELAXED);
  else if (!strcmp(name, "bytes_pulled")) *value = (double)__atomic_load_n(&c->bytes_pulled, __ATOMIC_RELAXED);
  else if (!strcmp(name, "dropped_pushes")) *value = (double)__atomic_load_n(&c->dropped_pushes, __ATOMIC_RELAXED);
  else if (!strcmp(name, "fast_forwards")) *value = (double)__atomic_load_n(&c->fast_forwards, __ATOMIC_RELAXED);
  else if (!strcmp(name, "clock")) *value = (double)__atomic_load_n(&c->clock, __ATOMIC_RELAXED);
  else if (!strcmp(name, "examples")) *value = (double)__atomic_load_n(&c->examples, __ATOMIC_RELAXED);
  else if (!strcmp(name, "direct_calls")) *value = (double)__atomic_load_n(&c->direct_calls, __ATOMIC_RELAXED);
  else if (!strcmp(name, "peer_mem_parts")) *value = (double)__atomic_load_n(&c->pm_parts, __ATOMIC_RELAXED);
  else if (!strcmp(name, "shared_parts")) *value = (double)__atomic_load_n(&c->shared_parts, __ATOMIC_RELAXED);
  else if (!strcmp(name, "http_port")) *value = c->emb.http_port;
  else {
    int err = 0, k = codec_stat(c, name, value, &err);
    if (k < 0) return err;
    if (k == 0) return ps__fail(PS_ERR_INVALID, "unknown statistic '%s'", name);
  }
  return 0;
}

int ps_server_stats(ps_ctx *ctx, int server, char *buf, size_t cap, int timeout_ms) {
  int rc = ps__ctx_check(ctx);
  if (rc || (rc = ps__ctx_state_err(ctx))) return rc;
  if (!buf || cap == 0) return ps__fail(PS_ERR_INVALID, "no buffer");
  pthread_mutex_lock(&ctx->mu);
  ps__ring *ring = ctx->ring;
  pthread_mutex_unlock(&ctx->mu);
  if (!ring || server < 0 || (size_t)server >= ps__ring_size(ring))
    return ps__fail(PS_ERR_RANGE, "no server %d (the job has %zu)", server, ring ? ps__ring_size(ring) : (size_t)0);
  ps_req *r = ps__ctrl_req(ctx, ps__ring_server_at(ring, (size_t)server), PS_MSG_STATS, NULL, 0, ps__deadline_for(ctx, timeout_ms));
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  /* The text reply lands in a buffer of the caller's size (one byte kept for the NUL). */
  r->parts[0].stats_buf = buf;
  r->parts[0].stats_cap = cap;
  return ps__req_run(ctx, r, timeout_ms);
}

