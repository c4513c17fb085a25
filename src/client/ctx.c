/*
 * ctx.c - the worker context: configuration, open and close, the I/O thread, the
 * scheduler link, heartbeats and the statistics reported with them.
 *
 * Threads. Opening runs on the caller's thread, in two steps that ps_ctx_open
 * (src/embed/embed.c, which first starts what runs beside the worker in embedded or
 * colocated mode) calls: ps__ctx_new reads the configuration and sets up the loop;
 * ps__ctx_start starts the I/O thread (io_main, a libuv loop owning every link) and
 * waits until the job has started. ps_ctx_close posts the shutdown to the loop (leave the job, close every
 * link), joins the thread and frees the context.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "client/client_int.h"
#include "common/fault.h"

void ps__ctx_fail(ps_ctx *ctx, int err, const char *msg) {
  pthread_mutex_lock(&ctx->mu);
  if (!ctx->failed) {
    __atomic_store_n(&ctx->failed, 1, __ATOMIC_RELAXED); /* read unlocked by link.c */
    ctx->fail_err = err;
    snprintf(ctx->fail_msg, sizeof ctx->fail_msg, "%s", msg);
  }
  pthread_cond_broadcast(&ctx->cv);
  pthread_mutex_unlock(&ctx->mu);
}

/* The counters every worker reports to the scheduler (names "ps.<stat>"), read by
 * `pshard plan --measured` and the progress line. */
static const char *const reported_stats[] = {"uptime_s", "compute_s", "pull_wait_s", "push_wait_s", "other_wait_s",
                                             "clock", "examples", "bytes_pushed", "bytes_pulled", "pulls", "pushes"};

static void report_stats(ps_ctx *ctx) {
  if (!ctx->sched->conn || !ctx->registered) return;
  for (size_t i = 0; i < sizeof reported_stats / sizeof reported_stats[0]; i++) {
    double v;
    char name[64];
    ps__wbuf w;
    if (ps_ctx_stat(ctx, reported_stats[i], &v)) continue;
    snprintf(name, sizeof name, "ps.%s", reported_stats[i]);
    ps__wbuf_init(&w);
    ps__wbuf_str(&w, name);
    ps__wbuf_f64(&w, v);
    ps__frame_hdr h = {.type = PS_MSG_METRIC, .sender = ctx->id, .clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED)};
    if (!w.oom) ps__conn_send_ctrl(ctx->sched->conn, &h, w.data, w.len);
    ps__wbuf_free(&w);
  }
}

/* ---- the node agent's callbacks (loop thread) */

static void agent_registered(void *arg, uint32_t id, uint32_t rank) {
  ps_ctx *ctx = arg;
  pthread_mutex_lock(&ctx->mu);
  ctx->id = id;
  ctx->rank = (int)rank;
  /* A job restored from a checkpoint resumes at its clock: every worker starts there,
   * and a program reads ps_ctx_clock to know where it is. (A scheduler that restarted
   * and took this worker back changes nothing of its clock.) */
  if (!ctx->registered) __atomic_store_n(&ctx->clock, ps__agent_start_clock(&ctx->agent), __ATOMIC_RELAXED);
  ctx->registered = 1;
  pthread_cond_broadcast(&ctx->cv);
  pthread_mutex_unlock(&ctx->mu);
  ps__sched_flush(ctx); /* calls made while a restarted scheduler was away */
}

static void agent_membership(void *arg, const ps__membership *m) { ps__on_membership(arg, m); }

/* The scheduler went away: the servers keep serving pushes and pulls, and the agent
 * waits rejoin_ms for a restarted scheduler to take this worker back. */
static void agent_detached(void *arg, const char *msg) {
  ps_ctx *ctx = arg;
  ps__log(PS_LOG_WARN, "%s; waiting up to %u ms for it to come back", msg, ctx->rejoin_ms);
}

/* The scheduler is gone or never answered: every later call fails with this. */
static void agent_lost(void *arg, int status, const char *msg) {
  ps_ctx *ctx = arg;
  if (!ctx->closing) ps__ctx_fail(ctx, status, msg);
  ps__sched_fail(ctx, status, msg);
}

/* Each heartbeat: the counters go to the scheduler about once a second. */
static void agent_tick(void *arg) {
  ps_ctx *ctx = arg;
  if (!ctx->sched->conn) return;
  if (++ctx->hb_count * ctx->heartbeat_ms >= 1000) {
    ctx->hb_count = 0;
    report_stats(ctx);
    ps__ctx_send_metrics(ctx);
  }
}

