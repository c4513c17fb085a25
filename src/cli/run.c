/*
 * run.c - `pshard run`, the local launcher (`pshard exec`, for mpirun and Slurm, is in
 * exec.c).
 *
 * `pshard run -s S -w K -- COMMAND ARGS...` starts a scheduler, S servers and K workers
 * (each worker runs COMMAND with PSHARD_* role variables set), each in its own process
 * group, with stdout and stderr on a pipe. One poll loop prefixes every line with its
 * role ("[worker 1] ..."), prints a progress line from the scheduler's counters, and
 * watches the children: when every worker has exited 0 the servers and scheduler are
 * stopped and run exits 0; when any process fails first (or Ctrl-C arrives) everything
 * is stopped (SIGTERM, SIGKILL after a grace period) and run exits with the first
 * failure's status (128+N for a signal).
 *
 * Under --replicas R >= 2 a server that exits does not stop the job (its keys have other
 * copies); with --respawn-servers run starts `pshard server --join` in its place (at
 * most --max-respawns times), once the scheduler lists a server dead and no other
 * replacement is still copying, and says when the replacement has its rows.
 *
 * Both take the checkpoint flags (--checkpoint-dir, --checkpoint-every,
 * --checkpoint-keep, --restore) and hand them to the roles they start: the scheduler
 * writes and restores checkpoints, the servers load their rows from one, the worker of
 * rank 0 asks for one every N clocks.
 *
 * The children themselves (starting them, their output, their exits, the signals that
 * end the job) are in run_procs.c.
 */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/run_ckpt.h"
#include "cli/run_procs.h"
#include "common/common.h"
#include "common/config.h"
#include "net/auth.h"
#include "net/oneshot.h"
#include "proto/frame.h"

static char *sched_argv_saved[32]; /* how the scheduler was started, to start it again */
/* The dashboard: the file the scheduler writes its HTTP address to, the address, and
 * whether a restarted scheduler's is still to be printed (run_watch). */
static char dash_file[PS_CFG_PATH_MAX + 8], dash_addr[128];
static int dash_pending;
static char *join_argv[16];        /* how a replacement server is started (--respawn-servers) */
static char run_dir[160]; /* $TMPDIR (or /tmp)/pshard-run-XXXXXX */

/* Remove dir and what the job put in it: files, and directories of files (the
 * scheduler's state). */
static void remove_dir(const char *dir, int depth) {
  DIR *d = opendir(dir);
  if (d) {
    struct dirent *e;
    while ((e = readdir(d))) {
      if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
      char path[256];
      struct stat st;
      if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path || lstat(path, &st)) continue;
      if (S_ISDIR(st.st_mode)) {
        if (depth > 0) remove_dir(path, depth - 1);
      } else {
        unlink(path);
      }
    }
    closedir(d);
  }
  rmdir(dir);
}

/* Remove the job's temporary directory: the scheduler's address files and its state
 * (kept for a restart of the scheduler while the job runs, of no use after). */
static void cleanup_dir(void) {
  if (!run_dir[0]) return;
  remove_dir(run_dir, 1);
  run_dir[0] = '\0';
}
/* Deadlines for asking the scheduler for its counters: the progress line must not hold
 * up the output loop; the final counters are worth a longer wait. */
#define PROGRESS_STATS_MS 500
#define FINAL_STATS_MS 2000

static double metric_sum(const char *stats, const char *name, int *count) {
  double sum = 0;
  char key[80];
  *count = 0;
  snprintf(key, sizeof key, " name=%s value=", name);
  for (const char *p = strstr(stats, key); p; p = strstr(p + 1, key)) {
    sum += strtod(p + strlen(key), NULL);
    (*count)++;
  }
  return sum;
}

/* Before the job started: "S of S servers, K of K workers registered" into out; 0, or -1
 * when it has started or the scheduler does not answer. */
static int waiting_for(const char *stats, char *out, size_t cap) {
  unsigned started = 1, sa = 0, wa = 0, se = 0, we = 0;
  const char *st = strstr(stats, "started ");
  if (!st || sscanf(st, "started %u\nservers_alive %u\nworkers_alive %u\nservers_expected %u\nworkers_expected %u",
                    &started, &sa, &wa, &se, &we) != 5 || started)
    return -1;
  snprintf(out, cap, "%u of %u servers, %u of %u workers registered", sa, se, wa, we);
  return 0;
}

