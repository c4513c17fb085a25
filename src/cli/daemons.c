/*
 * daemons.c - `pshard scheduler` and `pshard server`: run one role in the foreground.
 *
 * Flags override PSHARD_* environment variables. SIGINT/SIGTERM stop the role cleanly
 * (a signal thread calls the thread-safe stop function). A bad flag prints usage and
 * exits 2.
 */
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent/agent.h"
#include "cli/cli.h"
#include "common/common.h"
#include "common/config.h"
#include "net/auth.h"
#include "sched/sched.h"
#include "server/server.h"

typedef struct sigctx {
  sigset_t set;
  void (*stop)(void *);
  void *arg;
} sigctx;

static void *signal_thread(void *arg) {
  sigctx *s = arg;
  int sig;
  if (sigwait(&s->set, &sig) == 0 && sig != SIGUSR2) {
    if (__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE))
      s->stop(s->arg);
    else
      _exit(128 + sig); /* nothing to stop cleanly yet */
  }
  return NULL;
}

static pthread_t start_signal_thread(sigctx *s) {
  pthread_t t;
  sigemptyset(&s->set);
  sigaddset(&s->set, SIGINT);
  sigaddset(&s->set, SIGTERM);
  sigaddset(&s->set, SIGUSR2); /* used to end the thread after a normal exit */
  pthread_sigmask(SIG_BLOCK, &s->set, NULL);
  signal(SIGPIPE, SIG_IGN);
  pthread_create(&t, NULL, signal_thread, s);
  return t;
}

static void end_signal_thread(pthread_t t) {
  pthread_kill(t, SIGUSR2);
  pthread_join(t, NULL);
}

static int env_uint(const char *name, uint64_t *out) {
  const char *v = getenv(name);
  return v && *v && !ps__parse_u64(v, out);
}

/* The job secret's flags (net/auth.h), shared by both roles. */
#define AUTH_LONG_OPTS                                                                                   \
  {"secret-file", required_argument, 0, 'Y'}, {"job-id", required_argument, 0, 'j'},                      \
      {"insecure", no_argument, 0, 'I'}
#define AUTH_USAGE                                                                                       \
  "  --secret-file F           the job secret is in file F (mode 0600) [PSHARD_SECRET_FILE]; or the\n"     \
  "                            secret itself in PSHARD_SECRET\n"                                           \
  "  --job-id ID               the job the secret is bound to (default) [PSHARD_JOB_ID]\n"                \
  "  --insecure                allow binding a non-loopback address without a secret [PSHARD_INSECURE]\n"

typedef struct auth_flags {
  const char *secret_file, *job;
  int insecure;
} auth_flags;

/* One of AUTH_LONG_OPTS into f: 1 if c was one, else 0. */
static int auth_flag(int c, const char *arg, auth_flags *f) {
  switch (c) {
  case 'Y': f->secret_file = arg; return 1;
  case 'j': f->job = arg; return 1;
  case 'I': f->insecure = 1; return 1;
  default: return 0;
  }
}

/* Apply the flags over the environment and check the result: 0, or 2 with a message. */
static int auth_apply(const auth_flags *f, const char *prog) {
  if ((f->secret_file && ps__auth_set_secret_file(f->secret_file)) || (f->job && ps__auth_set_job(f->job)) ||
      ps__auth_arm_env()) {
    fprintf(stderr, "pshard %s: %s\n", prog, ps_errmsg());
    return 2;
  }
  if (f->insecure) ps__auth_set_insecure(1);
  return 0;
}

static int parse_uint_flag(const char *flag, const char *v, uint64_t max, uint64_t *out) {
  if (ps__parse_u64(v, out) || *out > max) {
    fprintf(stderr, "pshard: bad value '%s' for %s (an integer up to %llu)\n", v, flag, (unsigned long long)max);
    return -1;
  }
  return 0;
}

/* The metrics' HTTP flags, shared by both roles: --http-port N|off (0: ephemeral),
 * --http-host H (127.0.0.1). */