/* Caller thread, before the loop runs: the agent that will register this worker. */
static int agent_setup(ps_ctx *ctx) {
  ps__agent_opts o = {.sched_host = ctx->sched_host, .sched_port = ctx->sched_port,
                      .heartbeat_ms = ctx->heartbeat_ms, .connect_timeout_ms = ctx->connect_timeout_ms,
                      .rejoin_ms = ctx->rejoin_ms,
                      .pool = ctx->pool, .max_payload = 1u << 24};
  o.hello.role = PS_ROLE_WORKER;
  o.hello.pid = (uint32_t)getpid();
  snprintf(o.hello.hostid, sizeof o.hello.hostid, "%s", ctx->hostid);
  ps__agent_cbs cb = {.arg = ctx, .registered = agent_registered, .membership = agent_membership,
                      .lost = agent_lost, .tick = agent_tick, .link = ps__sched_on_link, .detached = agent_detached,
                      .on_header = ps__sched_on_header, .on_frame = ps__sched_on_frame};
  int rc = ps__agent_init(&ctx->agent, &ctx->loop, &o, &cb);
  if (rc == 0) ctx->agent_inited = 1;
  return rc;
}

static void mail_agent_start(void *arg) {
  ps_ctx *ctx = arg;
  if (ps__agent_start(&ctx->agent)) ps__ctx_fail(ctx, PS_ERR_UNAVAILABLE, ps_errmsg());
}

static void *io_main(void *arg) {
  ps_ctx *ctx = arg;
  ps__block_sigpipe();
  uv_run(&ctx->loop, UV_RUN_DEFAULT);
  return NULL;
}

static void mail_shutdown(void *arg) {
  ps_ctx *ctx = arg;
  ctx->closing = 1;
  for (peer *l = ctx->links; l; l = l->next) {
    ps__link_fail_all(l, PS_ERR_CLOSED, "context closed");
    if (l->conn) {
      if (l->id == SCHED_LINK)
      {
        report_stats(ctx); /* final counters before leaving */
        ps__ctx_send_metrics(ctx);
      }
      else
        ps__conn_close(l->conn, 0);
    }
  }
  if (ctx->agent_inited) ps__agent_stop(&ctx->agent, 1); /* LEAVE, then close */
  ps__loop_close_all(&ctx->loop);
  ps__mailbox_close(ctx->mail);
}

#define PS__STR(x) #x
#define PS__XSTR(x) PS__STR(x)
#if defined(PS_PROJECT_MAJOR) && \
    (PS_PROJECT_MAJOR != PS_VERSION_MAJOR || PS_PROJECT_MINOR != PS_VERSION_MINOR || PS_PROJECT_PATCH != PS_VERSION_PATCH)
#error "pshard.h PS_VERSION_* and CMakeLists.txt project(VERSION) differ"
#endif

const char *ps_version(void) {
  return PS__XSTR(PS_VERSION_MAJOR) "." PS__XSTR(PS_VERSION_MINOR) "." PS__XSTR(PS_VERSION_PATCH);
}

int ps__ctx_check(const ps_ctx *ctx) {
  if (!ctx) return ps__fail(PS_ERR_INVALID, "NULL context");
  return 0;
}

int ps__ctx_state_err(ps_ctx *ctx) {
  int rc = 0;
  pthread_mutex_lock(&ctx->mu);
  if (ctx->closing) rc = ps__fail(PS_ERR_CLOSED, "context is closed");
  else if (ctx->failed) rc = ps__fail(ctx->fail_err, "%s", ctx->fail_msg);
  pthread_mutex_unlock(&ctx->mu);
  return rc;
}

/* ---- context lifecycle */

int ps_ctx_rank(const ps_ctx *ctx) { return ctx ? ctx->rank : -1; }
int ps_ctx_num_workers(const ps_ctx *ctx) { return ctx ? __atomic_load_n(&ctx->nworkers, __ATOMIC_RELAXED) : 0; }
int ps_ctx_num_servers(const ps_ctx *ctx) { return ctx ? __atomic_load_n(&ctx->nservers, __ATOMIC_RELAXED) : 0; }
int64_t ps_ctx_clock(const ps_ctx *ctx) { return ctx ? __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED) : 0; }
uint64_t ps_ctx_epoch(const ps_ctx *ctx) { return ctx ? __atomic_load_n(&ctx->epoch, __ATOMIC_RELAXED) : 0; }

void ps__worker_opts_read(const ps_config *cfg, ps__worker_opts *o) {
  o->timeout_ms = (uint32_t)ps__config_uint(cfg, "timeout_ms", 30000);
  o->connect_timeout_ms = (uint32_t)ps__config_uint(cfg, "connect_timeout_ms", 60000);
  o->heartbeat_ms = (uint32_t)ps__config_uint(cfg, "heartbeat_ms", 200);
  o->rejoin_ms = (uint32_t)ps__config_uint(cfg, "rejoin_ms", PS__REJOIN_MS);
  o->vnodes = (uint32_t)ps__config_uint(cfg, "vnodes", 128);
  o->max_payload = ps__config_uint(cfg, "max_frame_mb", 2048) << 20;
  o->use_unix = strcmp(ps__config_str(cfg, "transport", "auto"), "tcp") != 0;
  o->count = ps__parse_switch(ps__config_str(cfg, "metrics", "on")) != 0;
  if (!o->heartbeat_ms) o->heartbeat_ms = 200;
  if (!o->vnodes) o->vnodes = 128;
}

