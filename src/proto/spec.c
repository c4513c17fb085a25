/*
 * spec.c - parse a table's option string into a ps__table_spec (proto/spec.h), and the
 * helpers that depend on the spec alone: row sizes and the learning-rate schedule.
 *
 * The spec is compared byte for byte when a table is declared again ("same options"),
 * so it is built in a zeroed struct (padding included), every float is normalised
 * (-0 becomes 0) and defaults that depend on other options (eps) are resolved after
 * the whole string has been read, making the result independent of option order.
 */
#include "proto/spec.h"

#include <math.h>
#include <stdarg.h>
#include <string.h>

#include "common/common.h"
#include "common/config.h"
#include "proto/codec.h"

#define MAX_DIM (1u << 20)            /* widest row: sparse dim or dense slice */
#define MAX_DENSE (1ull << 40)        /* largest dense table, in floats */
#define DEFAULT_SLICE 65536u
#define MAX_TOKEN 256

/* Option keys, in the order of pshard.h; a bit per key catches repeats. */
enum {
  K_OPT, K_LR, K_MOMENTUM, K_BETA1, K_BETA2, K_EPS, K_ACC0, K_L1, K_L2, K_BETA,
  K_UPDATE, K_INIT, K_SEED, K_SLICE, K_MODE, K_EVERY, K_AGG_N, K_AGG_MS, K_REF_BATCH, K_WARMUP,
  K_DECAY, K_NONFINITE, K_PUSH_CODEC, K_PULL_CODEC, K_COUNT
};
static const char *const key_names[K_COUNT] = {
    "opt", "lr", "momentum", "beta1", "beta2", "eps", "acc0",
    "l1", "l2", "beta", "update", "init", "seed", "slice", "mode", "every", "agg_n", "agg_ms",
    "ref_batch", "warmup", "decay", "nonfinite", "push_codec", "pull_codec",
};