static void progress(const char *addr, uint64_t t0, int tty) {
  char stats[16384];
  if (ps_cli_fetch_stats(addr, PROGRESS_STATS_MS, stats, sizeof stats)) return;
  char line[256];
  size_t n = (size_t)snprintf(line, sizeof line, "[pshard] %6.1fs", (double)(ps__now_ms() - t0) / 1000.0);
  char wait[128];
  if (!waiting_for(stats, wait, sizeof wait)) /* before the job starts: what it waits for */
    n += (size_t)snprintf(line + n, sizeof line - n, "  waiting: %s", wait);
  const char *tk = strstr(stats, "tasks partitions=");
  if (tk) {
    unsigned parts = 0, epochs = 0, epoch = 0, done = 0;
    if (sscanf(tk, "tasks partitions=%u epochs=%u epoch=%u done=%u", &parts, &epochs, &epoch, &done) == 4) {
      if (epoch >= epochs)
        n += (size_t)snprintf(line + n, sizeof line - n, "  epochs done");
      else
        n += (size_t)snprintf(line + n, sizeof line - n, "  epoch %u/%u  partitions %u/%u", epoch + 1, epochs, done, parts);
    }
  }
  int c1, c2;
  double loss = metric_sum(stats, "loss", &c1);
  double eps = metric_sum(stats, "examples_per_s", &c2);
  if (c2) n += (size_t)snprintf(line + n, sizeof line - n, "  %.0f examples/s", eps);
  if (c1) n += (size_t)snprintf(line + n, sizeof line - n, "  loss %.4f", loss / c1);
  if (n >= sizeof line) n = sizeof line - 1;
  if (tty)
    fprintf(stderr, "\r%-100s", line);
  else
    fprintf(stderr, "%s\n", line);
  fflush(stderr);
}

static void run_usage(FILE *f) {
  fprintf(f,
          "usage: pshard run -s S -w K [options] -- COMMAND [ARGS...]\n\n"
          "Start a scheduler, S servers and K workers on this machine; every worker runs COMMAND\n"
          "with PSHARD_ROLE=worker, PSHARD_SCHEDULER, PSHARD_SERVERS, PSHARD_WORKERS and\n"
          "PSHARD_WORKER_INDEX set. Output lines are prefixed with their role. Stops everything\n"
          "on Ctrl-C or when a process fails, and exits with the first failure's status.\n\n"
          "options:\n"
          "  -s, --servers S               number of servers (1)\n"
          "  -w, --workers K               number of workers (1)\n"
          "      --colocate                every worker runs one of the servers as a thread\n"
          "                                (PSHARD_COLOCATE=1) instead of S server processes;\n"
          "                                S is then K (-s, if given, must equal -w)\n"
          "      --replicas R              copies of every key range, 1 to 3 and at most S (2 when\n"
          "                                S >= 2, else 1) [PSHARD_REPLICAS]; with R >= 2 the job\n"
          "                                goes on when a server dies\n"
          "      --respawn-servers         with R >= 2: when a server exits, start a replacement\n"
          "                                (pshard server --join) that copies its rows (off)\n"
          "      --max-respawns N          replacements started at most, over the job (3)\n"
          "      --heartbeat-timeout-ms N  a silent node is dead after N ms (3000)\n"
          "      --progress-ms N           progress line period, 0 = none (1000)\n"
          "      --mode M                  consistency model for the job's tables: sync, sync:M,\n"
          "                                ssp:S or async (PSHARD_MODE when it is set, else sync);\n"
          "                                sets PSHARD_MODE for the workers\n"
          "      --transport auto|tcp      same-host transport (auto = AF_UNIX)\n"
          "      --stats-out FILE          when the workers are done, save the scheduler's counters\n"
          "                                and metrics to FILE (input of `pshard plan --measured`)\n"
          "      --grace-ms N              SIGTERM to SIGKILL grace when stopping (3000)\n"
          "      --http-port N|off         the scheduler's dashboard and the job's /metrics on port N,\n"
          "                                0 = any (0); the servers serve theirs on ports of their own\n"
          "                                (off: no HTTP at all) [PSHARD_HTTP_PORT]\n"
          CKPT_USAGE
          "      --verbose                 servers and scheduler log their events\n"
          "  -h, --help                    this text\n");
}

const char *ps_cli_self_exe(void) {
  static char path[4096];
  ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return "pshard";
  path[n] = '\0';
  return path;
}

/* What `pshard run` was asked to do. */
typedef struct run_opts {
  uint64_t S, K, hbt, prog, grace;
  uint64_t R;            /* replicas (2 when S >= 2, else 1) */
  int R_given;           /* --replicas (or PSHARD_REPLICAS) */
  int respawn;           /* --respawn-servers */
  uint64_t max_respawns; /* --max-respawns (3) */
  const char *mode;      /* NULL: sync */
  const char *transport;
  const char *stats_out; /* NULL: none */
  const char *http_port; /* the scheduler's --http-port ("0": any, "off") */
  int verbose, colocate, s_given;
  ckpt_opts ck;
  char **cmd;            /* the worker command, NULL-terminated */
} run_opts;

