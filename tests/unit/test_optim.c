/*
 * test_optim.c - the optimiser steps against hand-computed values, and the vector
 * helpers.
 *
 * Expected values are literals worked out in double precision from the update rules
 * (PyTorch conventions for momentum, Adagrad and Adam; McMahan et al. 2013 for FTRL),
 * not by calling the code under test. Tolerances allow for float arithmetic and for
 * hyper-parameters such as 0.9 being stored as floats.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <math.h>
#include <string.h>

#include "store/store.h"

#define TOL 2e-6f

static ps__optim optim(ps__opt_kind kind) {
  ps__optim o;
  memset(&o, 0, sizeof o);
  o.kind = kind;
  o.lr = 0.1f;
  o.momentum = 0.9f;
  o.beta1 = 0.9f;
  o.beta2 = 0.999f;
  o.eps = 1e-8f;
  o.beta = 1.0f;
  return o;
}

/* |got - want| within tol relative to max(1, |want|). */
static void near(float got, double want, double tol, const char *what) {
  double scale = fabs(want) > 1.0 ? fabs(want) : 1.0;
  cr_assert(fabs((double)got - want) <= tol * scale, "%s: got %.9g want %.9g", what, (double)got,
            want);
}

Test(optim, nstate) {
  cr_assert(eq(uint, ps__optim_nstate(PS__OPT_SGD), 0));
  cr_assert(eq(uint, ps__optim_nstate(PS__OPT_MOMENTUM), 1));
  cr_assert(eq(uint, ps__optim_nstate(PS__OPT_ADAGRAD), 1));
  cr_assert(eq(uint, ps__optim_nstate(PS__OPT_ADAM), 2));
  cr_assert(eq(uint, ps__optim_nstate(PS__OPT_FTRL), 2));
}

Test(optim, sgd) {
  ps__optim o = optim(PS__OPT_SGD);
  float w[3] = {1.0f, -2.0f, 0.5f};
  const float g1[3] = {0.5f, -1.0f, 2.0f}, g2[3] = {1.0f, 0.25f, -0.5f};
  /* w -= 0.1 g: {1 - .05, -2 + .1, .5 - .2} */
  ps__optim_apply(&o, 0.1f, 1, w, NULL, 0, g1, 3);
  near(w[0], 0.95, TOL, "w0 step1");
  near(w[1], -1.9, TOL, "w1 step1");
  near(w[2], 0.3, TOL, "w2 step1");
  /* {.95 - .1, -1.9 - .025, .3 + .05} */
  ps__optim_apply(&o, 0.1f, 2, w, NULL, 0, g2, 3);
  near(w[0], 0.85, TOL, "w0 step2");
  near(w[1], -1.925, TOL, "w1 step2");
  near(w[2], 0.35, TOL, "w2 step2");
  /* The lr argument is the one used, not o->lr. */
  ps__optim_apply(&o, 1.0f, 3, w, NULL, 0, g2, 3);
  near(w[0], -0.15, TOL, "w0 lr override");
}

Test(optim, momentum) {
  ps__optim o = optim(PS__OPT_MOMENTUM);
  float w[2] = {1.0f, 0.0f};
  float v[4] = {0, 0, 99.0f, 99.0f}; /* stride 4, n 2: v[2], v[3] untouched */
  const float g[3][2] = {{1.0f, -2.0f}, {0.5f, 0.0f}, {-1.0f, 1.0f}};
  /* v = .9 v + g; w -= .1 v
   * step 1: v = {1, -2},          w = {.9, .2}
   * step 2: v = {1.4, -1.8},      w = {.76, .38}
   * step 3: v = {.26, -.62},      w = {.734, .442} */
  const double wv[3][2] = {{0.9, 0.2}, {0.76, 0.38}, {0.734, 0.442}};
  const double vv[3][2] = {{1.0, -2.0}, {1.4, -1.8}, {0.26, -0.62}};
  for (int s = 0; s < 3; s++) {
    ps__optim_apply(&o, 0.1f, (uint64_t)s + 1, w, v, 4, g[s], 2);
    for (int i = 0; i < 2; i++) {
      near(w[i], wv[s][i], TOL, "momentum w");
      near(v[i], vv[s][i], TOL, "momentum v");
    }
  }
  cr_assert(eq(flt, v[2], 99.0f));
  cr_assert(eq(flt, v[3], 99.0f));
}

