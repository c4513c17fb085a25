/*
 * embed.c - opening a worker context, composed with what runs beside it in the process:
 * embedded mode (a scheduler and servers as threads) or a colocated server.
 *
 * This file sits above the client, the server and the scheduler: it is the one place
 * that starts server and scheduler threads for a worker. ps_ctx_open creates the
 * worker's context (client.h), starts the threads the configuration asks for, gives the
 * context the hook that stops them at close, and starts the context against the
 * scheduler's address: the embedded scheduler's, or the job's.
 *
 * Threads: ps_ctx_open runs on the caller's thread; each embedded node runs its own loop
 * on its own thread; the stop hook runs on the thread that closes the context.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "client/client.h"
#include "common/common.h"
#include "common/config.h"
#include "common/fault.h"
#include "net/auth.h"
#include "sched/sched.h"
#include "server/server.h"

typedef struct embed {
  ps__sched *sched;        /* embedded mode's scheduler, or NULL */
  pthread_t sched_thread;
  ps__server **servers;    /* embedded servers, or the one colocated server */
  pthread_t *threads;
  unsigned n;              /* servers started */
} embed;

static void *sched_main(void *arg) {
  ps__sched_run(arg);
  return NULL;
}

static void *server_main(void *arg) {
  ps__server_run(arg);
  return NULL;
}

/* The ps__ctx_embed hook: servers that stop by themselves within linger_ms are joined,
 * the others are stopped; then the scheduler. */
static void embed_stop(void *arg, uint32_t linger_ms) {
  embed *e = arg;
  if (linger_ms) {
    struct timespec ts = ps__abs_after_ms(linger_ms);
    for (unsigned i = 0; i < e->n; i++) {
      if (!e->servers[i] || pthread_timedjoin_np(e->threads[i], NULL, &ts)) continue;
      ps__server_destroy(e->servers[i]);
      e->servers[i] = NULL;
    }
  }
  for (unsigned i = 0; i < e->n; i++) {
    if (!e->servers[i]) continue;
    ps__server_stop(e->servers[i]);
    pthread_join(e->threads[i], NULL);
    ps__server_destroy(e->servers[i]);
  }
  if (e->sched) {
    ps__sched_stop(e->sched);
    pthread_join(e->sched_thread, NULL);
    ps__sched_destroy(e->sched);
  }
  free(e->servers);
  free(e->threads);
  free(e);
}

/* Start n server threads registering with the scheduler at sched_host:sched_port: an
 * embedded scheduler's, or the job's (a colocated server, which binds `host` and stops
 * once no worker is alive in the job). */
static int start_servers(embed *e, const ps__worker_opts *wo, const char *host, const char *sched_host,
                         int sched_port, unsigned n, int colocated, const ps_config *cfg) {
  /* A colocated server serves /metrics as `pshard server` does: http_port (PSHARD_HTTP_PORT;
   * 0 = ephemeral, the default; off = none) on http_host (PSHARD_HTTP_HOST, 127.0.0.1).
   * Embedded servers serve none: an embedded job has no HTTP. */
  const char *hp = colocated ? ps__config_str(cfg, "http_port", "0") : "off";
  int http = strcmp(hp, "off") != 0;
  int http_port = http ? (int)ps__config_uint(cfg, "http_port", 0) : 0;
  const char *http_host = ps__config_str(cfg, "http_host", "127.0.0.1");
  e->servers = ps__calloc(n, sizeof *e->servers);
  e->threads = ps__calloc(n, sizeof *e->threads);
  if (!e->servers || !e->threads) return ps__fail(PS_ERR_NOMEM, "out of memory");
  for (unsigned i = 0; i < n; i++) {
    ps__server_opts o = {.host = host, .sched_host = sched_host, .sched_port = sched_port,
                         .use_unix = wo->use_unix, .heartbeat_ms = wo->heartbeat_ms, .vnodes = wo->vnodes,
                         .max_payload = wo->max_payload, .connect_timeout_ms = wo->connect_timeout_ms,
                         .stop_without_workers = colocated, .metrics = wo->count ? 1 : -1,
                         .http = http, .http_host = http_host, .http_port = http_port,
                         /* an embedded scheduler cannot restart without the worker; a job's can */
                         .rejoin_ms = colocated ? wo->rejoin_ms : 0};
    int rc = ps__server_create(&o, &e->servers[i]);
    if (rc) return rc;
    e->n = i + 1;
    if (http && ps__server_http_port(e->servers[i]) >= 0)
      ps__log(PS_LOG_INFO, "metrics on http://%s:%d/metrics (the server colocated in this worker)", http_host,
              ps__server_http_port(e->servers[i]));
    if (pthread_create(&e->threads[i], NULL, server_main, e->servers[i])) {
      ps__server_destroy(e->servers[i]);
      e->servers[i] = NULL;
      return ps__fail(PS_ERR_NOMEM, "cannot start %s server thread", colocated ? "a colocated" : "an embedded");
    }
  }
  return 0;
}

/* Embedded mode: a scheduler on an ephemeral loopback port expecting nservers servers
 * and nworkers workers, and the servers. *port receives the scheduler's port. */