/* The flags, into o. -1 to go on, or the exit status (usage printed as needed). */
static int run_parse_flags(int argc, char **argv, run_opts *o) {
  static const struct option opts[] = {
      {"servers", required_argument, 0, 's'}, {"workers", required_argument, 0, 'w'},
      {"heartbeat-timeout-ms", required_argument, 0, 't'}, {"progress-ms", required_argument, 0, 'P'},
      {"transport", required_argument, 0, 'T'}, {"grace-ms", required_argument, 0, 'g'},
      {"verbose", no_argument, 0, 'v'},       {"help", no_argument, 0, 'h'},
      {"mode", required_argument, 0, 'm'},    {"stats-out", required_argument, 0, 'o'},
      {"colocate", no_argument, 0, 'C'},      {"replicas", required_argument, 0, 'r'},
      {"http-port", required_argument, 0, 'W'},
      {"respawn-servers", no_argument, 0, 1001}, {"max-respawns", required_argument, 0, 1002},
      CKPT_LONG_OPTS, {0, 0, 0, 0}};
  int c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "+s:w:h", opts, NULL)) != -1) {
    uint64_t *dst = NULL, max = 0;
    int ck = ps__cli_ckpt_flag(c, optarg, &o->ck, "run");
    if (ck >= 0) {
      if (ck) run_usage(stderr);
      if (ck) return ck;
      continue;
    }
    switch (c) {
    case 's': dst = &o->S; max = 256; o->s_given = 1; break;
    case 'C': o->colocate = 1; break;
    case 'w': dst = &o->K; max = 512; break;
    case 'r': dst = &o->R; max = 3; o->R_given = 1; break;
    case 1001: o->respawn = 1; break;
    case 1002: dst = &o->max_respawns; max = 1000; break;
    case 't': dst = &o->hbt; max = 86400000; break;
    case 'P': dst = &o->prog; max = 3600000; break;
    case 'g': dst = &o->grace; max = 600000; break;
    case 'T': o->transport = optarg; break;
    case 'o': o->stats_out = optarg; break;
    case 'W': {
      uint64_t p;
      if (strcmp(optarg, "off") && (ps__parse_u64(optarg, &p) || p > 65535)) {
        fprintf(stderr, "pshard run: bad value '%s' for --http-port (a port from 0 to 65535, or off)\n", optarg);
        return 2;
      }
      o->http_port = optarg;
      break;
    }
    case 'm': {
      ps__mode m;
      char msg[160];
      if (ps__mode_parse(optarg, &m, msg, sizeof msg)) {
        fprintf(stderr, "pshard run: --mode: %s\n", msg);
        return 2;
      }
      o->mode = optarg;
      break;
    }
    case 'v': o->verbose = 1; break;
    case 'h': run_usage(stdout); return 0;
    default:
      fprintf(stderr, "pshard run: unknown or incomplete option '%s'\n", argv[optind - 1]);
      run_usage(stderr);
      return 2;
    }
    if (dst && (ps__parse_u64(optarg, dst) || *dst > max)) {
      fprintf(stderr, "pshard run: bad value '%s' for %s (an integer from 0 to %llu)\n", optarg, argv[optind - 2],
              (unsigned long long)max);
      run_usage(stderr);
      return 2;
    }
  }
  return -1;
}

/* The flags and the command together. -1 to go on, or the exit status. */
static int run_check(int argc, char **argv, run_opts *o) {
  const char *env_mode = getenv("PSHARD_MODE");
  if (!o->mode && env_mode && *env_mode) { /* an exported mode holds unless --mode says otherwise */
    ps__mode m;
    char msg[160];
    if (ps__mode_parse(env_mode, &m, msg, sizeof msg)) {
      fprintf(stderr, "pshard run: PSHARD_MODE: %s\n", msg);
      return 2;
    }
    o->mode = env_mode;
  }
  if (o->colocate) {
    if (o->s_given && o->S != o->K) {
      fprintf(stderr, "pshard run: --colocate runs one server in each worker: -s must equal -w (or be left out)\n");
      return 2;
    }
    if (o->K > 256) {
      fprintf(stderr, "pshard run: --colocate: at most 256 servers, so at most 256 workers\n");
      return 2;
    }
    o->S = o->K;
  }
  const char *env_r = getenv("PSHARD_REPLICAS");
  if (!o->R_given && env_r && *env_r) {
    if (ps__parse_u64(env_r, &o->R) || o->R == 0 || o->R > 3) {
      fprintf(stderr, "pshard run: PSHARD_REPLICAS must be 1 to 3, not '%s'\n", env_r);
      return 2;
    }
    o->R_given = 1;
  }
  if (!o->R_given) o->R = o->S >= 2 ? 2 : 1; /* a second copy whenever there can be one */
  if (o->R == 0 || o->R > o->S) {
    fprintf(stderr, "pshard run: --replicas %llu needs at least that many servers (-s %llu), and 1 to 3 copies\n",
            (unsigned long long)o->R, (unsigned long long)o->S);
    return 2;
  }
  if (o->respawn && (o->R < 2 || o->colocate)) {
    fprintf(stderr, "pshard run: --respawn-servers needs --replicas 2 or 3 (and so -s 2 or more) and server processes (not --colocate): "
                    "a replacement copies a dead server's rows from their other copies\n");
    return 2;
  }
  if (o->S == 0 || o->K == 0 || o->hbt == 0) {
    fprintf(stderr, "pshard run: servers, workers and the heartbeat timeout must be at least 1\n");
    return 2;
  }
  if (strcmp(o->transport, "auto") && strcmp(o->transport, "tcp")) {
    fprintf(stderr, "pshard run: bad --transport '%s' (auto or tcp)\n", o->transport);
    return 2;
  }
  if (o->colocate && o->ck.restore) {
    /* A colocated server is a thread of its worker, which does not load checkpoints. */
    fprintf(stderr, "pshard run: --restore needs server processes; it cannot be used with --colocate\n");
    return 2;
  }
  int rc = ps__cli_ckpt_check(&o->ck, "run");
  if (rc >= 0) return rc;
  if (optind >= argc) {
    fprintf(stderr, "pshard run: no worker command (put it after --)\n");
    run_usage(stderr);
    return 2;
  }
  o->cmd = argv + optind;
  return -1;
}

