/*
 * bench.c - helpers shared by the benchmarks (see bench.h).
 */
#include "bench.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef PSHARD_BIN_DEFAULT
#define PSHARD_BIN_DEFAULT "pshard"
#endif

double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

double bench_pct(double *v, size_t n, double p) {
  if (n == 0) return NAN;
  qsort(v, n, sizeof *v, cmp_d);
  double r = p / 100.0 * (double)(n - 1);
  size_t i = (size_t)r;
  if (i + 1 >= n) return v[n - 1];
  return v[i] + (r - (double)i) * (v[i + 1] - v[i]);
}

double bench_median(double *v, size_t n) { return bench_pct(v, n, 50); }

void bench_check(int rc, const char *what) {
  if (rc == 0) return;
  fprintf(stderr, "bench: %s failed: %s (%s)\n", what, ps_errmsg(), ps_err_name(rc));
  exit(1);
}

/* ---------------------------------------------------------------- cluster */

const char *bench_pshard_bin(void) {
  const char *b = getenv("PSHARD_BIN");
  return b && *b ? b : PSHARD_BIN_DEFAULT;
}

static pid_t spawn_logged(char *const argv[], const char *log) {
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    exit(1);
  }
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    setpgid(0, 0);
    execvp(argv[0], argv);
    fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  return pid;
}

static void cluster_start(bench_cluster *c, int S, int K, const char *transport, int colocated) {
  memset(c, 0, sizeof *c);
  c->colocated = colocated;
  snprintf(c->dir, sizeof c->dir, "/tmp/pshard-bench-XXXXXX");
  if (!mkdtemp(c->dir)) {
    perror("mkdtemp");
    exit(1);
  }
  c->nservers = S;
  c->nworkers = K;
  char addr_file[128], log[128], s_s[16], s_k[16];
  snprintf(addr_file, sizeof addr_file, "%s/addr", c->dir);
  snprintf(log, sizeof log, "%s/log", c->dir);
  snprintf(s_s, sizeof s_s, "%d", S);
  snprintf(s_k, sizeof s_k, "%d", K);
  const char *bin = bench_pshard_bin();
  /* One copy of every key, as the figures these programs compare were taken with,
   * unless the program sets PSHARD_REPLICAS itself (bench_repl). */
  setenv("PSHARD_REPLICAS", "1", 0);
  char *sa[] = {(char *)bin, "scheduler", "--servers", s_s, "--workers", s_k, "--addr-file", addr_file,
                "--heartbeat-timeout-ms", "20000", NULL};
  c->sched_pid = spawn_logged(sa, log);
  for (int i = 0; i < 1000; i++) {
    FILE *f = fopen(addr_file, "r");
    if (f) {
      int ok = fscanf(f, "%63s", c->addr) == 1;
      fclose(f);
      if (ok) break;
    }
    usleep(10000);
  }
  if (!c->addr[0]) {
    fprintf(stderr, "bench: the scheduler did not start (see %s)\n", log);
    exit(1);
  }
  for (int i = 0; i < S && !c->colocated; i++) {
    const char *v = getenv("BENCH_LOG") ? "--verbose" : NULL; /* what the servers did, in the kept log */
    char *va[] = {(char *)bin, "server", "--scheduler", c->addr, "--transport", (char *)transport, (char *)v, NULL};
    c->server_pid[i] = spawn_logged(va, log);
    if (getenv("BENCH_PIDS")) fprintf(stderr, "# server %d pid %d\n", i, (int)c->server_pid[i]);
  }
}

void bench_cluster_start(bench_cluster *c, int S, int K, const char *transport) {
  cluster_start(c, S, K, transport, 0);
}

void bench_cluster_start_colocated(bench_cluster *c, int K) {
  cluster_start(c, K, K, "auto", 1);
  c->nservers = 0;
}

