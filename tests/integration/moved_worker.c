/*
 * moved_worker.c - keys a server does not own are rejected whole: a sparse push or
 * pull that names them fails with PS_ERR_MOVED ("... is not on this server") and
 * changes nothing, in a small call and in one large enough for the server's helper
 * thread (server.c, PAR_MIN_KEYS).
 *
 * Run with 2 servers and 2 workers: this process opens both workers, one with the
 * servers' ring and one with `vnodes=64` (the servers use 128), whose routing sends
 * each server keys it does not own. After the rejected calls, the table read through
 * the right ring must still hold its initial value everywhere.
 * Exit status: 0 as expected, 1 otherwise.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard.h"

#define CHECK(call)                                                                               \
  do {                                                                                            \
    int rc_ = (call);                                                                             \
    if (rc_) {                                                                                    \
      fprintf(stderr, "moved_worker: %s failed: %s: %s\n", #call, ps_err_name(rc_), ps_errmsg()); \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

#define N 300000u /* keys of the large calls, above PAR_MIN_KEYS */
#define SMALL 1000u

static ps_ctx *wrong;

static void *open_wrong(void *arg) {
  (void)arg;
  ps_config *cfg;
  CHECK(ps_config_new(&cfg));
  CHECK(ps_config_from_env(cfg));
  CHECK(ps_config_set(cfg, "vnodes", "64"));
  CHECK(ps_ctx_open(cfg, &wrong));
  ps_config_free(cfg);
  return NULL;
}

static int expect_moved(int rc, const char *what) {
  if (rc == PS_ERR_MOVED && strstr(ps_errmsg(), "is not on this server")) return 0;
  fprintf(stderr, "moved_worker: %s: expected PS_ERR_MOVED, got %s: %s\n", what, ps_err_name(rc), ps_errmsg());
  return 1;
}

int main(void) {
  ps_ctx *right;
  pthread_t th;
  if (pthread_create(&th, NULL, open_wrong, NULL)) return 1;
  CHECK(ps_ctx_open_env(&right));
  pthread_join(th, NULL);
  const char *opts = "opt=sgd lr=0.5 mode=async init=const:0.25";
  uint32_t tr, tw;
  CHECK(ps_table_declare(right, "t", PS_SPARSE, 1, opts, &tr));
  CHECK(ps_table_declare(wrong, "t", PS_SPARSE, 1, opts, &tw));
  uint64_t *keys = malloc(N * sizeof *keys);
  float *g = malloc(N * sizeof *g), *out = malloc(N * sizeof *out);
  if (!keys || !g || !out) return 1;
  for (uint32_t i = 0; i < N; i++) {
    keys[i] = (uint64_t)i * 2654435761u % 1000003u;
    g[i] = 1.0f;
  }
  int bad = 0;
  /* Half of the keys exist (created through the right ring), half do not. */
  for (uint32_t o = 0; o < N / 2; o += SMALL) CHECK(ps_pull(right, tr, keys + o, SMALL, out, -1));
  bad |= expect_moved(ps_push(wrong, tw, keys, SMALL, g, 1, PS_LR_SCHEDULE, -1), "small push");
  bad |= expect_moved(ps_pull(wrong, tw, keys, SMALL, out, -1), "small pull");
  bad |= expect_moved(ps_push(wrong, tw, keys, N, g, 1, PS_LR_SCHEDULE, -1), "large push");
  bad |= expect_moved(ps_pull(wrong, tw, keys, N, out, -1), "large pull");
  /* Nothing changed: every row still holds its initial value. */
  CHECK(ps_pull(right, tr, keys, N, out, -1));
  for (uint32_t i = 0; i < N && !bad; i++) {
    if (out[i] != 0.25f) {
      fprintf(stderr, "moved_worker: key %llu holds %.9g after rejected pushes\n", (unsigned long long)keys[i],
              (double)out[i]);
      bad = 1;
    }
  }
  /* The right ring still works for pushes. */
  CHECK(ps_push(right, tr, keys, N, g, 1, PS_LR_SCHEDULE, -1));
  ps_ctx_close(wrong);
  ps_ctx_close(right);
  free(keys);
  free(g);
  free(out);
  return bad;
}