#define HTTP_LONG_OPTS {"http-port", required_argument, 0, 'W'}, {"http-host", required_argument, 0, 'X'}
#define HTTP_USAGE(pad, what)                                                                              \
  "  --http-port N|off  " pad "serve " what " over HTTP on port N\n"                                        \
  "                     " pad "(0 = any, off = none; 0) [PSHARD_HTTP_PORT]\n"                                   \
  "  --http-host H      " pad "address of the HTTP server (127.0.0.1) [PSHARD_HTTP_HOST]\n"

typedef struct http_flags {
  int on, port;
  const char *host;
} http_flags;

/* "off", or a port: 0, or -1 with a message. */
static int http_port_parse(const char *prog, const char *v, const char *from, http_flags *f) {
  uint64_t p;
  if (!strcmp(v, "off")) {
    f->on = 0;
    return 0;
  }
  if (ps__parse_u64(v, &p) || p > 65535) {
    fprintf(stderr, "pshard %s: bad value '%s' for %s (a port from 0 to 65535, or off)\n", prog, v, from);
    return -1;
  }
  f->on = 1;
  f->port = (int)p;
  return 0;
}

/* The defaults and the environment: 0, or -1 (a bad PSHARD_HTTP_PORT). */
static int http_env(const char *prog, http_flags *f) {
  f->on = 1;
  f->port = 0;
  f->host = getenv("PSHARD_HTTP_HOST") && *getenv("PSHARD_HTTP_HOST") ? getenv("PSHARD_HTTP_HOST") : "127.0.0.1";
  const char *v = getenv("PSHARD_HTTP_PORT");
  return v && *v ? http_port_parse(prog, v, "PSHARD_HTTP_PORT", f) : 0;
}

/* One of HTTP_LONG_OPTS into f: 1 if c was one (-1 for a bad value), else 0. */
static int http_flag(const char *prog, int c, const char *arg, http_flags *f) {
  if (c == 'W') return http_port_parse(prog, arg, "--http-port", f) ? -1 : 1;
  if (c == 'X') {
    f->host = arg;
    return 1;
  }
  return 0;
}

static void sched_usage(FILE *f) {
  fprintf(f,
          "usage: pshard scheduler --servers S --workers K [options]\n\n"
          "Run the scheduler of a job. It prints 'listening on HOST:PORT' once bound.\n\n"
          "options (environment variable in brackets):\n"
          "  --servers S               servers expected before the job starts [PSHARD_SERVERS]\n"
          "  --workers K               workers expected before the job starts [PSHARD_WORKERS]\n"
          "  --host H                  address to bind (127.0.0.1) [PSHARD_HOST]\n"
          "  --port P                  port to bind, 0 = any (0) [PSHARD_PORT]\n"
          "  --heartbeat-ms N          check period (200) [PSHARD_HEARTBEAT_MS]\n"
          "  --heartbeat-timeout-ms N  a silent node is dead after N ms (3000) [PSHARD_HEARTBEAT_TIMEOUT_MS]\n"
          "  --stall-timeout-ms N      a worker that holds a sync round back N ms while others wait is\n"
          "                            removed (60000; 0 = never; a worker that never clocked: after\n"
          "                            the heartbeat timeout) [PSHARD_STALL_TIMEOUT_MS]\n"
          "  --addr-file F             also write HOST:PORT to F\n"
          "  --exit-when-done          stop (and stop the servers) once every worker has left;\n"
          "                            exit 1 if a worker died instead of leaving\n"
          "  --checkpoint-dir DIR      take checkpoints on request into DIR/ckpt-<id> [PSHARD_CHECKPOINT_DIR]\n"
          "  --checkpoint-keep K       complete checkpoints kept (3) [PSHARD_CHECKPOINT_KEEP]\n"
          "  --checkpoint-timeout-ms N a checkpoint fails when a server neither answers nor says it got\n"
          "                            on with its file for N ms (120000) [PSHARD_CHECKPOINT_TIMEOUT_MS]\n"
          "  --checkpoint-full-every N one checkpoint in N whole, the others increments (1)\n"
          "                            [PSHARD_CHECKPOINT_FULL_EVERY]\n"
          "  --restore DIR             resume the checkpoint DIR, or the newest one in DIR [PSHARD_RESTORE]\n"
          "  --replicas R              copies of every key range, 1 to 3, at most S (2 when S >= 2,\n"
          "                            else 1) [PSHARD_REPLICAS]\n"
          "  --vnodes N                ring points per server, as the servers' (128) [PSHARD_VNODES]\n"
          "  --state-dir DIR           keep the scheduler's state in DIR; started again with the same\n"
          "                            DIR (and --port), it takes its job's nodes back [PSHARD_STATE_DIR]\n"
          "  --verbose                 log registrations and membership changes\n"
          AUTH_USAGE HTTP_USAGE("       ", "the dashboard (/) and the job's /metrics")
          "  --help                    this text\n");
}

