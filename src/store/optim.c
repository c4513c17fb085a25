/*
 * optim.c - optimiser steps and small vector helpers, written to vectorise.
 *
 * The update rules follow PyTorch's conventions (torch.optim.SGD with momentum and no
 * dampening, Adagrad, Adam) and FTRL-proximal as in McMahan et al. 2013, so that a
 * model trained here can be compared with one trained by PyTorch; operations are
 * grouped as PyTorch groups them (addcdiv: w - lr * (g / denom)). Each rule is a
 * single loop over restrict-qualified blocks with no calls but sqrtf; scalars that
 * depend only on the step (Adam's bias corrections) are computed once per call in
 * double.
 *
 * sqrtf and vectorisation: with the default -fmath-errno, GCC 12 treats sqrtf as a
 * call that may write errno, splits it into a guarded library call and refuses to
 * vectorise the loop ("control flow in loop", "statement clobbers memory").
 * `#pragma GCC optimize("no-math-errno")` and the matching function attribute do not
 * help: the builtin's attributes are fixed when the compiler starts. Declaring sqrtf
 * `const` below does: it states what is true here (every argument is a sum of
 * squares, so sqrtf never sees a negative number and never sets errno), and GCC then
 * emits sqrtps. FTRL's soft threshold is written with selects of values already
 * computed (see ftrl_step) for the same reason. Check with
 * `gcc -O3 -fopt-info-vec-optimized`: all eight loops here vectorise.
 */
#include <string.h>

#include "store/store.h"

#include <math.h>

#include "common/common.h"

#if defined(__GNUC__)
extern float sqrtf(float) __attribute__((const, nothrow));
#endif

/* ---------------------------------------------------------------- update rules */

/* w -= lr * g */
static void sgd_step(float *restrict w, const float *restrict g, size_t n, float lr) {
  for (size_t i = 0; i < n; i++) w[i] -= lr * g[i];
}

/* PyTorch momentum (dampening 0, not Nesterov): v = mu*v + g; w -= lr*v. */
static void momentum_step(float *restrict w, float *restrict v, const float *restrict g,
                          size_t n, float lr, float mu) {
  for (size_t i = 0; i < n; i++) {
    float vi = mu * v[i] + g[i];
    v[i] = vi;
    w[i] -= lr * vi;
  }
}

/* acc += g^2; w -= lr * g / (sqrt(acc) + eps). */
static void adagrad_step(float *restrict w, float *restrict acc, const float *restrict g,
                         size_t n, float lr, float eps) {
  for (size_t i = 0; i < n; i++) {
    float gi = g[i];
    float a = acc[i] + gi * gi;
    acc[i] = a;
    w[i] -= lr * (gi / (sqrtf(a) + eps));
  }
}

/* PyTorch Adam: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 * w -= step_size * m / (sqrt(v) / bc2_sqrt + eps), step_size = lr / bc1. */
static void adam_step(float *restrict w, float *restrict m, float *restrict v,
                      const float *restrict g, size_t n, float b1, float b2, float step_size,
                      float bc2_sqrt, float eps) {
  float c1 = 1.0f - b1, c2 = 1.0f - b2;
  for (size_t i = 0; i < n; i++) {
    float gi = g[i];
    float mi = b1 * m[i] + c1 * gi;
    float vi = b2 * v[i] + c2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    w[i] -= step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
  }
}

/* FTRL-proximal, per coordinate with alpha = lr:
 * sigma = (sqrt(n + g^2) - sqrt(n)) / alpha; z += g - sigma w; n += g^2;
 * w = |z| <= l1 ? 0 : -(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2). */
static void ftrl_step(float *restrict w, float *restrict z, float *restrict nacc,
                      const float *restrict g, size_t n, float inv_alpha, float l1, float l2,
                      float beta) {
  for (size_t i = 0; i < n; i++) {
    float gi = g[i];
    float ni = nacc[i];
    float nn = ni + gi * gi;
    float sq = sqrtf(nn);
    float sigma = (sq - sqrtf(ni)) * inv_alpha;
    float zi = z[i] + gi - sigma * w[i];
    z[i] = zi;
    nacc[i] = nn;
    /* w = -sign(z) max(|z| - l1, 0) / den. Every operand is computed before the
     * selects: GCC will not if-convert a floating-point operation that might trap, so
     * nothing may sit in a branch arm. den is 0 only if beta = l2 = n = 0 (no gradient
     * yet, so z = 0 too); 1 then keeps w finite. */
    float t = __builtin_fabsf(zi) - l1;
    float mag = t > 0.0f ? t : 0.0f;
    float den = (beta + sq) * inv_alpha + l2;
    den = den > 0.0f ? den : 1.0f;
    w[i] = __builtin_copysignf(mag, -zi) / den + 0.0f; /* + 0 turns -0 into 0 */
  }
}

void ps__optim_apply(const ps__optim *o, float lr, uint64_t step, float *restrict w,
                     float *restrict state, size_t stride, const float *restrict g,
                     size_t n) {
  switch (o->kind) {
  case PS__OPT_SGD:
    sgd_step(w, g, n, lr);
    break;
  case PS__OPT_MOMENTUM:
    momentum_step(w, state, g, n, lr, o->momentum);
    break;
  case PS__OPT_ADAGRAD:
    adagrad_step(w, state, g, n, lr, o->eps);
    break;
  case PS__OPT_ADAM: {
    /* step 0 would divide by zero; the caller counts from 1, treat 0 as 1. */
    double t = (double)(step ? step : 1);
    PS_ASSERT(n <= stride); /* the m and v blocks must not overlap */
    double bc1 = 1.0 - pow((double)o->beta1, t);
    double bc2 = 1.0 - pow((double)o->beta2, t);
    adam_step(w, state, state + stride, g, n, o->beta1, o->beta2, (float)(lr / bc1),
              (float)sqrt(bc2), o->eps);
    break;
  }
  case PS__OPT_FTRL:
    /* alpha = 0 means no learning; the rule would divide by it. */
    if (!(lr > 0.0f)) break;
    PS_ASSERT(n <= stride);
    ftrl_step(w, state, state + stride, g, n, (float)(1.0 / (double)lr), o->l1, o->l2,
              o->beta);
    break;
  }
}

/* ---------------------------------------------------------------- vector helpers */

void ps__axpy(float *restrict y, float a, const float *restrict x, size_t n) {
  for (size_t i = 0; i < n; i++) y[i] += a * x[i];
}

void ps__vadd(float *restrict y, const float *restrict x, size_t n) {
  for (size_t i = 0; i < n; i++) y[i] += x[i];
}

void ps__vset(float *restrict y, float a, const float *restrict x, size_t n) {
  if (a == 1.0f) {
    memcpy(y, x, n * 4);
    return;
  }
  for (size_t i = 0; i < n; i++) y[i] = a * x[i];
}

void ps__vscale(float *y, float a, size_t n) {
  for (size_t i = 0; i < n; i++) y[i] *= a;
}