void bench_cluster_stop(bench_cluster *c) {
  for (int i = 0; i < c->nservers; i++)
    if (c->server_pid[i] > 0) kill(c->server_pid[i], SIGTERM);
  for (int i = 0; i < c->nservers; i++)
    if (c->server_pid[i] > 0) waitpid(c->server_pid[i], NULL, 0);
  if (c->sched_pid > 0) {
    kill(c->sched_pid, SIGTERM);
    waitpid(c->sched_pid, NULL, 0);
  }
  char cmd[600];
  const char *keep = getenv("BENCH_LOG"); /* a path: keep the cluster's log there */
  if (keep && *keep && strlen(keep) < 400) {
    snprintf(cmd, sizeof cmd, "cp %s/log '%s'", c->dir, keep);
    if (system(cmd)) fprintf(stderr, "bench: could not copy the cluster's log to %s\n", keep);
  }
  snprintf(cmd, sizeof cmd, "rm -rf %s", c->dir);
  if (system(cmd)) {
  }
}

ps_ctx *bench_open(const bench_cluster *c, int embedded_servers, int workers, const char *transport,
                   const char *mode) {
  ps_config *cfg;
  ps_ctx *ctx;
  char buf[32];
  bench_check(ps_config_new(&cfg), "ps_config_new");
  if (c) {
    bench_check(ps_config_set(cfg, "scheduler", c->addr), "config scheduler");
    if (c->colocated) bench_check(ps_config_set(cfg, "colocate", "1"), "config colocate");
  } else {
    snprintf(buf, sizeof buf, "%d", embedded_servers);
    bench_check(ps_config_set(cfg, "embedded", buf), "config embedded");
  }
  snprintf(buf, sizeof buf, "%d", workers);
  bench_check(ps_config_set(cfg, "workers", buf), "config workers");
  bench_check(ps_config_set(cfg, "transport", transport), "config transport");
  if (mode) bench_check(ps_config_set(cfg, "mode", mode), "config mode");
  bench_check(ps_config_set(cfg, "timeout_ms", "600000"), "config timeout");
  /* PSHARD_DIRECT=0 compares against requests that always cross the I/O thread. */
  if (getenv("PSHARD_DIRECT")) bench_check(ps_config_set(cfg, "direct", getenv("PSHARD_DIRECT")), "config direct");
  /* PSHARD_DEDUP=0: large sparse pulls ask for repeated keys again (before/after figures). */
  if (getenv("PSHARD_DEDUP")) bench_check(ps_config_set(cfg, "dedup", getenv("PSHARD_DEDUP")), "config dedup");
  /* PSHARD_METRICS=off: the context does not count (bench_metrics compares both). */
  if (getenv("PSHARD_METRICS")) bench_check(ps_config_set(cfg, "metrics", getenv("PSHARD_METRICS")), "config metrics");
  bench_check(ps_config_set(cfg, "heartbeat_timeout_ms", "20000"), "config heartbeat");
  bench_check(ps_ctx_open(cfg, &ctx), "ps_ctx_open");
  ps_config_free(cfg);
  return ctx;
}

size_t bench_rss(pid_t pid) {
  char path[64], line[256];
  size_t kb = 0;
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, "VmRSS:", 6)) kb = strtoull(line + 6, NULL, 10);
  fclose(f);
  return kb * 1024;
}

double bench_stat_value(const char *text, const char *key) {
  size_t kl = strlen(key);
  for (const char *p = text; p && *p;) {
    if (!strncmp(p, key, kl) && p[kl] == ' ') return strtod(p + kl + 1, NULL);
    p = strchr(p, '\n');
    if (p) p++;
  }
  return -1;
}

/* ---------------------------------------------------------------- raw sockets */

static void full_write(int fd, const void *p, size_t n) {
  const char *c = p;
  while (n) {
    ssize_t k = write(fd, c, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      perror("write");
      _exit(1);
    }
    c += k;
    n -= (size_t)k;
  }
}

static void full_read(int fd, void *p, size_t n) {
  char *c = p;
  while (n) {
    ssize_t k = read(fd, c, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      perror("read");
      _exit(1);
    }
    c += k;
    n -= (size_t)k;
  }
}

/* A connected pair of sockets across a fork: returns the parent's end; *child_fd is the
 * child's end (to be used after fork). Both are real TCP loopback or AF_UNIX sockets
 * that went through listen/accept, as the library's are. */
