/*
 * test_cx.c - the worker's error feedback with topk (client/cx.c), through an embedded
 * job: topk sends the values whose gathered gradient is the most consistent (largest
 * |gathered| / sqrt(sum of squares since last sent)), not the largest, and what it
 * holds back arrives later in full, on dense and sparse tables.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <stdint.h>
#include <stdio.h>

#include "pshard.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

static ps_ctx *open_embedded(void) {
  ps_config *cfg;
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "embedded", "1"));
  OK(ps_config_set(cfg, "workers", "1"));
  OK(ps_config_set(cfg, "timeout_ms", "10000"));
  OK(ps_config_set(cfg, "connect_timeout_ms", "10000"));
  ps_ctx *ctx = NULL;
  OK(ps_ctx_open(cfg, &ctx));
  ps_config_free(cfg);
  cr_assert(ctx != NULL);
  return ctx;
}

/* Value 0's gradient flips between +10 and -10, value 1's is +1 every push; topk:1
 * sends one value a push. By size value 0 would win every push until value 1 had
 * gathered 10; by consistency value 0 goes once (a tie at push 1, to the lower index)
 * and value 1 every push after: after 10 pushes all of its 10 has arrived, and value
 * 0 has its first +10 applied and holds -10 (the sum of its gradients is 0). */
static void check_consistent_first(ps_ctx *ctx, uint32_t table, int dense) {
  uint64_t keys[2] = {41, 42};
  for (int p = 0; p < 10; p++) {
    float g[2] = {p % 2 ? -10.0f : 10.0f, 1.0f};
    if (dense) OK(ps_push_range(ctx, table, 0, 2, g, 1, PS_LR_SCHEDULE, -1));
    else OK(ps_push(ctx, table, keys, 2, g, 1, PS_LR_SCHEDULE, -1));
    OK(ps_clock(ctx));
    float w[2];
    if (dense) OK(ps_pull_range(ctx, table, 0, 2, w, -1));
    else OK(ps_pull(ctx, table, keys, 2, w, -1));
    cr_assert(eq(flt, w[0], -10.0f), "push %d: value 0 is %g", p + 1, w[0]);
    float want1 = p == 0 ? 0.0f : -(float)(p + 1); /* push 2 sends the 2 gathered, then 1 each */
    cr_assert(eq(flt, w[1], want1), "push %d: value 1 is %g, want %g", p + 1, w[1], want1);
  }
}

Test(cx, topk_sends_the_most_consistent_values_dense, .timeout = 30) {
  ps_ctx *ctx = open_embedded();
  uint32_t t;
  OK(ps_table_declare(ctx, "d", PS_DENSE, 2, "opt=sgd lr=1 update=sum push_codec=topk:1", &t));
  check_consistent_first(ctx, t, 1);
  double raw, wire;
  OK(ps_ctx_stat(ctx, "push_raw_bytes", &raw));
  OK(ps_ctx_stat(ctx, "push_wire_bytes", &wire));
  cr_assert(eq(dbl, raw, 10 * 2 * 4.0));
  cr_assert(eq(dbl, wire, 10 * 8.0), "one pair a push");
  ps_ctx_close(ctx);
}

Test(cx, topk_sends_the_most_consistent_values_sparse, .timeout = 30) {
  ps_ctx *ctx = open_embedded();
  uint32_t t;
  OK(ps_table_declare(ctx, "s", PS_SPARSE, 1, "opt=sgd lr=1 update=sum push_codec=topk:1", &t));
  check_consistent_first(ctx, t, 0);
  ps_ctx_close(ctx);
}

/* A gradient that keeps its sign is never starved by a larger one that does not: with
 * many noisy values and one steady small one, the steady one arrives within a few
 * pushes, and the noisy ones' sum still arrives in full once they settle. */
Test(cx, topk_holds_back_noise_and_delivers_it_in_full, .timeout = 30) {
  enum { N = 50, P = 40 };
  ps_ctx *ctx = open_embedded();
  uint32_t t;
  OK(ps_table_declare(ctx, "n", PS_DENSE, N, "opt=sgd lr=1 update=sum push_codec=topk:5", &t));
  double produced[N] = {0};
  float g[N], w[N];
  for (int p = 0; p < P; p++) {
    for (int i = 0; i < N; i++) g[i] = i == N - 1 ? 0.5f : ((p + i) % 2 ? -8.0f : 8.0f) * (1 + i % 3);
    for (int i = 0; i < N; i++) produced[i] += g[i];
    OK(ps_push_range(ctx, t, 0, N, g, 1, PS_LR_SCHEDULE, -1));
    OK(ps_clock(ctx));
  }
  OK(ps_pull_range(ctx, t, 0, N, w, -1));
  /* the steady value: all of it but at most a couple of pushes' worth */
  double steady = -(double)w[N - 1];
  cr_assert(steady >= produced[N - 1] - 1.0, "steady value got %g of %g", steady, produced[N - 1]);
  /* then pushes of zero: what is held (a noisy value holds at most a step's size) drains */
  for (int i = 0; i < N; i++) g[i] = 0;
  for (int p = 0; p < 2 * N; p++) {
    OK(ps_push_range(ctx, t, 0, N, g, 1, PS_LR_SCHEDULE, -1));
    OK(ps_clock(ctx));
  }
  OK(ps_pull_range(ctx, t, 0, N, w, -1));
  for (int i = 0; i < N; i++) {
    double got = -(double)w[i];
    cr_assert(eq(dbl, got, produced[i]), "value %d: %g arrived of %g", i, got, produced[i]);
  }
  ps_ctx_close(ctx);
}