Test(optim, adagrad) {
  ps__optim o = optim(PS__OPT_ADAGRAD);
  o.eps = 1e-10f;
  float w[2] = {1.0f, -0.5f};
  float acc[2] = {0.1f, 0.1f}; /* acc0 = 0.1 */
  const float g[3][2] = {{1.0f, -2.0f}, {0.5f, 0.25f}, {-1.0f, 0.0f}};
  /* acc += g^2; w -= .1 g / (sqrt(acc) + 1e-10)
   * step 1: acc = {1.1, 4.1}:     w = {1 - .1/sqrt(1.1), -.5 + .2/sqrt(4.1)}
   * step 2: acc = {1.35, 4.1625}
   * step 3: acc = {2.35, 4.1625}: a zero gradient leaves w[1] alone */
  const double wv[3][2] = {{0.9046537410845317, -0.40122704033991907},
                           {0.8616205927970418, -0.41348061737421526},
                           {0.9268534000981308, -0.41348061737421526}};
  const double av[3][2] = {{1.1, 4.1}, {1.35, 4.1625}, {2.35, 4.1625}};
  for (int s = 0; s < 3; s++) {
    ps__optim_apply(&o, 0.1f, (uint64_t)s + 1, w, acc, 2, g[s], 2);
    for (int i = 0; i < 2; i++) {
      near(w[i], wv[s][i], TOL, "adagrad w");
      near(acc[i], av[s][i], TOL, "adagrad acc");
    }
  }
}

Test(optim, adagrad_eps_matters) {
  /* acc0 = 0 and g = 0: the step is 0 / (0 + eps) = 0, not NaN. */
  ps__optim o = optim(PS__OPT_ADAGRAD);
  o.eps = 1e-10f;
  float w[1] = {2.0f}, acc[1] = {0.0f};
  const float g[1] = {0.0f};
  ps__optim_apply(&o, 0.1f, 1, w, acc, 1, g, 1);
  cr_assert(eq(flt, w[0], 2.0f));
  cr_assert(eq(flt, acc[0], 0.0f));
}

Test(optim, adam_bias_correction) {
  ps__optim o = optim(PS__OPT_ADAM);
  float w[2] = {1.0f, -0.5f};
  float st[6]; /* m at st[0..1], v at st[3..4] (stride 3), st[2], st[5] untouched */
  const float g[3][2] = {{0.5f, -2.0f}, {-1.0f, 0.25f}, {0.2f, 1.0f}};
  for (int i = 0; i < 6; i++) st[i] = 0.0f;
  st[2] = st[5] = 42.0f;
  /* lr .1, b1 .9, b2 .999, eps 1e-8.
   * step 1: m = .1 g = {.05, -.2}, v = .001 g^2 = {.00025, .004}, bc1 = .1, bc2 = .001:
   *   w -= (.1/.1) m / (sqrt(v)/sqrt(.001) + 1e-8) = {.05/.5, -.2/2} (+ eps):
   *   the first Adam step moves each weight by lr * sign(g).
   * step 2: m = {-.055, -.155}, v = {.00124975, .0040585}, bc1 = .19, bc2 = .001999.
   * step 3: m = {-.0295, -.0395}, v = {.00128850025, .0050544415}, bc1 = .271,
   *   bc2 = .002997001. */
  const double wv[3][2] = {{0.9000000019999999, -0.4000000004999999},
                           {0.9366103542405653, -0.3427465433289554},
                           {0.9532121057371113, -0.3315228792956701}};
  const double mv[3][2] = {{0.05, -0.2}, {-0.055, -0.155}, {-0.0295, -0.0395}};
  const double vv[3][2] = {
      {0.00025, 0.004}, {0.00124975, 0.0040585}, {0.00128850025, 0.0050544415}};
  for (int s = 0; s < 3; s++) {
    ps__optim_apply(&o, 0.1f, (uint64_t)s + 1, w, st, 3, g[s], 2);
    for (int i = 0; i < 2; i++) {
      near(w[i], wv[s][i], 1e-5, "adam w");
      near(st[i], mv[s][i], 1e-6, "adam m");
      near(st[3 + i], vv[s][i], 1e-6, "adam v");
    }
  }
  cr_assert(eq(flt, st[2], 42.0f));
  cr_assert(eq(flt, st[5], 42.0f));
}

Test(optim, adam_step_count_matters) {
  /* A step applied as step 100 instead of 1: bc1 ~ 1, bc2 ~ .095, so the move is
   * (lr / bc1) * .05 / (sqrt(.00025)/sqrt(.0952) + 1e-8) = .0975771, not .1. */
  ps__optim o = optim(PS__OPT_ADAM);
  float w[1] = {1.0f}, st[2] = {0, 0};
  const float g[1] = {0.5f};
  ps__optim_apply(&o, 0.1f, 100, w, st, 1, g, 1);
  /* bc1 = 1 - .9^100 = .9999734386, bc2 = 1 - .999^100 = .0952078529 */
  near(w[0], 0.9024229157876086,
       1e-5, "adam step 100");
}

