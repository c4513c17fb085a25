/*
 * fault_worker.c - a worker that runs a fixed script of pushes and pulls and prints
 * what each call returned, for the fault-injection tests (test_fault.py).
 *
 * One sparse table "f" (dim 2, sgd with lr 1, zero init, the mode of --mode), rows 1
 * and 2. Each push sends the gradient 1 for every value, so each push the servers
 * apply lowers every value by exactly 1, and a pull shows how many were applied.
 *
 * Usage: fault_worker [--mode async|sync] [--timeout-ms T] OP...
 *   push    ps_push of rows 1, 2
 *   pull    ps_pull of rows 1, 2
 *   clock   ps_clock
 * Each op prints one line: "OP rc=NAME ms=ELAPSED [v=a,b,c,d] [msg=...]".
 * Connection settings come from the environment (PSHARD_*). Exit status: 0 when the
 * script ran (whatever the calls returned), 1 when the context could not be opened or
 * the table declared, 2 bad usage.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pshard.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
  const char *mode = "async";
  int timeout_ms = -1, first = 1;
  while (first < argc && !strncmp(argv[first], "--", 2)) {
    if (first + 1 >= argc) {
      fprintf(stderr, "fault_worker: %s needs a value\n", argv[first]);
      return 2;
    }
    if (!strcmp(argv[first], "--mode")) mode = argv[first + 1];
    else if (!strcmp(argv[first], "--timeout-ms")) timeout_ms = atoi(argv[first + 1]);
    else {
      fprintf(stderr, "fault_worker: unknown option %s\n", argv[first]);
      return 2;
    }
    first += 2;
  }
  ps_ctx *ctx;
  int rc = ps_ctx_open_env(&ctx);
  if (rc) {
    fprintf(stderr, "fault_worker: ps_ctx_open_env: %s: %s\n", ps_err_name(rc), ps_errmsg());
    return 1;
  }
  char opts[128];
  uint32_t t;
  snprintf(opts, sizeof opts, "opt=sgd lr=1 init=zero mode=%s", mode);
  rc = ps_table_declare(ctx, "f", PS_SPARSE, 2, opts, &t);
  if (rc) {
    fprintf(stderr, "fault_worker: ps_table_declare: %s: %s\n", ps_err_name(rc), ps_errmsg());
    ps_ctx_close(ctx);
    return 1;
  }
  const uint64_t keys[2] = {1, 2};
  const float grads[4] = {1, 1, 1, 1};
  for (int i = first; i < argc; i++) {
    float v[4] = {0};
    double t0 = now_ms();
    int pull = 0;
    if (!strcmp(argv[i], "push")) rc = ps_push(ctx, t, keys, 2, grads, 1, PS_LR_SCHEDULE, timeout_ms);
    else if (!strcmp(argv[i], "pull")) {
      rc = ps_pull(ctx, t, keys, 2, v, timeout_ms);
      pull = 1;
    }
    else if (!strcmp(argv[i], "clock")) rc = ps_clock(ctx);
    else {
      fprintf(stderr, "fault_worker: unknown op %s\n", argv[i]);
      ps_ctx_close(ctx);
      return 2;
    }
    printf("%s rc=%s ms=%.0f", argv[i], ps_err_name(rc), now_ms() - t0);
    if (pull && rc == 0) printf(" v=%g,%g,%g,%g", v[0], v[1], v[2], v[3]);
    if (rc) printf(" msg=%s", ps_errmsg());
    printf("\n");
    fflush(stdout);
  }
  ps_ctx_close(ctx);
  return 0;
}