/* The job's temporary directory (its name into run_dir, removed at exit) and the
 * signal handling of the output loop. 0, or the exit status. */
static int run_prepare(void) {
  const char *tmp = getenv("TMPDIR");
  char dir[sizeof run_dir];
  if (!tmp || !*tmp) tmp = "/tmp";
  int n = snprintf(dir, sizeof dir, "%s/pshard-run-XXXXXX", tmp);
  if (n < 0 || (size_t)n >= sizeof dir) {
    fprintf(stderr, "pshard run: TMPDIR is too long (at most %zu bytes)\n", sizeof dir - 18);
    return 1;
  }
  if (!mkdtemp(dir)) {
    fprintf(stderr, "pshard run: cannot create a temporary directory in %s: %s\n", tmp, strerror(errno));
    return 1;
  }
  snprintf(run_dir, sizeof run_dir, "%s", dir);
  atexit(cleanup_dir);
  return ps__procs_signals();
}

/* The scheduler's HTTP address HOST:PORT from dash_file into out: 1, or 0 when there is
 * none (yet: a scheduler writes it before its data address, and not with --http-port off). */
static int read_dashboard(char *out, size_t cap) {
  FILE *hf = fopen(dash_file, "r");
  out[0] = '\0';
  if (hf) {
    if (fgets(out, (int)cap, hf)) out[strcspn(out, "\n")] = '\0';
    fclose(hf);
  }
  return out[0] != '\0';
}

/* Start the scheduler (ps__procs[0]) and wait up to 10 s for its address in addr_file.
 * -1 with the address in addr, or the exit status (everything stopped). */
static int run_scheduler(const run_opts *o, const char *exe, char *addr_file, char *addr, size_t cap, uint64_t t0) {
  static char s_s[16], s_k[16], s_hbt[24], s_r[8]; /* static: sched_argv_saved points at them */
  snprintf(s_r, sizeof s_r, "%llu", (unsigned long long)o->R);
  snprintf(s_s, sizeof s_s, "%llu", (unsigned long long)o->S);
  snprintf(s_k, sizeof s_k, "%llu", (unsigned long long)o->K);
  snprintf(s_hbt, sizeof s_hbt, "%llu", (unsigned long long)o->hbt);
  /* Its state in the job's directory: a scheduler that dies is started again (run_watch)
   * and takes the job back (src/sched/state.c). */
  static char state_dir[sizeof run_dir + 8];
  snprintf(state_dir, sizeof state_dir, "%s/state", run_dir);
  char *sched_argv[32] = {(char *)exe, "scheduler", "--servers", s_s, "--workers", s_k, "--addr-file", addr_file,
                          "--heartbeat-timeout-ms", s_hbt, "--state-dir", state_dir};
  int n = 12;
  sched_argv[n++] = "--replicas";
  sched_argv[n++] = s_r;
  sched_argv[n++] = "--http-port";
  sched_argv[n++] = (char *)o->http_port;
  ps__cli_ckpt_sched_args(&o->ck, sched_argv, &n);
  if (o->verbose) sched_argv[n++] = "--verbose";
  sched_argv[n] = NULL;
  for (int i = 0; i <= n; i++) sched_argv_saved[i] = sched_argv[i];
  if (!ps__proc_spawn("scheduler", 0, sched_argv, NULL)) {
    fprintf(stderr, "pshard run: cannot start the scheduler\n");
    return 1;
  }
  while (ps__now_ms() - t0 < 10000) {
    FILE *f = fopen(addr_file, "r");
    if (f) {
      if (fgets(addr, (int)cap, f)) addr[strcspn(addr, "\n")] = '\0';
      fclose(f);
      if (addr[0]) break;
    }
    ps__procs_reap();
    ps__proc_drain(&ps__procs[0], 0);
    if (ps__procs[0].exited) break;
    usleep(10000);
  }
  if (!addr[0]) {
    fprintf(stderr, "pshard run: the scheduler did not start\n");
    ps__procs_stop((int)o->grace);
    return ps__procs[0].exited && ps__procs[0].status ? ps__procs[0].status : 1;
  }
  snprintf(dash_file, sizeof dash_file, "%s.http", addr_file); /* written before the address */
  if (read_dashboard(dash_addr, sizeof dash_addr))
    fprintf(stderr, "[pshard] dashboard: http://%s/ (the job's metrics: http://%s/metrics)\n", dash_addr, dash_addr);
  return -1;
}

