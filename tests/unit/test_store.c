/*
 * test_store.c - table specs, row initialisers and the row map.
 *
 * Spec parsing (proto/spec.c): defaults, every option, byte-comparability, and each
 * rejection with its message. Initialisers: determinism, bounds and moments, dense last
 * slices, optimiser state. Row map: a million keys (0 and UINT64_MAX included), pointer
 * stability across growth, clear and reuse, insertion order, memory accounting.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <ctype.h>
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "proto/spec.h"
#include "store/store.h"

/* ---------------------------------------------------------------- spec */

static ps__table_spec parse_ok(const char *name, int kind, uint64_t size, const char *opts) {
  ps__table_spec s;
  char err[256] = "";
  int rc = ps__table_spec_parse(&s, name, kind, size, opts, err, sizeof err);
  cr_assert(eq(int, rc, 0), "parse '%s' failed: %s", opts ? opts : "(null)", err);
  cr_assert(eq(str, err, ""));
  return s;
}

Test(spec, sparse_defaults) {
  ps__table_spec s = parse_ok("emb", PS_SPARSE, 16, NULL);
  cr_assert(eq(int, s.kind, PS_SPARSE));
  cr_assert(eq(u64, s.size, 16));
  cr_assert(eq(u32, s.width, 16));
  cr_assert(eq(u64, s.nrows, 0));
  cr_assert(eq(int, s.opt.kind, PS__OPT_SGD));
  cr_assert(eq(flt, s.opt.lr, 0.01f));
  cr_assert(eq(flt, s.opt.momentum, 0.9f));
  cr_assert(eq(flt, s.opt.beta1, 0.9f));
  cr_assert(eq(flt, s.opt.beta2, 0.999f));
  cr_assert(eq(flt, s.opt.eps, 1e-8f));
  cr_assert(eq(flt, s.opt.acc0, 0.0f));
  cr_assert(eq(flt, s.opt.l1, 0.0f));
  cr_assert(eq(flt, s.opt.l2, 0.0f));
  cr_assert(eq(flt, s.opt.beta, 1.0f));
  cr_assert(eq(int, s.update, PS__UPDATE_MEAN));
  cr_assert(eq(int, s.init.kind, PS__INIT_ZERO));
  cr_assert(eq(flt, s.init.a, 0.0f));
  cr_assert(eq(u64, s.init.seed, 0));
  cr_assert(eq(u64, s.name_hash, ps__hash64("emb", 3, 0)));
  cr_assert(eq(sz, ps__spec_row_floats(&s), 16));
  cr_assert(eq(u32, ps__spec_row_len(&s, 0), 16));
  cr_assert(eq(u32, ps__spec_row_len(&s, UINT64_MAX), 16));
}

Test(spec, dense_slices) {
  ps__table_spec s = parse_ok("w", PS_DENSE, 100000, "");
  cr_assert(eq(u32, s.width, 65536));
  cr_assert(eq(u64, s.nrows, 2));
  cr_assert(eq(u32, ps__spec_row_len(&s, 0), 65536));
  cr_assert(eq(u32, ps__spec_row_len(&s, 1), 100000 - 65536));
  cr_assert(eq(u32, ps__spec_row_len(&s, 2), 0));
  cr_assert(eq(u32, ps__spec_row_len(&s, UINT64_MAX), 0)); /* no wrap-around at the top */

  s = parse_ok("b", PS_DENSE, 10, NULL); /* smaller than a slice: one short row */
  cr_assert(eq(u32, s.width, 10));
  cr_assert(eq(u64, s.nrows, 1));
  cr_assert(eq(u32, ps__spec_row_len(&s, 0), 10));

  s = parse_ok("w", PS_DENSE, 2500, "slice=1000 opt=adam");
  cr_assert(eq(u32, s.width, 1000));
  cr_assert(eq(u64, s.nrows, 3));
  cr_assert(eq(u32, ps__spec_row_len(&s, 1), 1000));
  cr_assert(eq(u32, ps__spec_row_len(&s, 2), 500));
  cr_assert(eq(sz, ps__spec_row_floats(&s), 3000));

  s = parse_ok("w", PS_DENSE, 3000, "slice=1000"); /* exact multiple */
  cr_assert(eq(u64, s.nrows, 3));
  cr_assert(eq(u32, ps__spec_row_len(&s, 2), 1000));

  s = parse_ok("w", PS_DENSE, 1ull << 40, "slice=1048576"); /* the largest allowed */
  cr_assert(eq(u64, s.nrows, 1ull << 20));
  cr_assert(eq(u32, ps__spec_row_len(&s, (1ull << 20) - 1), 1u << 20));

  s = parse_ok("e", PS_SPARSE, 1u << 20, NULL); /* the widest sparse row */
  cr_assert(eq(u32, s.width, 1u << 20));
}

