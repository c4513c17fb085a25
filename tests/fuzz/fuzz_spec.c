/*
 * fuzz_spec.c - fuzz target for the table-spec parser (proto/spec.c).
 *
 * An input is text. Its first line is the declaration: "KIND SIZE NAME", KIND being
 * dense, sparse or a raw kind number, SIZE a decimal number (anything else reads as
 * 0), NAME the rest of the line (absent: a NULL name). The rest of the input is the
 * option string (absent when there is no second line: NULL options). Embedded NULs end
 * a string early, as they would in a C caller.
 *
 * Besides "does not crash or read out of bounds", the target checks what the parser
 * promises:
 *  - it returns 0, PS_ERR_CONFIG or PS_ERR_INVALID; on failure it writes a message
 *    (NUL-terminated within errlen, for every errlen, with the same verdict) and leaves
 *    the spec untouched;
 *  - an accepted spec is consistent: width and row count cover the size exactly, row
 *    lengths add up, every float is finite, at least 0, never -0, and within its range,
 *    the enums hold known values, the learning-rate schedule never yields NaN or a
 *    negative rate;
 *  - the result does not depend on option order or on which blanks separate options:
 *    the options reversed and rejoined with other blanks give the same verdict and, if
 *    accepted, the same bytes (the scheduler compares specs with memcmp).
 * A violated property aborts with a message, which libFuzzer and the replay driver
 * report as a crash.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "common/config.h"
#include "proto/spec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "fuzz_spec: property violated at %s:%d: %s\n", __FILE__,       \
              __LINE__, #cond);                                                     \
      abort();                                                                      \
    }                                                                               \
  } while (0)

/* A copy of data[0, n) up to its first NUL, NUL-terminated. */
static char *cstr(const uint8_t *data, size_t n) {
  const uint8_t *z = memchr(data, 0, n);
  if (z) n = (size_t)(z - data);
  char *s = malloc(n + 1);
  CHECK(s != NULL);
  memcpy(s, data, n);
  s[n] = '\0';
  return s;
}

static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The options' tokens in reverse order, joined by blanks that vary with the position. */
static char *reversed(const char *opts) {
  static const char *const seps[] = {" ", "\t", "\r\n", "  \n\t"};
  size_t n = strlen(opts), ntok = 0, cap = 16;
  const char **start = malloc(cap * sizeof *start);
  size_t *len = malloc(cap * sizeof *len);
  char *out = malloc(4 * n + 8);
  CHECK(start && len && out);
  for (const char *p = opts; *p;) {
    while (*p && is_blank(*p)) p++;
    if (!*p) break;
    if (ntok == cap) {
      cap *= 2;
      start = realloc(start, cap * sizeof *start);
      len = realloc(len, cap * sizeof *len);
      CHECK(start && len);
    }
    start[ntok] = p;
    while (*p && !is_blank(*p)) p++;
    len[ntok] = (size_t)(p - start[ntok]);
    ntok++;
  }
  size_t o = 0;
  if (ntok % 2) out[o++] = '\t'; /* leading blanks are allowed too */
  for (size_t i = ntok; i-- > 0;) {
    memcpy(out + o, start[i], len[i]);
    o += len[i];
    if (i) {
      const char *sep = seps[i % 4];
      memcpy(out + o, sep, strlen(sep));
      o += strlen(sep);
    }
  }
  out[o] = '\0';
  free(start);
  free(len);
  return out;
}

static int nonneg_float(float v) { return isfinite(v) && v >= 0.0f && !signbit(v); }