/* Start the S servers (none when colocated) and the K workers. -1, or the exit status
 * (everything stopped). */
static int run_nodes(const run_opts *o, const char *exe, char *addr) {
  char *srv_argv[12] = {(char *)exe, "server", "--scheduler", addr, "--transport", (char *)o->transport,
                        "--http-port", strcmp(o->http_port, "off") ? "0" : "off"};
  int n = 8;
  if (o->ck.restore) {
    srv_argv[n++] = "--restore";
    srv_argv[n++] = (char *)o->ck.restore;
  }
  if (o->verbose) srv_argv[n++] = "--verbose";
  srv_argv[n] = NULL;
  /* A replacement: the same flags but --restore (it copies its rows from the other
   * copies), and --join. */
  int nj = 0;
  for (int i = 0; i < n; i++) {
    if (!strcmp(srv_argv[i], "--restore")) {
      i++;
      continue;
    }
    join_argv[nj++] = srv_argv[i];
  }
  join_argv[nj++] = "--join";
  join_argv[nj] = NULL;
  for (uint64_t i = 0; i < (o->colocate ? 0 : o->S); i++) {
    char name[32];
    snprintf(name, sizeof name, "server %llu", (unsigned long long)i);
    if (!ps__proc_spawn(name, 0, srv_argv, NULL)) {
      fprintf(stderr, "pshard run: cannot start %s\n", name);
      ps__procs_stop((int)o->grace);
      return 1;
    }
  }
  static char env_role[] = "PSHARD_ROLE=worker";
  char env_sched[160], env_s[48], env_k[48], env_t[48], env_m[64];
  snprintf(env_m, sizeof env_m, "PSHARD_MODE=%s", o->mode ? o->mode : "sync"); /* o->mode: --mode or PSHARD_MODE */
  snprintf(env_sched, sizeof env_sched, "PSHARD_SCHEDULER=%s", addr);
  snprintf(env_s, sizeof env_s, "PSHARD_SERVERS=%llu", (unsigned long long)o->S);
  snprintf(env_k, sizeof env_k, "PSHARD_WORKERS=%llu", (unsigned long long)o->K);
  snprintf(env_t, sizeof env_t, "PSHARD_TRANSPORT=%s", o->transport);
  for (uint64_t i = 0; i < o->K; i++) {
    char name[32], *env_i = ps__malloc(48);
    if (!env_i) break;
    snprintf(name, sizeof name, "worker %llu", (unsigned long long)i);
    snprintf(env_i, 48, "PSHARD_WORKER_INDEX=%llu", (unsigned long long)i);
    static char env_colo[] = "PSHARD_COLOCATE=1";
    /* A colocated server takes a port of its own, as the server processes do: the
     * scheduler's --http-port (PSHARD_HTTP_PORT) is the dashboard's alone. */
    static char env_http_any[] = "PSHARD_HTTP_PORT=0", env_http_off[] = "PSHARD_HTTP_PORT=off";
    char *env[12] = {env_role, env_sched, env_s, env_k, env_t, env_i, env_m};
    int ne = 7;
    if (o->ck.every) env[ne++] = (char *)o->ck.env_every;
    if (o->colocate) env[ne++] = env_colo;
    if (o->colocate) env[ne++] = strcmp(o->http_port, "off") ? env_http_any : env_http_off;
    env[ne] = NULL;
    if (!ps__proc_spawn(name, 1, o->cmd, env)) {
      fprintf(stderr, "pshard run: cannot start %s\n", name);
      ps__procs_stop((int)o->grace);
      return 1;
    }
    free(env_i); /* the child has its own copy */
  }
  return -1;
}

/* Wait up to 200 ms for output or a signal, and pass on what arrived. */
/* --stats-out: the scheduler's counters into path. 0, or 1 (said why). */
static int save_stats(const char *path, const char *addr) {
  static char stats[1 << 20];
  FILE *f = NULL;
  if (ps_cli_fetch_stats(addr, FINAL_STATS_MS, stats, sizeof stats)) {
    fprintf(stderr, "[pshard] cannot save the job's counters to %s: %s\n", path, ps_errmsg());
    return 1;
  }
  if (!(f = fopen(path, "w"))) {
    fprintf(stderr, "[pshard] cannot save the job's counters to %s: %s\n", path, strerror(errno));
    return 1;
  }
  int bad = fputs(stats, f) < 0;
  if (fclose(f) != 0) bad = 1;
  if (bad) {
    fprintf(stderr, "[pshard] cannot save the job's counters to %s: write failed\n", path);
    return 1;
  }
  return 0;
}

/* Every worker exited 0: save the counters if asked, stop the servers, then the
 * scheduler. The exit status. */
