/*
 * test_client.c - the public API of the worker side, in one process.
 *
 * Most tests run in embedded mode (a scheduler and two servers as threads of the test
 * process, one worker). Tests that need a second worker (a pull that must wait for a
 * round, barriers) start the scheduler and servers as threads with the internal role
 * API and open two worker contexts against them. Covered: every error the API
 * documents for bad input (and that state is unchanged after it), error names and
 * messages, configuration errors, blocking and non-blocking push and pull on dense and
 * sparse tables across servers, repeated keys, requests that time out and stay usable,
 * cancellation, barriers and metrics. Every wait is bounded.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "net/net.h"
#include "pshard.h"
#include "common/config.h"
#include "sched/sched.h"
#include "server/server.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

#define FAILS(code, call)                                                                           \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, (code)), "%s -> %s (%s), expected %s", #call, ps_err_name(rc_), ps_errmsg(), \
              ps_err_name(code));                                                                   \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void set_common(ps_config *cfg) {
  OK(ps_config_set(cfg, "timeout_ms", "10000"));
  OK(ps_config_set(cfg, "connect_timeout_ms", "10000"));
  OK(ps_config_set(cfg, "heartbeat_ms", "100"));
  OK(ps_config_set(cfg, "heartbeat_timeout_ms", "5000"));
}

static ps_ctx *open_embedded(unsigned servers) {
  ps_config *cfg;
  char n[16];
  OK(ps_config_new(&cfg));
  snprintf(n, sizeof n, "%u", servers);
  OK(ps_config_set(cfg, "embedded", n));
  OK(ps_config_set(cfg, "workers", "1"));
  set_common(cfg);
  ps_ctx *ctx = NULL;
  OK(ps_ctx_open(cfg, &ctx));
  ps_config_free(cfg);
  cr_assert(ctx != NULL);
  return ctx;
}

/* ---------------------------------------------------------------- an in-process job with K workers */

typedef struct mini {
  ps__sched *sched;
  pthread_t sched_thread;
  ps__server *srv[4];
  pthread_t srv_thread[4];
  unsigned nsrv;
  char addr[64];
} mini;

static void *run_sched(void *a) {
  ps__sched_run(a);
  return NULL;
}
static void *run_server(void *a) {
  ps__server_run(a);
  return NULL;
}

static void mini_start(mini *m, unsigned servers, unsigned workers) {
  memset(m, 0, sizeof *m);
  ps__sched_opts so = {.host = "127.0.0.1", .servers = servers, .workers = workers, .heartbeat_ms = 100,
                       .heartbeat_timeout_ms = 5000};
  OK(ps__sched_create(&so, &m->sched));
  cr_assert(eq(int, pthread_create(&m->sched_thread, NULL, run_sched, m->sched), 0));
  int port = ps__sched_port(m->sched);
  snprintf(m->addr, sizeof m->addr, "127.0.0.1:%d", port);
  for (unsigned i = 0; i < servers; i++) {
    ps__server_opts o = {.host = "127.0.0.1", .sched_host = "127.0.0.1", .sched_port = port, .use_unix = 1,
                         .heartbeat_ms = 100, .connect_timeout_ms = 10000};
    OK(ps__server_create(&o, &m->srv[i]));
    cr_assert(eq(int, pthread_create(&m->srv_thread[i], NULL, run_server, m->srv[i]), 0));
    m->nsrv = i + 1;
  }
}

static void mini_stop(mini *m) {
  for (unsigned i = 0; i < m->nsrv; i++) {
    ps__server_stop(m->srv[i]);
    pthread_join(m->srv_thread[i], NULL);
    ps__server_destroy(m->srv[i]);
  }
  ps__sched_stop(m->sched);
  pthread_join(m->sched_thread, NULL);
  ps__sched_destroy(m->sched);
}

typedef struct opener {
  const char *addr;
  const char *timeout_ms; /* the context's request deadline, if not set_common's */
  ps_ctx *ctx;
  int rc;
  char msg[512];
} opener;

static void *open_worker(void *arg) {
  opener *o = arg;
  ps_config *cfg;
  o->rc = ps_config_new(&cfg);
  if (o->rc) return NULL;
  set_common(cfg);
  if (o->timeout_ms) ps_config_set(cfg, "timeout_ms", o->timeout_ms);
  ps_config_set(cfg, "scheduler", o->addr);
  o->rc = ps_ctx_open(cfg, &o->ctx);
  snprintf(o->msg, sizeof o->msg, "%s", ps_errmsg());
  ps_config_free(cfg);
  return NULL;
}

/* Open two workers of one job (ps_ctx_open returns once both joined). */
static void open_two(mini *m, ps_ctx **a, ps_ctx **b) {
  opener oa = {.addr = m->addr}, ob = {.addr = m->addr};
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, open_worker, &ob), 0));
  open_worker(&oa);
  pthread_join(t, NULL);
  cr_assert(eq(int, oa.rc, 0), "open a: %s", oa.msg);
  cr_assert(eq(int, ob.rc, 0), "open b: %s", ob.msg);
  cr_assert(eq(int, ps_ctx_num_workers(oa.ctx), 2));
  cr_assert(ne(int, ps_ctx_rank(oa.ctx), ps_ctx_rank(ob.ctx)));
  *a = oa.ctx;
  *b = ob.ctx;
}

/* ---------------------------------------------------------------- error codes */

Test(errors, every_code_has_a_name_and_a_message) {
  static const struct { int code; const char *name, *msg; } table[] = {
#define X(name, code, msg) {code, "PS_" #name, msg},
      PS_ERRNO_MAP(X)
#undef X
  };
  size_t n = sizeof table / sizeof table[0];
  cr_assert(eq(sz, n, (size_t)PS_ERR__COUNT), "the codes are not dense 0..count-1");
  for (size_t i = 0; i < n; i++) {
    cr_assert(eq(int, table[i].code, (int)i));
    cr_assert(eq(str, (char *)ps_err_name(table[i].code), (char *)table[i].name));
    cr_assert(eq(str, (char *)ps_strerror(table[i].code), (char *)table[i].msg));
    cr_assert(ne(str, (char *)ps_strerror(table[i].code), "unknown error"));
    cr_assert(gt(sz, strlen(ps_strerror(table[i].code)), 0));
    for (size_t j = 0; j < i; j++) {
      cr_assert(ne(str, (char *)ps_err_name(table[i].code), (char *)ps_err_name(table[j].code)));
      cr_assert(ne(str, (char *)ps_strerror(table[i].code), (char *)ps_strerror(table[j].code)));
    }
  }
  cr_assert(eq(str, (char *)ps_err_name(PS_OK), "PS_OK"));
  cr_assert(eq(str, (char *)ps_err_name(PS_ERR_NO_TABLE), "PS_ERR_NO_TABLE"));
  cr_assert(eq(str, (char *)ps_strerror(PS_ERR_NO_TABLE), "unknown table"));
  cr_assert(eq(int, PS_ERR_NO_TABLE, 8)); /* travels on the wire: never renumbered */
  cr_assert(eq(int, PS_ERR_RANGE, 18));
  cr_assert(eq(int, PS_ERR_PENDING, 21));
  const int bad[] = {-1, PS_ERR__COUNT, PS_ERR__COUNT + 1, 1000, -2147483647 - 1, 2147483647};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert(not(eq(ptr, (void *)ps_strerror(bad[i]), NULL)));
    cr_assert(not(eq(ptr, (void *)ps_err_name(bad[i]), NULL)));
    cr_assert(gt(sz, strlen(ps_err_name(bad[i])), 0));
  }
}

/* ---------------------------------------------------------------- configuration */

Test(config, errors_leave_the_configuration_unchanged, .timeout = 30) {
  ps_config *cfg;
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "workers", "3"));
  FAILS(PS_ERR_CONFIG, ps_config_set(cfg, "wrokers", "3"));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "wrokers"), NULL)), "message: %s", ps_errmsg());
  static const char *const bad[][2] = {
      {"workers", "abc"},       {"workers", "-1"},          {"workers", ""},
      {"workers", "4097"},      {"workers", "3x"},          {"workers", "99999999999999999999999"},
      {"role", "boss"},         {"mode", "chaos"},          {"transport", "carrier-pigeon"},
      {"scheduler", "nohost"},  {"scheduler", "h:0"},       {"scheduler", "h:70000"},
      {"scheduler", "h:"},      {"host", ""},               {"timeout_ms", "1e3"},
      {"embedded", "257"},      {"max_frame_mb", "0x10"},     {"replicas", "0"},
      {"replicas", "4"},        {"metrics", "maybe"},       {"metrics", ""},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const char *k = bad[i][0];
    const char *before = ps_config_get(cfg, k);
    char *copy = before ? strdup(before) : NULL;
    int rc = ps_config_set(cfg, k, bad[i][1]);
    cr_assert(eq(int, rc, PS_ERR_CONFIG), "%s='%s' -> %s", k, bad[i][1], ps_err_name(rc));
    cr_assert(gt(sz, strlen(ps_errmsg()), 0), "no message for %s='%s'", k, bad[i][1]);
    const char *after = ps_config_get(cfg, k);
    if (copy)
      cr_assert(eq(str, (char *)after, copy), "%s changed to '%s' by a failed set", k, after);
    else
      cr_assert(eq(ptr, (void *)after, NULL), "%s set by a failed set", k);
    free(copy);
  }
  cr_assert(eq(str, (char *)ps_config_get(cfg, "workers"), "3"));
  cr_assert(eq(ptr, (void *)ps_config_get(cfg, "nonsense"), NULL));
  OK(ps_config_set(cfg, "scheduler", "127.0.0.1:7000"));
  OK(ps_config_set(cfg, "mode", "sync"));
  OK(ps_config_set(cfg, "transport", "tcp"));
  OK(ps_config_set(cfg, "replicas", "3"));
  OK(ps_config_set(cfg, "metrics", "off"));
  OK(ps_config_set(cfg, "metrics", "on"));
  FAILS(PS_ERR_INVALID, ps_config_set(NULL, "workers", "1"));
  FAILS(PS_ERR_INVALID, ps_config_set(cfg, NULL, "1"));
  FAILS(PS_ERR_INVALID, ps_config_set(cfg, "workers", NULL));
  FAILS(PS_ERR_INVALID, ps_config_new(NULL));
  ps_config_free(cfg);
  ps_config_free(NULL);
}