static int connected_pair(int unix_sock, int *child_fd, char *upath) {
  int l, a, c;
  if (unix_sock) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(upath, 100, "/tmp/pshard-bench-raw-%d.sock", (int)getpid());
    unlink(upath);
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", upath);
    l = socket(AF_UNIX, SOCK_STREAM, 0);
    if (bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 1)) {
      perror("bind unix");
      exit(1);
    }
    c = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&sa, sizeof sa)) {
      perror("connect unix");
      exit(1);
    }
  } else {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    l = socket(AF_INET, SOCK_STREAM, 0);
    if (bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 1) || getsockname(l, (struct sockaddr *)&sa, &len)) {
      perror("bind tcp");
      exit(1);
    }
    c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&sa, sizeof sa)) {
      perror("connect tcp");
      exit(1);
    }
  }
  a = accept(l, NULL, NULL);
  close(l);
  if (unix_sock) unlink(upath);
  if (!unix_sock) {
    int one = 1;
    setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  } else {
    /* Like for like: pshard raises an AF_UNIX socket's send buffer to 1 MiB
     * (src/net/conn.c, UNIX_SNDBUF), so the raw stream's limit gets the same. */
    int sb = 1 << 20;
    setsockopt(a, SOL_SOCKET, SO_SNDBUF, &sb, sizeof sb);
    setsockopt(c, SOL_SOCKET, SO_SNDBUF, &sb, sizeof sb);
  }
  *child_fd = c;
  return a;
}

double bench_raw_stream(int unix_sock, size_t msg, size_t total) {
  char upath[128];
  int cfd, pfd = connected_pair(unix_sock, &cfd, upath);
  size_t n = total / msg;
  if (n < 2) n = 2;
  size_t warm = n / 8 ? n / 8 : 1;
  pid_t pid = fork();
  if (pid == 0) { /* receiver */
    close(pfd);
    char *buf = malloc(msg);
    memset(buf, 0, msg);
    for (size_t i = 0; i < warm + n; i++) full_read(cfd, buf, msg);
    full_write(cfd, "k", 1);
    _exit(0);
  }
  close(cfd);
  char *buf = malloc(msg);
  memset(buf, 1, msg);
  for (size_t i = 0; i < warm; i++) full_write(pfd, buf, msg);
  double t0 = bench_now();
  for (size_t i = 0; i < n; i++) full_write(pfd, buf, msg);
  char k;
  full_read(pfd, &k, 1);
  double t = bench_now() - t0;
  close(pfd);
  waitpid(pid, NULL, 0);
  free(buf);
  return (double)(n * msg) / t / 1e9;
}

/* Median seconds of a req-byte request answered by a resp-byte reply between two
 * processes; with two_bufs each side receives into one buffer and sends from another. */
static double raw_round_trip(int unix_sock, size_t req, size_t resp, int iters, int two_bufs, int warm) {
  char upath[128];
  int cfd, pfd = connected_pair(unix_sock, &cfd, upath);
  size_t cap = req > resp ? req : resp;
  pid_t pid = fork();
  if (pid == 0) { /* echo side */
    close(pfd);
    char *in = calloc(1, cap), *out = two_bufs ? calloc(1, cap) : in;
    for (int i = 0; i < warm + iters; i++) {
      full_read(cfd, in, req);
      full_write(cfd, out, resp);
    }
    _exit(0);
  }
  close(cfd);
  char *snd = calloc(1, cap), *rcv = two_bufs ? calloc(1, cap) : snd;
  double *t = malloc(sizeof *t * (size_t)iters);
  for (int i = 0; i < warm + iters; i++) {
    double t0 = bench_now();
    full_write(pfd, snd, req);
    full_read(pfd, rcv, resp);
    if (i >= warm) t[i - warm] = bench_now() - t0;
  }
  close(pfd);
  waitpid(pid, NULL, 0);
  double m = bench_median(t, (size_t)iters);
  free(t);
  if (rcv != snd) free(rcv);
  free(snd);
  return m;
}

double bench_raw_rtt(int unix_sock, size_t req, size_t resp, int iters) {
  return raw_round_trip(unix_sock, req, resp, iters, 0, iters / 10 + 10);
}

double bench_raw_exchange(int unix_sock, size_t bytes, int iters) {
  return 2.0 * (double)bytes / raw_round_trip(unix_sock, bytes, bytes, iters, 1, iters / 10 + 3) / 1e9;
}

