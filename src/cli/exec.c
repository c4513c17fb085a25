/*
 * exec.c - `pshard exec`: take a role from the rank an mpirun or Slurm launcher gives
 * (rank 0 the scheduler, ranks 1..S the servers, the others the workers running the
 * command), with the checkpoint flags `pshard run` has (run_ckpt.h).
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/run_ckpt.h"
#include "common/common.h"
#include "common/config.h"
#include "net/auth.h"

/* ------------------------------------------------------------------ exec */

static const char *first_env(const char *const names[]) {
  for (int i = 0; names[i]; i++) {
    const char *v = getenv(names[i]);
    if (v && *v) return v;
  }
  return NULL;
}

static void exec_usage(FILE *f) {
  fprintf(f,
          "usage: pshard exec -s S (--scheduler HOST:PORT | --addr-file FILE) [--host H] -- COMMAND [ARGS...]\n\n"
          "Take a role from the launcher's rank: rank 0 runs the scheduler, ranks 1..S the servers,\n"
          "every other rank runs COMMAND as a worker; the scheduler and servers exit once every\n"
          "worker has left. Ranks come from Open MPI\n"
          "(OMPI_COMM_WORLD_RANK/SIZE), MPICH/PMI (PMI_RANK/SIZE), PMIx or Slurm\n"
          "(SLURM_PROCID/SLURM_NTASKS).\n\n"
          "  -s, --servers S           number of servers among the ranks\n"
          "      --scheduler HOST:PORT rank 0 listens there; the others connect to it\n"
          "      --addr-file FILE      rank 0 binds any port and writes HOST:PORT to FILE (on a\n"
          "                            file system every rank sees); the others read it\n"
          "      --host H              this rank's address to bind and advertise (127.0.0.1)\n"
          "      --wait-ms N           how long ranks wait for the address file (60000)\n"
          "      --replicas R          copies of every key range, 1 to 3 and at most S (2 when\n"
          "                            S >= 2, else 1) [PSHARD_REPLICAS]\n"
          "      --colocate            every rank but 0 is a worker that also runs one of the\n"
          "                            servers as a thread (PSHARD_COLOCATE=1, bound to --host);\n"
          "                            S is then the number of workers (-s may be left out)\n"
          CKPT_USAGE
          "  -h, --help                this text\n");
}

/* What `pshard exec` was asked to do. */
typedef struct exec_opts {
  uint64_t S, wait_ms;
  char replicas[8];      /* --replicas R for the scheduler, "" for its default */
  const char *sched, *addr_file, *host;
  int colocate;
  ckpt_opts ck;
} exec_opts;