/* Numbers are plain digits: strtoull() alone also takes leading blanks and a sign.
 * (Regression test: " 5" used to be accepted as 5.) */
Test(config, numbers_are_plain_digits, .timeout = 30) {
  ps_config *cfg;
  OK(ps_config_new(&cfg));
  static const char *const bad[] = {" 5", "+5", "\t5", "5 "};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = ps_config_set(cfg, "heartbeat_ms", bad[i]);
    cr_expect(eq(int, rc, PS_ERR_CONFIG), "heartbeat_ms='%s' -> %s", bad[i], ps_err_name(rc));
  }
  ps_config_free(cfg);
}

Test(config, checkpoint_every_takes_clocks_or_a_duration, .timeout = 30) {
  ps_config *cfg;
  OK(ps_config_new(&cfg));
  static const char *const good[] = {"0", "25", "500ms", "30s", "10m", "2h", "720h"};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) OK(ps_config_set(cfg, "checkpoint_every", good[i]));
  static const char *const bad[] = {"", "10x", "5 m", "-5", "0s", "721h", "1.5h", "m", "10mm", "1000000001",
                                    "99999999999999999999999s"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = ps_config_set(cfg, "checkpoint_every", bad[i]);
    cr_expect(eq(int, rc, PS_ERR_CONFIG), "checkpoint_every='%s' -> %s", bad[i], ps_err_name(rc));
  }
  uint64_t c, ms;
  cr_expect(eq(int, ps__parse_every("10m", &c, &ms), 0));
  cr_expect(eq(u64, c, 0));
  cr_expect(eq(u64, ms, 600000));
  cr_expect(eq(int, ps__parse_every("40", &c, &ms), 0));
  cr_expect(eq(u64, c, 40));
  cr_expect(eq(u64, ms, 0));
  ps_config_free(cfg);
}

Test(config, environment, .timeout = 30) {
  ps_config *cfg;
  OK(ps_config_new(&cfg));
  setenv("PSHARD_WORKERS", "5", 1);
  setenv("PSHARD_NO_SUCH_KEY", "whatever", 1);
  OK(ps_config_from_env(cfg));
  cr_assert(eq(str, (char *)ps_config_get(cfg, "workers"), "5"));
  setenv("PSHARD_SERVERS", "many", 1);
  FAILS(PS_ERR_CONFIG, ps_config_from_env(cfg));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "PSHARD_SERVERS"), NULL)), "message: %s", ps_errmsg());
  unsetenv("PSHARD_SERVERS");
  unsetenv("PSHARD_WORKERS");
  unsetenv("PSHARD_NO_SUCH_KEY");
  FAILS(PS_ERR_INVALID, ps_config_from_env(NULL));
  ps_config_free(cfg);
}

/* ---------------------------------------------------------------- opening a context */

/* The embedded job's scheduler takes `replicas`, and refuses more copies than servers. */
Test(ctx, embedded_replicas, .timeout = 30) {
  ps_config *cfg;
  ps_ctx *ctx = NULL;
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "embedded", "1"));
  OK(ps_config_set(cfg, "replicas", "2"));
  FAILS(PS_ERR_CONFIG, ps_ctx_open(cfg, &ctx));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "replicas 2"), NULL)), "message: %s", ps_errmsg());
  cr_assert(eq(ptr, ctx, NULL));
  OK(ps_config_set(cfg, "embedded", "2"));
  OK(ps_ctx_open(cfg, &ctx));
  uint32_t t;
  OK(ps_table_declare(ctx, "w", PS_SPARSE, 2, "opt=sgd lr=1 init=zero mode=async", &t));
  uint64_t keys[4] = {1, 2, 3, 4};
  float g[8] = {1, 1, 1, 1, 1, 1, 1, 1}, v[8];
  OK(ps_push(ctx, t, keys, 4, g, 1, PS_LR_SCHEDULE, 10000));
  OK(ps_pull(ctx, t, keys, 4, v, 10000));
  for (int i = 0; i < 8; i++) cr_assert(eq(flt, v[i], -1.0f), "value %d: %g", i, (double)v[i]);
  /* every push went down a chain: the servers forwarded them */
  unsigned long long fw = 0;
  for (int k = 0; k < 2; k++) {
    char buf[8192];
    OK(ps_server_stats(ctx, k, buf, sizeof buf, 10000));
    const char *f = strstr(buf, "forwards ");
    cr_assert(not(eq(ptr, (void *)f, NULL)), "stats: %s", buf);
    fw += strtoull(f + 9, NULL, 10);
  }
  cr_assert(gt(u64, (uint64_t)fw, 0));
  ps_ctx_close(ctx);
  ps_config_free(cfg);
}

/* The replicas a server reports (STATS `replicas`). */
static unsigned server_replicas(ps_ctx *ctx) {
  char buf[8192];
  OK(ps_server_stats(ctx, 0, buf, sizeof buf, 10000));
  const char *f = strstr(buf, "\nreplicas ");
  cr_assert(not(eq(ptr, (void *)f, NULL)), "stats: %s", buf);
  return (unsigned)strtoul(f + 10, NULL, 10);
}

/* Without `replicas`, a job of two servers or more keeps two copies, one of one server
 * one; `replicas=1` keeps one copy on two servers. */
Test(ctx, embedded_replicas_default, .timeout = 30) {
  const char *servers[3] = {"1", "2", "2"}, *replicas[3] = {NULL, NULL, "1"};
  unsigned want[3] = {1, 2, 1};
  for (int i = 0; i < 3; i++) {
    ps_config *cfg;
    ps_ctx *ctx = NULL;
    OK(ps_config_new(&cfg));
    OK(ps_config_set(cfg, "embedded", servers[i]));
    if (replicas[i]) OK(ps_config_set(cfg, "replicas", replicas[i]));
    set_common(cfg);
    OK(ps_ctx_open(cfg, &ctx));
    uint32_t t; /* the servers hear of the job's replicas with its membership */
    OK(ps_table_declare(ctx, "w", PS_SPARSE, 1, "opt=sgd lr=1 init=zero mode=async", &t));
    cr_assert(eq(u32, server_replicas(ctx), want[i]), "servers %s replicas %s", servers[i],
              replicas[i] ? replicas[i] : "(default)");
    ps_ctx_close(ctx);
    ps_config_free(cfg);
  }
}

Test(ctx, open_errors, .timeout = 30) {
  ps_config *cfg;
  ps_ctx *ctx = (ps_ctx *)&ctx; /* not NULL: a failed open must clear it */
  FAILS(PS_ERR_INVALID, ps_ctx_open(NULL, NULL));

  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "role", "server"));
  FAILS(PS_ERR_ROLE, ps_ctx_open(cfg, &ctx));
  cr_assert(eq(ptr, ctx, NULL));
  ps_config_free(cfg);

  OK(ps_config_new(&cfg)); /* neither a scheduler nor embedded */
  FAILS(PS_ERR_CONFIG, ps_ctx_open(cfg, &ctx));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "scheduler"), NULL)), "message: %s", ps_errmsg());
  ps_config_free(cfg);

  OK(ps_config_new(&cfg)); /* an embedded job has its own servers: no colocated one */
  OK(ps_config_set(cfg, "embedded", "1"));
  OK(ps_config_set(cfg, "colocate", "1"));
  FAILS(PS_ERR_CONFIG, ps_ctx_open(cfg, &ctx));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "colocate"), NULL)), "message: %s", ps_errmsg());
  cr_assert(eq(ptr, ctx, NULL));
  ps_config_free(cfg);

  /* A scheduler address where nobody listens: a port that was just free. */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  cr_assert(eq(int, bind(fd, (struct sockaddr *)&sa, sizeof sa), 0));
  cr_assert(eq(int, getsockname(fd, (struct sockaddr *)&sa, &len), 0));
  close(fd);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(sa.sin_port));
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "scheduler", addr));
  OK(ps_config_set(cfg, "connect_timeout_ms", "1000"));
  double t0 = now_s();
  /* Refused connections are retried (launchers start every rank at once, the scheduler
   * may not listen yet) until connect_timeout_ms, then reported. */
  int rc = ps_ctx_open(cfg, &ctx);
  cr_assert(rc == PS_ERR_UNAVAILABLE || rc == PS_ERR_TIMEOUT, "got %s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "scheduler"), NULL)), "message: %s", ps_errmsg());
  cr_assert(lt(dbl, now_s() - t0, 3.0), "a refused connection took %.2fs to report", now_s() - t0);
  cr_assert(eq(ptr, ctx, NULL));
  ps_config_free(cfg);

  /* The same with a colocated server: its thread (which cannot register either) is
   * stopped at once, not kept for the job's other workers. */
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "scheduler", addr));
  OK(ps_config_set(cfg, "connect_timeout_ms", "1000"));
  OK(ps_config_set(cfg, "colocate", "1"));
  t0 = now_s();
  rc = ps_ctx_open(cfg, &ctx);
  cr_assert(rc == PS_ERR_UNAVAILABLE || rc == PS_ERR_TIMEOUT, "got %s: %s", ps_err_name(rc), ps_errmsg());
  cr_assert(lt(dbl, now_s() - t0, 3.0), "a colocated open took %.2fs to fail", now_s() - t0);
  cr_assert(eq(ptr, ctx, NULL));
  ps_config_free(cfg);

  /* The job never starts (it expects a second worker): bounded by connect_timeout_ms. */
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "embedded", "1"));
  OK(ps_config_set(cfg, "workers", "2"));
  OK(ps_config_set(cfg, "connect_timeout_ms", "300"));
  t0 = now_s();
  FAILS(PS_ERR_TIMEOUT, ps_ctx_open(cfg, &ctx));
  double dt = now_s() - t0;
  cr_assert(ge(dbl, dt, 0.25), "gave up after %.3fs", dt);
  cr_assert(lt(dbl, dt, 5.0), "gave up after %.3fs", dt);
  cr_assert(eq(ptr, ctx, NULL));
  ps_config_free(cfg);

  ps_ctx_close(NULL);
  cr_assert(eq(int, ps_ctx_rank(NULL), -1));
  cr_assert(eq(int, ps_ctx_num_workers(NULL), 0));
  cr_assert(eq(int, ps_ctx_num_servers(NULL), 0));
  FAILS(PS_ERR_INVALID, ps_clock(NULL));
  FAILS(PS_ERR_INVALID, ps_barrier(NULL, 10));
  FAILS(PS_ERR_INVALID, ps_metric(NULL, "loss", 1));
  FAILS(PS_ERR_INVALID, ps_req_wait(NULL, 0));
  ps_req_free(NULL);
}