Test(spec, every_option) {
  ps__table_spec s = parse_ok("t", PS_DENSE, 5000,
                              "opt=adam lr=0.5 momentum=0.75 beta1=0.5 beta2=0.25 eps=1e-6 "
                              "acc0=0.125 l1=0.0625 l2=2 beta=3 update=sum init=uniform:0.5 "
                              "seed=18446744073709551615 slice=1024");
  cr_assert(eq(int, s.opt.kind, PS__OPT_ADAM));
  cr_assert(eq(flt, s.opt.lr, 0.5f));
  cr_assert(eq(flt, s.opt.momentum, 0.75f));
  cr_assert(eq(flt, s.opt.beta1, 0.5f));
  cr_assert(eq(flt, s.opt.beta2, 0.25f));
  cr_assert(eq(flt, s.opt.eps, 1e-6f));
  cr_assert(eq(flt, s.opt.acc0, 0.125f));
  cr_assert(eq(flt, s.opt.l1, 0.0625f));
  cr_assert(eq(flt, s.opt.l2, 2.0f));
  cr_assert(eq(flt, s.opt.beta, 3.0f));
  cr_assert(eq(int, s.update, PS__UPDATE_SUM));
  cr_assert(eq(int, s.init.kind, PS__INIT_UNIFORM));
  cr_assert(eq(flt, s.init.a, 0.5f));
  cr_assert(eq(u64, s.init.seed, UINT64_MAX));
  cr_assert(eq(u32, s.width, 1024));
  cr_assert(eq(u64, s.nrows, 5));
  cr_assert(eq(u32, ps__spec_row_len(&s, 4), 5000 - 4096));

  s = parse_ok("t", PS_SPARSE, 8, "init=const:-1.5 update=mean");
  cr_assert(eq(int, s.init.kind, PS__INIT_CONST));
  cr_assert(eq(flt, s.init.a, -1.5f));
  cr_assert(eq(int, s.update, PS__UPDATE_MEAN));
  s = parse_ok("t", PS_SPARSE, 8, "init=normal:0.01");
  cr_assert(eq(int, s.init.kind, PS__INIT_NORMAL));
  cr_assert(eq(flt, s.init.a, 0.01f));
  s = parse_ok("t", PS_SPARSE, 8, "init=zero");
  cr_assert(eq(int, s.init.kind, PS__INIT_ZERO));

  static const struct { const char *opt; ps__opt_kind kind; size_t row_floats; } kinds[] = {
      {"opt=sgd", PS__OPT_SGD, 8},         {"opt=momentum", PS__OPT_MOMENTUM, 16},
      {"opt=adagrad", PS__OPT_ADAGRAD, 16}, {"opt=adam", PS__OPT_ADAM, 24},
      {"opt=ftrl", PS__OPT_FTRL, 24},
  };
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    s = parse_ok("t", PS_SPARSE, 8, kinds[i].opt);
    cr_assert(eq(int, s.opt.kind, kinds[i].kind), "%s", kinds[i].opt);
    cr_assert(eq(sz, ps__spec_row_floats(&s), kinds[i].row_floats), "%s", kinds[i].opt);
  }
}

Test(spec, eps_default_depends_on_opt) {
  ps__table_spec s = parse_ok("t", PS_SPARSE, 4, "opt=adagrad");
  cr_assert(eq(flt, s.opt.eps, 1e-10f));
  s = parse_ok("t", PS_SPARSE, 4, "opt=adam");
  cr_assert(eq(flt, s.opt.eps, 1e-8f));
  s = parse_ok("t", PS_SPARSE, 4, "eps=1e-3 opt=adagrad"); /* set before opt: kept */
  cr_assert(eq(flt, s.opt.eps, 1e-3f));
}

/* Specs are compared with memcmp to detect "declared with different options". */
static int same(const char *a, const char *b) {
  ps__table_spec x, y;
  memset(&x, 0xaa, sizeof x); /* garbage in the padding must not survive */
  memset(&y, 0x55, sizeof y);
  cr_assert(eq(int, ps__table_spec_parse(&x, "t", PS_SPARSE, 8, a, NULL, 0), 0));
  cr_assert(eq(int, ps__table_spec_parse(&y, "t", PS_SPARSE, 8, b, NULL, 0), 0));
  return memcmp(&x, &y, sizeof x) == 0;
}

Test(spec, byte_comparable) {
  cr_assert(same(NULL, ""));
  cr_assert(same("", "   "));
  cr_assert(same(NULL, "opt=sgd lr=0.01 update=mean init=zero seed=0"));
  cr_assert(same("lr=0.5 opt=adam", "opt=adam  \tlr=0.5"));
  cr_assert(same("lr=0.01", "lr=1e-2"));
  cr_assert(same("lr=0", "lr=-0"));
  cr_assert(same("decay=cos:10:0", "decay=cos:10:-0"));
  cr_assert(same("opt=adagrad eps=1e-10", "opt=adagrad"));
  cr_assert(not(same("lr=0.5", "lr=0.25")));
  cr_assert(not(same(NULL, "seed=1")));
  cr_assert(not(same(NULL, "update=sum")));

  ps__table_spec x, y;
  cr_assert(eq(int, ps__table_spec_parse(&x, "a", PS_SPARSE, 8, NULL, NULL, 0), 0));
  cr_assert(eq(int, ps__table_spec_parse(&y, "b", PS_SPARSE, 8, NULL, NULL, 0), 0));
  cr_assert(ne(u64, x.name_hash, y.name_hash));
}

struct bad {
  int kind;
  uint64_t size;
  const char *opts;
  int rc;
  const char *msg;
};