/* The flags, into o. -1 to go on, or the exit status (usage printed as needed). */
static int exec_parse_flags(int argc, char **argv, exec_opts *o) {
  static const struct option opts[] = {
      {"servers", required_argument, 0, 's'}, {"scheduler", required_argument, 0, 'S'},
      {"addr-file", required_argument, 0, 'a'}, {"host", required_argument, 0, 'H'},
      {"wait-ms", required_argument, 0, 'W'}, {"help", no_argument, 0, 'h'},
      {"colocate", no_argument, 0, 'C'},      {"replicas", required_argument, 0, 'r'},
      CKPT_LONG_OPTS, {0, 0, 0, 0}};
  int c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "+s:h", opts, NULL)) != -1) {
    int ck = ps__cli_ckpt_flag(c, optarg, &o->ck, "exec");
    if (ck > 0) return ck;
    if (ck == 0) continue;
    switch (c) {
    case 's':
      if (ps__parse_u64(optarg, &o->S) || o->S == 0 || o->S > 4096) {
        fprintf(stderr, "pshard exec: bad --servers '%s'\n", optarg);
        return 2;
      }
      break;
    case 'S': o->sched = optarg; break;
    case 'a': o->addr_file = optarg; break;
    case 'H': o->host = optarg; break;
    case 'C': o->colocate = 1; break;
    case 'r': {
      uint64_t r;
      if (ps__parse_u64(optarg, &r) || r == 0 || r > 3) {
        fprintf(stderr, "pshard exec: bad --replicas '%s' (1 to 3)\n", optarg);
        return 2;
      }
      snprintf(o->replicas, sizeof o->replicas, "%llu", (unsigned long long)r);
      break;
    }
    case 'W':
      if (ps__parse_u64(optarg, &o->wait_ms)) {
        fprintf(stderr, "pshard exec: bad --wait-ms '%s'\n", optarg);
        return 2;
      }
      break;
    case 'h': exec_usage(stdout); return 0;
    default:
      fprintf(stderr, "pshard exec: unknown or incomplete option '%s'\n", argv[optind - 1]);
      exec_usage(stderr);
      return 2;
    }
  }
  if ((o->S == 0 && !o->colocate) || (!o->sched == !o->addr_file) || optind >= argc) {
    fprintf(stderr, "pshard exec: need --servers (or --colocate), exactly one of --scheduler/--addr-file, and a "
                    "command\n");
    exec_usage(stderr);
    return 2;
  }
  if (o->colocate && o->ck.restore) {
    fprintf(stderr, "pshard exec: --restore needs server processes; it cannot be used with --colocate\n");
    return 2;
  }
  return ps__cli_ckpt_check(&o->ck, "exec");
}

/* This rank and the number of ranks, from the launcher's environment, checked against
 * the servers asked for (o->S becomes the number of servers). -1, or the exit status. */
static int exec_rank(exec_opts *o, uint64_t *rank, uint64_t *size) {
  static const char *const rank_vars[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", NULL};
  static const char *const size_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "SLURM_NPROCS", NULL};
  const char *rs = first_env(rank_vars), *ss = first_env(size_vars);
  if (!rs || !ss || ps__parse_u64(rs, rank) || ps__parse_u64(ss, size) || *rank >= *size) {
    fprintf(stderr, "pshard exec: no launcher rank found (run under mpirun or srun)\n");
    return 2;
  }
  uint64_t n = *size;
  if (o->colocate) {
    if (n < 2 || (o->S && o->S != n - 1)) {
      fprintf(stderr, "pshard exec: --colocate: %llu ranks hold a scheduler and %llu workers, each with a server%s\n",
              (unsigned long long)n, (unsigned long long)(n ? n - 1 : 0),
              n < 2 ? "; at least 2 ranks are needed" : ": -s must equal that number or be left out");
      return 2;
    }
    o->S = n - 1;
  } else if (n < o->S + 2) {
    fprintf(stderr, "pshard exec: %llu ranks cannot hold a scheduler, %llu servers and a worker\n",
            (unsigned long long)n, (unsigned long long)o->S);
    return 2;
  }
  return -1;
}

/* Rank 0: become the scheduler. Returns only on failure, with the exit status. */
static int exec_scheduler(const exec_opts *o, const char *exe, char *s_s, char *s_k) {
  char port[16] = "0", shost[64];
  int p;
  if (o->sched) {
    if (ps__parse_hostport(o->sched, shost, sizeof shost, &p)) {
      fprintf(stderr, "pshard exec: bad --scheduler '%s'\n", o->sched);
      return 2;
    }
    snprintf(port, sizeof port, "%d", p);
    char *a[32] = {(char *)exe, "scheduler", "--servers", s_s, "--workers", s_k, "--host", shost, "--port", port,
                   "--exit-when-done"};
    int n = 11;
    if (o->replicas[0]) a[n++] = "--replicas", a[n++] = (char *)o->replicas;
    ps__cli_ckpt_sched_args(&o->ck, a, &n);
    a[n] = NULL;
    execv(exe, a);
  } else {
    unlink(o->addr_file);
    char *a[32] = {(char *)exe, "scheduler", "--servers", s_s, "--workers", s_k, "--host", (char *)o->host,
                   "--addr-file", (char *)o->addr_file, "--exit-when-done"};
    int n = 11;
    if (o->replicas[0]) a[n++] = "--replicas", a[n++] = (char *)o->replicas;
    ps__cli_ckpt_sched_args(&o->ck, a, &n);
    a[n] = NULL;
    execv(exe, a);
  }
  fprintf(stderr, "pshard exec: cannot run the scheduler: %s\n", strerror(errno));
  return 1;
}