Test(ctx, embedded_identity, .timeout = 30) {
  ps_ctx *ctx = open_embedded(2);
  cr_assert(eq(int, ps_ctx_rank(ctx), 0));
  cr_assert(eq(int, ps_ctx_num_workers(ctx), 1));
  cr_assert(eq(int, ps_ctx_num_servers(ctx), 2));
  cr_assert(eq(i64, ps_ctx_clock(ctx), 0));
  cr_assert(gt(u64, ps_ctx_epoch(ctx), 0));
  uint32_t t; /* connects the servers: see clock_before_anything_else */
  OK(ps_table_declare(ctx, "t", PS_SPARSE, 1, NULL, &t));
  OK(ps_clock(ctx));
  OK(ps_clock(ctx));
  cr_assert(eq(i64, ps_ctx_clock(ctx), 2));
  OK(ps_metric(ctx, "loss", 0.5));
  OK(ps_metric(ctx, "loss", 0.25));
  FAILS(PS_ERR_INVALID, ps_metric(ctx, "", 1));
  FAILS(PS_ERR_INVALID, ps_metric(ctx, NULL, 1));
  char longname[100];
  memset(longname, 'x', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  FAILS(PS_ERR_INVALID, ps_metric(ctx, longname, 1));
  OK(ps_barrier(ctx, 5000)); /* the only worker */
  OK(ps_barrier(ctx, -1));
  ps_ctx_close(ctx);
}

/* ---------------------------------------------------------------- bad input */

#define DN 100 /* dense table size */
#define SD 4   /* sparse dim */

static void snapshot(ps_ctx *ctx, uint32_t td, uint32_t ts, float *d, float *s) {
  static const uint64_t keys[] = {0, 1, 5, 1000, UINT64_MAX};
  OK(ps_pull_range(ctx, td, 0, DN, d, -1));
  OK(ps_pull(ctx, ts, keys, 5, s, -1));
}

Test(api, bad_input_is_refused_and_changes_nothing, .timeout = 30) {
  ps_ctx *ctx = open_embedded(2);
  uint32_t td, ts, tm, id;
  OK(ps_table_declare(ctx, "d", PS_DENSE, DN, "opt=sgd lr=1 update=sum slice=16 init=uniform:1 seed=2", &td));
  OK(ps_table_declare(ctx, "s", PS_SPARSE, SD, "opt=adagrad lr=0.5 init=normal:1", &ts));
  OK(ps_table_declare(ctx, "m", PS_SPARSE, SD, NULL, &tm)); /* mean mode (default) */
  cr_assert(ne(u32, td, ts));
  cr_assert(ne(u32, ts, tm));
  /* Train one step so that the state is not the initial one. */
  float g[DN], d0[DN], s0[5 * SD], d1[DN], s1[5 * SD];
  for (int i = 0; i < DN; i++) g[i] = (float)i / 64.0f;
  uint64_t k[3] = {1, 5, 1000};
  float gs[3 * SD];
  for (int i = 0; i < 3 * SD; i++) gs[i] = 0.5f;
  OK(ps_push_range(ctx, td, 0, DN, g, 1, PS_LR_SCHEDULE, -1));
  OK(ps_push(ctx, ts, k, 3, gs, 2, PS_LR_SCHEDULE, -1));
  OK(ps_clock(ctx));
  snapshot(ctx, td, ts, d0, s0);

  float out[DN + 8];
  uint64_t keys[2] = {1, 2};
  ps_req *req = (ps_req *)&req;
  /* unknown tables */
  FAILS(PS_ERR_NO_TABLE, ps_pull(ctx, 999, keys, 2, out, -1));
  FAILS(PS_ERR_NO_TABLE, ps_pull(ctx, 0, keys, 2, out, -1));
  FAILS(PS_ERR_NO_TABLE, ps_push(ctx, 999, keys, 2, out, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_NO_TABLE, ps_pull_range(ctx, 999, 0, 1, out, -1));
  FAILS(PS_ERR_NO_TABLE, ps_push_range(ctx, UINT32_MAX, 0, 1, out, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_NO_TABLE, ps_pull_start(ctx, 999, keys, 2, out, &req));
  FAILS(PS_ERR_NO_TABLE, ps_push_range_start(ctx, 999, 0, 1, out, 1, PS_LR_SCHEDULE, &req));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "999"), NULL)), "message: %s", ps_errmsg());
  /* the wrong kind of call */
  FAILS(PS_ERR_INVALID, ps_pull(ctx, td, keys, 2, out, -1));
  FAILS(PS_ERR_INVALID, ps_push(ctx, td, keys, 2, out, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_INVALID, ps_pull_range(ctx, ts, 0, 1, out, -1));
  FAILS(PS_ERR_INVALID, ps_push_range(ctx, ts, 0, 1, out, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_INVALID, ps_pull_start(ctx, td, keys, 2, out, &req));
  FAILS(PS_ERR_INVALID, ps_pull_range_start(ctx, ts, 0, 1, out, &req));
  /* dense ranges out of bounds (including ones whose end overflows) */
  FAILS(PS_ERR_RANGE, ps_pull_range(ctx, td, DN, 1, out, -1));
  FAILS(PS_ERR_RANGE, ps_pull_range(ctx, td, 0, DN + 1, out, -1));
  FAILS(PS_ERR_RANGE, ps_pull_range(ctx, td, DN - 1, 2, out, -1));
  FAILS(PS_ERR_RANGE, ps_pull_range(ctx, td, 0, 0, out, -1));
  FAILS(PS_ERR_RANGE, ps_pull_range(ctx, td, UINT64_MAX, 2, out, -1));
  FAILS(PS_ERR_RANGE, ps_pull_range(ctx, td, 5, UINT64_MAX, out, -1));
  FAILS(PS_ERR_RANGE, ps_push_range(ctx, td, 90, 20, g, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_RANGE, ps_push_range_start(ctx, td, 100, 1, g, 1, PS_LR_SCHEDULE, &req));
  FAILS(PS_ERR_RANGE, ps_pull_range_start(ctx, td, 0, 101, out, &req));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "100"), NULL)), "message: %s", ps_errmsg());
  /* NULL buffers and handles */
  FAILS(PS_ERR_INVALID, ps_pull(ctx, ts, NULL, 2, out, -1));
  FAILS(PS_ERR_INVALID, ps_pull(ctx, ts, keys, 2, NULL, -1));
  FAILS(PS_ERR_INVALID, ps_push(ctx, ts, keys, 2, NULL, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_INVALID, ps_pull_range(ctx, td, 0, 4, NULL, -1));
  FAILS(PS_ERR_INVALID, ps_push_range(ctx, td, 0, 4, NULL, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_INVALID, ps_pull_start(ctx, ts, keys, 2, out, NULL));
  FAILS(PS_ERR_INVALID, ps_push_range_start(ctx, td, 0, 4, g, 1, PS_LR_SCHEDULE, NULL));
  /* batch 0 means nothing in mean mode; sum mode ignores the batch */
  FAILS(PS_ERR_INVALID, ps_push(ctx, tm, keys, 2, gs, 0, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_INVALID, ps_push_start(ctx, tm, keys, 2, gs, 0, PS_LR_SCHEDULE, &req));
  cr_assert(eq(ptr, req, (ps_req *)&req), "a failed start wrote the request handle");
  /* table declarations */
  OK(ps_table_declare(ctx, "d", PS_DENSE, DN, "opt=sgd lr=1 update=sum slice=16 init=uniform:1 seed=2", &id));
  cr_assert(eq(u32, id, td), "same declaration, different id");
  OK(ps_table_declare(ctx, "d", PS_DENSE, DN, "  seed=2 init=uniform:1 slice=16 update=sum lr=1 opt=sgd ", &id));
  cr_assert(eq(u32, id, td), "option order changed the identity");
  id = 12345;
  FAILS(PS_ERR_CONFLICT, ps_table_declare(ctx, "d", PS_DENSE, DN, "opt=sgd lr=0.5 update=sum slice=16", &id));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "'d'"), NULL)), "message: %s", ps_errmsg());
  cr_assert(eq(u32, id, 12345), "a failed declare wrote the id");
  FAILS(PS_ERR_CONFLICT, ps_table_declare(ctx, "d", PS_DENSE, DN + 1, "opt=sgd lr=1 update=sum slice=16 init=uniform:1 seed=2", &id));
  FAILS(PS_ERR_CONFLICT, ps_table_declare(ctx, "d", PS_SPARSE, DN, "opt=sgd lr=1 update=sum init=uniform:1 seed=2", &id));
  FAILS(PS_ERR_CONFLICT, ps_table_declare(ctx, "s", PS_SPARSE, SD, "opt=adagrad lr=0.5", &id));
  static const char *const bad_opts[][2] = {
      {"opt=sgdx", "opt"},          {"lr=-1", "lr"},          {"lr=abc", "lr"},
      {"bogus=1", "bogus"},         {"lr", "lr"},             {"update=median", "update"},
      {"init=gauss:1", "init"},     {"beta1=1", "beta1"},     {"lr=0.1 lr=0.2", "lr"},
      {"slice=0", "slice"},         {"seed=-3", "seed"},      {"init=uniform:-1", "init"},
  };
  for (size_t i = 0; i < sizeof bad_opts / sizeof bad_opts[0]; i++) {
    int rc = ps_table_declare(ctx, "fresh", PS_DENSE, 10, bad_opts[i][0], &id);
    cr_assert(eq(int, rc, PS_ERR_CONFIG), "'%s' -> %s", bad_opts[i][0], ps_err_name(rc));
    cr_assert(not(eq(ptr, strstr(ps_errmsg(), bad_opts[i][1]), NULL)), "'%s': message '%s' does not name '%s'",
              bad_opts[i][0], ps_errmsg(), bad_opts[i][1]);
  }
  FAILS(PS_ERR_CONFIG, ps_table_declare(ctx, "fresh", PS_SPARSE, 4, "slice=4", &id));
  FAILS(PS_ERR_INVALID, ps_table_declare(ctx, "fresh", PS_DENSE, 0, NULL, &id));
  FAILS(PS_ERR_INVALID, ps_table_declare(ctx, "fresh", (ps_table_kind)7, 4, NULL, &id));
  FAILS(PS_ERR_INVALID, ps_table_declare(ctx, "", PS_DENSE, 4, NULL, &id));
  FAILS(PS_ERR_INVALID, ps_table_declare(ctx, NULL, PS_DENSE, 4, NULL, &id));
  FAILS(PS_ERR_INVALID, ps_table_declare(NULL, "x", PS_DENSE, 4, NULL, &id));
  /* None of the failed names exists now: "fresh" can be declared with any options. */
  OK(ps_table_declare(ctx, "fresh", PS_SPARSE, 2, "opt=adam", &id));

  /* Nothing above touched the state (the pulls run at the same clock). */
  snapshot(ctx, td, ts, d1, s1);
  cr_assert(eq(int, memcmp(d0, d1, sizeof d0), 0), "dense table changed by refused calls");
  cr_assert(eq(int, memcmp(s0, s1, sizeof s0), 0), "sparse table changed by refused calls");
  /* And the context still works. */
  OK(ps_push_range(ctx, td, 0, DN, g, 1, 1.0f, -1));
  OK(ps_clock(ctx));
  OK(ps_pull_range(ctx, td, 0, DN, d1, -1));
  for (int i = 0; i < DN; i++) cr_assert(eq(flt, d1[i], d0[i] - g[i]), "element %d: %g vs %g", i, d1[i], d0[i] - g[i]);
  ps_ctx_close(ctx);
}