static const struct bad bad_cases[] = {
    {PS_SPARSE, 8, "lrr=1", PS_ERR_CONFIG, "unknown table option 'lrr'"},
    {PS_SPARSE, 8, "=5", PS_ERR_CONFIG, "unknown table option ''"},
    {PS_SPARSE, 8, "lr", PS_ERR_CONFIG, "bad table option 'lr': expected key=value"},
    {PS_SPARSE, 8, "lr=x", PS_ERR_CONFIG, "bad value 'x' for option 'lr'"},
    {PS_SPARSE, 8, "lr=", PS_ERR_CONFIG, "bad value '' for option 'lr'"},
    {PS_SPARSE, 8, "lr=0.1x", PS_ERR_CONFIG, "bad value '0.1x' for option 'lr'"},
    {PS_SPARSE, 8, "lr=nan", PS_ERR_CONFIG, "bad value 'nan' for option 'lr'"},
    {PS_SPARSE, 8, "lr=inf", PS_ERR_CONFIG, "bad value 'inf' for option 'lr'"},
    {PS_SPARSE, 8, "lr=1e99", PS_ERR_CONFIG, "bad value '1e99' for option 'lr'"},
    {PS_SPARSE, 8, "lr=-0.1", PS_ERR_CONFIG, "bad value '-0.1' for option 'lr': must be >= 0"},
    {PS_SPARSE, 8, "lr=0.1 lr=0.2", PS_ERR_CONFIG, "table option 'lr' given twice"},
    {PS_SPARSE, 8, "momentum=-1", PS_ERR_CONFIG, "bad value '-1' for option 'momentum'"},
    {PS_SPARSE, 8, "beta1=1", PS_ERR_CONFIG, "bad value '1' for option 'beta1': must be in [0, 1)"},
    {PS_SPARSE, 8, "beta1=-0.5", PS_ERR_CONFIG, "bad value '-0.5' for option 'beta1'"},
    {PS_SPARSE, 8, "beta2=1.5", PS_ERR_CONFIG, "bad value '1.5' for option 'beta2'"},
    {PS_SPARSE, 8, "beta2=-0.1", PS_ERR_CONFIG, "bad value '-0.1' for option 'beta2'"},
    {PS_SPARSE, 8, "eps=-1e-8", PS_ERR_CONFIG, "bad value '-1e-8' for option 'eps'"},
    {PS_SPARSE, 8, "acc0=-1", PS_ERR_CONFIG, "bad value '-1' for option 'acc0'"},
    {PS_SPARSE, 8, "l1=-1", PS_ERR_CONFIG, "bad value '-1' for option 'l1'"},
    {PS_SPARSE, 8, "l2=x", PS_ERR_CONFIG, "bad value 'x' for option 'l2'"},
    {PS_SPARSE, 8, "beta=-2", PS_ERR_CONFIG, "bad value '-2' for option 'beta'"},
    {PS_SPARSE, 8, "opt=rmsprop", PS_ERR_CONFIG, "bad value 'rmsprop' for option 'opt'"},
    {PS_SPARSE, 8, "opt=SGD", PS_ERR_CONFIG, "bad value 'SGD' for option 'opt'"},
    {PS_SPARSE, 8, "update=avg", PS_ERR_CONFIG, "bad value 'avg' for option 'update'"},
    {PS_SPARSE, 8, "init=gauss:1", PS_ERR_CONFIG, "bad value 'gauss:1' for option 'init'"},
    {PS_SPARSE, 8, "init=uniform", PS_ERR_CONFIG, "bad value 'uniform' for option 'init'"},
    {PS_SPARSE, 8, "init=uniform:-1", PS_ERR_CONFIG, "bad value 'uniform:-1' for option 'init'"},
    {PS_SPARSE, 8, "init=normal:x", PS_ERR_CONFIG, "bad value 'normal:x' for option 'init'"},
    {PS_SPARSE, 8, "init=const:", PS_ERR_CONFIG, "bad value 'const:' for option 'init'"},
    {PS_SPARSE, 8, "init=zero:1", PS_ERR_CONFIG, "bad value 'zero:1' for option 'init'"},
    {PS_SPARSE, 8, "seed=-1", PS_ERR_CONFIG, "bad value '-1' for option 'seed'"},
    {PS_SPARSE, 8, "seed=18446744073709551616", PS_ERR_CONFIG, "for option 'seed'"},
    {PS_SPARSE, 8, "seed=1.5", PS_ERR_CONFIG, "bad value '1.5' for option 'seed'"},
    {PS_DENSE, 100, "slice=0", PS_ERR_CONFIG, "bad value '0' for option 'slice'"},
    {PS_DENSE, 100, "slice=1048577", PS_ERR_CONFIG, "bad value '1048577' for option 'slice'"},
    {PS_DENSE, 100, "slice=x", PS_ERR_CONFIG, "bad value 'x' for option 'slice'"},
    {PS_SPARSE, 8, "slice=16", PS_ERR_CONFIG, "option 'slice' applies only to dense tables"},
    {PS_SPARSE, 8, "opt=adam lr=0.1 bogus=1", PS_ERR_CONFIG, "unknown table option 'bogus'"},
    {3, 8, NULL, PS_ERR_INVALID, "bad table kind 3"},
    {0, 8, NULL, PS_ERR_INVALID, "bad table kind 0"},
    {PS_SPARSE, 0, NULL, PS_ERR_INVALID, "table size must be > 0"},
    {PS_DENSE, 0, NULL, PS_ERR_INVALID, "table size must be > 0"},
    {PS_DENSE, (1ull << 40) + 1, NULL, PS_ERR_INVALID, "exceeds the maximum 2^40"},
    {PS_SPARSE, (1u << 20) + 1, NULL, PS_ERR_INVALID,
     "sparse table dimension 1048577 exceeds the maximum 1048576"},
};