static int fail(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Write the message into err (if any room) and return code. */
static int fail(char *err, size_t errlen, int code, const char *fmt, ...) {
  if (err && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return code;
}

/* A finite float >= lo (and < hi if has_hi), -0 folded to 0. 0, -1 malformed, -2 out of range. */
static int parse_ranged(const char *s, float *out, float lo, int has_hi, float hi) {
  float v;
  if (ps__parse_float(s, &v)) return -1;
  if (v < lo || (has_hi && v >= hi)) return -2;
  *out = v == 0.0f ? 0.0f : v;
  return 0;
}

static int parse_opt_kind(const char *s, ps__opt_kind *out) {
  static const struct { const char *name; ps__opt_kind kind; } t[] = {
      {"sgd", PS__OPT_SGD},   {"momentum", PS__OPT_MOMENTUM}, {"adagrad", PS__OPT_ADAGRAD},
      {"adam", PS__OPT_ADAM}, {"ftrl", PS__OPT_FTRL},
  };
  for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
    if (strcmp(s, t[i].name) == 0) {
      *out = t[i].kind;
      return 0;
    }
  }
  return -1;
}

/* init=zero | const:V | uniform:A | normal:SD */
static int parse_init(const char *s, ps__init *out) {
  const char *colon = strchr(s, ':');
  size_t n = colon ? (size_t)(colon - s) : strlen(s);
  float a;
  if (!colon) {
    if (strcmp(s, "zero") != 0) return -1;
    out->kind = PS__INIT_ZERO;
    out->a = 0.0f;
    return 0;
  }
  if (n == 5 && memcmp(s, "const", 5) == 0) {
    if (ps__parse_float(colon + 1, &a)) return -1;
    out->kind = PS__INIT_CONST;
  } else if (n == 7 && memcmp(s, "uniform", 7) == 0) {
    if (ps__parse_float(colon + 1, &a) || a < 0.0f) return -1;
    out->kind = PS__INIT_UNIFORM;
  } else if (n == 6 && memcmp(s, "normal", 6) == 0) {
    /* A standard normal sample reaches about 9 here (init.c): a larger SD than
     * 1e37 could overflow to an infinite initial value. */
    if (ps__parse_float(colon + 1, &a) || a < 0.0f || a > 1e37f) return -1;
    out->kind = PS__INIT_NORMAL;
  } else {
    return -1;
  }
  out->a = a == 0.0f ? 0.0f : a;
  return 0;
}

/* decay=const | step:S:G | cos:T | cos:T:MIN into s. 0, or -1 if malformed or out of range. */
static int parse_decay(const char *val, ps__table_spec *s) {
  unsigned long a = 0;
  float g = 0;
  char extra;
  if (!strcmp(val, "const")) {
    s->decay = PS__DECAY_CONST;
  } else if (sscanf(val, "step:%lu:%f%c", &a, &g, &extra) == 2 && a >= 1 && a <= 1000000000ul && g > 0 && g <= 1) {
    s->decay = PS__DECAY_STEP;
    s->decay_every = (uint32_t)a;
    s->decay_gamma = g;
  } else if (sscanf(val, "cos:%lu%c", &a, &extra) == 1 && a >= 1 && a <= 1000000000ul) {
    s->decay = PS__DECAY_COS;
    s->decay_steps = (uint32_t)a;
    s->decay_gamma = 0;
  } else if (sscanf(val, "cos:%lu:%f%c", &a, &g, &extra) == 2 && a >= 1 && a <= 1000000000ul && g >= 0 && g <= 1) {
    s->decay = PS__DECAY_COS;
    s->decay_steps = (uint32_t)a;
    s->decay_gamma = g == 0.0f ? 0.0f : g; /* cos:T:-0 is cos:T:0 */
  } else {
    return -1;
  }
  return 0;
}

/* One of the integer options every, agg_n, agg_ms, ref_batch, warmup (key k). */
static int apply_count(ps__table_spec *s, int k, const char *val, char *err, size_t errlen) {
  uint64_t v;
  uint32_t *dst = k == K_EVERY ? &s->every : k == K_AGG_N ? &s->agg_n : k == K_AGG_MS ? &s->agg_ms
                : k == K_REF_BATCH ? &s->ref_batch : &s->warmup;
  uint64_t max = k == K_WARMUP ? 1000000000u : 1000000u;
  if (ps__parse_u64(val, &v) || v > max || (k == K_EVERY && v == 0))
    return fail(err, errlen, PS_ERR_CONFIG, "bad value '%s' for option '%s': must be %s..%llu", val, key_names[k],
                k == K_EVERY ? "1" : "0", (unsigned long long)max);
  *dst = (uint32_t)v;
  return 0;
}

/* Apply one key=value pair. Returns 0 or an error code with err filled in. */
static int apply_option(ps__table_spec *s, int kind, int k, const char *val, uint64_t *slice,
                        char *err, size_t errlen) {
  const char *name = key_names[k];
  float *fp = NULL;
  int has_hi = 0, rc;
  const char *range = "must be >= 0";

  switch (k) {
  case K_OPT:
    if (parse_opt_kind(val, &s->opt.kind))
      return fail(err, errlen, PS_ERR_CONFIG,
                  "bad value '%s' for option 'opt': expected sgd, momentum, adagrad, adam or ftrl",
                  val);
    return 0;
  case K_UPDATE:
    if (strcmp(val, "mean") == 0) s->update = PS__UPDATE_MEAN;
    else if (strcmp(val, "sum") == 0) s->update = PS__UPDATE_SUM;
    else
      return fail(err, errlen, PS_ERR_CONFIG,
                  "bad value '%s' for option 'update': expected mean or sum", val);
    return 0;
  case K_INIT:
    if (parse_init(val, &s->init))
      return fail(err, errlen, PS_ERR_CONFIG,
                  "bad value '%s' for option 'init': expected zero, const:V, uniform:A or "
                  "normal:SD (A, SD >= 0, finite; SD <= 1e37)",
                  val);
    return 0;
  case K_SEED:
    if (ps__parse_u64(val, &s->init.seed))
      return fail(err, errlen, PS_ERR_CONFIG,
                  "bad value '%s' for option 'seed': expected an unsigned integer", val);
    return 0;
  case K_SLICE:
    if (kind != PS_DENSE)
      return fail(err, errlen, PS_ERR_CONFIG, "option 'slice' applies only to dense tables");
    if (ps__parse_u64(val, slice) || *slice == 0 || *slice > MAX_DIM)
      return fail(err, errlen, PS_ERR_CONFIG,
                  "bad value '%s' for option 'slice': must be 1..%u", val, MAX_DIM);
    return 0;
  case K_MODE: {
    ps__mode m;
    char msg[160];
    if (ps__mode_parse(val, &m, msg, sizeof msg)) return fail(err, errlen, PS_ERR_CONFIG, "option 'mode': %s", msg);
    s->mode = (uint32_t)m.kind;
    s->mode_param = m.param;
    return 0;
  }
  case K_DECAY:
    if (parse_decay(val, s))
      return fail(err, errlen, PS_ERR_CONFIG,
                  "bad value '%s' for option 'decay': expected const, step:S:G (every S steps times G, "
                  "0 < G <= 1) or cos:T[:MIN] (cosine over T steps down to MIN times the peak)", val);
    return 0;
  case K_NONFINITE:
    if (!strcmp(val, "refuse")) s->nonfinite = PS__NONFINITE_REFUSE;
    else if (!strcmp(val, "skip")) s->nonfinite = PS__NONFINITE_SKIP;
    else if (!strcmp(val, "allow")) s->nonfinite = PS__NONFINITE_ALLOW;
    else
      return fail(err, errlen, PS_ERR_CONFIG, "bad value '%s' for option 'nonfinite': expected refuse, skip or allow",
                  val);
    return 0;
  case K_PUSH_CODEC:
  case K_PULL_CODEC: {
    ps__codec *c = k == K_PUSH_CODEC ? &s->push_codec : &s->pull_codec;
    if (ps__codec_parse(val, c))
      return fail(err, errlen, PS_ERR_CONFIG,
                  "bad value '%s' for option '%s': expected none, fp16, bf16, int8%s", val, name,
                  k == K_PUSH_CODEC ? " or topk:F (F < 1 a fraction of the values, F >= 1 a count)" : "");
    if (k == K_PULL_CODEC && c->kind == PS_CODEC_TOPK)
      return fail(err, errlen, PS_ERR_CONFIG,
                  "option 'pull_codec': topk applies to pushes only (a pull must return every value)");
    return 0;
  }
  case K_EVERY:
  case K_AGG_N:
  case K_AGG_MS:
  case K_REF_BATCH:
  case K_WARMUP: return apply_count(s, k, val, err, errlen);
  case K_LR: fp = &s->opt.lr; break;
  case K_MOMENTUM: fp = &s->opt.momentum; break;
  case K_BETA1: fp = &s->opt.beta1; has_hi = 1; range = "must be in [0, 1)"; break;
  case K_BETA2: fp = &s->opt.beta2; has_hi = 1; range = "must be in [0, 1)"; break;
  case K_EPS: fp = &s->opt.eps; break;
  case K_ACC0: fp = &s->opt.acc0; break;
  case K_L1: fp = &s->opt.l1; break;
  case K_L2: fp = &s->opt.l2; break;
  case K_BETA: fp = &s->opt.beta; break;
  default: PS_ASSERT(0);
  }
  rc = parse_ranged(val, fp, 0.0f, has_hi, 1.0f);
  if (rc == -1)
    return fail(err, errlen, PS_ERR_CONFIG, "bad value '%s' for option '%s'", val, name);
  if (rc == -2)
    return fail(err, errlen, PS_ERR_CONFIG, "bad value '%s' for option '%s': %s", val, name,
                range);
  return 0;
}

/* The arguments besides the option string. 0 or PS_ERR_INVALID with err filled in. */
static int check_table(const char *name, int kind, uint64_t size, char *err, size_t errlen) {
  if (!name) return fail(err, errlen, PS_ERR_INVALID, "table name missing");
  if (kind != PS_DENSE && kind != PS_SPARSE)
    return fail(err, errlen, PS_ERR_INVALID, "bad table kind %d: expected dense or sparse", kind);
  if (size == 0) return fail(err, errlen, PS_ERR_INVALID, "table size must be > 0");
  if (kind == PS_DENSE && size > MAX_DENSE)
    return fail(err, errlen, PS_ERR_INVALID,
                "dense table size %llu exceeds the maximum 2^40", (unsigned long long)size);
  if (kind == PS_SPARSE && size > MAX_DIM)
    return fail(err, errlen, PS_ERR_INVALID, "sparse table dimension %llu exceeds the maximum %u",
                (unsigned long long)size, MAX_DIM);
  return 0;
}

/* A spec with every default that does not depend on other options. */
static void spec_defaults(ps__table_spec *s, int kind, uint64_t size) {
  memset(s, 0, sizeof *s); /* padding too: specs are compared with memcmp */
  s->kind = kind;
  s->size = size;
  s->opt.kind = PS__OPT_SGD;
  s->opt.lr = 0.01f;
  s->opt.momentum = 0.9f;
  s->opt.beta1 = 0.9f;
  s->opt.beta2 = 0.999f;
  s->opt.acc0 = 0.0f;
  s->opt.l1 = 0.0f;
  s->opt.l2 = 0.0f;
  s->opt.beta = 1.0f;
  s->init.kind = PS__INIT_ZERO;
  s->update = PS__UPDATE_MEAN;
  s->mode = PS__MODE_SYNC;
  s->every = 1;
}

/* Apply every key=value token of p (separated by white space) to s, noting each key in
 * *seen. 0 or an error code with err filled in. */
static int apply_options(ps__table_spec *s, int kind, const char *p, uint64_t *slice, unsigned *seen, char *err,
                         size_t errlen) {
  for (;;) {
    char tok[MAX_TOKEN];
    const char *start, *eq;
    size_t n, klen;
    int k, rc;

    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    if (!*p) return 0;
    start = p;
    while (*p && *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') p++;
    n = (size_t)(p - start);
    if (n >= sizeof tok)
      return fail(err, errlen, PS_ERR_CONFIG, "table option '%.32s...' is too long", start);
    memcpy(tok, start, n);
    tok[n] = '\0';

    eq = strchr(tok, '=');
    if (!eq)
      return fail(err, errlen, PS_ERR_CONFIG, "bad table option '%s': expected key=value", tok);
    klen = (size_t)(eq - tok);
    for (k = 0; k < K_COUNT; k++)
      if (strlen(key_names[k]) == klen && memcmp(key_names[k], tok, klen) == 0) break;
    if (k == K_COUNT)
      return fail(err, errlen, PS_ERR_CONFIG, "unknown table option '%.*s'", (int)klen, tok);
    if (*seen & (1u << k))
      return fail(err, errlen, PS_ERR_CONFIG, "table option '%s' given twice", key_names[k]);
    *seen |= 1u << k;
    rc = apply_option(s, kind, k, eq + 1, slice, err, errlen);
    if (rc) return rc;
  }
}

int ps__table_spec_parse(ps__table_spec *spec, const char *name, int kind, uint64_t size,
                         const char *options, char *err, size_t errlen) {
  ps__table_spec s;
  uint64_t slice = DEFAULT_SLICE;
  unsigned seen = 0;
  int rc;

  if (err && errlen > 0) err[0] = '\0';
  if ((rc = check_table(name, kind, size, err, errlen)) != 0) return rc;
  spec_defaults(&s, kind, size);
  if ((rc = apply_options(&s, kind, options ? options : "", &slice, &seen, err, errlen)) != 0) return rc;

  if ((s.agg_n || s.agg_ms) && s.mode != PS__MODE_ASYNC && s.mode != PS__MODE_SSP)
    return fail(err, errlen, PS_ERR_CONFIG, "options 'agg_n' and 'agg_ms' apply to async and ssp tables");
  if (s.every > 1 && s.mode != PS__MODE_SYNC && s.mode != PS__MODE_SYNC_M)
    return fail(err, errlen, PS_ERR_CONFIG, "option 'every' applies to sync and sync:M tables");
  if (!(seen & (1u << K_EPS))) s.opt.eps = s.opt.kind == PS__OPT_ADAGRAD ? 1e-10f : 1e-8f;

  if (kind == PS_DENSE) {
    s.width = (uint32_t)(size < slice ? size : slice);
    s.nrows = (size + s.width - 1) / s.width;
  } else {
    s.width = (uint32_t)size;
    s.nrows = 0;
  }
  s.name_hash = ps__hash64(name, strlen(name), 0);
  memcpy(spec, &s, sizeof s); /* not struct assignment, which need not copy padding */
  return 0;
}

unsigned ps__optim_nstate(ps__opt_kind kind) {
  switch (kind) {
  case PS__OPT_SGD: return 0;
  case PS__OPT_MOMENTUM: return 1;
  case PS__OPT_ADAGRAD: return 1;
  case PS__OPT_ADAM: return 2;
  case PS__OPT_FTRL: return 2;
  }
  return 0;
}

size_t ps__spec_row_floats(const ps__table_spec *spec) {
  return (size_t)spec->width * (1 + ps__optim_nstate(spec->opt.kind));
}

uint32_t ps__spec_row_len(const ps__table_spec *spec, uint64_t row) {
  if (spec->kind != PS_DENSE) return spec->width;
  if (row >= spec->nrows) return 0; /* before row + 1, which wraps for UINT64_MAX */
  if (row + 1 < spec->nrows) return spec->width;
  return (uint32_t)(spec->size - row * spec->width);
}

float ps__lr_at(const ps__table_spec *spec, uint64_t step, double global_batch) {
  double lr = spec->opt.lr;
  if (spec->ref_batch && global_batch > 0) lr *= global_batch / (double)spec->ref_batch;
  if (step == 0) step = 1;
  if (spec->warmup && step <= spec->warmup) return (float)(lr * (double)step / (double)spec->warmup);
  uint64_t t = step - spec->warmup; /* steps after warm-up, 1-based */
  switch (spec->decay) {
  case PS__DECAY_STEP:
    lr *= pow((double)spec->decay_gamma, (double)((t - 1) / spec->decay_every));
    break;
  case PS__DECAY_COS: {
    double x = t - 1 >= spec->decay_steps ? 1.0 : (double)(t - 1) / (double)spec->decay_steps;
    double lo = spec->decay_gamma;
    lr *= lo + (1.0 - lo) * 0.5 * (1.0 + cos(3.14159265358979323846 * x));
    break;
  }
  default:
    break;
  }
  return (float)lr;
}