static void stop_sched(void *arg) { ps__sched_stop(arg); }
static void stop_server(void *arg) { ps__server_stop(arg); }

/* Long because it is one getopt loop over every flag and the checks of their values,
 * which read best in one place. */
int ps_cli_scheduler(int argc, char **argv) {
  static const struct option opts[] = {
      {"servers", required_argument, 0, 's'}, {"workers", required_argument, 0, 'w'},
      {"host", required_argument, 0, 'H'},    {"port", required_argument, 0, 'p'},
      {"heartbeat-ms", required_argument, 0, 'b'}, {"heartbeat-timeout-ms", required_argument, 0, 't'},
      {"stall-timeout-ms", required_argument, 0, 'S'}, {"addr-file", required_argument, 0, 'a'}, {"verbose", no_argument, 0, 'v'},
      {"help", no_argument, 0, 'h'},          {"exit-when-done", no_argument, 0, 'x'},
      {"checkpoint-dir", required_argument, 0, 'C'}, {"checkpoint-keep", required_argument, 0, 'K'},
      {"checkpoint-full-every", required_argument, 0, 'F'}, {"checkpoint-timeout-ms", required_argument, 0, 'T'},
      {"restore", required_argument, 0, 'R'}, {"state-dir", required_argument, 0, 'D'},
      {"replicas", required_argument, 0, 'r'}, {"vnodes", required_argument, 0, 'n'},
      AUTH_LONG_OPTS, HTTP_LONG_OPTS, {0, 0, 0, 0}};
  auth_flags af = {0};
  http_flags hf;
  if (http_env("scheduler", &hf)) return 2;
  int exit_when_done = 0;
  uint64_t servers = 0, workers = 0, port = 0, hb = 200, hbt = 3000, keep = 3, full_every = 1, replicas = 0,
           vnodes = 128, stall = 60000, ckpt_timeout = 120000;
  const char *ckpt_dir = getenv("PSHARD_CHECKPOINT_DIR"), *restore = getenv("PSHARD_RESTORE");
  const char *state_dir = getenv("PSHARD_STATE_DIR");
  int have_s = env_uint("PSHARD_SERVERS", &servers), have_w = env_uint("PSHARD_WORKERS", &workers);
  const char *host = getenv("PSHARD_HOST") ? getenv("PSHARD_HOST") : "127.0.0.1";
  const char *addr_file = NULL;
  int verbose = 0, c;
  env_uint("PSHARD_PORT", &port);
  env_uint("PSHARD_HEARTBEAT_MS", &hb);
  env_uint("PSHARD_HEARTBEAT_TIMEOUT_MS", &hbt);
  env_uint("PSHARD_STALL_TIMEOUT_MS", &stall);
  env_uint("PSHARD_CHECKPOINT_KEEP", &keep);
  env_uint("PSHARD_CHECKPOINT_TIMEOUT_MS", &ckpt_timeout);
  env_uint("PSHARD_CHECKPOINT_FULL_EVERY", &full_every);
  if (env_uint("PSHARD_REPLICAS", &replicas) && !replicas) {
    fprintf(stderr, "pshard scheduler: PSHARD_REPLICAS must be 1 to 3\n");
    return 2;
  }
  env_uint("PSHARD_VNODES", &vnodes);
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (auth_flag(c, optarg, &af)) continue;
    int hr = http_flag("scheduler", c, optarg, &hf);
    if (hr < 0) return 2;
    if (hr) continue;
    switch (c) {
    case 's': if (parse_uint_flag("--servers", optarg, 4096, &servers)) return 2; have_s = 1; break;
    case 'w': if (parse_uint_flag("--workers", optarg, 4096, &workers)) return 2; have_w = 1; break;
    case 'H': host = optarg; break;
    case 'p': if (parse_uint_flag("--port", optarg, 65535, &port)) return 2; break;
    case 'b': if (parse_uint_flag("--heartbeat-ms", optarg, 600000, &hb) || !hb) return 2; break;
    case 't': if (parse_uint_flag("--heartbeat-timeout-ms", optarg, 86400000, &hbt) || !hbt) return 2; break;
    case 'S': if (parse_uint_flag("--stall-timeout-ms", optarg, 86400000, &stall)) return 2; break;
    case 'a': addr_file = optarg; break;
    case 'x': exit_when_done = 1; break;
    case 'C': ckpt_dir = optarg; break;
    case 'K':
      if (parse_uint_flag("--checkpoint-keep", optarg, 1000000, &keep)) return 2;
      if (!keep) {
        fprintf(stderr, "pshard scheduler: --checkpoint-keep must be at least 1\n");
        return 2;
      }
      break;
    case 'F':
      if (parse_uint_flag("--checkpoint-full-every", optarg, 1000000, &full_every) || !full_every) {
        fprintf(stderr, "pshard scheduler: --checkpoint-full-every must be 1 to 1000000\n");
        return 2;
      }
      break;
    case 'T': if (parse_uint_flag("--checkpoint-timeout-ms", optarg, 86400000, &ckpt_timeout)) return 2; break;
    case 'R': restore = optarg; break;
    case 'D': state_dir = optarg; break;
    case 'r':
      if (parse_uint_flag("--replicas", optarg, 3, &replicas) || !replicas) {
        fprintf(stderr, "pshard scheduler: --replicas must be 1 to 3\n");
        return 2;
      }
      break;
    case 'n': if (parse_uint_flag("--vnodes", optarg, 4096, &vnodes) || !vnodes) return 2; break;
    case 'v': verbose = 1; break;
    case 'h': sched_usage(stdout); return 0;
    default:
      fprintf(stderr, "pshard scheduler: unknown or incomplete option '%s'\n", argv[optind - 1]);
      sched_usage(stderr);
      return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "pshard scheduler: unexpected argument '%s'\n", argv[optind]);
    sched_usage(stderr);
    return 2;
  }
  if (!have_s || !have_w || servers == 0 || workers == 0) {
    fprintf(stderr, "pshard scheduler: --servers and --workers are required (at least 1 each)\n");
    sched_usage(stderr);
    return 2;
  }
  if (!replicas) replicas = servers >= 2 ? 2 : 1; /* neither the flag nor PSHARD_REPLICAS */
  if (replicas < 1 || replicas > 3 || replicas > servers) {
    fprintf(stderr, "pshard scheduler: --replicas %llu needs 1 to 3 copies and at least that many servers (--servers %llu)\n",
            (unsigned long long)replicas, (unsigned long long)servers);
    return 2;
  }
  if (ckpt_timeout < 1000 || ckpt_timeout > 86400000) { /* the flag's, or PSHARD_CHECKPOINT_TIMEOUT_MS's */
    fprintf(stderr, "pshard scheduler: the checkpoint timeout must be 1000 to 86400000 ms, not %llu\n",
            (unsigned long long)ckpt_timeout);
    return 2;
  }
  ps__log_to_stderr(verbose ? PS_LOG_INFO : PS_LOG_WARN, "");
  if (auth_apply(&af, "scheduler")) return 2;
  sigctx sc = {0};
  pthread_t st = start_signal_thread(&sc);
  ps__sched_opts o = {.host = host, .port = (int)port, .servers = (uint32_t)servers, .workers = (uint32_t)workers,
                      .heartbeat_ms = (uint32_t)hb, .heartbeat_timeout_ms = (uint32_t)hbt,
                      .stall_timeout_ms = stall ? (uint32_t)(stall > UINT32_MAX - 1 ? UINT32_MAX - 1 : stall) : UINT32_MAX,
                      .exit_when_done = exit_when_done,
                      .checkpoint_dir = ckpt_dir && *ckpt_dir ? ckpt_dir : NULL,
                      .checkpoint_keep = (unsigned)keep,
                      .checkpoint_timeout_ms = (uint32_t)ckpt_timeout,
                      .checkpoint_full_every = (unsigned)(full_every ? full_every : 1),
                      .restore_dir = restore && *restore ? restore : NULL,
                      .state_dir = state_dir && *state_dir ? state_dir : NULL,
                      .replicas = (unsigned)replicas, .vnodes = (unsigned)vnodes,
                      .http = hf.on, .http_host = hf.host, .http_port = hf.port};
  ps__sched *s;
  if (ps__sched_create(&o, &s)) {
    fprintf(stderr, "pshard scheduler: %s\n", ps_errmsg());
    end_signal_thread(st);
    return 1;
  }
  printf("listening on %s:%d\n", host, ps__sched_port(s));
  if (ps__sched_http_port(s) >= 0)
    printf("dashboard on http://%s:%d/ (metrics: /metrics)\n", hf.host, ps__sched_http_port(s));
  fflush(stdout);
  if (addr_file && ps__sched_http_port(s) >= 0) { /* beside the address: where `pshard run` finds the dashboard */
    char hp[4096], tmp[4100];
    snprintf(hp, sizeof hp, "%s.http", addr_file);
    snprintf(tmp, sizeof tmp, "%s.tmp", hp);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%s:%d\n", hf.host, ps__sched_http_port(s)) < 0 || fclose(f) != 0 || rename(tmp, hp) != 0)
      fprintf(stderr, "pshard scheduler: cannot write %s\n", hp);
  }
  if (addr_file) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", addr_file);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%s:%d\n", host, ps__sched_port(s)) < 0 || fclose(f) != 0 || rename(tmp, addr_file) != 0) {
      fprintf(stderr, "pshard scheduler: cannot write %s\n", addr_file);
      ps__sched_destroy(s);
      end_signal_thread(st);
      return 1;
    }
  }
  sc.arg = s;
  __atomic_store_n(&sc.stop, stop_sched, __ATOMIC_RELEASE);
  int rc = ps__sched_run(s);
  ps__sched_destroy(s);
  end_signal_thread(st);
  return rc;
}

