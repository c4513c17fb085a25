/*
 * init.c - deterministic initial values for new rows.
 *
 * Element j of the row with key k in a table is a pure function of (seed, name hash,
 * k, j): a per-row base is mixed from the first three and each element mixes the base
 * with j. Every server therefore creates the same row, whichever server owns the key
 * and whenever it is first touched. Normal values use Box-Muller in double on two
 * uniforms; they are reproducible across processes of one build (libm's log and cos).
 */
#include "store/store.h"

#include <math.h>
#include <string.h>

#include "common/common.h"

/* Uniform in [-1, 1) with 24 random bits, exact in float. */
static float uniform_pm1(uint64_t x) {
  return (float)((int32_t)(x >> 40) - (1 << 23)) * (1.0f / (float)(1 << 23));
}

/* Standard normal from two independent 64-bit values (Box-Muller, cosine branch). */
static float std_normal(uint64_t x1, uint64_t x2) {
  double u1 = ((double)(x1 >> 11) + 1.0) * (1.0 / 9007199254740992.0); /* (0, 1] */
  double u2 = (double)(x2 >> 11) * (1.0 / 9007199254740992.0);         /* [0, 1) */
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void ps__row_init(const ps__table_spec *spec, uint64_t key, float *row) {
  uint32_t width = spec->width;
  uint32_t len = ps__spec_row_len(spec, key);
  unsigned nstate = ps__optim_nstate(spec->opt.kind);
  uint64_t base = ps__mix64(ps__mix64(spec->init.seed ^ ps__mix64(spec->name_hash)) ^ key);
  float a = spec->init.a;

  if (len > width) len = width;
  switch (spec->init.kind) {
  case PS__INIT_ZERO:
    memset(row, 0, (size_t)len * sizeof(float));
    break;
  case PS__INIT_CONST:
    for (uint32_t j = 0; j < len; j++) row[j] = a;
    break;
  case PS__INIT_UNIFORM:
    for (uint32_t j = 0; j < len; j++) row[j] = a * uniform_pm1(ps__mix64(base + j));
    break;
  case PS__INIT_NORMAL:
    for (uint32_t j = 0; j < len; j++) {
      uint64_t x1 = ps__mix64(base + 2 * (uint64_t)j);
      uint64_t x2 = ps__mix64(base + 2 * (uint64_t)j + 1);
      row[j] = a * std_normal(x1, x2);
    }
    break;
  }
  /* The tail of a short last dense slice is stored but never used: keep it zero. */
  memset(row + len, 0, (size_t)(width - len) * sizeof(float));

  float *state = row + width;
  size_t nst = (size_t)width * nstate;
  if (spec->opt.kind == PS__OPT_ADAGRAD) {
    for (size_t i = 0; i < nst; i++) state[i] = spec->opt.acc0;
  } else {
    memset(state, 0, nst * sizeof(float));
  }
}