/* The loop, its pool and mailbox, the scheduler link and the deadline sweep. */
static int ctx_loop_init(ps_ctx *ctx) {
  uv_loop_init(&ctx->loop);
  ctx->loop.data = ctx;
  ctx->pool = ps__pool_new(256u << 20);
  ctx->mail = ps__mailbox_new(&ctx->loop);
  ctx->sched = ps__calloc(1, sizeof *ctx->sched);
  if (!ctx->pool || !ctx->mail || !ctx->sched) return ps__fail(PS_ERR_NOMEM, "out of memory");
  ctx->sched->id = SCHED_LINK;
  ctx->sched->alive = 1;
  ctx->links = ctx->sched;
  uv_timer_init(&ctx->loop, &ctx->sweep_timer);
  ctx->sweep_timer.data = ctx;
  uv_timer_start(&ctx->sweep_timer, ps__sweep_tick, 50, 50);
  return 0;
}

int ps__ctx_new(const ps_config *cfg, ps_ctx **out) {
  *out = NULL;
  const char *role = ps__config_str(cfg, "role", "worker");
  if (strcmp(role, "worker"))
    return ps__fail(PS_ERR_ROLE, "ps_ctx_open opens a worker; role is '%s' (start servers with `pshard server`)", role);
  ps_ctx *ctx = ps__calloc(1, sizeof *ctx);
  if (!ctx) return ps__fail(PS_ERR_NOMEM, "out of memory");
  pthread_mutex_init(&ctx->mu, NULL);
  pthread_cond_init(&ctx->cv, NULL);
  ps__worker_opts wo;
  ps__worker_opts_read(cfg, &wo);
  ctx->timeout_ms = wo.timeout_ms;
  ctx->connect_timeout_ms = wo.connect_timeout_ms;
  ctx->heartbeat_ms = wo.heartbeat_ms;
  ctx->rejoin_ms = wo.rejoin_ms;
  ctx->vnodes = wo.vnodes;
  ctx->max_payload = wo.max_payload;
  ctx->use_unix = wo.use_unix;
  snprintf(ctx->mode, sizeof ctx->mode, "%s", ps__config_str(cfg, "mode", ""));
  ctx->opened_ns = ps__now_ns();
  /* Pushes of this process (shard/once.h): a restarted worker's are newer. */
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  ctx->incarnation = (uint64_t)now.tv_sec * 1000000u + (uint64_t)now.tv_nsec / 1000u;
  if (!ctx->incarnation) ctx->incarnation = 1;
  ctx->retry_ms = (uint32_t)ps__config_uint(cfg, "retry_ms", 1000);
  ctx->spin_ns = sysconf(_SC_NPROCESSORS_ONLN) > 1 ? 50000 : 0;
  /* Armed fault rules see every frame only if the I/O goes through the loop's connections. */
  ctx->direct = ps__config_uint(cfg, "direct", 1) && !ps__fault_on();
  ctx->dedup = (int)ps__config_uint(cfg, "dedup", 1);
  ctx->count = wo.count;
  if (ps__parse_every(ps__config_str(cfg, "checkpoint_every", "0"), &ctx->ckpt_every, &ctx->ckpt_every_ms)) {
    ctx->ckpt_every = ctx->ckpt_every_ms = 0; /* refused when it was set */
  }
  ctx->ckpt_last_ms = ps__now_ms();
  ctx->peer_mem = ps__config_uint(cfg, "peer_mem", 1) && ps__pm_usable();
  pthread_mutex_init(&ctx->lend_mu, NULL);
  pthread_mutex_init(&ctx->keep_mu, NULL);
  pthread_cond_init(&ctx->lend_cv, NULL);
  pthread_mutex_init(&ctx->upool_mu, NULL);
  ctx->upool = ps__pool_new(512u << 20);
  ps__hostid(ctx->hostid, sizeof ctx->hostid);
  ctx->emb.http_port = -1;
  int rc = ctx_loop_init(ctx);
  if (rc) return ps__ctx_abort(ctx, rc);
  *out = ctx;
  return 0;
}

void ps__ctx_set_embed(ps_ctx *ctx, const ps__ctx_embed *emb) { ctx->emb = *emb; }

int ps__ctx_abort(ps_ctx *ctx, int rc) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ctx->emb_linger = 0; /* the job did not start with us: stop what runs beside at once */
  ps_ctx_close(ctx);
  return ps__fail(rc, "%s", msg);
}