Test(spec, rejections) {
  for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
    const struct bad *b = &bad_cases[i];
    ps__table_spec s, before;
    char err[256];
    memset(&s, 0x77, sizeof s);
    memcpy(&before, &s, sizeof s);
    int rc = ps__table_spec_parse(&s, "t", b->kind, b->size, b->opts, err, sizeof err);
    cr_assert(eq(int, rc, b->rc), "case %zu '%s': rc %d, message '%s'", i,
              b->opts ? b->opts : "(null)", rc, err);
    cr_assert(strstr(err, b->msg) != NULL, "case %zu '%s': message '%s' lacks '%s'", i,
              b->opts ? b->opts : "(null)", err, b->msg);
    int lower = islower((unsigned char)err[0]) || err[0] == '\'';
    cr_assert(lower, "not lowercase: '%s'", err);
    cr_assert(memcmp(&s, &before, sizeof s) == 0, "case %zu: spec written on failure", i);
  }
}

Test(spec, rejection_details) {
  ps__table_spec s;
  char err[64], longopt[400];
  /* A missing name, no room for a message, a truncated message. */
  cr_assert(eq(int, ps__table_spec_parse(&s, NULL, PS_SPARSE, 8, NULL, err, sizeof err),
               PS_ERR_INVALID));
  cr_assert(eq(int, ps__table_spec_parse(&s, "t", PS_SPARSE, 8, "x=1", NULL, 0),
               PS_ERR_CONFIG));
  cr_assert(eq(int, ps__table_spec_parse(&s, "t", PS_SPARSE, 8, "x=1", err, 1), PS_ERR_CONFIG));
  cr_assert(eq(str, err, ""));
  /* An absurdly long token is refused, not overflowed. */
  memcpy(longopt, "init=const:", 11);
  memset(longopt + 11, '1', sizeof longopt - 12);
  longopt[sizeof longopt - 1] = '\0';
  cr_assert(eq(int, ps__table_spec_parse(&s, "t", PS_SPARSE, 8, longopt, err, sizeof err),
               PS_ERR_CONFIG));
  cr_assert(strstr(err, "too long") != NULL, "message '%s'", err);
}

/* ---------------------------------------------------------------- init */

Test(init, deterministic_per_key) {
  ps__table_spec s = parse_ok("emb", PS_SPARSE, 16, "init=uniform:0.5 seed=7");
  float a[16], b[16], c[16];
  ps__row_init(&s, 123, a);
  ps__row_init(&s, 123, b);
  cr_assert(memcmp(a, b, sizeof a) == 0, "same key gave different rows");
  ps__row_init(&s, 124, c);
  cr_assert(memcmp(a, c, sizeof a) != 0, "keys 123 and 124 gave the same row");
  int distinct = 0;
  for (int j = 1; j < 16; j++) distinct += a[j] != a[0];
  cr_assert(ge(int, distinct, 14), "elements of one row are not independent");

  ps__table_spec s2 = parse_ok("emb", PS_SPARSE, 16, "init=uniform:0.5 seed=8");
  ps__row_init(&s2, 123, c);
  cr_assert(memcmp(a, c, sizeof a) != 0, "the seed does not matter");
  ps__table_spec s3 = parse_ok("emb2", PS_SPARSE, 16, "init=uniform:0.5 seed=7");
  ps__row_init(&s3, 123, c);
  cr_assert(memcmp(a, c, sizeof a) != 0, "the table name does not matter");

  /* Keys 0 and UINT64_MAX are ordinary keys. */
  ps__row_init(&s, 0, b);
  ps__row_init(&s, UINT64_MAX, c);
  cr_assert(memcmp(b, c, sizeof b) != 0);
}

Test(init, uniform_within_bounds) {
  enum { DIM = 16, ROWS = 6250 }; /* 100k values */
  ps__table_spec s = parse_ok("u", PS_SPARSE, DIM, "init=uniform:0.25 seed=3");
  float row[DIM];
  double sum = 0, sum2 = 0, lo = 1, hi = -1;
  for (uint64_t k = 0; k < ROWS; k++) {
    ps__row_init(&s, k * 1000003u, row);
    for (int j = 0; j < DIM; j++) {
      cr_assert(row[j] >= -0.25f && row[j] <= 0.25f, "value %g out of [-0.25, 0.25]",
                (double)row[j]);
      sum += row[j];
      sum2 += (double)row[j] * row[j];
      if (row[j] < lo) lo = row[j];
      if (row[j] > hi) hi = row[j];
    }
  }
  double n = DIM * ROWS, mean = sum / n, sd = sqrt(sum2 / n - mean * mean);
  cr_assert(lt(dbl, fabs(mean), 0.003), "mean %g", mean);
  cr_assert(lt(dbl, fabs(sd - 0.25 / sqrt(3.0)), 0.002), "sd %g", sd);
  cr_assert(lt(dbl, lo, -0.249), "min %g", lo);
  cr_assert(gt(dbl, hi, 0.249), "max %g", hi);
}