static int run_finish(const run_opts *o, const char *addr, uint64_t t0) {
  int status = 0;
  if (o->stats_out) status = save_stats(o->stats_out, addr);
  /* Servers first, so they do not report the scheduler's exit as a loss. */
  for (int i = 1; i < ps__nprocs; i++)
    if (!ps__procs[i].exited && !ps__procs[i].is_worker) kill(-ps__procs[i].pid, SIGTERM);
  for (uint64_t t1 = ps__now_ms(); ps__now_ms() - t1 < o->grace;) {
    ps__procs_reap();
    int up = 0;
    for (int i = 1; i < ps__nprocs; i++) {
      ps__proc_drain(&ps__procs[i], 0);
      up += !ps__procs[i].exited && !ps__procs[i].is_worker;
    }
    if (!up) break;
    usleep(10000);
  }
  ps__procs_stop((int)o->grace);
  fprintf(stderr, "[pshard] all %llu workers finished in %.1f s\n", (unsigned long long)o->K,
          (double)(ps__now_ms() - t0) / 1000.0);
  return status;
}

#define SCHED_RESTARTS 5 /* a scheduler that keeps dying is a failure after this many */

/* The scheduler (ps__procs[sched]) died while workers run: start it again on its port with
 * its state directory, so the nodes, which wait for it, are taken back. 0, or -1 when it
 * cannot be (the caller fails the job). */
static int restart_scheduler(const char *addr, int *sched, int *restarts) {
  proc *old = &ps__procs[*sched];
  const char *colon = strrchr(addr, ':');
  if (!colon || ++*restarts > SCHED_RESTARTS || ps__nprocs == MAX_PROCS) return -1;
  static char port[16], state_dir[sizeof run_dir + 8];
  snprintf(port, sizeof port, "%s", colon + 1);
  snprintf(state_dir, sizeof state_dir, "%s/state", run_dir);
  char *argv[32];
  int n = 0;
  for (; n < 30 && sched_argv_saved[n]; n++) argv[n] = sched_argv_saved[n];
  argv[n++] = "--port";
  argv[n++] = port;
  argv[n] = NULL;
  /* The dashboard keeps its port too (bookmarks and scrape targets stay valid), unless
   * the last scheduler started on it died before serving it (the port may be taken):
   * then any port. The address is printed again once the new scheduler wrote it. */
  static char http_port[16];
  const char *hc = strrchr(dash_addr, ':');
  if (hc && dash_addr[0] && !dash_pending) {
    snprintf(http_port, sizeof http_port, "%s", hc + 1);
    for (int i = 0; i + 1 < n; i++)
      if (!strcmp(argv[i], "--http-port")) argv[i + 1] = http_port;
  }
  unlink(dash_file);
  dash_pending = dash_addr[0] != '\0';
  fprintf(stderr, "[pshard] the scheduler exited with status %d; starting it again on port %s (%d of %d)\n",
          old->status, port, *restarts, SCHED_RESTARTS);
  old->replaced = 1;
  proc *p = ps__proc_spawn("scheduler", 0, argv, NULL);
  if (!p) return -1;
  *sched = (int)(p - ps__procs);
  return 0;
}

/* --respawn-servers: servers that exited and wait for a replacement, and the last one
 * started, until it has its rows. */
typedef struct respawn_state {
  uint64_t started;       /* replacements started */
  unsigned pending;       /* server exits without a replacement yet */
  uint64_t pending_since; /* ms */
  uint64_t next_check;    /* ms: the scheduler's counters are read every RESPAWN_CHECK_MS */
  int watched;            /* ps__procs index of the replacement copying its rows, or -1 */
  int dead_at_start;      /* dead servers the scheduler listed when it was started */
  int seen_syncing;       /* the scheduler listed a replacement copying since then */
  int before_start;       /* the job had not started when it was started */
  uint64_t watched_since; /* ms */
} respawn_state;

#define RESPAWN_CHECK_MS 250
#define RESPAWN_WAIT_MS 60000 /* a server exit the scheduler does not list as dead for this long is let go */

/* The scheduler's server lines: how many are dead, and whether one is still copying
 * its rows as a replacement (`late=1 syncing=1`); and whether the job started. 0, or
 * -1 when unreachable. */
static int sched_servers(const char *addr, int *dead, int *syncing, int *started) {
  static char stats[1 << 18];
  if (ps_cli_fetch_stats(addr, PROGRESS_STATS_MS, stats, sizeof stats)) return -1;
  *dead = *syncing = 0;
  *started = !strncmp(stats, "started 1\n", 10) || strstr(stats, "\nstarted 1\n") || strstr(stats, "\nstarted 2\n");
  for (const char *l = stats; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL) {
    const char *e = strchr(l, '\n');
    size_t len = e ? (size_t)(e - l) : strlen(l);
    char line[512];
    if (strncmp(l, "node ", 5) || len >= sizeof line) continue;
    memcpy(line, l, len);
    line[len] = '\0';
    if (!strstr(line, " role=server ")) continue;
    if (strstr(line, " alive=0")) (*dead)++;
    else if (strstr(line, " syncing=1")) (*syncing)++;
  }
  return 0;
}

/* Start a replacement for an exited server once the scheduler lists a dead one and no
 * replacement is copying (one syncs at a time), and say when the last one has its rows. */