/* Caller thread: wait until registered and the job started, or the connect deadline. */
static int ctx_wait_started(ps_ctx *ctx) {
  int rc = 0;
  uint64_t deadline = ps__now_ms() + ctx->connect_timeout_ms;
  pthread_mutex_lock(&ctx->mu);
  while (!ctx->failed && !(ctx->registered && ctx->started && ctx->ring)) {
    uint64_t now = ps__now_ms();
    if (now >= deadline) break;
    struct timespec ts = ps__abs_after_ms(deadline - now < 100 ? deadline - now : 100);
    pthread_cond_timedwait(&ctx->cv, &ctx->mu, &ts);
  }
  if (ctx->failed) {
    rc = ps__fail(ctx->fail_err, "%s", ctx->fail_msg);
  } else if (!ctx->registered && ps__agent_refused(&ctx->agent)) {
    rc = ps__fail(PS_ERR_UNAVAILABLE, "cannot reach the scheduler at %s:%d: connection refused (retried for %u ms)",
                  ctx->sched_host, ctx->sched_port, ctx->connect_timeout_ms);
  } else if (!(ctx->registered && ctx->started && ctx->ring)) {
    rc = ps__fail(PS_ERR_TIMEOUT, "the job did not start within %u ms (%s)", ctx->connect_timeout_ms,
                  ctx->registered ? "waiting for the other servers and workers" : "no answer from the scheduler");
  }
  pthread_mutex_unlock(&ctx->mu);
  return rc;
}

int ps__ctx_start(ps_ctx *ctx, const char *sched_host, int sched_port, int linger) {
  int rc;
  if (strlen(sched_host) >= sizeof ctx->sched_host) {
    rc = ps__fail(PS_ERR_CONFIG, "scheduler host name too long");
    return ps__ctx_abort(ctx, rc);
  }
  snprintf(ctx->sched_host, sizeof ctx->sched_host, "%s", sched_host);
  ctx->sched_port = sched_port;
  if ((rc = agent_setup(ctx))) return ps__ctx_abort(ctx, rc);
  ps__mailbox_post(ctx->mail, mail_agent_start, ctx);
  if (pthread_create(&ctx->thread, NULL, io_main, ctx)) return ps__ctx_abort(ctx, ps__fail(PS_ERR_NOMEM, "cannot start the I/O thread"));
  ctx->thread_started = 1;
  if ((rc = ctx_wait_started(ctx))) return ps__ctx_abort(ctx, rc);
  ctx->emb_linger = linger;
  return 0;
}

void ps_ctx_close(ps_ctx *ctx) {
  if (!ctx) return;
  if (ctx->thread_started) {
    if (ps__mailbox_post(ctx->mail, mail_shutdown, ctx) == 0) pthread_join(ctx->thread, NULL);
  } else if (ctx->mail) {
    ctx->closing = 1;
    ps__mailbox_close(ctx->mail);
    ps__loop_close_all(&ctx->loop);
    uv_run(&ctx->loop, UV_RUN_DEFAULT);
  } else {
    ps__loop_close_all(&ctx->loop);
    uv_run(&ctx->loop, UV_RUN_DEFAULT);
  }
  /* The loop is gone: release held peer-memory parts at their deadlines. */
  for (int held = 1; held;) {
    held = 0;
    for (part *p = ctx->held; p; p = p->next) held |= ps__part_must_hold(p);
    if (held) usleep(20000);
  }
  while (ctx->held) ps__part_finish(ctx->held);
  uv_loop_close(&ctx->loop);
  /* What runs beside the worker in this process stops now; a colocated server first
   * serves the other workers until none is left in the job (it stops by itself then),
   * bounded by the request timeout. */
  if (ctx->emb.stop) ctx->emb.stop(ctx->emb.arg, ctx->emb_linger ? ctx->timeout_ms : 0);
  while (ctx->links) {
    peer *l = ctx->links;
    ctx->links = l->next;
    free(l->dbuf);
    free(l);
  }
  for (size_t i = 0; i < ctx->nretired; i++) ps__ring_free(ctx->retired[i]);
  free(ctx->retired);
  ps__ring_free(ctx->ring);
  ps__pool_free(ctx->pool);
  ps__pool_free(ctx->upool);
  pthread_mutex_destroy(&ctx->upool_mu);
  pthread_mutex_destroy(&ctx->lend_mu);
  pthread_cond_destroy(&ctx->lend_cv);
  for (size_t i = 0; i < ctx->ntables; i++) {
    ps__cx_table_free(ctx->tables[i].cx);
    free(ctx->tables[i].tc);
  }
  free(ctx->tables);
  ps__keep_free(ctx); /* the loop has stopped */
  pthread_mutex_destroy(&ctx->keep_mu);
  pthread_mutex_destroy(&ctx->mu);
  pthread_cond_destroy(&ctx->cv);
  free(ctx);
}