/* Push and pull with a NULL context return PS_ERR_INVALID like every other call.
 * (Regression test: they used to dereference it, deadline_for running before
 * ctx_check.) */
Test(api, null_context_in_push_and_pull, .timeout = 30) {
  uint64_t k = 1;
  float v[4] = {0};
  ps_req *r;
  FAILS(PS_ERR_INVALID, ps_pull(NULL, 1, &k, 1, v, -1));
  FAILS(PS_ERR_INVALID, ps_push(NULL, 1, &k, 1, v, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_INVALID, ps_pull_range(NULL, 1, 0, 4, v, -1));
  FAILS(PS_ERR_INVALID, ps_push_range(NULL, 1, 0, 4, v, 1, PS_LR_SCHEDULE, -1));
  FAILS(PS_ERR_INVALID, ps_pull_start(NULL, 1, &k, 1, v, &r));
  FAILS(PS_ERR_INVALID, ps_push_start(NULL, 1, &k, 1, v, 1, PS_LR_SCHEDULE, &r));
  FAILS(PS_ERR_INVALID, ps_pull_range_start(NULL, 1, 0, 4, v, &r));
  FAILS(PS_ERR_INVALID, ps_push_range_start(NULL, 1, 0, 4, v, 1, PS_LR_SCHEDULE, &r));
}

/* ---------------------------------------------------------------- the data path */

Test(api, blocking_push_pull_dense_and_sparse, .timeout = 30) {
  ps_ctx *ctx = open_embedded(2);
  uint32_t td, ts, tc;
  /* 37 floats in slices of 4: ten slices spread over both servers, a short last one. */
  OK(ps_table_declare(ctx, "d", PS_DENSE, 37, "opt=sgd lr=1 update=sum slice=4", &td));
  OK(ps_table_declare(ctx, "s", PS_SPARSE, 3, "opt=sgd lr=1 update=sum", &ts));
  OK(ps_table_declare(ctx, "c", PS_SPARSE, 2, "init=const:0.25", &tc));

  float d[37], g[37];
  for (int i = 0; i < 37; i++) {
    g[i] = (float)(i + 1);
    d[i] = -1;
  }
  OK(ps_pull_range(ctx, td, 0, 37, d, -1));
  for (int i = 0; i < 37; i++) cr_assert(eq(flt, d[i], 0.0f));
  OK(ps_push_range(ctx, td, 3, 27, g, 1, PS_LR_SCHEDULE, -1)); /* [3, 30) */
  OK(ps_push_range(ctx, td, 36, 1, g, 1, PS_LR_SCHEDULE, -1)); /* the short last slice */

  /* The case: key 5 twice with g=1 under sgd lr=1 sum from zero -> -2. */
  uint64_t k55[2] = {5, 5};
  float ones[6] = {1, 1, 1, 1, 1, 1};
  OK(ps_push(ctx, ts, k55, 2, ones, 1, PS_LR_SCHEDULE, -1));
  /* Many keys over both servers, each twice, not adjacent: the partitioned path. */
  uint64_t many[128];
  float gm[128 * 3];
  for (int i = 0; i < 128; i++) {
    many[i] = 1000 + (uint64_t)(i % 64) * 7919;
    for (int j = 0; j < 3; j++) gm[i * 3 + j] = (float)((i % 64) + 1) + (float)j / 4.0f;
  }
  OK(ps_push(ctx, ts, many, 128, gm, 1, PS_LR_SCHEDULE, -1));
  /* Before the clock nothing is applied (sync mode: a pull sees completed rounds). */
  OK(ps_pull_range(ctx, td, 0, 37, d, -1));
  for (int i = 0; i < 37; i++) cr_assert(eq(flt, d[i], 0.0f));
  OK(ps_clock(ctx));

  OK(ps_pull_range(ctx, td, 0, 37, d, -1));
  for (int i = 0; i < 37; i++) {
    float want = (i >= 3 && i < 30) ? -(float)(i - 3 + 1) : (i == 36 ? -1.0f : 0.0f);
    cr_assert(eq(flt, d[i], want), "d[%d] = %g, want %g", i, d[i], want);
  }
  float part[9];
  OK(ps_pull_range(ctx, td, 14, 9, part, -1)); /* an inner range across slices */
  for (int i = 0; i < 9; i++) cr_assert(eq(flt, part[i], d[14 + i]));

  float row[3];
  uint64_t k5 = 5;
  OK(ps_pull(ctx, ts, &k5, 1, row, -1));
  for (int j = 0; j < 3; j++) cr_assert(eq(flt, row[j], -2.0f), "row 5[%d] = %g", j, row[j]);
  float pm[128 * 3];
  OK(ps_pull(ctx, ts, many, 128, pm, -1));
  for (int i = 0; i < 128; i++)
    for (int j = 0; j < 3; j++) {
      float want = -2.0f * ((float)((i % 64) + 1) + (float)j / 4.0f);
      cr_assert(eq(flt, pm[i * 3 + j], want), "key %llu [%d] = %g, want %g", (unsigned long long)many[i], j,
                pm[i * 3 + j], want);
    }

  /* Repeated keys in a pull: the same row each time, in the caller's order. */
  uint64_t rep[5] = {5, 1000, 5, 77777, 1000};
  float pr[5 * 3];
  OK(ps_pull(ctx, ts, rep, 5, pr, -1));
  for (int j = 0; j < 3; j++) {
    cr_assert(eq(flt, pr[0 * 3 + j], -2.0f));
    cr_assert(eq(flt, pr[2 * 3 + j], -2.0f));
    cr_assert(eq(flt, pr[1 * 3 + j], pm[0 * 3 + j]));
    cr_assert(eq(flt, pr[4 * 3 + j], pm[0 * 3 + j]));
    cr_assert(eq(flt, pr[3 * 3 + j], 0.0f)); /* never touched: the zero initialiser */
  }
  /* Fresh rows come from the table's initialiser; an empty pull is a no-op. */
  uint64_t fresh[3] = {0, UINT64_MAX, 42};
  float pc[6];
  OK(ps_pull(ctx, tc, fresh, 3, pc, -1));
  for (int i = 0; i < 6; i++) cr_assert(eq(flt, pc[i], 0.25f));
  OK(ps_pull(ctx, tc, NULL, 0, NULL, -1));
  ps_ctx_close(ctx);
}

Test(api, mean_mode_counts_each_workers_batch_once_per_round, .timeout = 30) {
  /* Pushing a table in pieces within one step (per layer, as backprop produces them)
   * must not count the batch twice: each piece is divided by the batch once. */
  ps_ctx *ctx = open_embedded(2);
  uint32_t td, ts;
  OK(ps_table_declare(ctx, "d", PS_DENSE, 20, "opt=sgd lr=1 slice=4", &td));
  OK(ps_table_declare(ctx, "s", PS_SPARSE, 2, "opt=sgd lr=1", &ts));
  float g[20], d[20];
  for (int i = 0; i < 20; i++) g[i] = (float)(i + 1) / 8.0f;
  OK(ps_push_range(ctx, td, 0, 10, g, 8, PS_LR_SCHEDULE, -1));
  OK(ps_push_range(ctx, td, 10, 10, g + 10, 8, PS_LR_SCHEDULE, -1));
  uint64_t k1 = 11, k2 = 12;
  float r1[2] = {1, 2}, r2[2] = {3, 4}, out[4];
  OK(ps_push(ctx, ts, &k1, 1, r1, 8, PS_LR_SCHEDULE, -1));
  OK(ps_push(ctx, ts, &k2, 1, r2, 8, PS_LR_SCHEDULE, -1));
  OK(ps_clock(ctx));
  OK(ps_pull_range(ctx, td, 0, 20, d, -1));
  for (int i = 0; i < 20; i++) cr_assert(eq(flt, d[i], -g[i]), "d[%d] = %g, want %g", i, d[i], -g[i]);
  uint64_t ks[2] = {11, 12};
  OK(ps_pull(ctx, ts, ks, 2, out, -1));
  cr_assert(eq(flt, out[0], -1.0f));
  cr_assert(eq(flt, out[1], -2.0f));
  cr_assert(eq(flt, out[2], -3.0f));
  cr_assert(eq(flt, out[3], -4.0f));
  /* An explicit learning rate overrides the table's for that push. */
  OK(ps_push_range(ctx, td, 0, 20, g, 8, 0.5f, -1));
  OK(ps_clock(ctx));
  OK(ps_pull_range(ctx, td, 0, 20, d, -1));
  for (int i = 0; i < 20; i++) cr_assert(eq(flt, d[i], -1.5f * g[i]), "d[%d] = %g", i, d[i]);
  ps_ctx_close(ctx);
}

Test(api, non_blocking_requests, .timeout = 30) {
  ps_ctx *ctx = open_embedded(2);
  uint32_t td, ts;
  OK(ps_table_declare(ctx, "d", PS_DENSE, 1000, "opt=sgd lr=1 update=sum slice=64", &td));
  OK(ps_table_declare(ctx, "s", PS_SPARSE, 8, "opt=sgd lr=1 update=sum", &ts));
  float g[1000];
  for (int i = 0; i < 1000; i++) g[i] = (float)(i % 17);
  uint64_t keys[50];
  float gs[50 * 8];
  for (int i = 0; i < 50; i++) {
    keys[i] = (uint64_t)i * 1000003u;
    for (int j = 0; j < 8; j++) gs[i * 8 + j] = (float)(i + j);
  }
  /* Several requests in flight at once, waited in another order than started. */
  ps_req *r[4];
  OK(ps_push_range_start(ctx, td, 0, 500, g, 1, PS_LR_SCHEDULE, &r[0]));
  OK(ps_push_range_start(ctx, td, 500, 500, g + 500, 1, PS_LR_SCHEDULE, &r[1]));
  OK(ps_push_start(ctx, ts, keys, 25, gs, 1, PS_LR_SCHEDULE, &r[2]));
  OK(ps_push_start(ctx, ts, keys + 25, 25, gs + 25 * 8, 1, PS_LR_SCHEDULE, &r[3]));
  OK(ps_req_wait(r[3], -1));
  OK(ps_req_wait(r[0], 10000));
  OK(ps_req_wait(r[0], 0)); /* waiting again on a finished request gives its result */
  for (int i = 0; i < 4; i++) ps_req_free(r[i]); /* r[1], r[2] freed without a wait */
  OK(ps_clock(ctx));

  float d[1000], s[50 * 8];
  memset(d, 0x7f, sizeof d);
  memset(s, 0x7f, sizeof s);
  ps_req *p[2];
  OK(ps_pull_range_start(ctx, td, 0, 1000, d, &p[0]));
  OK(ps_pull_start(ctx, ts, keys, 50, s, &p[1]));
  OK(ps_req_wait(p[1], -1));
  OK(ps_req_wait(p[0], -1));
  ps_req_free(p[0]);
  ps_req_free(p[1]);
  for (int i = 0; i < 1000; i++) cr_assert(eq(flt, d[i], -g[i]), "d[%d] = %g", i, d[i]);
  for (int i = 0; i < 50 * 8; i++) cr_assert(eq(flt, s[i], -gs[i]), "s[%d] = %g", i, s[i]);
  ps_ctx_close(ctx);
}

/* ps_req_free of a running request: it returns once the library no longer touches the
 * request or its buffers, and the context goes on working. (Regression test: it used to
 * return while the cancel handler or a pending write callback still used the request:
 * heap-use-after-free under ASan; in release a later request failed as "canceled".) */
Test(api, freeing_running_requests, .timeout = 30) {
  ps_ctx *ctx = open_embedded(2);
  uint32_t td, ts;
  const size_t big = 4u << 20; /* 16 MiB pushes: still being written when freed */
  OK(ps_table_declare(ctx, "d", PS_DENSE, big, "opt=sgd lr=1 update=sum", &td));
  OK(ps_table_declare(ctx, "s", PS_SPARSE, 8, "opt=sgd lr=1 update=sum", &ts));
  float *g = calloc(big, sizeof *g), *d = calloc(big, sizeof *d);
  cr_assert(g && d);
  uint64_t keys[50];
  float gs[50 * 8] = {0}, s[50 * 8];
  for (int i = 0; i < 50; i++) keys[i] = (uint64_t)i * 1000003u;
  for (int it = 0; it < 10; it++) {
    ps_req *q;
    OK(ps_pull_range_start(ctx, td, 0, 1000, d, &q));
    ps_req_free(q);
    OK(ps_push_start(ctx, ts, keys, 50, gs, 1, PS_LR_SCHEDULE, &q));
    ps_req_free(q);
    OK(ps_pull_start(ctx, ts, keys, 50, s, &q));
    ps_req_free(q);
    OK(ps_push_range_start(ctx, td, 0, big, g, 1, PS_LR_SCHEDULE, &q));
    ps_req_free(q);
  }
  OK(ps_clock(ctx));
  OK(ps_pull_range(ctx, td, 0, 1000, d, -1));
  OK(ps_pull(ctx, ts, keys, 50, s, -1));
  free(g);
  free(d);
  ps_ctx_close(ctx);
}

/* A clock before any other contact with the servers (their connections are still being
 * opened): the CLOCK frames are queued as detached one-part requests. (Regression test:
 * those were freed when written while still on the link's in-flight list:
 * heap-use-after-free under ASan, silent list corruption otherwise.) */
Test(api, clock_before_anything_else, .timeout = 30) {
  ps_ctx *ctx = open_embedded(2);
  OK(ps_clock(ctx));
  OK(ps_clock(ctx));
  uint32_t td;
  OK(ps_table_declare(ctx, "d", PS_DENSE, 40, "opt=sgd lr=1 update=sum slice=4", &td));
  float g[40], d[40];
  for (int i = 0; i < 40; i++) g[i] = (float)i;
  for (int it = 0; it < 3; it++) {
    OK(ps_push_range(ctx, td, 0, 40, g, 1, PS_LR_SCHEDULE, -1));
    OK(ps_clock(ctx));
  }
  OK(ps_pull_range(ctx, td, 0, 40, d, -1));
  for (int i = 0; i < 40; i++) cr_assert(eq(flt, d[i], -3.0f * g[i]));
  cr_assert(eq(i64, ps_ctx_clock(ctx), 5));
  ps_ctx_close(ctx);
}

/* With the default SIGPIPE disposition (a user's program), an embedded job must never
 * kill its process. (Regression test: about 1 in 100 ps_ctx_open/ps_ctx_close cycles
 * died of SIGPIPE, an embedded scheduler or server writing to a connection closed
 * during the shutdown, and so did freeing a running pull.) The other tests run with the
 * default disposition too. */
Test(api, sigpipe_kills_nobody, .timeout = 60) {
  for (int i = 0; i < 60; i++) {
    ps_ctx *ctx = open_embedded(2);
    signal(SIGPIPE, SIG_DFL);
    uint32_t td;
    OK(ps_table_declare(ctx, "d", PS_DENSE, 1u << 20, "opt=sgd lr=1 update=sum", &td));
    if (i % 10 == 0) {
      float *g = calloc(1u << 20, sizeof *g);
      cr_assert(g != NULL);
      ps_req *q;
      OK(ps_pull_range_start(ctx, td, 0, 1u << 20, g, &q));
      ps_req_free(q);
      OK(ps_push_range_start(ctx, td, 0, 1u << 20, g, 1, PS_LR_SCHEDULE, &q));
      ps_req_free(q);
      free(g);
    }
    ps_ctx_close(ctx);
  }
}

/* ---------------------------------------------------------------- two workers */

typedef struct clock_later {
  ps_ctx *ctx;
  int delay_ms;
  int rc;
} clock_later;

static void *do_clock_later(void *arg) {
  clock_later *c = arg;
  usleep((useconds_t)c->delay_ms * 1000);
  c->rc = ps_clock(c->ctx);
  return NULL;
}

Test(api, a_pull_for_an_unfinished_round_waits_and_times_out, .timeout = 30) {
  mini m;
  ps_ctx *a, *b;
  mini_start(&m, 2, 2);
  open_two(&m, &a, &b);
  uint32_t td, tdb;
  OK(ps_table_declare(a, "d", PS_DENSE, 10, "opt=sgd lr=1 update=sum slice=4", &td));
  /* b attaches to the table by name (same id). */
  OK(ps_table_declare(b, "d", PS_DENSE, 10, "opt=sgd lr=1 update=sum slice=4", &tdb));
  cr_assert(eq(u32, tdb, td));
  float g[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, d[10];
  OK(ps_push_range(a, td, 0, 10, g, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(a));

  /* Round 0 needs b's clock: a's pull at clock 1 is deferred by the servers. */
  for (int i = 0; i < 10; i++) d[i] = 123.0f;
  ps_req *r;
  OK(ps_pull_range_start(a, td, 0, 10, d, &r));
  FAILS(PS_ERR_PENDING, ps_req_wait(r, 0));
  double t0 = now_s();
  FAILS(PS_ERR_PENDING, ps_req_wait(r, 150));
  double dt = now_s() - t0;
  cr_assert(ge(dbl, dt, 0.14), "waited only %.3fs", dt);
  cr_assert(lt(dbl, dt, 2.0), "waited %.3fs", dt);
  for (int i = 0; i < 10; i++) cr_assert(eq(flt, d[i], 123.0f), "the buffer was written before completion");
  /* The request is still usable: once b clocks, the same wait succeeds. */
  OK(ps_clock(b));
  OK(ps_req_wait(r, 5000));
  ps_req_free(r);
  for (int i = 0; i < 10; i++) cr_assert(eq(flt, d[i], -g[i]));
  /* b sees the same parameters. */
  float db[10];
  OK(ps_pull_range(b, tdb, 0, 10, db, -1));
  cr_assert(eq(int, memcmp(d, db, sizeof d), 0));
  ps_ctx_close(a);
  ps_ctx_close(b);
  mini_stop(&m);
}

/* ps_req_wait tells a request still running after the wait's own timeout
 * (PS_ERR_PENDING: it stays valid) from one that failed at its own deadline
 * (PS_ERR_TIMEOUT, its result: it is done). */
Test(api, req_wait_tells_still_running_from_failed_at_its_deadline, .timeout = 30) {
  mini m;
  mini_start(&m, 1, 2);
  opener oa = {.addr = m.addr, .timeout_ms = "500"}, ob = {.addr = m.addr};
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, open_worker, &ob), 0));
  open_worker(&oa);
  pthread_join(t, NULL);
  cr_assert(eq(int, oa.rc, 0), "open a: %s", oa.msg);
  cr_assert(eq(int, ob.rc, 0), "open b: %s", ob.msg);
  ps_ctx *a = oa.ctx, *b = ob.ctx;
  uint32_t td;
  OK(ps_table_declare(a, "d", PS_DENSE, 10, "opt=sgd lr=1 update=sum slice=4", &td));
  OK(ps_table_declare(b, "d", PS_DENSE, 10, "opt=sgd lr=1 update=sum slice=4", &td));
  float g[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, d[10];
  OK(ps_push_range(a, td, 0, 10, g, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(a));
  /* Round 0 needs b's clock, which never comes: a's pull waits on the server. */
  ps_req *r;
  OK(ps_pull_range_start(a, td, 0, 10, d, &r));
  FAILS(PS_ERR_PENDING, ps_req_wait(r, 0));
  FAILS(PS_ERR_PENDING, ps_req_wait(r, 50));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "still running"), NULL)), "message: %s", ps_errmsg());
  cr_assert(eq(int, ps_req_done(r), 0));
  double t0 = now_s();
  FAILS(PS_ERR_TIMEOUT, ps_req_wait(r, 10000)); /* the request's deadline: 500 ms */
  double dt = now_s() - t0;
  cr_assert(lt(dbl, dt, 5.0), "the request ended after %.2fs", dt);
  cr_assert(eq(int, ps_req_done(r), 1));
  FAILS(PS_ERR_TIMEOUT, ps_req_wait(r, 0)); /* waiting again gives the same result */
  ps_req_free(r);
  /* A blocking call's own timeout stays PS_ERR_TIMEOUT. */
  FAILS(PS_ERR_TIMEOUT, ps_pull_range(a, td, 0, 10, d, 100));
  ps_ctx_close(a);
  ps_ctx_close(b);
  mini_stop(&m);
}