Test(init, normal_moments) {
  enum { DIM = 32, ROWS = 3125 }; /* 100k values */
  ps__table_spec s = parse_ok("n", PS_SPARSE, DIM, "init=normal:0.5");
  float row[DIM];
  double sum = 0, sum2 = 0, within1 = 0;
  for (uint64_t k = 0; k < ROWS; k++) {
    ps__row_init(&s, k, row);
    for (int j = 0; j < DIM; j++) {
      cr_assert(isfinite(row[j]));
      sum += row[j];
      sum2 += (double)row[j] * row[j];
      within1 += fabs(row[j]) <= 0.5;
    }
  }
  double n = DIM * ROWS, mean = sum / n, sd = sqrt(sum2 / n - mean * mean);
  /* Standard error of the mean is .5/sqrt(1e5) = .0016; of the sd about .0011. */
  cr_assert(lt(dbl, fabs(mean), 0.008), "mean %g", mean);
  cr_assert(lt(dbl, fabs(sd - 0.5), 0.006), "sd %g", sd);
  cr_assert(lt(dbl, fabs(within1 / n - 0.6827), 0.01), "P(|x| <= sd) = %g", within1 / n);
}

Test(init, const_zero_and_state) {
  float row[64];
  ps__table_spec s = parse_ok("c", PS_SPARSE, 16, "init=const:2.5 opt=adagrad acc0=0.1");
  for (int i = 0; i < 64; i++) row[i] = -7.0f;
  ps__row_init(&s, 5, row);
  for (int j = 0; j < 16; j++) cr_assert(eq(flt, row[j], 2.5f));
  for (int j = 16; j < 32; j++) cr_assert(eq(flt, row[j], 0.1f), "acc at %d", j);
  cr_assert(eq(flt, row[32], -7.0f), "wrote past the row");

  s = parse_ok("z", PS_SPARSE, 16, "opt=adam");
  for (int i = 0; i < 64; i++) row[i] = -7.0f;
  ps__row_init(&s, 5, row);
  for (int j = 0; j < 48; j++) cr_assert(eq(flt, row[j], 0.0f), "at %d", j);
  cr_assert(eq(flt, row[48], -7.0f), "wrote past the row");

  s = parse_ok("f", PS_SPARSE, 16, "opt=ftrl init=normal:1");
  for (int i = 0; i < 64; i++) row[i] = -7.0f;
  ps__row_init(&s, 5, row);
  for (int j = 16; j < 48; j++) cr_assert(eq(flt, row[j], 0.0f), "ftrl state at %d", j);
}

Test(init, dense_last_slice) {
  /* 2500 floats in slices of 1000: slice 2 uses 500, the rest of its width is 0. */
  enum { W = 1000 };
  static float row[2 * W + 8];
  ps__table_spec s = parse_ok("d", PS_DENSE, 2500, "slice=1000 init=uniform:1 opt=momentum");
  for (size_t i = 0; i < sizeof row / sizeof row[0]; i++) row[i] = 9.0f;
  ps__row_init(&s, 2, row);
  int nonzero = 0;
  for (int j = 0; j < 500; j++) nonzero += row[j] != 0.0f && row[j] >= -1.0f && row[j] <= 1.0f;
  cr_assert(ge(int, nonzero, 499));
  for (int j = 500; j < 2 * W; j++) cr_assert(eq(flt, row[j], 0.0f), "at %d", j);
  cr_assert(eq(flt, row[2 * W], 9.0f), "wrote past the row");

  /* Slices are keyed by index: slice 0 and 1 differ, and each is reproducible. */
  static float a[2 * W], b[2 * W];
  ps__row_init(&s, 0, a);
  ps__row_init(&s, 1, b);
  cr_assert(memcmp(a, b, W * sizeof(float)) != 0);
  ps__row_init(&s, 1, a);
  cr_assert(memcmp(a, b, sizeof a) == 0);

  s = parse_ok("d", PS_DENSE, 2500, "slice=1000 init=const:3");
  ps__row_init(&s, 2, row);
  cr_assert(eq(flt, row[499], 3.0f));
  cr_assert(eq(flt, row[500], 0.0f));
}

/* ---------------------------------------------------------------- rowmap */

enum { NKEYS = 1000000, DIM = 16 };

/* Distinct keys including 0 (i = 0) and UINT64_MAX (i = 1). */
static uint64_t key_of(size_t i) {
  if (i == 1) return UINT64_MAX;
  return (uint64_t)i * 0x9E3779B97F4A7C15ull; /* odd multiplier: a bijection */
}

Test(rowmap, million_keys) {
  ps__rowmap *m = ps__rowmap_new(2 * DIM);
  cr_assert(not(zero(ptr, m)));
  cr_assert(zero(ptr, ps__rowmap_get(m, 0)));
  cr_assert(eq(sz, ps__rowmap_count(m), 0));
  cr_assert(key_of(0) == 0 && key_of(1) == UINT64_MAX);
  for (size_t i = 0; i < NKEYS; i++) {
    int created = -1;
    float *r = ps__rowmap_upsert(m, key_of(i), &created);
    cr_assert(not(zero(ptr, r)));
    cr_assert(eq(int, created, 1), "key %zu not created", i);
    for (int j = 0; j < 2 * DIM; j++)
      if (r[j] != 0.0f) cr_fatal("row %zu not zero-filled", i);
    r[0] = (float)i;
    r[2 * DIM - 1] = (float)(i & 0xffff);
  }
  cr_assert(eq(sz, ps__rowmap_count(m), NKEYS));
  for (size_t i = 0; i < NKEYS; i++) {
    float *r = ps__rowmap_get(m, key_of(i));
    if (!r || r[0] != (float)i || r[2 * DIM - 1] != (float)(i & 0xffff))
      cr_fatal("key %zu: wrong row", i);
  }
  /* Absent keys. */
  for (size_t i = NKEYS; i < NKEYS + 100000; i++)
    if (ps__rowmap_get(m, key_of(i))) cr_fatal("absent key %zu found", i);
  cr_assert(zero(ptr, ps__rowmap_get(m, 1)));
  /* Upsert of an existing key returns the same row and leaves it alone. */
  for (size_t i = 0; i < NKEYS; i += 997) {
    int created = -1;
    float *r = ps__rowmap_upsert(m, key_of(i), &created);
    cr_assert(eq(int, created, 0));
    cr_assert(eq(ptr, r, ps__rowmap_get(m, key_of(i))));
    cr_assert(eq(flt, r[0], (float)i));
  }
  cr_assert(not(zero(ptr, ps__rowmap_upsert(m, 0, NULL)))); /* created may be NULL */
  cr_assert(eq(sz, ps__rowmap_count(m), NKEYS));
  ps__rowmap_free(m);
  ps__rowmap_free(NULL);
}

