/*
 * bench_ctr.c - click-through training throughput for K workers and S servers, and the
 * traffic each step moved against the cost model.
 *
 * Runs the project's own example: ctr_gen makes a Criteo-like data set once (binary
 * partitions), then for each (K, S) `pshard run -s S -w K -- ctr_worker --data DIR`
 * trains one epoch (sync mode, FTRL, sparse dim-1 table). Figures:
 *   examples/s   all workers' examples over the slowest worker's training time
 *                (ctr_worker's own "trained on N examples in T s" lines)
 *   traffic      bytes the server processes read and wrote on their sockets
 *                (/proc/PID/io rchar + wchar, sampled while they run), per global step
 *                (K batches), against the cost model: every worker pulls and pushes
 *                the rows its batch touches, K x U x dim x 4 bytes of values each way
 *                per step (U = distinct ids in a batch, measured from the data), plus
 *                the keys (8 B per row on the pull request and on the push).
 * This machine has 2 cores: K = 4 with S = 2 runs 7 processes on them.
 *
 * usage: bench_ctr [--rows N] [--parts P] [--batch B] [--workers 1,2,4] [--servers 1,2]
 *                  [--data DIR]
 */
#include <ctype.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "ctr_data.h"

#ifndef CTR_GEN_BIN
#define CTR_GEN_BIN "ctr_gen"
#endif
#ifndef CTR_WORKER_BIN
#define CTR_WORKER_BIN "ctr_worker"
#endif

/* Mean distinct ids per batch of B examples over the training partitions; *steps_out
 * gets the number of batches (each partition is read in batches of B). */
static double touched_rows(const char *dir, size_t B, double *batches_out, double *examples_out) {
  DIR *d = opendir(dir);
  struct dirent *e;
  double uniq = 0, batches = 0, examples = 0;
  size_t cap = 1u << 20;
  uint64_t *keys = malloc(cap * 8);
  uint32_t *gen = calloc(cap, 4), cur = 0;
  ctr_batch b;
  ctr_batch_init(&b);
  while (d && (e = readdir(d))) {
    if (strncmp(e->d_name, "train", 5)) continue;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    ctr_reader *r;
    if (ctr_reader_open(path, &r)) continue;
    while (ctr_reader_next(r, B, &b) == 0 && b.rows) {
      if (b.nnz * 2 > cap) {
        while (b.nnz * 2 > cap) cap *= 2;
        keys = realloc(keys, cap * 8);
        free(gen);
        gen = calloc(cap, 4);
        cur = 0;
      }
      cur++;
      size_t u = 0;
      for (size_t i = 0; i < b.nnz; i++) {
        uint64_t k = b.ids[i], h = (k * 0x9e3779b97f4a7c15ull) >> 20;
        for (size_t j = h & (cap - 1);; j = (j + 1) & (cap - 1)) {
          if (gen[j] != cur) {
            gen[j] = cur;
            keys[j] = k;
            u++;
            break;
          }
          if (keys[j] == k) break;
        }
      }
      uniq += (double)u + 1; /* + the bias row */
      batches++;
      examples += (double)b.rows;
    }
    ctr_reader_close(r);
  }
  if (d) closedir(d);
  ctr_batch_free(&b);
  free(keys);
  free(gen);
  *batches_out = batches;
  *examples_out = examples;
  return batches ? uniq / batches : 0;
}

/* Children of `parent` whose command line has " server" as its second word. */
static int server_pids(pid_t parent, pid_t *out, int max) {
  DIR *d = opendir("/proc");
  struct dirent *e;
  int n = 0;
  while (d && (e = readdir(d)) && n < max) {
    if (!isdigit((unsigned char)e->d_name[0])) continue;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    int ppid = 0;
    char *p = fgets(buf, sizeof buf, f) ? strrchr(buf, ')') : NULL;
    fclose(f);
    if (!p || sscanf(p + 2, "%*c %d", &ppid) != 1 || ppid != parent) continue;
    snprintf(path, sizeof path, "/proc/%s/cmdline", e->d_name);
    f = fopen(path, "r");
    if (!f) continue;
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    size_t first = strlen(buf);
    if (first + 1 < len && !strcmp(buf + first + 1, "server")) out[n++] = (pid_t)atoi(e->d_name);
  }
  if (d) closedir(d);
  return n;
}

static double io_bytes(pid_t pid) {
  char path[64], line[128];
  double v = -1;
  snprintf(path, sizeof path, "/proc/%d/io", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  double r = 0, w = 0;
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, "rchar:", 6)) r = atof(line + 6);
    if (!strncmp(line, "wchar:", 6)) w = atof(line + 6);
  }
  fclose(f);
  v = r + w;
  return v;
}

typedef struct run_result {
  double examples, seconds, server_bytes;
} run_result;