/* The other ranks: the scheduler's address, given or read from the address file once
 * rank 0 has written it (waiting up to --wait-ms). 0, or the exit status. */
static int exec_sched_addr(const exec_opts *o, char *addr, size_t cap) {
  if (o->sched) {
    snprintf(addr, cap, "%s", o->sched);
    return 0;
  }
  uint64_t t0 = ps__now_ms();
  addr[0] = '\0';
  while (!addr[0]) {
    FILE *f = fopen(o->addr_file, "r");
    if (f) {
      if (fgets(addr, (int)cap, f)) addr[strcspn(addr, "\n")] = '\0';
      fclose(f);
    }
    if (addr[0]) break;
    if (ps__now_ms() - t0 > o->wait_ms) {
      fprintf(stderr, "pshard exec: no scheduler address in %s after %llu ms\n", o->addr_file,
              (unsigned long long)o->wait_ms);
      return 1;
    }
    usleep(20000);
  }
  return 0;
}

int ps_cli_exec(int argc, char **argv) {
  exec_opts o = {.wait_ms = 60000, .host = "127.0.0.1"};
  uint64_t rank, size;
  int rc;
  if ((rc = exec_parse_flags(argc, argv, &o)) >= 0 || (rc = exec_rank(&o, &rank, &size)) >= 0) return rc;
  uint64_t K = o.colocate ? size - 1 : size - 1 - o.S;
  uint64_t first_worker = o.colocate ? 1 : o.S + 1;
  char s_s[16], s_k[16], addr[160];
  snprintf(s_s, sizeof s_s, "%llu", (unsigned long long)o.S);
  snprintf(s_k, sizeof s_k, "%llu", (unsigned long long)K);
  const char *exe = ps_cli_self_exe();
  if (rank == 0) return ps__cli_ckpt_make_dir(&o.ck, "exec") ? 1 : exec_scheduler(&o, exe, s_s, s_k);
  if ((rc = exec_sched_addr(&o, addr, sizeof addr)) != 0) return rc;
  if (rank < first_worker) {
    char *a[] = {(char *)exe, "server", "--scheduler", addr, "--host", (char *)o.host,
                 o.ck.restore ? "--restore" : NULL, (char *)o.ck.restore, NULL};
    execv(exe, a);
    fprintf(stderr, "pshard exec: cannot run the server: %s\n", strerror(errno));
    return 1;
  }
  setenv("PSHARD_ROLE", "worker", 1);
  setenv("PSHARD_SCHEDULER", addr, 1);
  setenv("PSHARD_SERVERS", s_s, 1);
  setenv("PSHARD_WORKERS", s_k, 1);
  char idx[24];
  snprintf(idx, sizeof idx, "%llu", (unsigned long long)(rank - first_worker));
  setenv("PSHARD_WORKER_INDEX", idx, 1);
  if (o.ck.every) {
    char every[24];
    snprintf(every, sizeof every, "%llu", (unsigned long long)o.ck.every);
    setenv("PSHARD_CHECKPOINT_EVERY", every, 1);
  }
  if (o.colocate) {
    setenv("PSHARD_COLOCATE", "1", 1);
    setenv("PSHARD_HOST", o.host, 1);
  }
  execvp(argv[optind], argv + optind);
  fprintf(stderr, "pshard exec: cannot run %s: %s\n", argv[optind], strerror(errno));
  return 127;
}