Test(api, version_is_the_headers) {
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", PS_VERSION_MAJOR, PS_VERSION_MINOR, PS_VERSION_PATCH);
  cr_assert(eq(str, (char *)ps_version(), want));
  cr_assert(eq(ptr, (void *)ps_version(), (void *)ps_version()), "not a static string");
}

/* A deferred pull freed while pending, and blocking pulls that time out, leave the
 * context working. (Regression test, see freeing_running_requests: the later blocking
 * pull used to fail with PS_ERR_CANCELED.) */
Test(api, a_deferred_pull_freed_or_timed_out, .timeout = 30) {
  mini m;
  ps_ctx *a, *b;
  mini_start(&m, 2, 2);
  open_two(&m, &a, &b);
  uint32_t td, ts;
  OK(ps_table_declare(a, "d", PS_DENSE, 10, "opt=sgd lr=1 update=sum slice=4", &td));
  OK(ps_table_declare(a, "s", PS_SPARSE, 2, "opt=sgd lr=1 update=sum", &ts));
  OK(ps_table_declare(b, "s", PS_SPARSE, 2, "opt=sgd lr=1 update=sum", &ts)); /* connects b's links */
  float g[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, d[10];
  ps_req *r;
  double t0;
  OK(ps_clock(a)); /* round 0: empty */
  OK(ps_clock(b));
  /* Round 1 waits for b: a's pull at clock 2 is deferred. */
  OK(ps_push_range(a, td, 0, 10, g, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(a));
  OK(ps_pull_range_start(a, td, 0, 10, d, &r));
  FAILS(PS_ERR_PENDING, ps_req_wait(r, 20));
  t0 = now_s();
  ps_req_free(r);
  cr_assert(lt(dbl, now_s() - t0, 1.0), "freeing a pending request blocked");
  uint64_t key = 3;
  float row[2];
  t0 = now_s();
  FAILS(PS_ERR_TIMEOUT, ps_pull(a, ts, &key, 1, row, 100));
  cr_assert(lt(dbl, now_s() - t0, 2.0));
  FAILS(PS_ERR_TIMEOUT, ps_pull_range(a, td, 0, 10, d, 100));
  /* b clocks from another thread while a waits in a blocking pull. */
  clock_later cl = {.ctx = b, .delay_ms = 100};
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, do_clock_later, &cl), 0));
  OK(ps_pull_range(a, td, 0, 10, d, 5000));
  pthread_join(t, NULL);
  OK(cl.rc);
  for (int i = 0; i < 10; i++) cr_assert(eq(flt, d[i], -g[i]));
  OK(ps_pull(a, ts, &key, 1, row, -1));
  cr_assert(eq(flt, row[0], 0.0f));
  ps_ctx_close(a);
  ps_ctx_close(b);
  mini_stop(&m);
}