/* Properties of a spec the parser accepted. */
static void check_spec(const ps__table_spec *s, int kind, uint64_t size, const char *name) {
  CHECK(s->kind == kind);
  CHECK(s->size == size);
  CHECK(s->width >= 1 && s->width <= (1u << 20));
  if (kind == PS_DENSE) {
    CHECK(size <= (1ull << 40));
    CHECK(s->nrows >= 1);
    CHECK((s->nrows - 1) * s->width < size && s->nrows * s->width >= size);
    uint32_t last = ps__spec_row_len(s, s->nrows - 1);
    CHECK(last >= 1 && last <= s->width);
    CHECK((s->nrows - 1) * s->width + last == size);
    if (s->nrows > 1) CHECK(ps__spec_row_len(s, 0) == s->width);
    CHECK(ps__spec_row_len(s, s->nrows) == 0);
    CHECK(ps__spec_row_len(s, UINT64_MAX) == 0);
  } else {
    CHECK(s->width == size && s->nrows == 0);
    CHECK(ps__spec_row_len(s, 0) == s->width && ps__spec_row_len(s, UINT64_MAX) == s->width);
  }
  CHECK(s->opt.kind >= PS__OPT_SGD && s->opt.kind <= PS__OPT_FTRL);
  CHECK(ps__spec_row_floats(s) == (size_t)s->width * (1 + ps__optim_nstate(s->opt.kind)));
  CHECK(ps__optim_nstate(s->opt.kind) <= 2);
  const float fs[] = {s->opt.lr, s->opt.momentum, s->opt.beta1, s->opt.beta2, s->opt.eps, s->opt.acc0,
                      s->opt.l1, s->opt.l2, s->opt.beta, s->decay_gamma};
  for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++) CHECK(nonneg_float(fs[i]));
  CHECK(s->opt.beta1 < 1.0f && s->opt.beta2 < 1.0f);
  CHECK(s->init.kind >= PS__INIT_ZERO && s->init.kind <= PS__INIT_NORMAL);
  CHECK(isfinite(s->init.a) && !(s->init.a == 0.0f && signbit(s->init.a)));
  if (s->init.kind == PS__INIT_UNIFORM || s->init.kind == PS__INIT_NORMAL) CHECK(s->init.a >= 0.0f);
  if (s->init.kind == PS__INIT_ZERO) CHECK(s->init.a == 0.0f);
  CHECK(s->update == PS__UPDATE_MEAN || s->update == PS__UPDATE_SUM);
  CHECK(s->mode <= PS__MODE_ASYNC);
  if (s->mode == PS__MODE_SYNC || s->mode == PS__MODE_ASYNC) CHECK(s->mode_param == 0);
  if (s->mode == PS__MODE_SYNC_M) CHECK(s->mode_param >= 1);
  CHECK(s->mode_param <= 1000000);
  CHECK(s->every >= 1 && s->every <= 1000000);
  if (s->every > 1) CHECK(s->mode == PS__MODE_SYNC || s->mode == PS__MODE_SYNC_M);
  if (s->agg_n || s->agg_ms) CHECK(s->mode == PS__MODE_ASYNC || s->mode == PS__MODE_SSP);
  CHECK(s->agg_n <= 1000000 && s->agg_ms <= 1000000 && s->ref_batch <= 1000000);
  CHECK(s->warmup <= 1000000000u);
  switch (s->decay) {
  case PS__DECAY_CONST: break;
  case PS__DECAY_STEP:
    CHECK(s->decay_every >= 1 && s->decay_every <= 1000000000u);
    CHECK(s->decay_gamma > 0.0f && s->decay_gamma <= 1.0f);
    break;
  case PS__DECAY_COS:
    CHECK(s->decay_steps >= 1 && s->decay_steps <= 1000000000u);
    CHECK(s->decay_gamma <= 1.0f);
    break;
  default: CHECK(0);
  }
  CHECK(s->name_hash == ps__hash64(name, strlen(name), 0));

  /* The schedule at its corners: never NaN, never negative. */
  const uint64_t steps[] = {0, 1, 2, s->warmup, (uint64_t)s->warmup + 1, (uint64_t)s->warmup + s->decay_steps,
                            (uint64_t)s->warmup + s->decay_steps + 1, 1000000007ull, UINT64_MAX};
  const double batches[] = {0.0, 1.0, 3.0, 1e6, 1e13}; /* 4096 workers x 2^32 examples at most */
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++)
    for (size_t j = 0; j < sizeof batches / sizeof batches[0]; j++) {
      float lr = ps__lr_at(s, steps[i], batches[j]);
      CHECK(!isnan(lr) && lr >= 0.0f);
    }
}

/* Parse with every errlen in a few sizes: same verdict, message always terminated. */
static void check_errlen(const char *name, int kind, uint64_t size, const char *opts, int rc) {
  static const size_t lens[] = {0, 1, 2, 7, 33};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    char err[40];
    ps__table_spec s;
    memset(err, 'z', sizeof err);
    int rc2 = ps__table_spec_parse(&s, name, kind, size, opts, lens[i] ? err : NULL, lens[i]);
    CHECK(rc2 == rc);
    if (lens[i]) {
      CHECK(memchr(err, 0, lens[i]) != NULL);
      CHECK(err[lens[i]] == 'z'); /* nothing written past errlen */
    }
    if (lens[i] > 1 && rc != 0) CHECK(err[0] != '\0');
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const uint8_t *nl = memchr(data, '\n', size);
  size_t hlen = nl ? (size_t)(nl - data) : size;
  char *header = cstr(data, hlen);
  char *opts = nl ? cstr(nl + 1, size - hlen - 1) : NULL;

  /* The declaration line. */
  int kind;
  uint64_t tsize = 0;
  char *p = header, *name = NULL;
  if (!strncmp(p, "dense", 5)) kind = PS_DENSE, p += 5;
  else if (!strncmp(p, "sparse", 6)) kind = PS_SPARSE, p += 6;
  else kind = (int)strtol(p, &p, 10);
  while (*p == ' ') p++;
  char *end = p;
  while (*end && *end != ' ') end++;
  if (*end) {
    *end = '\0';
    name = end + 1;
  }
  if (ps__parse_u64(p, &tsize)) tsize = 0;

  ps__table_spec s, before;
  char err[256];
  memset(&s, 0xa5, sizeof s);
  memcpy(&before, &s, sizeof s);
  memset(err, 'z', sizeof err);
  int rc = ps__table_spec_parse(&s, name, kind, tsize, opts, err, sizeof err);
  CHECK(rc == 0 || rc == PS_ERR_CONFIG || rc == PS_ERR_INVALID);
  CHECK(memchr(err, 0, sizeof err) != NULL);
  if (rc != 0) {
    CHECK(err[0] != '\0');
    CHECK(memcmp(&s, &before, sizeof s) == 0);
    if (!name || (kind != PS_DENSE && kind != PS_SPARSE) || tsize == 0) CHECK(rc == PS_ERR_INVALID);
  } else {
    CHECK(err[0] == '\0');
    check_spec(&s, kind, tsize, name);
  }
  check_errlen(name, kind, tsize, opts, rc);

  /* Order and blanks do not matter. */
  if (opts) {
    char *rev = reversed(opts);
    ps__table_spec r;
    int rc2 = ps__table_spec_parse(&r, name, kind, tsize, rev, NULL, 0);
    CHECK((rc == 0) == (rc2 == 0));
    if (rc == 0) CHECK(memcmp(&s, &r, sizeof s) == 0);
    free(rev);
  }
  free(header);
  free(opts);
  return 0;
}