Test(rowmap, sequential_keys) {
  /* Consecutive keys must not cluster in the index. */
  ps__rowmap *m = ps__rowmap_new(1);
  for (uint64_t k = 0; k < 300000; k++) *ps__rowmap_upsert(m, k, NULL) = (float)k;
  for (uint64_t k = 0; k < 300000; k++) {
    float *r = ps__rowmap_get(m, k);
    if (!r || *r != (float)k) cr_fatal("key %llu", (unsigned long long)k);
  }
  ps__rowmap_free(m);
}

Test(rowmap, pointers_stable_across_growth) {
  enum { EARLY = 5000 };
  static float *early[EARLY];
  ps__rowmap *m = ps__rowmap_new(2 * DIM);
  for (size_t i = 0; i < EARLY; i++) {
    early[i] = ps__rowmap_upsert(m, key_of(i), NULL);
    early[i][3] = (float)i + 0.5f;
  }
  for (size_t i = EARLY; i < 400000; i++) ps__rowmap_upsert(m, key_of(i), NULL)[3] = -1.0f;
  for (size_t i = 0; i < EARLY; i++) {
    if (ps__rowmap_get(m, key_of(i)) != early[i]) cr_fatal("row %zu moved", i);
    if (early[i][3] != (float)i + 0.5f) cr_fatal("row %zu overwritten", i);
  }
  /* Rows do not overlap: each one's last float is its own. */
  for (size_t i = 0; i < EARLY; i++) early[i][2 * DIM - 1] = (float)i;
  for (size_t i = 0; i < EARLY; i++)
    if (early[i][2 * DIM - 1] != (float)i || early[i][3] != (float)i + 0.5f)
      cr_fatal("row %zu overlaps another", i);
  ps__rowmap_free(m);
}

Test(rowmap, order_key_at_row_at) {
  ps__rowmap *m = ps__rowmap_new(3); /* odd width: keys stay aligned */
  enum { N = 100000 };
  for (size_t i = 0; i < N; i++) {
    uint64_t k = key_of(N - 1 - i);
    ps__rowmap_upsert(m, k, NULL)[2] = (float)i;
    if (i % 3 == 0) ps__rowmap_upsert(m, k, NULL); /* repeats do not add rows */
  }
  cr_assert(eq(sz, ps__rowmap_count(m), N));
  for (size_t i = 0; i < N; i++) {
    if (ps__rowmap_key_at(m, i) != key_of(N - 1 - i)) cr_fatal("key_at(%zu)", i);
    float *r = ps__rowmap_row_at(m, i);
    if (r != ps__rowmap_get(m, key_of(N - 1 - i)) || r[2] != (float)i)
      cr_fatal("row_at(%zu)", i);
  }
  ps__rowmap_free(m);
}

Test(rowmap, clear_and_reuse) {
  ps__rowmap *m = ps__rowmap_new(DIM);
  enum { N = 200000 };
  for (size_t i = 0; i < N; i++) {
    float *r = ps__rowmap_upsert(m, key_of(i), NULL);
    for (int j = 0; j < DIM; j++) r[j] = 1.0f;
  }
  float *first = ps__rowmap_row_at(m, 0);
  size_t bytes = ps__rowmap_bytes(m);
  for (int round = 0; round < 3; round++) {
    ps__rowmap_clear(m);
    cr_assert(eq(sz, ps__rowmap_count(m), 0));
    cr_assert(zero(ptr, ps__rowmap_get(m, key_of(0))));
    cr_assert(zero(ptr, ps__rowmap_get(m, key_of(N / 2))));
    cr_assert(eq(sz, ps__rowmap_bytes(m), bytes), "clear freed or grew memory");
    /* Other keys now; the recycled rows come back zero-filled. */
    for (size_t i = 0; i < N; i++) {
      int created = 0;
      float *r = ps__rowmap_upsert(m, key_of(N * (round + 1) + i), &created);
      if (!created) cr_fatal("round %d: key %zu not created", round, i);
      for (int j = 0; j < DIM; j++)
        if (r[j] != 0.0f) cr_fatal("round %d: recycled row %zu not zeroed", round, i);
      for (int j = 0; j < DIM; j++) r[j] = 1.0f;
    }
    cr_assert(eq(ptr, ps__rowmap_row_at(m, 0), first), "memory not reused");
    cr_assert(eq(sz, ps__rowmap_bytes(m), bytes), "reuse allocated more memory");
    cr_assert(eq(u64, ps__rowmap_key_at(m, 0), key_of(N * (round + 1))));
    cr_assert(zero(ptr, ps__rowmap_get(m, key_of(1))));
  }
  ps__rowmap_clear(m);
  ps__rowmap_clear(m);
  cr_assert(eq(sz, ps__rowmap_count(m), 0));
  ps__rowmap_free(m);

  m = ps__rowmap_new(DIM); /* clear of a never-used map */
  ps__rowmap_clear(m);
  cr_assert(zero(ptr, ps__rowmap_get(m, 0)));
  ps__rowmap_free(m);
}