Test(optim, ftrl_l1_zeroing) {
  ps__optim o = optim(PS__OPT_FTRL);
  o.l1 = 0.2f;
  o.l2 = 0.1f;
  o.beta = 1.0f;
  float w[1] = {0.0f}, st[2] = {0.0f, 0.0f}; /* z = st[0], n = st[1] */
  const float g[3] = {0.3f, -0.5f, -1.0f};
  /* alpha = .5.
   * step 1: sigma = (.3 - 0)/.5 = .6; z = .3; n = .09; |z| > .2:
   *   w = -(.3 - .2) / ((1 + .3)/.5 + .1) = -.1/2.7 = -.037037...
   * step 2: n = .34, sigma = (sqrt(.34) - .3)/.5 = .5661904;
   *   z = .3 - .5 - sigma * (-.037037) = -.1790300; |z| <= .2, so w = 0.
   * step 3: n = 1.34, sigma irrelevant (w = 0); z = -1.1790300;
   *   w = (1.1790300 - .2) / ((1 + sqrt(1.34))/.5 + .1) = .2217424 */
  const double wv[3] = {-0.03703703703703703, 0.0, 0.22174243954492318};
  const double zv[3] = {0.3, -0.1790299859641089, -1.179029985964109};
  const double nv[3] = {0.09, 0.34, 1.34};
  for (int s = 0; s < 3; s++) {
    ps__optim_apply(&o, 0.5f, (uint64_t)s + 1, w, st, 1, &g[s], 1);
    near(w[0], wv[s], TOL, "ftrl w");
    near(st[0], zv[s], TOL, "ftrl z");
    near(st[1], nv[s], TOL, "ftrl n");
  }
}

Test(optim, ftrl_zero_is_positive_zero_and_no_nan) {
  /* beta = l2 = 0 and a zero gradient: the rule's denominator is 0; w must stay 0. */
  ps__optim o = optim(PS__OPT_FTRL);
  o.beta = 0.0f;
  float w[2] = {0.0f, 0.0f}, st[4] = {0, 0, 0, 0};
  const float g[2] = {0.0f, 0.1f};
  ps__optim_apply(&o, 0.5f, 1, w, st, 2, g, 2);
  cr_assert(eq(flt, w[0], 0.0f));
  cr_assert(not(signbit(w[0])), "w[0] is -0");
  /* g = .1, l1 = 0: z = .1, n = .01, w = -.1 / ((0 + .1)/.5) = -.5 */
  near(w[1], -0.5, TOL, "ftrl beta 0");
  /* lr 0: no learning, nothing changes. */
  ps__optim_apply(&o, 0.0f, 2, w, st, 2, g, 2);
  near(w[1], -0.5, TOL, "ftrl lr 0");
  near(st[2 + 1], 0.01, TOL, "ftrl n after lr 0");
}

/* The vector paths with odd lengths and offsets, against a double reference. */
Test(optim, long_vectors_match_scalar_reference) {
  enum { N = 1003 };
  static float w[N + 1], st[2 * N + 2], g[N + 1];
  static double rw[N], rm[N], rv[N];
  ps__optim o = optim(PS__OPT_ADAM);
  for (int i = 0; i < N; i++) {
    w[i + 1] = rw[i] = 0.001 * (i % 97) - 0.05;
    g[i + 1] = (float)(0.01 * ((i * 7) % 13) - 0.06);
    st[1 + i] = st[1 + N + i] = 0.0f;
    rm[i] = rv[i] = 0.0;
  }
  for (uint64_t t = 1; t <= 3; t++) {
    ps__optim_apply(&o, 0.01f, t, w + 1, st + 1, N, g + 1, N);
    double bc1 = 1.0 - pow(0.9, (double)t), bc2 = 1.0 - pow(0.999, (double)t);
    for (int i = 0; i < N; i++) {
      double gi = g[i + 1];
      rm[i] = 0.9 * rm[i] + 0.1 * gi;
      rv[i] = 0.999 * rv[i] + 0.001 * gi * gi;
      rw[i] -= (0.01 / bc1) * rm[i] / (sqrt(rv[i]) / sqrt(bc2) + 1e-8);
    }
  }
  for (int i = 0; i < N; i++) {
    near(w[i + 1], rw[i], 1e-5, "adam vector");
    near(st[1 + i], rm[i], 1e-6, "adam vector m");
    near(st[1 + N + i], rv[i], 1e-7, "adam vector v");
  }
}

Test(optim, vector_helpers) {
  enum { N = 37 };
  float y[N], x[N];
  for (int i = 0; i < N; i++) {
    y[i] = (float)i;
    x[i] = (float)(2 * i + 1);
  }
  ps__axpy(y, 0.5f, x, N); /* y = i + .5 (2i + 1) = 2i + .5 */
  for (int i = 0; i < N; i++) cr_assert(eq(flt, y[i], 2.0f * (float)i + 0.5f));
  ps__vadd(y, x, N); /* 4i + 1.5 */
  for (int i = 0; i < N; i++) cr_assert(eq(flt, y[i], 4.0f * (float)i + 1.5f));
  ps__vscale(y, 0.25f, N); /* i + .375 */
  for (int i = 0; i < N; i++) cr_assert(eq(flt, y[i], (float)i + 0.375f));
  ps__vscale(y, 2.0f, 0); /* n = 0 is a no-op */
  cr_assert(eq(flt, y[1], 1.375f));
}