static void respawn_tick(const run_opts *o, const char *addr, respawn_state *rs, int tty) {
  uint64_t now = ps__now_ms();
  if ((!rs->pending && rs->watched < 0) || now < rs->next_check) return;
  rs->next_check = now + RESPAWN_CHECK_MS;
  int dead, syncing, started;
  if (sched_servers(addr, &dead, &syncing, &started)) return; /* the scheduler is away: later */
  if (rs->watched >= 0 && syncing) rs->seen_syncing = 1;
  /* It took a dead server's place (one dead fewer, or it was seen copying) and nobody
   * copies any more; or it is gone; or the scheduler never listed it (given up). */
  if (rs->watched >= 0 && !syncing && (dead < rs->dead_at_start || rs->seen_syncing)) {
    proc *w = &ps__procs[rs->watched];
    if (!w->exited) {
      if (tty && o->prog) fprintf(stderr, "\n");
      if (rs->before_start) /* it took the place with nothing to copy */
        fprintf(stderr, "[pshard] %s has taken the dead server's place before the job started\n", w->name);
      else
        fprintf(stderr, "[pshard] %s has copied its rows: it holds real copies of the dead server's key ranges\n",
                w->name);
    }
    rs->watched = -1;
  }
  if (rs->watched >= 0 && (ps__procs[rs->watched].exited || now - rs->watched_since > RESPAWN_WAIT_MS)) rs->watched = -1;
  if (!rs->pending || syncing || rs->watched >= 0) return;
  if (!dead) {
    if (now - rs->pending_since < RESPAWN_WAIT_MS) return;
    fprintf(stderr, "[pshard] the scheduler lists no dead server; no replacement started\n");
    rs->pending = 0;
    return;
  }
  char name[32];
  snprintf(name, sizeof name, "server r%llu", (unsigned long long)rs->started + 1);
  if (tty && o->prog) fprintf(stderr, "\n");
  proc *p = ps__nprocs < MAX_PROCS ? ps__proc_spawn(name, 0, join_argv, NULL) : NULL;
  rs->pending--;
  rs->pending_since = now;
  if (!p) {
    fprintf(stderr, "[pshard] cannot start a replacement server\n");
    return;
  }
  rs->started++;
  rs->watched = (int)(p - ps__procs);
  rs->dead_at_start = dead;
  rs->seen_syncing = 0;
  rs->before_start = !started;
  rs->watched_since = now;
  fprintf(stderr, "[pshard] starting %s (pshard server --join, %llu of at most %llu) to take a dead server's place\n",
          name, (unsigned long long)rs->started, (unsigned long long)o->max_respawns);
}

/* The output loop: relay output, print progress, and end the job on a signal, on the
 * first failure (a worker's nonzero exit or any exit of the others) or when every
 * worker is done. A scheduler that dies while workers run is started again. The exit
 * status. */
static int run_watch(const run_opts *o, const char *addr, uint64_t t0) {
  int tty = isatty(2), status = 0, sched = 0, restarts = 0;
  uint64_t last_prog = ps__now_ms();
  const char *failed = NULL;
  respawn_state rs = {.watched = -1};
  for (;;) {
    ps__procs_poll();
    ps__procs_reap();
    if (o->respawn) respawn_tick(o, addr, &rs, tty);
    if (ps__procs[sched].exited && !ps__got_signal && ps__procs[sched].status != 0) {
      int workers_up = 0;
      for (int i = 0; i < ps__nprocs; i++) workers_up += ps__procs[i].is_worker && !ps__procs[i].exited;
      if (workers_up && restart_scheduler(addr, &sched, &restarts) == 0) continue;
    }
    char dash_new[sizeof dash_addr];
    if (dash_pending && read_dashboard(dash_new, sizeof dash_new)) {
      memcpy(dash_addr, dash_new, sizeof dash_addr);
      dash_pending = 0;
      if (tty && o->prog) fprintf(stderr, "\n");
      fprintf(stderr, "[pshard] dashboard (the scheduler started again): http://%s/ (the job's metrics: http://%s/metrics)\n",
              dash_addr, dash_addr);
    }
    if (ps__got_signal) {
      if (tty && o->prog) fprintf(stderr, "\n");
      fprintf(stderr, "[pshard] interrupted; stopping every process\n");
      ps__procs_stop((int)o->grace);
      return 128 + ps__got_signal;
    }
    int workers_left = 0;
    for (int i = 0; i < ps__nprocs; i++) {
      proc *p = &ps__procs[i];
      if (p->is_worker && !p->exited) workers_left++;
      if (!p->exited || failed || p->replaced) continue;
      if (o->R >= 2 && !p->is_worker && i != sched && !strncmp(p->name, "server", 6)) {
        /* Its keys have other copies: the job goes on (a worker fails if a range lost
         * every copy, and that stops it). */
        if (tty && o->prog) fprintf(stderr, "\n");
        fprintf(stderr, "[pshard] %s exited with status %d; its keys are served by their other copies (replicas %llu)\n",
                p->name, p->status, (unsigned long long)o->R);
        p->replaced = 1;
        if (o->respawn && rs.started + rs.pending < o->max_respawns) {
          if (!rs.pending) rs.pending_since = ps__now_ms();
          rs.pending++;
        } else if (o->respawn) {
          fprintf(stderr, "[pshard] no replacement for it: %llu started already (--max-respawns)\n",
                  (unsigned long long)rs.started);
        }
        continue;
      }
      if (p->status != 0 || !p->is_worker) {
        failed = p->name;
        status = p->status ? p->status : 1;
      }
    }
    if (failed) {
      if (tty && o->prog) fprintf(stderr, "\n");
      fprintf(stderr, "[pshard] %s exited with status %d; stopping every process\n", failed, status);
      char stats[16384], wait[128];
      if (!ps_cli_fetch_stats(addr, PROGRESS_STATS_MS, stats, sizeof stats) && !waiting_for(stats, wait, sizeof wait))
        fprintf(stderr, "[pshard] the job had not started: %s\n", wait);
      ps__procs_stop((int)o->grace);
      return status;
    }
    if (workers_left == 0) {
      if (tty && o->prog) fprintf(stderr, "\n");
      return run_finish(o, addr, t0);
    }
    if (o->prog && ps__now_ms() - last_prog >= o->prog) {
      last_prog = ps__now_ms();
      progress(addr, t0, tty);
    }
  }
}