typedef struct barrier_arg {
  ps_ctx *ctx;
  int timeout_ms;
  int rc;
} barrier_arg;

static void *do_barrier(void *arg) {
  barrier_arg *x = arg;
  x->rc = ps_barrier(x->ctx, x->timeout_ms);
  return NULL;
}

static void barrier_both(ps_ctx *a, ps_ctx *b, int timeout_ms, int *ra, int *rb) {
  barrier_arg xa = {a, timeout_ms, -1}, xb = {b, timeout_ms, -1};
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, do_barrier, &xb), 0));
  do_barrier(&xa);
  pthread_join(t, NULL);
  *ra = xa.rc;
  *rb = xb.rc;
}

Test(api, barrier, .timeout = 30) {
  mini m;
  ps_ctx *a, *b;
  mini_start(&m, 1, 2);
  open_two(&m, &a, &b);
  int ra, rb;
  for (int i = 0; i < 3; i++) {
    barrier_both(a, b, 5000, &ra, &rb);
    OK(ra);
    OK(rb);
  }
  ps_ctx_close(a);
  ps_ctx_close(b);
  mini_stop(&m);
}

/* Alone at a barrier: bounded by the timeout. (Every blocking call that times out
 * frees its request while it runs, which is the bug of freeing_running_requests.) */
Test(api, barrier_times_out, .timeout = 30) {
  mini m;
  ps_ctx *a, *b;
  mini_start(&m, 1, 2);
  open_two(&m, &a, &b);
  double t0 = now_s();
  FAILS(PS_ERR_TIMEOUT, ps_barrier(a, 150));
  double dt = now_s() - t0;
  cr_assert(ge(dbl, dt, 0.14), "gave up after %.3fs", dt);
  cr_assert(lt(dbl, dt, 2.0), "gave up after %.3fs", dt);
  OK(ps_metric(a, "still", 1)); /* the context still works */
  ps_ctx_close(a);
  ps_ctx_close(b);
  mini_stop(&m);
}

/* A barrier that timed out must not leave the workers' barriers out of step: once every
 * worker calls ps_barrier again, everybody passes. (Regression test: the timed-out call
 * used up a sequence number on one worker only, so afterwards one side passed alone and
 * the other waited for a barrier nobody else would enter.) */
Test(api, barrier_after_a_timeout, .timeout = 30) {
  mini m;
  ps_ctx *a, *b;
  mini_start(&m, 1, 2);
  open_two(&m, &a, &b);
  int ra, rb;
  FAILS(PS_ERR_TIMEOUT, ps_barrier(a, 100));
  for (int i = 0; i < 2; i++) {
    barrier_both(a, b, 2000, &ra, &rb);
    cr_expect(eq(int, ra, 0), "round %d: a -> %s", i, ps_err_name(ra));
    cr_expect(eq(int, rb, 0), "round %d: b -> %s", i, ps_err_name(rb));
  }
  ps_ctx_close(a);
  ps_ctx_close(b);
  mini_stop(&m);
}

/* ---------------------------------------------------------------- caller-side I/O (lent links) */

/* An embedded job with one more option set (key = value). */
static ps_ctx *open_embedded_with(unsigned servers, const char *key, const char *value);
#define open_embedded_with_direct(servers, direct) open_embedded_with(servers, "direct", direct)

static ps_ctx *open_embedded_with(unsigned servers, const char *key, const char *value) {
  ps_config *cfg;
  char n[16];
  OK(ps_config_new(&cfg));
  snprintf(n, sizeof n, "%u", servers);
  OK(ps_config_set(cfg, "embedded", n));
  OK(ps_config_set(cfg, "workers", "1"));
  OK(ps_config_set(cfg, key, value));
  set_common(cfg);
  ps_ctx *ctx = NULL;
  OK(ps_ctx_open(cfg, &ctx));
  ps_config_free(cfg);
  return ctx;
}

static double stat_of(ps_ctx *ctx, const char *name) {
  double v = -1;
  OK(ps_ctx_stat(ctx, name, &v));
  return v;
}

/* ps_push_pull and ps_push_pull_range: one round trip that gives what a push followed
 * by a pull gives, with grads and out the same array or not, on the caller's thread
 * (direct=1) and through the I/O thread (direct=0). */
Test(direct, push_pull_equals_push_then_pull, .timeout = 60) {
  for (int mode = 0; mode < 2; mode++) {
    ps_ctx *ctx = open_embedded_with_direct(2, mode ? "1" : "0");
    uint32_t ts, td;
    OK(ps_table_declare(ctx, "s", PS_SPARSE, 3, "opt=sgd lr=1 update=sum mode=async", &ts));
    OK(ps_table_declare(ctx, "d", PS_DENSE, 1000, "opt=sgd lr=1 update=sum mode=async slice=16", &td));
    uint64_t keys[40];
    float g[40 * 3], out[40 * 3];
    for (int i = 0; i < 40; i++) keys[i] = (uint64_t)i * 7919u;
    for (int i = 0; i < 120; i++) g[i] = (float)(i + 1);
    for (int rep = 0; rep < 20; rep++) { /* enough calls for the links to be lent */
      memset(out, 0, sizeof out);
      OK(ps_push_pull(ctx, ts, keys, 40, g, 1, PS_LR_SCHEDULE, out, -1));
      for (int i = 0; i < 120; i++)
        cr_assert(eq(flt, out[i], -(float)(rep + 1) * g[i]), "mode %d rep %d [%d]: %f", mode, rep, i, out[i]);
    }
    /* In place: pushing the rows themselves zeroes them (sgd, lr 1). */
    OK(ps_push_pull(ctx, ts, keys, 40, out, 1, PS_LR_SCHEDULE, out, -1));
    for (int i = 0; i < 120; i++) cr_assert(eq(flt, out[i], 0.0f), "in place [%d]: %f", i, out[i]);

    static float dg[1000], dout[1000];
    for (int i = 0; i < 1000; i++) dg[i] = (float)(i % 17) - 8.0f;
    for (int rep = 0; rep < 20; rep++) {
      OK(ps_push_pull_range(ctx, td, 5, 990, dg + 5, 1, PS_LR_SCHEDULE, dout + 5, -1));
      for (int i = 5; i < 995; i++)
        cr_assert(eq(flt, dout[i], -(float)(rep + 1) * dg[i]), "dense mode %d rep %d [%d]", mode, rep, i);
    }
    OK(ps_pull_range(ctx, td, 0, 1000, dout, -1));
    cr_assert(eq(flt, dout[0], 0.0f));
    cr_assert(eq(flt, dout[999], 0.0f));
    cr_assert(eq(flt, dout[500], -20.0f * dg[500]));
    /* Bad input is refused before anything is sent. */
    FAILS(PS_ERR_RANGE, ps_push_pull_range(ctx, td, 990, 20, dg, 1, PS_LR_SCHEDULE, dout, -1));
    FAILS(PS_ERR_INVALID, ps_push_pull(ctx, td, keys, 1, g, 1, PS_LR_SCHEDULE, out, -1));
    FAILS(PS_ERR_NO_TABLE, ps_push_pull(ctx, 999, keys, 1, g, 1, PS_LR_SCHEDULE, out, -1));
    if (mode)
      cr_assert(gt(dbl, stat_of(ctx, "direct_calls"), 30.0), "only %.0f direct calls", stat_of(ctx, "direct_calls"));
    else
      cr_assert(eq(dbl, stat_of(ctx, "direct_calls"), 0.0));
    ps_ctx_close(ctx);
  }
}