static int start_embedded(embed *e, const ps_config *cfg, const ps__worker_opts *wo, unsigned nservers, int *port) {
  ps__sched_opts so = {.host = "127.0.0.1", .port = 0, .servers = nservers,
                       .workers = (uint32_t)ps__config_uint(cfg, "workers", 1), .heartbeat_ms = wo->heartbeat_ms,
                       .heartbeat_timeout_ms = (uint32_t)ps__config_uint(cfg, "heartbeat_timeout_ms", 3000),
                       .max_payload = wo->max_payload,
                       .replicas = (unsigned)ps__config_uint(cfg, "replicas", 0)}; /* 0: 2 when S >= 2 */
  int rc = ps__sched_create(&so, &e->sched);
  if (rc) return rc;
  if (pthread_create(&e->sched_thread, NULL, sched_main, e->sched)) {
    ps__sched_destroy(e->sched);
    e->sched = NULL;
    return ps__fail(PS_ERR_NOMEM, "cannot start the embedded scheduler thread");
  }
  *port = ps__sched_port(e->sched);
  return start_servers(e, wo, "127.0.0.1", "127.0.0.1", *port, nservers, 0, cfg);
}

/* Open a worker of cfg on ctx: start what runs beside it, then the context. */
static int open_with(ps_ctx *ctx, const ps_config *cfg) {
  ps__worker_opts wo;
  ps__worker_opts_read(cfg, &wo);
  unsigned emb = (unsigned)ps__config_uint(cfg, "embedded", 0);
  int colocate = ps__config_uint(cfg, "colocate", 0) != 0;
  if (emb && colocate)
    return ps__ctx_abort(ctx, ps__fail(PS_ERR_CONFIG, "'embedded' and 'colocate' exclude each other: an embedded job "
                                                      "has its own servers"));
  char host[PS_CFG_HOST_MAX] = "127.0.0.1";
  int port = 0;
  if (!emb) {
    const char *addr = ps_config_get(cfg, "scheduler");
    if (!addr)
      return ps__ctx_abort(ctx, ps__fail(PS_ERR_CONFIG, "no scheduler address: set 'scheduler' (PSHARD_SCHEDULER) "
                                                        "or 'embedded'"));
    if (ps__parse_hostport(addr, host, sizeof host, &port))
      return ps__ctx_abort(ctx, ps__fail(PS_ERR_CONFIG, "bad scheduler address '%s'", addr));
  }
  if (!emb && !colocate) return ps__ctx_start(ctx, host, port, 0);
  embed *e = ps__calloc(1, sizeof *e);
  if (!e) return ps__ctx_abort(ctx, ps__fail(PS_ERR_NOMEM, "out of memory"));
  ps__ctx_embed hook = {.stop = embed_stop, .arg = e, .http_port = -1};
  ps__ctx_set_embed(ctx, &hook); /* from here on, closing ctx stops what started */
  int rc = emb ? start_embedded(e, cfg, &wo, emb, &port)
               /* A colocated server: one more server of the job, in this process (design.md §10). */
               : start_servers(e, &wo, ps__config_str(cfg, "host", "127.0.0.1"), host, port, 1, 1, cfg);
  if (rc) return ps__ctx_abort(ctx, rc);
  if (colocate && e->n && e->servers[0]) {
    hook.http_port = ps__server_http_port(e->servers[0]);
    ps__ctx_set_embed(ctx, &hook);
  }
  return ps__ctx_start(ctx, host, port, colocate);
}

int ps_ctx_open(const ps_config *cfg, ps_ctx **out) {
  int rc;
  if (!out) return ps__fail(PS_ERR_INVALID, "out is NULL");
  *out = NULL;
  ps_config *empty = NULL;
  if (!cfg) {
    if ((rc = ps_config_new(&empty))) return rc;
    cfg = empty;
  }
  /* Fault injection (common/fault.h): the configuration's rules, else PSHARD_FAULT's. */
  const char *fault = ps_config_get(cfg, "fault");
  if ((rc = fault ? ps__fault_arm(fault) : ps__fault_arm_env())) {
    ps_config_free(empty);
    return rc;
  }
  /* The job secret (net/auth.h): the configuration's file and job id, else the
   * environment's, checked here so that a bad one fails the open with its message. */
  const char *sf = ps_config_get(cfg, "secret_file"), *job = ps_config_get(cfg, "job_id");
  if ((sf && *sf && (rc = ps__auth_set_secret_file(sf))) || (job && *job && (rc = ps__auth_set_job(job))) ||
      (rc = ps__auth_arm_env())) {
    ps_config_free(empty);
    return rc;
  }
  if (ps__config_uint(cfg, "insecure", 0)) ps__auth_set_insecure(1);
  ps_ctx *ctx;
  rc = ps__ctx_new(cfg, &ctx);
  if (!rc) rc = open_with(ctx, cfg);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ps_config_free(empty);
  if (rc) return ps__fail(rc, "%s", msg);
  *out = ctx;
  return 0;
}

int ps_ctx_open_env(ps_ctx **out) {
  ps_config *cfg;
  int rc = ps_config_new(&cfg);
  if (rc) return rc;
  rc = ps_config_from_env(cfg);
  if (!rc) rc = ps_ctx_open(cfg, out);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ps_config_free(cfg);
  if (rc) ps__fail(rc, "%s", msg);
  return rc;
}