double bench_memcpy(size_t n) {
  char *a = malloc(n), *b = malloc(n);
  memset(a, 1, n);
  memset(b, 2, n);
  size_t r0 = ((size_t)1 << 30) / n;
  int reps = r0 > 2000 ? 2000 : (int)r0;
  if (reps < 3) reps = 3;
  if (reps > 2000) reps = 2000;
  double best = 0;
  for (int r = 0; r < 3; r++) {
    double t0 = bench_now();
    for (int i = 0; i < reps; i++) {
      memcpy(i & 1 ? a : b, i & 1 ? b : a, n);
      __asm__ volatile("" ::"r"(a), "r"(b) : "memory");
    }
    double g = (double)n * reps / (bench_now() - t0) / 1e9;
    if (g > best) best = g;
  }
  free(a);
  free(b);
  return best;
}

/* ---------------------------------------------------------------- keys */

uint64_t bench_rand(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static double helper1(double x) { return fabs(x) > 1e-8 ? log1p(x) / x : 1 - x * (0.5 - x * (1.0 / 3 - 0.25 * x)); }
static double helper2(double x) { return fabs(x) > 1e-8 ? expm1(x) / x : 1 + x * 0.5 * (1 + x / 3 * (1 + 0.25 * x)); }
static double zh(const bench_zipf *z, double x) { return exp(-z->s * log(x)); }
static double zH(const bench_zipf *z, double x) {
  double lx = log(x);
  return helper2((1 - z->s) * lx) * lx;
}
static double zHinv(const bench_zipf *z, double x) {
  double t = x * (1 - z->s);
  if (t < -1) t = -1;
  return exp(helper1(t) * x);
}

void bench_zipf_init(bench_zipf *z, uint64_t n, double s, uint64_t seed) {
  z->n = n;
  z->s = s;
  z->hx0 = zH(z, 1.5) - 1.0;
  z->hn = zH(z, (double)n + 0.5);
  z->q = 2.0 - zHinv(z, zH(z, 2.5) - zh(z, 2.0));
  z->rng = seed * 0x2545f4914f6cdd1dull + 1;
  z->mul = 1000003; /* a prime: coprime with every n that it does not divide */
  while (n % z->mul == 0) z->mul += 2;
  z->add = n / 3;
}

uint64_t bench_zipf_next(bench_zipf *z) {
  for (;;) {
    double u01 = (double)(bench_rand(&z->rng) >> 11) * (1.0 / 9007199254740992.0);
    double u = z->hn + u01 * (z->hx0 - z->hn);
    double x = zHinv(z, u);
    double kd = floor(x + 0.5);
    if (kd < 1) kd = 1;
    if (kd > (double)z->n) kd = (double)z->n;
    if (kd - x <= z->q || u >= zH(z, kd + 0.5) - zh(z, kd)) {
      uint64_t k = (uint64_t)kd - 1;
      return (uint64_t)(((unsigned __int128)k * z->mul + z->add) % z->n);
    }
  }
}

/* utime + stime of a /proc stat file, in clock ticks (0 when unreadable). */
static unsigned long long stat_ticks(const char *path) {
  char buf[1024];
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the command may hold blanks */
  unsigned long long ut = 0, st = 0;
  if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2) return 0;
  return ut + st;
}

double bench_cpu_s(pid_t pid) {
  char path[64];
  unsigned long long ns = 0, live_ticks = 0;
  if (pid == 0) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
  }
  /* Sum over the live threads (schedstat: first field, ns on CPU), plus what threads
   * that ended took (the process's ticks beyond its live threads': a server's helper
   * threads come and go). */
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  if (!d) return 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char p2[128];
    snprintf(p2, sizeof p2, "/proc/%d/task/%s/schedstat", (int)pid, e->d_name);
    FILE *f = fopen(p2, "r");
    unsigned long long v = 0;
    if (f) {
      if (fscanf(f, "%llu", &v) == 1) ns += v;
      fclose(f);
    }
    snprintf(p2, sizeof p2, "/proc/%d/task/%s/stat", (int)pid, e->d_name);
    live_ticks += stat_ticks(p2);
  }
  closedir(d);
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  unsigned long long all = stat_ticks(path);
  double hz = (double)sysconf(_SC_CLK_TCK);
  double gone = all > live_ticks && hz > 0 ? (double)(all - live_ticks) / hz : 0;
  return (double)ns * 1e-9 + gone;
}