/* Each dense part chooses its value transport (net/xport.h): a part of 64 KiB or more
 * to a server of this process goes by peer memory (the frame names the caller's
 * buffers; one count per part), with the shared-buffer hint when they lie in ps_alloc
 * memory; a small part, or a call whose deadline is less than 4 s away, carries its
 * values inline. The values are the same every way: on lent links (direct=1) and
 * through the I/O thread, blocking or not. */
Test(direct, dense_parts_choose_their_transport, .timeout = 60) {
  enum { N = 200000 };
  int pm = ps__pm_usable(); /* else every part goes inline */
  float *g = malloc(N * 4), *out = malloc(N * 4), *sh = ps_alloc(N * 4);
  cr_assert(g && out && sh, "%s", ps_errmsg());
  for (int i = 0; i < N; i++) g[i] = (float)(i % 251) - 125.0f;
  for (int mode = 0; mode < 2; mode++) {
    ps_ctx *ctx = open_embedded_with_direct(2, mode ? "1" : "0");
    uint32_t td;
    OK(ps_table_declare(ctx, "d", PS_DENSE, N, "opt=sgd lr=1 update=sum mode=async slice=1024", &td));
    double parts = stat_of(ctx, "peer_mem_parts"), shared = stat_of(ctx, "shared_parts");
#define EXPECT_PARTS(np, ns, what)                                                                   \
  do {                                                                                              \
    double p_ = stat_of(ctx, "peer_mem_parts") - parts, s_ = stat_of(ctx, "shared_parts") - shared; \
    cr_assert(eq(dbl, p_, pm ? (double)(np) : 0.0), "mode %d, %s: %g peer-memory parts", mode, what, p_); \
    cr_assert(eq(dbl, s_, pm ? (double)(ns) : 0.0), "mode %d, %s: %g shared parts", mode, what, s_);     \
    parts += p_, shared += s_;                                                                      \
  } while (0)
    OK(ps_push_range(ctx, td, 0, N, g, 1, PS_LR_SCHEDULE, -1));
    EXPECT_PARTS(2, 0, "a large push");
    memset(out, 0, N * 4);
    OK(ps_pull_range(ctx, td, 0, N, out, -1));
    EXPECT_PARTS(2, 0, "a large pull");
    for (int i = 0; i < N; i++) cr_assert(eq(flt, out[i], -g[i]), "mode %d [%d]", mode, i);
    memset(sh, 0, N * 4);
    OK(ps_pull_range(ctx, td, 0, N, sh, -1));
    EXPECT_PARTS(2, 2, "a pull into ps_alloc memory");
    cr_assert(eq(int, memcmp(sh, out, N * 4), 0), "mode %d: the shared pull differs", mode);
    /* Small parts: inline. */
    float small[1000];
    OK(ps_pull_range(ctx, td, 5000, 1000, small, -1));
    EXPECT_PARTS(0, 0, "a small pull");
    cr_assert(eq(int, memcmp(small, out + 5000, sizeof small), 0));
    /* A deadline 3 s away: inline, the same values. */
    memset(out, 0, N * 4);
    OK(ps_pull_range(ctx, td, 0, N, out, 3000));
    EXPECT_PARTS(0, 0, "a pull due in 3 s");
    for (int i = 0; i < N; i++) cr_assert(eq(flt, out[i], -g[i]), "mode %d, due in 3 s [%d]", mode, i);
    OK(ps_push_range(ctx, td, 0, N, g, 1, PS_LR_SCHEDULE, 3000));
    EXPECT_PARTS(0, 0, "a push due in 3 s");
    /* Non-blocking: always through the I/O thread. */
    ps_req *q;
    memset(sh, 0, N * 4);
    OK(ps_pull_range_start(ctx, td, 0, N, sh, &q));
    OK(ps_req_wait(q, -1));
    ps_req_free(q);
    EXPECT_PARTS(2, 2, "a pull_start into ps_alloc memory");
    for (int i = 0; i < N; i++) cr_assert(eq(flt, sh[i], -2.0f * g[i]), "mode %d, pull_start [%d]", mode, i);
#undef EXPECT_PARTS
    ps_ctx_close(ctx);
  }
  ps_free(sh);
  free(g);
  free(out);
}

/* A blocking call never overtakes a non-blocking one made before it: a pull after an
 * unfinished push_start sees that push (async, one connection per server). */