Test(rowmap, bytes_within_1_3x_of_payload) {
  /* 1M rows of dim 16 with adagrad: 32 floats = 128 bytes of payload per row. */
  ps__table_spec s = parse_ok("emb", PS_SPARSE, DIM, "opt=adagrad");
  size_t rf = ps__spec_row_floats(&s);
  cr_assert(eq(sz, rf, 32));
  ps__rowmap *m = ps__rowmap_new(rf);
  for (size_t i = 0; i < NKEYS; i++) ps__rowmap_upsert(m, key_of(i), NULL);
  size_t bytes = ps__rowmap_bytes(m), payload = (size_t)NKEYS * rf * sizeof(float);
  double ratio = (double)bytes / (double)payload;
  cr_log_info("rowmap: %zu rows x %zu floats: %zu bytes, %.1f bytes/row, %.3fx payload",
              (size_t)NKEYS, rf, bytes, (double)bytes / NKEYS, ratio);
  cr_assert(le(dbl, ratio, 1.3), "%.3fx payload", ratio);
  cr_assert(ge(dbl, ratio, 1.0));
  ps__rowmap_free(m);
}

Test(rowmap, small_maps_stay_small) {
  ps__rowmap *m = ps__rowmap_new(32);
  ps__rowmap_upsert(m, 7, NULL);
  ps__rowmap_upsert(m, 8, NULL);
  cr_assert(lt(sz, ps__rowmap_bytes(m), 4096), "%zu bytes for 2 rows", ps__rowmap_bytes(m));
  ps__rowmap_free(m);
}

Test(rowmap, wide_rows_one_per_chunk) {
  /* 4 MiB rows, wider than a chunk target. */
  size_t rf = (size_t)1 << 20;
  ps__rowmap *m = ps__rowmap_new(rf);
  float *r[3];
  for (int i = 0; i < 3; i++) {
    r[i] = ps__rowmap_upsert(m, (uint64_t)i * 10, NULL);
    cr_assert(not(zero(ptr, r[i])));
    r[i][0] = (float)i;
    r[i][rf - 1] = (float)i;
  }
  for (int i = 0; i < 3; i++) {
    cr_assert(eq(ptr, ps__rowmap_get(m, (uint64_t)i * 10), r[i]));
    cr_assert(eq(flt, r[i][0], (float)i));
    cr_assert(eq(flt, r[i][rf - 1], (float)i));
    cr_assert(eq(u64, ps__rowmap_key_at(m, (size_t)i), (uint64_t)i * 10));
  }
  cr_assert(lt(sz, ps__rowmap_bytes(m), 3 * rf * sizeof(float) + 65536));
  ps__rowmap_free(m);
}

Test(rowmap, allocation_failure_leaves_map_unchanged) {
  /* A row of 2^40 bytes is refused before malloc is even asked. */
  ps__rowmap *m = ps__rowmap_new((size_t)1 << 38);
  cr_assert(not(zero(ptr, m)));
  int created = 5;
  cr_assert(zero(ptr, ps__rowmap_upsert(m, 1, &created)));
  cr_assert(eq(int, created, 0));
  cr_assert(eq(sz, ps__rowmap_count(m), 0));
  cr_assert(zero(ptr, ps__rowmap_get(m, 1)));
  ps__rowmap_free(m);
  /* Rows whose size overflows are refused at creation. */
  cr_assert(zero(ptr, ps__rowmap_new(SIZE_MAX / 2)));
}

/* ps__rowmap_find_many(_le) answers exactly as ps__rowmap_get does, key by key, for
 * batches shorter and longer than its pipeline, present and absent keys, repeats. */
static void find_many_matches_get(size_t row_floats) {
  ps__rowmap *m = ps__rowmap_new(row_floats);
  cr_assert(not(zero(ptr, m)));
  uint64_t keys[3000];
  uint8_t le[3000 * 8];
  float *rows[3000];
  for (size_t i = 0; i < 3000; i++) keys[i] = i % 7 == 0 ? i / 7 : (i * 0x9e3779b97f4a7c15ull) | 1;
  for (size_t i = 2900; i < 3000; i++) keys[i] = keys[i - 2900]; /* repeats */
  /* Empty map: everything absent. */
  ps__rowmap_find_many(m, keys, 3000, rows);
  for (size_t i = 0; i < 3000; i++) cr_assert(zero(ptr, rows[i]));
  for (size_t i = 0; i < 3000; i += 2) cr_assert(not(zero(ptr, ps__rowmap_upsert(m, keys[i], NULL))));
  for (size_t i = 0; i < 3000; i++)
    for (int b = 0; b < 8; b++) le[8 * i + b] = (uint8_t)(keys[i] >> (8 * b));
  size_t lens[] = {0, 1, 2, 7, 8, 15, 16, 17, 31, 33, 100, 3000};
  for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
    size_t n = lens[l];
    for (int variant = 0; variant < 2; variant++) {
      for (size_t i = 0; i < n; i++) rows[i] = (float *)1;
      if (variant)
        ps__rowmap_find_many_le(m, le, n, rows);
      else
        ps__rowmap_find_many(m, keys, n, rows);
      for (size_t i = 0; i < n; i++)
        cr_assert(eq(ptr, rows[i], ps__rowmap_get(m, keys[i])), "n %zu variant %d key %zu", n, variant, i);
    }
  }
  ps__rowmap_free(m);
}