/* The job's secret and id, in the environment every process of the job inherits (not
 * on a command line, which other users can read): the caller's own when it set
 * PSHARD_SECRET_FILE or PSHARD_SECRET (so that tools can talk to the job), else 32
 * bytes from the OS random source. A job id is drawn too unless PSHARD_JOB_ID is set.
 * 0, or the exit status. */
static int run_secret(void) {
  static const char hex[] = "0123456789abcdef";
  uint8_t b[32];
  char s[2 * sizeof b + 1];
  const char *f = getenv("PSHARD_SECRET_FILE"), *v = getenv("PSHARD_SECRET"), *j = getenv("PSHARD_JOB_ID");
  if (!(f && *f) && !(v && *v)) {
    if (ps__random_bytes(b, sizeof b)) {
      fprintf(stderr, "pshard run: no random bytes for the job secret\n");
      return 1;
    }
    for (size_t i = 0; i < sizeof b; i++) {
      s[2 * i] = hex[b[i] >> 4];
      s[2 * i + 1] = hex[b[i] & 15];
    }
    s[2 * sizeof b] = '\0';
    setenv("PSHARD_SECRET", s, 1);
    memset(s, 0, sizeof s);
    memset(b, 0, sizeof b);
  }
  if (!(j && *j)) {
    if (ps__random_bytes(b, 8)) return 1;
    for (size_t i = 0; i < 8; i++) {
      s[2 * i] = hex[b[i] >> 4];
      s[2 * i + 1] = hex[b[i] & 15];
    }
    s[16] = '\0';
    setenv("PSHARD_JOB_ID", s, 1);
  }
  if (ps__auth_arm_env()) {
    fprintf(stderr, "pshard run: %s\n", ps_errmsg());
    return 2;
  }
  return 0;
}

int ps_cli_run(int argc, char **argv) {
  run_opts o = {.S = 1, .K = 1, .R = 0, .max_respawns = 3, .hbt = 3000, .prog = 1000, .grace = 3000, .transport = "auto",
                .http_port = getenv("PSHARD_HTTP_PORT") && *getenv("PSHARD_HTTP_PORT") ? getenv("PSHARD_HTTP_PORT") : "0"};
  int rc;
  if ((rc = run_parse_flags(argc, argv, &o)) >= 0 || (rc = run_check(argc, argv, &o)) >= 0) return rc;
  if ((rc = ps__cli_ckpt_make_dir(&o.ck, "run")) != 0 || (rc = run_prepare()) != 0 || (rc = run_secret()) != 0)
    return rc;
  char addr_file[256], addr[128] = "";
  snprintf(addr_file, sizeof addr_file, "%s/addr", run_dir);
  const char *exe = ps_cli_self_exe();
  uint64_t t0 = ps__now_ms();
  if ((rc = run_scheduler(&o, exe, addr_file, addr, sizeof addr, t0)) >= 0) return rc;
  if ((rc = run_nodes(&o, exe, addr)) >= 0) return rc;
  return run_watch(&o, addr, t0);
}

/* ------------------------------------------------------------------ stats query */

int ps_cli_fetch_stats(const char *addr, uint64_t timeout_ms, char *out, size_t cap) {
  ps__frame_hdr h = {.type = PS_MSG_STATS, .req_id = 1};
  void *body = NULL;
  size_t n = 0;
  if (cap == 0) return ps__fail(PS_ERR_INVALID, "no room for the counters"), -1;
  if (ps__oneshot(addr, &h, NULL, 0, timeout_ms, cap - 1, NULL, &body, &n)) return -1;
  if (n) memcpy(out, body, n);
  out[n] = '\0';
  free(body);
  return 0;
}