static void server_usage(FILE *f) {
  fprintf(f,
          "usage: pshard server --scheduler HOST:PORT [options]\n\n"
          "Run a parameter server: register with the scheduler, hold a shard of every table.\n\n"
          "options (environment variable in brackets):\n"
          "  --scheduler HOST:PORT   the scheduler [PSHARD_SCHEDULER]\n"
          "  --host H                address to bind and advertise (127.0.0.1) [PSHARD_HOST]\n"
          "  --port P                port, 0 = any (0)\n"
          "  --transport auto|tcp    auto also serves same-host peers over AF_UNIX (auto) [PSHARD_TRANSPORT]\n"
          "  --heartbeat-ms N        heartbeat period (200) [PSHARD_HEARTBEAT_MS]\n"
          "  --vnodes N              ring points per server (128) [PSHARD_VNODES]\n"
          "  --max-frame-mb N        largest accepted frame (2048) [PSHARD_MAX_FRAME_MB]\n"
          "  --connect-timeout-ms N  give up registering after N ms (60000) [PSHARD_CONNECT_TIMEOUT_MS]\n"
          "  --rejoin-ms N           a lost scheduler is waited for N ms while serving on (10000; 0: stop\n"
          "                          at once) [PSHARD_REJOIN_MS]\n"
          "  --poll-us N             after a worker's frame, poll the sockets for N us before sleeping,\n"
          "                          so a request that follows soon finds the server awake (50; 0 = off);\n"
          "                          0.5 ms more per MiB the frame moved on the socket, at most 1 ms\n"
          "                          [PSHARD_POLL_US]\n"
          "  --restore DIR           load this server's rows of every table from the checkpoint in DIR\n"
          "                          (a checkpoint's directory, or the newest complete one under DIR);\n"
          "                          the scheduler must be started with the same --restore [PSHARD_RESTORE]\n"
          "  --join                  replace a dead server of a running job with replicas >= 2: take its\n"
          "                          id and copy its rows from the other copies; refused when no server\n"
          "                          is dead. Before the job starts, register as any server does (so\n"
          "                          every server of a restarting launcher may have it) [PSHARD_JOIN=1]\n"
          "  --verbose               log table creation and membership changes\n"
          AUTH_USAGE HTTP_USAGE("     ", "/metrics")
          "  --help                  this text\n\n"
          "limits (environment only):\n"
          "  PSHARD_SERVER_MEMORY_MB   memory budget of the tables' rows (half the machine's memory)\n"
          "  PSHARD_FRAME_BUDGET_MB    bytes of partial frames in flight (a quarter of the memory\n"
          "                            budget, at least --max-frame-mb)\n"
          "  PSHARD_FRAME_DEADLINE_MS  a frame begun must arrive within this (60000)\n");
}