Test(rowmap, find_many_matches_get) {
  find_many_matches_get(3);
  find_many_matches_get(1);
  find_many_matches_get(2 * DIM);
}

/* One-float rows (a sparse sgd table of dim 1): values, keys and insertion order
 * survive every growth of the index, and a clear keeps the memory. */
Test(rowmap, one_float_rows) {
  ps__rowmap *m = ps__rowmap_new(1);
  for (size_t i = 0; i < NKEYS; i++) {
    int created = 0;
    float *r = ps__rowmap_upsert(m, key_of(i), &created);
    if (!r || !created || *r != 0.0f) cr_fatal("insert %zu", i);
    *r = (float)i;
    if (i % 3 == 0) {
      float *again = ps__rowmap_upsert(m, key_of(i), &created); /* not an insert */
      if (again != r || created) cr_fatal("repeat %zu", i);
    }
  }
  cr_assert(eq(sz, ps__rowmap_count(m), NKEYS));
  for (size_t i = 0; i < NKEYS; i++) {
    float *r = ps__rowmap_get(m, key_of(i));
    if (!r || *r != (float)i) cr_fatal("get %zu", i);
    if (ps__rowmap_row_at(m, i) != r) cr_fatal("row_at %zu", i);
    if (ps__rowmap_key_at(m, i) != key_of(i)) cr_fatal("key_at %zu", i);
  }
  for (size_t i = NKEYS; i < NKEYS + 1000; i++)
    if (ps__rowmap_get(m, key_of(i))) cr_fatal("absent key %zu found", i);
  /* Memory: the key and the row, 4-byte index entries at load >= 7/16 (the old index,
   * half the size, too while rows move to a new one), chunk tails. */
  size_t bytes = ps__rowmap_bytes(m);
  cr_log_info("rowmap: %zu one-float rows: %zu bytes, %.1f bytes/row", (size_t)NKEYS, bytes, (double)bytes / NKEYS);
  cr_assert(le(dbl, (double)bytes / NKEYS, 12.0 + 4.0 * 16 / 7 + (ps__rowmap_moving(m) ? 4.0 * 8 / 7 : 0) + 0.5),
            "%zu bytes", bytes);
  ps__rowmap_clear(m);
  cr_assert(le(sz, ps__rowmap_bytes(m), bytes), "clear grew memory");
  bytes = ps__rowmap_bytes(m);
  cr_assert(zero(ptr, ps__rowmap_get(m, key_of(0))));
  for (size_t i = 0; i < NKEYS; i++) {
    float *r = ps__rowmap_upsert(m, key_of(NKEYS + i), NULL);
    if (!r || *r != 0.0f) cr_fatal("reuse %zu", i);
    *r = -(float)i;
  }
  cr_assert(eq(sz, ps__rowmap_bytes(m), bytes), "reuse allocated more memory");
  for (size_t i = 0; i < NKEYS; i += 997) {
    float *r = ps__rowmap_get(m, key_of(NKEYS + i));
    if (!r || *r != -(float)i || ps__rowmap_row_at(m, i) != r) cr_fatal("after reuse %zu", i);
  }
  ps__rowmap_free(m);
}

/* A map that once held many rows and then few is cleared row by row: what stays must be
 * exactly what was inserted since (both kinds of map, colliding keys included). */
static void clear_after_growth(ps__rowmap *m) {
  int created;
  for (uint64_t k = 0; k < 200000; k++) cr_assert(ps__rowmap_upsert(m, k * 977, &created) != NULL);
  ps__rowmap_clear(m);
  for (int round = 0; round < 50; round++) {
    for (uint64_t k = 0; k < 40; k++) {
      float *r = ps__rowmap_upsert(m, k * 7919 + (uint64_t)round, &created);
      cr_assert(r != NULL && created, "round %d key %llu", round, (unsigned long long)k);
      r[0] = (float)k;
    }
    cr_assert(eq(sz, ps__rowmap_count(m), 40));
    for (uint64_t k = 0; k < 40; k++) {
      float *r = ps__rowmap_get(m, k * 7919 + (uint64_t)round);
      cr_assert(r != NULL && r[0] == (float)k);
    }
    cr_assert(ps__rowmap_get(m, 977) == NULL, "a row of before the clear is back");
    ps__rowmap_clear(m);
    cr_assert(eq(sz, ps__rowmap_count(m), 0));
    for (uint64_t k = 0; k < 40; k++) cr_assert(ps__rowmap_get(m, k * 7919 + (uint64_t)round) == NULL);
  }
}

Test(rowmap, clear_after_growth_row_by_row) {
  ps__rowmap *a = ps__rowmap_new(4), *b = ps__rowmap_new(1);
  clear_after_growth(a);
  clear_after_growth(b);
  ps__rowmap_free(a);
  ps__rowmap_free(b);
}
