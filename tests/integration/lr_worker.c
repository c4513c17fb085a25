/*
 * lr_worker.c - shows the servers' scaled learning rate as workers leave.
 * Usage: lr_worker STEPS LEAVE_AFTER BATCH "TABLE OPTIONS" [SLEEP_MS]
 * Every worker pushes a dense gradient of ones with batch BATCH each step. Workers other
 * than rank 0 leave after LEAVE_AFTER steps; rank 0 prints, after each step, the rate
 * and global batch the server used for its last update: "step N lr X global_batch B".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard.h"

#define CHECK(x)                                                             \
  do {                                                                       \
    int rc_ = (x);                                                           \
    if (rc_) {                                                               \
      fprintf(stderr, "lr_worker: %s: %s: %s\n", #x, ps_err_name(rc_), ps_errmsg()); \
      return 1;                                                              \
    }                                                                        \
  } while (0)

int main(int argc, char **argv) {
  if (argc < 5) return 2;
  int steps = atoi(argv[1]), leave = atoi(argv[2]);
  uint32_t batch = (uint32_t)atoi(argv[3]);
  int sleep_ms = argc > 5 ? atoi(argv[5]) : 0;
  ps_ctx *ctx;
  uint32_t t;
  float g[4] = {1, 1, 1, 1}, w[4];
  char stats[8192];
  CHECK(ps_ctx_open_env(&ctx));
  int rank = ps_ctx_rank(ctx);
  CHECK(ps_table_declare(ctx, "w", PS_DENSE, 4, argv[4], &t));
  for (int s = 0; s < steps; s++) {
    if (rank != 0 && s == leave) break;
    CHECK(ps_pull_range(ctx, t, 0, 4, w, -1));
    CHECK(ps_push_range(ctx, t, 0, 4, g, batch, PS_LR_SCHEDULE, -1));
    CHECK(ps_clock(ctx));
    if (rank == 0) {
      CHECK(ps_pull_range(ctx, t, 0, 4, w, -1)); /* waits for this round */
      CHECK(ps_server_stats(ctx, 0, stats, sizeof stats, -1));
      const char *p = strstr(stats, " lr=");
      const char *b = strstr(stats, " global_batch=");
      if (!p || !b) return 1;
      printf("step %d lr %g global_batch %g w0 %g\n", s + 1, atof(p + 4), atof(b + 14), (double)w[0]);
      fflush(stdout);
    }
    if (sleep_ms) usleep((useconds_t)sleep_ms * 1000);
  }
  ps_ctx_close(ctx);
  return 0;
}