static run_result run_job(const char *dir, int K, int S, size_t B) {
  run_result res = {0, 0, 0};
  int fds[2];
  if (pipe(fds)) exit(1);
  char sk[16], ss[16], sb[16];
  snprintf(sk, sizeof sk, "%d", K);
  snprintf(ss, sizeof ss, "%d", S);
  snprintf(sb, sizeof sb, "%zu", B);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    execl(bench_pshard_bin(), bench_pshard_bin(), "run", "-s", ss, "-w", sk, "--progress-ms", "0", "--mode", "sync",
          "--", CTR_WORKER_BIN, "--data", dir, "--batch", sb, "--epochs", "1", (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  /* Sample the servers' socket bytes while the job runs; read the output. */
  pid_t seen[16];
  double last[16];
  int nseen = 0;
  FILE *out = fdopen(fds[0], "r");
  int fd = fileno(out);
  char line[1024];
  fd_set rs;
  for (;;) {
    FD_ZERO(&rs);
    FD_SET(fd, &rs);
    struct timeval tv = {0, 50000};
    int rc = select(fd + 1, &rs, NULL, NULL, &tv);
    pid_t cur[16];
    int nc = server_pids(pid, cur, 16);
    for (int i = 0; i < nc; i++) {
      int j;
      for (j = 0; j < nseen && seen[j] != cur[i]; j++) {
      }
      if (j == nseen && nseen < 16) {
        seen[nseen] = cur[i];
        last[nseen++] = 0;
      }
      double v = io_bytes(cur[i]);
      if (v > last[j]) last[j] = v;
    }
    if (rc > 0) {
      if (!fgets(line, sizeof line, out)) break;
      char *t = strstr(line, "trained on ");
      unsigned long long n;
      double secs;
      if (t && sscanf(t, "trained on %llu examples in %lf s", &n, &secs) == 2) {
        res.examples += (double)n;
        if (secs > res.seconds) res.seconds = secs;
      }
      if (strstr(line, "error") || strstr(line, "ctr_worker:")) fprintf(stderr, "%s", line);
    }
  }
  fclose(out);
  int st;
  waitpid(pid, &st, 0);
  for (int i = 0; i < nseen; i++) res.server_bytes += last[i];
  return res;
}

int main(int argc, char **argv) {
  const char *workers_s = "1,2,4", *servers_s = "1,2";
  char dir[256] = "/tmp/pshard-bench-ctr";
  unsigned long long rows = 2000000;
  int parts = 8;
  size_t B = 1000;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--rows") && i + 1 < argc) rows = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--parts") && i + 1 < argc) parts = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--batch") && i + 1 < argc) B = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--workers") && i + 1 < argc) workers_s = argv[++i];
    else if (!strcmp(argv[i], "--servers") && i + 1 < argc) servers_s = argv[++i];
    else if (!strcmp(argv[i], "--data") && i + 1 < argc) snprintf(dir, sizeof dir, "%s", argv[++i]);
    else {
      fprintf(stderr, "usage: bench_ctr [--rows N] [--parts P] [--batch B] [--workers LIST] [--servers LIST] "
                      "[--data DIR]\n");
      return 2;
    }
  }
  char meta[300], cmd[1024];
  snprintf(meta, sizeof meta, "%s/meta.txt", dir);
  struct stat sbuf;
  if (stat(meta, &sbuf) != 0) {
    snprintf(cmd, sizeof cmd, "%s --rows %llu --test-rows 20000 --parts %d --format bin --out %s --quiet",
             CTR_GEN_BIN, rows, parts, dir);
    if (system(cmd) != 0) {
      fprintf(stderr, "bench_ctr: %s failed\n", cmd);
      return 1;
    }
  }
  double batches, examples;
  double U = touched_rows(dir, B, &batches, &examples);
  printf("# bench_ctr: %s, %.0f training examples in %d partitions, batch %zu: %.0f batches, %.1f distinct rows "
         "(of dim 1) per batch\n",
         dir, examples, parts, B, batches, U);
  printf("# traffic per step = server socket bytes (read + written) / (batches / K); model = K x U x (4 B value "
         "pulled + 4 B pushed) and, with keys, K x U x (8+4 + 8+4) B\n");
  printf("%2s %2s %12s %8s %12s %12s %12s %7s\n", "K", "S", "examples/s", "speedup", "KB/step", "model_KB",
         "model+keys", "ratio");
  fflush(stdout);
  int ks[8], ss[8], nk = 0, ns = 0;
  char buf[64];
  snprintf(buf, sizeof buf, "%s", workers_s);
  for (char *s = strtok(buf, ","); s && nk < 8; s = strtok(NULL, ",")) ks[nk++] = atoi(s);
  snprintf(buf, sizeof buf, "%s", servers_s);
  for (char *s = strtok(buf, ","); s && ns < 8; s = strtok(NULL, ",")) ss[ns++] = atoi(s);
  double base = 0;
  for (int si = 0; si < ns; si++) {
    for (int ki = 0; ki < nk; ki++) {
      int K = ks[ki], S = ss[si];
      run_result r = run_job(dir, K, S, B);
      double eps = r.seconds > 0 ? r.examples / r.seconds : 0;
      if (K == ks[0] && S == ss[0]) base = eps;
      double steps = batches / K;
      double kb = r.server_bytes / steps / 1e3;
      double model = K * U * 8 / 1e3, model_keys = K * U * 24 / 1e3;
      printf("%2d %2d %12.0f %8.2f %12.1f %12.1f %12.1f %7.2f\n", K, S, eps, base > 0 ? eps / base : 0, kb, model,
             model_keys, kb / model_keys);
      fflush(stdout);
    }
  }
  return 0;
}