Test(direct, blocking_calls_keep_the_order_of_earlier_requests, .timeout = 60) {
  ps_ctx *ctx = open_embedded(2);
  uint32_t ts;
  OK(ps_table_declare(ctx, "s", PS_SPARSE, 1, "opt=sgd lr=1 update=sum mode=async", &ts));
  uint64_t keys[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  float one[8] = {1, 1, 1, 1, 1, 1, 1, 1}, out[8];
  for (int i = 0; i < 200; i++) {
    ps_req *r;
    if (i % 3 == 0) {
      OK(ps_push_start(ctx, ts, keys, 8, one, 1, PS_LR_SCHEDULE, &r));
      OK(ps_pull(ctx, ts, keys, 8, out, -1));
      OK(ps_req_wait(r, -1));
      ps_req_free(r);
    } else {
      OK(ps_push(ctx, ts, keys, 8, one, 1, PS_LR_SCHEDULE, -1));
      OK(ps_pull(ctx, ts, keys, 8, out, -1));
    }
    for (int k = 0; k < 8; k++) cr_assert(eq(flt, out[k], -(float)(i + 1)), "step %d key %d: %f", i, k, out[k]);
  }
  cr_assert(gt(dbl, stat_of(ctx, "direct_calls"), 0.0));
  ps_ctx_close(ctx);
}

typedef struct hammer {
  ps_ctx *ctx;
  uint32_t table;
  int n, nonblocking, rc;
} hammer;

static void *do_hammer(void *arg) {
  hammer *h = arg;
  uint64_t key = 42;
  float one = 1, row;
  for (int i = 0; i < h->n && !h->rc; i++) {
    if (h->nonblocking) {
      ps_req *r;
      h->rc = ps_push_start(h->ctx, h->table, &key, 1, &one, 1, PS_LR_SCHEDULE, &r);
      if (!h->rc) {
        h->rc = ps_req_wait(r, -1);
        ps_req_free(r);
      }
    } else {
      h->rc = ps_push(h->ctx, h->table, &key, 1, &one, 1, PS_LR_SCHEDULE, -1);
      if (!h->rc) h->rc = ps_pull(h->ctx, h->table, &key, 1, &row, -1);
    }
  }
  return NULL;
}

/* Threads that share a context, with blocking and non-blocking calls mixed: no push is
 * lost or applied twice while links move between the callers and the I/O thread. */
Test(direct, threads_sharing_a_context, .timeout = 60) {
  ps_ctx *ctx = open_embedded(2);
  uint32_t ts;
  OK(ps_table_declare(ctx, "s", PS_SPARSE, 1, "opt=sgd lr=1 update=sum mode=async", &ts));
  hammer h[4];
  pthread_t t[4];
  for (int i = 0; i < 4; i++) {
    h[i] = (hammer){.ctx = ctx, .table = ts, .n = 400, .nonblocking = i == 3};
    cr_assert(eq(int, pthread_create(&t[i], NULL, do_hammer, &h[i]), 0));
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    cr_assert(eq(int, h[i].rc, 0), "thread %d: %s", i, ps_errmsg());
  }
  uint64_t key = 42;
  float row;
  OK(ps_pull(ctx, ts, &key, 1, &row, -1));
  cr_assert(eq(flt, row, -1600.0f));
  ps_ctx_close(ctx);
}

/* Sync rounds with push, clock and pull all on lent links: each round is applied once
 * the worker's CLOCK (written by the caller) reaches the servers. */
Test(direct, sync_rounds_on_lent_links, .timeout = 60) {
  ps_ctx *ctx = open_embedded(2);
  uint32_t td;
  OK(ps_table_declare(ctx, "d", PS_DENSE, 64, "opt=sgd lr=1 update=sum mode=sync slice=8", &td));
  float g[64], w[64];
  for (int i = 0; i < 64; i++) g[i] = (float)i;
  for (int c = 1; c <= 50; c++) {
    OK(ps_push_range(ctx, td, 0, 64, g, 1, PS_LR_SCHEDULE, -1));
    OK(ps_clock(ctx));
    OK(ps_pull_range(ctx, td, 0, 64, w, -1));
    for (int i = 0; i < 64; i++) cr_assert(eq(flt, w[i], -(float)c * g[i]), "round %d [%d]: %f", c, i, w[i]);
  }
  cr_assert(gt(dbl, stat_of(ctx, "direct_calls"), 100.0), "only %.0f direct calls", stat_of(ctx, "direct_calls"));
  ps_ctx_close(ctx);
}

/* A blocking call on a lent link whose reply will never come because a later round is
 * needed: it times out; the server's late answer, which lands on the same connection,
 * is dropped by the next call, which gets its own answer. */
Test(direct, a_late_reply_to_a_timed_out_call_is_dropped, .timeout = 60) {
  mini m;
  ps_ctx *a, *b;
  mini_start(&m, 1, 2);
  open_two(&m, &a, &b);
  uint32_t ts, td;
  OK(ps_table_declare(a, "s", PS_SPARSE, 2, "opt=sgd lr=1 update=sum mode=sync", &ts));
  OK(ps_table_declare(a, "d", PS_DENSE, 8, "opt=sgd lr=1 update=sum mode=sync", &td));
  OK(ps_table_declare(b, "s", PS_SPARSE, 2, "opt=sgd lr=1 update=sum mode=sync", &ts));
  uint64_t key = 3;
  float one[2] = {1, 1}, row[2] = {7, 7}, d[8];
  OK(ps_push(a, ts, &key, 1, one, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(a));
  double before = stat_of(a, "direct_calls");
  FAILS(PS_ERR_TIMEOUT, ps_pull(a, ts, &key, 1, row, 100)); /* round 0 waits for b */
  cr_assert(gt(dbl, stat_of(a, "direct_calls"), before), "the pull did not run on a lent link");
  cr_assert(eq(flt, row[0], 7.0f), "a timed-out pull wrote the caller's buffer");
  OK(ps_push(b, ts, &key, 1, one, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(b)); /* round 0 closes: the server answers a's old pull now */
  usleep(100000);
  for (int i = 0; i < 8; i++) d[i] = 5.0f;
  OK(ps_pull_range(a, td, 0, 8, d, 5000));
  for (int i = 0; i < 8; i++) cr_assert(eq(flt, d[i], 0.0f), "[%d] = %f", i, d[i]);
  OK(ps_pull(a, ts, &key, 1, row, 5000));
  cr_assert(eq(flt, row[0], -2.0f));
  cr_assert(eq(flt, row[1], -2.0f));
  ps_ctx_close(a);
  ps_ctx_close(b);
  mini_stop(&m);
}

typedef struct stopper {
  mini *m;
  int delay_ms;
} stopper;

static void *stop_server_later(void *arg) {
  stopper *s = arg;
  usleep((useconds_t)s->delay_ms * 1000);
  ps__server_stop(s->m->srv[0]);
  return NULL;
}

/* A server that goes away while a caller waits on its lent link ends that call at once
 * with an error (not at the deadline), and the context keeps working. */
Test(direct, a_server_leaving_ends_a_waiting_call, .timeout = 60) {
  mini m;
  ps_ctx *a, *b;
  mini_start(&m, 1, 2);
  open_two(&m, &a, &b);
  uint32_t td;
  OK(ps_table_declare(a, "d", PS_DENSE, 8, "opt=sgd lr=1 update=sum mode=sync", &td));
  OK(ps_table_declare(b, "d", PS_DENSE, 8, "opt=sgd lr=1 update=sum mode=sync", &td));
  float g[8] = {1, 1, 1, 1, 1, 1, 1, 1}, d[8];
  OK(ps_push_range(a, td, 0, 8, g, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(a));
  double before = stat_of(a, "direct_calls");
  stopper st = {.m = &m, .delay_ms = 200};
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, stop_server_later, &st), 0));
  double t0 = now_s();
  int rc = ps_pull_range(a, td, 0, 8, d, 8000); /* waits for b's clock, which never comes */
  double dt = now_s() - t0;
  pthread_join(t, NULL);
  pthread_join(m.srv_thread[0], NULL);
  ps__server_destroy(m.srv[0]);
  m.nsrv = 0;
  cr_assert(ne(int, rc, 0), "the pull succeeded");
  cr_assert(ne(int, rc, PS_ERR_TIMEOUT), "the pull waited for its deadline (%.2f s)", dt);
  cr_assert(lt(dbl, dt, 5.0), "the pull took %.2f s", dt);
  cr_assert(gt(dbl, stat_of(a, "direct_calls"), before), "the pull did not run on a lent link");
  OK(ps_metric(a, "still", 1)); /* the context still works */
  ps_ctx_close(a);
  ps_ctx_close(b);
  mini_stop(&m);
}

/* A sparse pull whose reply is large enough to be streamed while its rows are looked
 * up (>= 16 MiB) answers exactly what small pulls of the same keys answer: existing
 * rows, rows it creates (initialised by the table's rule), and repeated keys. */
Test(api, a_streamed_sparse_pull_matches_small_pulls, .timeout = 120) {
  ps_ctx *ctx = open_embedded_with(1, "dedup", "0"); /* the whole 17.9 MB reply, repeats included */
  uint32_t ts;
  enum { DIM = 64, N = 70000 };
  OK(ps_table_declare(ctx, "e", PS_SPARSE, DIM, "opt=sgd lr=1 update=sum mode=async init=uniform:0.5", &ts));
  uint64_t *keys = malloc(N * sizeof *keys);
  float *big = malloc((size_t)N * DIM * 4), *small = malloc((size_t)N * DIM * 4), *g = malloc(1000 * DIM * 4);
  cr_assert(keys && big && small && g);
  for (int i = 0; i < N; i++) keys[i] = (uint64_t)(i % 50000) * 2654435761u; /* 20000 repeats */
  /* Half of the distinct keys exist (and were updated) before the big pull. */
  for (int i = 0; i < 1000 * DIM; i++) g[i] = 0.25f;
  for (int b = 0; b < 25000; b += 1000) OK(ps_push(ctx, ts, keys + b, 1000, g, 1, PS_LR_SCHEDULE, -1));
  OK(ps_pull(ctx, ts, keys, N, big, -1)); /* 17.9 MB reply */
  for (int b = 0; b < N; b += 1000) OK(ps_pull(ctx, ts, keys + b, N - b < 1000 ? N - b : 1000, small + (size_t)b * DIM, -1));
  cr_assert(eq(int, memcmp(big, small, (size_t)N * DIM * 4), 0), "the streamed reply differs from small pulls");
  /* Repeats carry the same row; an updated row is its initial value minus 0.25. */
  cr_assert(eq(int, memcmp(big, big + (size_t)50000 * DIM, DIM * 4), 0));
  int nonzero = 0;
  for (int i = 0; i < DIM; i++) nonzero += big[(size_t)30000 * DIM + i] != 0.0f;
  cr_assert(gt(int, nonzero, 0), "a created row is not initialised");
  free(keys);
  free(big);
  free(small);
  free(g);
  ps_ctx_close(ctx);
}

/* A large pull with repeated keys asks for each distinct key once (dedup) and gives the
 * same rows, in caller order, as small pulls (which are not de-duplicated) and as the
 * same pull with dedup=0: through lent links and through the loop (a *_start call), on
 * one server and routed over three, for rows of dim 16. Mostly distinct keys take the
 * plain path. */
Test(api, a_deduplicated_pull_matches_small_pulls, .timeout = 120) {
  enum { DIM = 16, N = 30000, DISTINCT = 4000 };
  uint64_t *keys = malloc(N * sizeof *keys), *uniq = malloc(N * sizeof *uniq);
  float *a = malloc((size_t)N * DIM * 4), *b = malloc((size_t)N * DIM * 4), *g = malloc(1000 * DIM * 4);
  cr_assert(keys && uniq && a && b && g);
  for (int i = 0; i < N; i++) keys[i] = (uint64_t)((i * 7919) % DISTINCT) * 2654435761u + 11;
  for (int i = 0; i < N; i++) uniq[i] = (uint64_t)i * 40503u + 5;
  for (int i = 0; i < 1000 * DIM; i++) g[i] = 0.5f;
  for (unsigned servers = 1; servers <= 3; servers += 2) {
    for (int dedup = 1; dedup >= 0; dedup--) {
      ps_ctx *ctx = open_embedded_with(servers, "dedup", dedup ? "1" : "0");
      uint32_t ts;
      OK(ps_table_declare(ctx, "e", PS_SPARSE, DIM, "opt=sgd lr=1 update=sum mode=async init=uniform:0.5 seed=9", &ts));
      for (int k = 0; k < 2000; k += 1000) OK(ps_push(ctx, ts, keys + k, 1000, g, 1, PS_LR_SCHEDULE, -1));
      double before = stat_of(ctx, "bytes_pulled");
      OK(ps_pull(ctx, ts, keys, N, a, -1));
      double moved = stat_of(ctx, "bytes_pulled") - before;
      if (dedup) /* one row per distinct key went over the wire */
        cr_assert(eq(dbl, moved, (double)DISTINCT * DIM * 4), "%u servers: %g bytes pulled", servers, moved);
      else
        cr_assert(eq(dbl, moved, (double)N * DIM * 4), "%u servers: %g bytes pulled", servers, moved);
      for (int k = 0; k < N; k += 1000) OK(ps_pull(ctx, ts, keys + k, 1000, b + (size_t)k * DIM, -1));
      cr_assert(eq(int, memcmp(a, b, (size_t)N * DIM * 4), 0), "%u servers, dedup %d: rows differ", servers, dedup);
      memset(a, 0, (size_t)N * DIM * 4);
      ps_req *q;
      OK(ps_pull_start(ctx, ts, keys, N, a, &q));
      OK(ps_req_wait(q, -1));
      ps_req_free(q);
      cr_assert(eq(int, memcmp(a, b, (size_t)N * DIM * 4), 0), "%u servers, dedup %d: *_start rows differ", servers,
                dedup);
      /* Mostly distinct keys: the plain path, every row on the wire. */
      before = stat_of(ctx, "bytes_pulled");
      OK(ps_pull(ctx, ts, uniq, N, a, -1));
      cr_assert(eq(dbl, stat_of(ctx, "bytes_pulled") - before, (double)N * DIM * 4));
      for (int k = 0; k < N; k += 1000) OK(ps_pull(ctx, ts, uniq + k, 1000, b + (size_t)k * DIM, -1));
      cr_assert(eq(int, memcmp(a, b, (size_t)N * DIM * 4), 0));
      ps_ctx_close(ctx);
    }
  }
  free(keys);
  free(uniq);
  free(a);
  free(b);
  free(g);
}