/* Long for the same reason as ps_cli_scheduler: one getopt loop and its checks. */
int ps_cli_server(int argc, char **argv) {
  static const struct option opts[] = {
      {"scheduler", required_argument, 0, 'S'}, {"host", required_argument, 0, 'H'},
      {"port", required_argument, 0, 'p'},      {"transport", required_argument, 0, 'T'},
      {"heartbeat-ms", required_argument, 0, 'b'}, {"vnodes", required_argument, 0, 'n'},
      {"max-frame-mb", required_argument, 0, 'm'}, {"connect-timeout-ms", required_argument, 0, 'c'},
      {"poll-us", required_argument, 0, 'P'},   {"verbose", no_argument, 0, 'v'},
      {"help", no_argument, 0, 'h'},            {"restore", required_argument, 0, 'R'},
      {"rejoin-ms", required_argument, 0, 'J'}, {"join", no_argument, 0, 'Q'},
      AUTH_LONG_OPTS, HTTP_LONG_OPTS, {0, 0, 0, 0}};
  auth_flags af = {0};
  http_flags hf;
  if (http_env("server", &hf)) return 2;
  const char *sched = getenv("PSHARD_SCHEDULER");
  const char *host = getenv("PSHARD_HOST") ? getenv("PSHARD_HOST") : "127.0.0.1";
  const char *join_env = getenv("PSHARD_JOIN");
  int join = 0;
  if (join_env && *join_env) {
    if (strcmp(join_env, "0") && strcmp(join_env, "1")) {
      fprintf(stderr, "pshard server: bad PSHARD_JOIN '%s' (0 or 1)\n", join_env);
      return 2;
    }
    join = join_env[0] == '1';
  }
  const char *transport = getenv("PSHARD_TRANSPORT") ? getenv("PSHARD_TRANSPORT") : "auto";
  const char *restore = getenv("PSHARD_RESTORE") && *getenv("PSHARD_RESTORE") ? getenv("PSHARD_RESTORE") : NULL;
  uint64_t port = 0, hb = 200, vnodes = 128, maxmb = 2048, cto = 60000, poll_us = 50, rejoin = PS__REJOIN_MS;
  int verbose = 0, c;
  env_uint("PSHARD_HEARTBEAT_MS", &hb);
  env_uint("PSHARD_REJOIN_MS", &rejoin);
  env_uint("PSHARD_VNODES", &vnodes);
  env_uint("PSHARD_MAX_FRAME_MB", &maxmb);
  env_uint("PSHARD_CONNECT_TIMEOUT_MS", &cto);
  env_uint("PSHARD_POLL_US", &poll_us);
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (auth_flag(c, optarg, &af)) continue;
    int hr = http_flag("server", c, optarg, &hf);
    if (hr < 0) return 2;
    if (hr) continue;
    switch (c) {
    case 'S': sched = optarg; break;
    case 'H': host = optarg; break;
    case 'p': if (parse_uint_flag("--port", optarg, 65535, &port)) return 2; break;
    case 'T': transport = optarg; break;
    case 'b': if (parse_uint_flag("--heartbeat-ms", optarg, 600000, &hb) || !hb) return 2; break;
    case 'n': if (parse_uint_flag("--vnodes", optarg, 4096, &vnodes) || !vnodes) return 2; break;
    case 'm': if (parse_uint_flag("--max-frame-mb", optarg, 1u << 20, &maxmb) || !maxmb) return 2; break;
    case 'c': if (parse_uint_flag("--connect-timeout-ms", optarg, 86400000, &cto) || !cto) return 2; break;
    case 'P': if (parse_uint_flag("--poll-us", optarg, 1000000, &poll_us)) return 2; break;
    case 'R': restore = optarg; break;
    case 'J': if (parse_uint_flag("--rejoin-ms", optarg, 86400000, &rejoin)) return 2; break;
    case 'Q': join = 1; break;
    case 'v': verbose = 1; break;
    case 'h': server_usage(stdout); return 0;
    default:
      fprintf(stderr, "pshard server: unknown or incomplete option '%s'\n", argv[optind - 1]);
      server_usage(stderr);
      return 2;
    }
  }
  char shost[PS_CFG_HOST_MAX];
  int sport;
  if (optind < argc) {
    fprintf(stderr, "pshard server: unexpected argument '%s'\n", argv[optind]);
    server_usage(stderr);
    return 2;
  }
  if (!sched || ps__parse_hostport(sched, shost, sizeof shost, &sport) || sport == 0) {
    fprintf(stderr, "pshard server: %s\n", sched ? "bad --scheduler address (HOST:PORT)" : "--scheduler is required");
    server_usage(stderr);
    return 2;
  }
  if (strcmp(transport, "auto") && strcmp(transport, "tcp")) {
    fprintf(stderr, "pshard server: bad --transport '%s' (auto or tcp)\n", transport);
    server_usage(stderr);
    return 2;
  }
  if (restore && (!*restore || strlen(restore) >= PS_CFG_PATH_MAX)) {
    fprintf(stderr, "pshard server: bad --restore directory (1..%d bytes)\n", PS_CFG_PATH_MAX - 1);
    server_usage(stderr);
    return 2;
  }
  if (join && restore) {
    fprintf(stderr, "pshard server: --join copies its rows from the running job; it takes no --restore\n");
    return 2;
  }
  ps__log_to_stderr(verbose ? PS_LOG_INFO : PS_LOG_WARN, "");
  if (auth_apply(&af, "server")) return 2;
  sigctx sc = {0};
  pthread_t st = start_signal_thread(&sc);
  ps__server_opts o = {.host = host, .port = (int)port, .sched_host = shost, .sched_port = sport,
                       .use_unix = strcmp(transport, "tcp") != 0, .heartbeat_ms = (uint32_t)hb,
                       .vnodes = (uint32_t)vnodes, .max_payload = maxmb << 20, .connect_timeout_ms = (uint32_t)cto,
                       .poll_us = (uint32_t)poll_us, .restore_dir = restore,
                       .rejoin_ms = (uint32_t)rejoin, .http = hf.on, .http_host = hf.host, .http_port = hf.port,
                       .join = join};
  ps__server *s;
  if (ps__server_create(&o, &s)) {
    fprintf(stderr, "pshard server: %s\n", ps_errmsg());
    end_signal_thread(st);
    return 1;
  }
  if (ps__server_http_port(s) >= 0) {
    printf("metrics on http://%s:%d/metrics\n", hf.host, ps__server_http_port(s));
    fflush(stdout);
  }
  sc.arg = s;
  __atomic_store_n(&sc.stop, stop_server, __ATOMIC_RELEASE);
  int rc = ps__server_run(s);
  ps__server_destroy(s);
  end_signal_thread(st);
  return rc ? 1 : 0;
}
