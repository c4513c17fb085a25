/*
 * test_cx.c - the worker's error feedback with topk (client/cx.c), through an embedded
 * job: under a normalising optimiser (Adagrad here, as Adam and FTRL) topk sends the
 * values whose gathered gradient is the most consistent (largest |gathered| / sqrt(sum
 * of squares since last sent)), under SGD the largest, on dense and sparse tables, and
 * a key repeated in one push gathers its residual once.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <math.h>
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

/* One push of g (2 values) then a clock and a pull into w. */
static void step(ps_ctx *ctx, uint32_t table, int dense, const float *g, float *w) {
  uint64_t keys[2] = {41, 42};
  if (dense) OK(ps_push_range(ctx, table, 0, 2, g, 1, PS_LR_SCHEDULE, -1));
  else OK(ps_push(ctx, table, keys, 2, g, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(ctx));
  if (dense) OK(ps_pull_range(ctx, table, 0, 2, w, -1));
  else OK(ps_pull(ctx, table, keys, 2, w, -1));
}

/* Adagrad (lr 1, acc0 1) on one value: what the server does with what it receives. */
static void adagrad(float *w, float *acc, float g) {
  *acc += g * g;
  *w -= g / sqrtf(*acc);
}

/* Value 0's gradient flips between +10 and -10, value 1's is +1 every push; topk:1
 * sends one value a push. By size value 0 would go every push until value 1 had
 * gathered 10. By consistency value 0 goes at push 1 (both score 1: the lower index),
 * value 1 at push 2 (2 / sqrt(2) against 10 / 10) and every push after, while value 0's
 * residual swings between -10 and 0 against a growing sum of squares. */
static void check_consistent_first(ps_ctx *ctx, uint32_t table, int dense) {
  float w0 = 0, a0 = 1, w1 = 0, a1 = 1, w[2];
  for (int p = 0; p < 10; p++) {
    float g[2] = {p % 2 ? -10.0f : 10.0f, 1.0f};
    step(ctx, table, dense, g, w);
    adagrad(&w0, &a0, p == 0 ? 10.0f : 0.0f);
    adagrad(&w1, &a1, p == 0 ? 0.0f : p == 1 ? 2.0f : 1.0f);
    cr_assert(fabsf(w[0] - w0) <= 1e-5f, "push %d: value 0 is %g, want %g", p + 1, w[0], w0);
    cr_assert(fabsf(w[1] - w1) <= 1e-5f, "push %d: value 1 is %g, want %g", p + 1, w[1], w1);
  }
}

Test(cx, topk_sends_the_most_consistent_values_dense, .timeout = 30) {
  ps_ctx *ctx = open_embedded();
  uint32_t t;
  OK(ps_table_declare(ctx, "d", PS_DENSE, 2, "opt=adagrad lr=1 acc0=1 update=sum push_codec=topk:1", &t));
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
  OK(ps_table_declare(ctx, "s", PS_SPARSE, 1, "opt=adagrad lr=1 acc0=1 update=sum push_codec=topk:1", &t));
  check_consistent_first(ctx, t, 0);
  ps_ctx_close(ctx);
}

/* Under SGD a value moves by what it is sent: topk sends the largest. The same pushes
 * send value 0 every time (value 1 reaches 10 at push 10 and loses the tie), so value 1
 * has received nothing and value 0 holds what it was sent: +10 - 10 + ... */
Test(cx, topk_under_sgd_sends_the_largest, .timeout = 30) {
  ps_ctx *ctx = open_embedded();
  uint32_t t;
  OK(ps_table_declare(ctx, "g", PS_DENSE, 2, "opt=sgd lr=1 update=sum push_codec=topk:1", &t));
  float w[2];
  for (int p = 0; p < 10; p++) {
    float g[2] = {p % 2 ? -10.0f : 10.0f, 1.0f};
    step(ctx, t, 1, g, w);
    cr_assert(eq(flt, w[0], p % 2 ? 0.0f : -10.0f), "push %d: value 0 is %g", p + 1, w[0]);
    cr_assert(eq(flt, w[1], 0.0f), "push %d: value 1 is %g", p + 1, w[1]);
  }
  ps_ctx_close(ctx);
}

/* Many values whose gradients flip sign and one steady small one: with 5 values sent a
 * push out of 50, the steady one is sent nearly every push, where by size it would wait
 * for 48 pushes (to gather 24). Sums of squares restart at each send: after pushes of
 * zeros everything held has been sent, so every value ends where the sum of its
 * gradients, sent in the pieces it was, takes it (Adagrad is not linear: checked as a
 * bound), and no value is left holding what it gathered. */
Test(cx, topk_keeps_a_steady_gradient_moving_among_noisy_ones, .timeout = 30) {
  enum { N = 50, P = 40 };
  ps_ctx *ctx = open_embedded();
  uint32_t t;
  OK(ps_table_declare(ctx, "n", PS_DENSE, N, "opt=adagrad lr=1 acc0=1 update=sum push_codec=topk:5", &t));
  float g[N], w[N];
  for (int p = 0; p < P; p++) {
    for (int i = 0; i < N; i++) g[i] = i == N - 1 ? 0.5f : ((p + i) % 2 ? -8.0f : 8.0f) * (float)(1 + i % 3);
    OK(ps_push_range(ctx, t, 0, N, g, 1, PS_LR_SCHEDULE, -1));
    OK(ps_clock(ctx));
  }
  OK(ps_pull_range(ctx, t, 0, N, w, -1));
  /* Sent 0.5 on at least P - 4 pushes: Adagrad moves it by at least sum 0.5 / sqrt(1 + 0.25 j). */
  double bound = 0;
  for (int j = 1; j <= P - 4; j++) bound += 0.5 / sqrt(1.0 + 0.25 * j);
  double steady = -(double)w[N - 1];
  cr_assert(steady >= bound, "the steady value moved %g, less than %g", steady, bound);
  ps_ctx_close(ctx);
}

/* A key twice in one push takes its residual at its first place only, and both places'
 * gradients count in its sum of squares: places scored 1 / 1 and 1 / sqrt(2), the first
 * is sent, the second's 1 is held. A later push of 0 gathers the held 1 (its sum of
 * squares restarted at the send and still 0: the score is the value) and sends it. */
Test(cx, topk_a_repeated_key_gathers_once, .timeout = 30) {
  ps_ctx *ctx = open_embedded();
  uint32_t t;
  OK(ps_table_declare(ctx, "r", PS_SPARSE, 1, "opt=adagrad lr=1 acc0=1 update=sum push_codec=topk:1", &t));
  uint64_t k55[2] = {5, 5}, k5 = 5;
  float ones[2] = {1, 1}, zero = 0, w, wa = 0, a = 1;
  OK(ps_push(ctx, t, k55, 2, ones, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(ctx));
  OK(ps_pull(ctx, t, &k5, 1, &w, -1));
  adagrad(&wa, &a, 1.0f);
  cr_assert(fabsf(w - wa) <= 1e-6f, "after the repeat: %g, want %g", w, wa);
  OK(ps_push(ctx, t, &k5, 1, &zero, 1, PS_LR_SCHEDULE, -1));
  OK(ps_clock(ctx));
  OK(ps_pull(ctx, t, &k5, 1, &w, -1));
  adagrad(&wa, &a, 1.0f);
  cr_assert(fabsf(w - wa) <= 1e-6f, "after the held value: %g, want %g", w, wa);
  ps_ctx_close(ctx);
}
