/*
 * ctr_gen.c - a deterministic generator of Criteo-like click logs with a planted
 * sparse logistic model, for the click-through example.
 *
 * Every example is a function of (seed, stream, row index) alone: its random numbers
 * come from a splitmix64 sequence seeded by those three. So the output is the same
 * bytes on every run, the concatenation of the train parts does not depend on how many
 * parts there are, and parts can be written by several threads at once. Nothing is
 * kept per example (memory is constant in the number of rows), except the test set's
 * scores for the exact AUC (8 bytes an example; above EXACT_AUC_MAX test rows the AUC
 * comes from a fine histogram instead).
 *
 * An example has one value per field unless the field is missing (a per-field rate):
 *  - categorical field f: value k ~ Zipf(s_f) on {1..V_f}, drawn by rejection-inversion
 *    (Hörmann and Derflinger), which needs no table whatever V_f is;
 *  - integer field f: a count c = k - 1 with k ~ Zipf(s_f) on {1..V_f}, bucketised into
 *    b = 0 for c = 0, else 1 + floor(log2 c).
 * The feature id of (field f, value v) is xxh64 of the 16 bytes le64(f) le64(v) with seed
 * 0, keeping the top --id-bits bits. With --crosses K, an example that has both fields of
 * cross j (0 <= j < K) present also has the feature (j, value a, value b), of id xxh64 of
 * the 32 bytes "cross\0\0\0" le64(j) le64(a) le64(b), seed 0, top --id-bits bits. The
 * crosses pair the categorical fields in order of vocabulary (largest first, ties by
 * field number): ranks (0,1), (0,2), (1,2), (0,3), (1,3), (2,3), (0,4), ... so the first
 * crosses pair the fields with the most values, as click-through models' crosses of
 * user, item and context ids do. Crosses draw no random numbers: the single-field
 * features and the label's draw are those of the data without crosses. The planted weight of an id is a pure function of
 * (seed, id): with probability 0.1 "large" (sd 0.8), otherwise "small" (sd 0.1), from an
 * approximately normal draw (sum of four uniforms). The bias is solved so that the mean
 * click probability on a calibration sample is --ctr. The label is 1 with probability
 * sigmoid(bias + sum of the example's weights), so this model's log-loss and AUC on the
 * test set are the best any model can reach.
 *
 * Output: DIR/train-NNNNN.{txt,bin} (P parts of consecutive rows), DIR/test.{txt,bin},
 * and DIR/meta.txt, written last (a directory with meta.txt is complete).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "ctr_data.h"

#define GEN_VERSION 1
#define MAX_FIELDS 1000
#define MAX_CROSSES 1000
#define MAX_IDS (MAX_FIELDS + MAX_CROSSES)
#define MAX_PARTS 100000
#define EXACT_AUC_MAX (1u << 23)
#define CALIB_ROWS 50000
#define P_LARGE 0.1
#define SD_LARGE 0.8
#define SD_SMALL 0.1

enum { STREAM_TRAIN = 1, STREAM_TEST = 2, STREAM_CALIB = 3, STREAM_WEIGHT = 4 };

/* ---------------------------------------------------------------- random numbers */

static inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

typedef struct rng {
  uint64_t s;
} rng;

static inline uint64_t rng_u64(rng *r) { return mix64(r->s += 0x9e3779b97f4a7c15ull); }
/* Uniform in [0, 1). */
static inline double rng_unit(rng *r) { return (double)(rng_u64(r) >> 11) * 0x1p-53; }

static inline rng rng_for(uint64_t seed, uint64_t stream, uint64_t row) {
  rng r = {mix64(mix64(seed ^ stream << 60) + row)};
  return r;
}

/* ---------------------------------------------------------------- Zipf sampling */

/* Rejection-inversion sampling of P(k) ~ k^-e on {1..n} (W. Hörmann, G. Derflinger,
 * "Rejection-inversion to generate variates from monotone discrete distributions",
 * 1996), in the formulation of Apache Commons RNG. Constant time and memory. */
typedef struct zipf {
  double e, n, hx1, hxn, s;
} zipf;

static double helper1(double x) {
  return fabs(x) > 1e-8 ? log1p(x) / x : 1 - x * (0.5 - x * (1.0 / 3 - 0.25 * x));
}
static double helper2(double x) {
  return fabs(x) > 1e-8 ? expm1(x) / x : 1 + x * 0.5 * (1 + x * (1.0 / 3) * (1 + 0.25 * x));
}
static double zh(const zipf *z, double x) { return exp(-z->e * log(x)); }
static double zhint(const zipf *z, double x) {
  double lx = log(x);
  return helper2((1 - z->e) * lx) * lx;
}
static double zhinv(const zipf *z, double x) {
  double t = x * (1 - z->e);
  if (t < -1) t = -1;
  return exp(helper1(t) * x);
}

static void zipf_init(zipf *z, uint64_t n, double e) {
  z->e = e;
  z->n = (double)n;
  z->hx1 = zhint(z, 1.5) - 1;
  z->hxn = zhint(z, z->n + 0.5);
  z->s = 2 - zhinv(z, zhint(z, 2.5) - zh(z, 2));
}

static uint64_t zipf_draw(const zipf *z, rng *r) {
  if (z->n <= 1) return 1;
  for (;;) {
    double u = z->hxn + rng_unit(r) * (z->hx1 - z->hxn);
    double x = zhinv(z, u);
    double kd = floor(x + 0.5);
    if (kd < 1) kd = 1;
    else if (kd > z->n) kd = z->n;
    if (kd - x <= z->s || u >= zhint(z, kd + 0.5) - zh(z, kd)) return (uint64_t)kd;
  }
}

/* ---------------------------------------------------------------- fields */

/* Criteo (Kaggle display advertising) shapes: value ranges of the 13 integer fields,
 * cardinalities of the 26 categorical ones, and missing rates. More fields cycle. */
static const uint64_t int_range[13] = {5775, 257675, 65535, 969, 23159456, 431037, 56311,
                                       6047, 29019, 11, 231, 4008, 7393};
static const double int_missing[13] = {0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04,
                                       0.001, 0.04, 0.45, 0.04, 0.77, 0.22};
static const uint64_t cat_card[26] = {1460, 583, 10131227, 2202608, 305, 24, 12517,
                                      633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                                      5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
                                      286181, 105, 142572};
static const double cat_missing[26] = {0, 0, 0.034, 0.034, 0, 0.12, 0, 0, 0, 0, 0,
                                       0.034, 0, 0, 0, 0.034, 0, 0, 0.44, 0.44, 0.034,
                                       0.76, 0, 0.034, 0.44, 0.44};

typedef struct field {
  int is_int;
  uint64_t vocab;
  double missing;
  zipf z;
} field;

typedef struct gen {
  uint64_t seed, wseed;
  int nfields, nint, ncat, id_bits;
  uint64_t signal_top; /* only values of rank <= this carry planted weight (0 = all) */
  field f[MAX_FIELDS];
  int ncross;
  int cross[MAX_CROSSES][2]; /* the two (categorical) fields of each cross */
  double bias;
} gen;

static void fields_init(gen *g, uint64_t max_vocab) {
  g->nfields = g->nint + g->ncat;
  for (int i = 0; i < g->nfields; i++) {
    field *f = &g->f[i];
    f->is_int = i < g->nint;
    /* A fixed spread of exponents: integer counts fall off faster than categories. */
    double frac = fmod(0.6180339887498949 * (i + 1), 1.0);
    double e;
    if (f->is_int) {
      f->vocab = int_range[i % 13] + 1;
      f->missing = int_missing[i % 13];
      e = 1.2 + 0.4 * frac;
    } else {
      int c = (i - g->nint) % 26;
      f->vocab = cat_card[c];
      f->missing = cat_missing[c];
      e = 1.05 + 0.3 * frac;
    }
    if (max_vocab && f->vocab > max_vocab) f->vocab = max_vocab;
    zipf_init(&f->z, f->vocab, e);
  }
}

/* The crosses' fields: pairs of categorical fields by vocabulary rank (see the top).
 * Returns -1 if there are fewer than g->ncross pairs. */
static int crosses_init(gen *g) {
  int ord[MAX_FIELDS], n = 0;
  for (int i = g->nint; i < g->nfields; i++) { /* insertion sort: largest vocab first */
    int k = n++;
    for (; k > 0 && g->f[ord[k - 1]].vocab < g->f[i].vocab; k--) ord[k] = ord[k - 1];
    ord[k] = i;
  }
  int c = 0;
  for (int q = 1; q < n && c < g->ncross; q++)
    for (int p = 0; p < q && c < g->ncross; p++) g->cross[c][0] = ord[p], g->cross[c][1] = ord[q], c++;
  return c == g->ncross ? 0 : -1;
}

static inline uint64_t cross_id(const gen *g, uint64_t j, uint64_t a, uint64_t b) {
  unsigned char x[32] = {'c', 'r', 'o', 's', 's', 0, 0, 0};
  for (int i = 0; i < 8; i++) {
    x[8 + i] = (unsigned char)(j >> (8 * i));
    x[16 + i] = (unsigned char)(a >> (8 * i));
    x[24 + i] = (unsigned char)(b >> (8 * i));
  }
  uint64_t h = XXH64(x, 32, 0);
  return g->id_bits < 64 ? h >> (64 - g->id_bits) : h;
}

static inline uint64_t feature_id(const gen *g, uint64_t fld, uint64_t value) {
  unsigned char b[16];
  for (int i = 0; i < 8; i++) {
    b[i] = (unsigned char)(fld >> (8 * i));
    b[8 + i] = (unsigned char)(value >> (8 * i));
  }
  uint64_t h = XXH64(b, 16, 0);
  return g->id_bits < 64 ? h >> (64 - g->id_bits) : h;
}

/* The planted weight of a feature id. */
static inline double weight(const gen *g, uint64_t id) {
  uint64_t h1 = mix64(id ^ g->wseed), h2 = mix64(h1);
  /* sum of four 16-bit uniforms, centred and scaled to unit variance */
  double z = (double)((h2 & 0xffff) + (h2 >> 16 & 0xffff) + (h2 >> 32 & 0xffff) + (h2 >> 48)) *
                 (1.0 / 65536) -
             2.0;
  z *= 1.7320508075688772;
  return (double)(h1 >> 11) * 0x1p-53 < P_LARGE ? SD_LARGE * z : SD_SMALL * z;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

static inline void sort_ids(uint64_t *a, size_t n) {
  if (n > 64) { /* with crosses */
    qsort(a, n, sizeof *a, cmp_u64);
    return;
  }
  for (size_t i = 1; i < n; i++) {
    uint64_t v = a[i];
    size_t j = i;
    for (; j > 0 && a[j - 1] > v; j--) a[j] = a[j - 1];
    a[j] = v;
  }
}

/* One example: its sorted feature ids (returns how many), its logit without the bias,
 * and the uniform draw that decides its label. */
static size_t gen_row(const gen *g, uint64_t stream, uint64_t row, uint64_t *ids,
                      double *score, double *u) {
  rng r = rng_for(g->seed, stream, row);
  size_t n = 0;
  double s = 0;
  uint64_t val[MAX_FIELDS]; /* categorical values, 0 when missing (values start at 1) */
  for (int i = 0; i < g->nfields; i++) {
    const field *f = &g->f[i];
    val[i] = 0;
    if (f->missing > 0 && rng_unit(&r) < f->missing) continue;
    uint64_t k = zipf_draw(&f->z, &r), v;
    if (!f->is_int) val[i] = k;
    if (f->is_int) {
      uint64_t c = k - 1;
      v = c == 0 ? 0 : 64 - (uint64_t)__builtin_clzll(c);
    } else {
      v = k;
    }
    uint64_t id = feature_id(g, (uint64_t)i, v);
    /* With --signal-top, the long tail of rare values is noise (weight 0): a model can
     * learn only what the data shows often enough, so the planted optimum is reachable. */
    if (!g->signal_top || f->is_int || k <= g->signal_top) s += weight(g, id);
    ids[n++] = id;
  }
  for (int j = 0; j < g->ncross; j++) {
    uint64_t a = val[g->cross[j][0]], b = val[g->cross[j][1]];
    if (!a || !b) continue;
    uint64_t id = cross_id(g, (uint64_t)j, a, b);
    /* with --signal-top, a cross carries weight when both its values do */
    if (!g->signal_top || (a <= g->signal_top && b <= g->signal_top)) s += weight(g, id);
    ids[n++] = id;
  }
  sort_ids(ids, n);
  *score = s;
  *u = rng_unit(&r);
  return n;
}

static inline double sigmoid(double x) {
  return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
}

/* Solve mean(sigmoid(s_i + b)) = ctr on a calibration sample by bisection. */
static double calibrate_bias(const gen *g, double ctr) {
  double *s = malloc(CALIB_ROWS * sizeof *s);
  uint64_t ids[MAX_IDS];
  if (!s) return log(ctr / (1 - ctr));
  for (uint64_t i = 0; i < CALIB_ROWS; i++) {
    double u;
    gen_row(g, STREAM_CALIB, i, ids, &s[i], &u);
  }
  double lo = -50, hi = 50;
  for (int it = 0; it < 100; it++) {
    double b = 0.5 * (lo + hi), m = 0;
    for (size_t i = 0; i < CALIB_ROWS; i++) m += sigmoid(s[i] + b);
    if (m / CALIB_ROWS < ctr) lo = b;
    else hi = b;
  }
  free(s);
  return 0.5 * (lo + hi);
}

/* ---------------------------------------------------------------- the job */

typedef struct unit_result {
  uint64_t rows, positives, nnz, bytes;
} unit_result;

typedef struct job {
  gen *g;
  const char *dir;
  int format, parts;
  uint64_t rows, test_rows;
  atomic_int next;  /* next unit to take: 0..parts-1 train, parts = test */
  atomic_int stop;  /* set on the first error */
  pthread_mutex_t mu;
  char err[1100];
  unit_result *res; /* parts + 1 */
  /* test set */
  float *t_score, *t_label;
  ctr_auc_hist *t_hist;
  double t_logloss;
  uint64_t t_correct;
} job;

/* floor(rows * p / parts) without overflow: part p holds rows [start(p), start(p+1)). */
static uint64_t part_start(uint64_t rows, uint64_t p, uint64_t parts) {
  return rows / parts * p + rows % parts * p / parts;
}

static const char *ext(int format) { return format == CTR_FMT_BIN ? "bin" : "txt"; }

static void job_fail(job *j, const char *msg) {
  pthread_mutex_lock(&j->mu);
  if (!j->err[0]) snprintf(j->err, sizeof j->err, "%s", msg);
  pthread_mutex_unlock(&j->mu);
  atomic_store(&j->stop, 1);
}

static int run_unit(job *j, int unit) {
  const gen *g = j->g;
  int is_test = unit == j->parts;
  uint64_t lo, hi, stream;
  char path[4096];
  if (is_test) {
    lo = 0;
    hi = j->test_rows;
    stream = STREAM_TEST;
    snprintf(path, sizeof path, "%s/test.%s", j->dir, ext(j->format));
  } else {
    lo = part_start(j->rows, (uint64_t)unit, (uint64_t)j->parts);
    hi = part_start(j->rows, (uint64_t)unit + 1, (uint64_t)j->parts);
    stream = STREAM_TRAIN;
    snprintf(path, sizeof path, "%s/train-%05d.%s", j->dir, unit, ext(j->format));
  }
  ctr_writer *w;
  if (ctr_writer_open(path, j->format, &w) != CTR_OK) {
    job_fail(j, ctr_errmsg());
    return -1;
  }
  unit_result *res = &j->res[unit];
  uint64_t ids[MAX_IDS];
  double ll = 0;
  uint64_t correct = 0;
  for (uint64_t row = lo; row < hi; row++) {
    if ((row & 4095) == 0 && atomic_load(&j->stop)) {
      ctr_writer_abort(w);
      return -1;
    }
    double s, u;
    size_t n = gen_row(g, stream, row, ids, &s, &u);
    double logit = s + g->bias, p = sigmoid(logit);
    int y = u < p;
    if (ctr_writer_add(w, (float)y, ids, NULL, n) != CTR_OK) {
      job_fail(j, ctr_errmsg());
      ctr_writer_abort(w);
      return -1;
    }
    res->positives += (uint64_t)y;
    res->nnz += n;
    if (is_test) {
      ll -= y ? log(p) : log1p(-p);
      correct += (logit > 0) == y;
      if (j->t_score) {
        j->t_score[row] = (float)logit;
        j->t_label[row] = (float)y;
      } else {
        ctr_auc_hist_add(j->t_hist, (float)y, p);
      }
    }
  }
  res->rows = hi - lo;
  if (ctr_writer_close(w) != CTR_OK) {
    job_fail(j, ctr_errmsg());
    return -1;
  }
  struct stat st;
  if (stat(path, &st) == 0) res->bytes = (uint64_t)st.st_size;
  if (is_test) {
    j->t_logloss = hi > lo ? ll / (double)(hi - lo) : NAN;
    j->t_correct = correct;
  }
  return 0;
}

static void *worker(void *arg) {
  job *j = arg;
  for (;;) {
    int u = atomic_fetch_add(&j->next, 1);
    if (u > j->parts || atomic_load(&j->stop)) break;
    if (run_unit(j, u) != 0) break;
  }
  return NULL;
}

/* ---------------------------------------------------------------- command line */

static void usage(FILE *f) {
  fprintf(f,
          "usage: ctr_gen [options]\n"
          "Generate Criteo-like click logs with a planted logistic model.\n\n"
          "  --rows N        train examples (1M; suffixes k, M, G; 1e6 works)\n"
          "  --test-rows N   test examples (100k)\n"
          "  --parts P       train files (1)\n"
          "  --out DIR       output directory, created if missing (ctr-data)\n"
          "  --fields I,C    integer and categorical fields (13,26 as in Criteo)\n"
          "  --seed S        random seed (1)\n"
          "  --format F      libsvm | bin (libsvm)\n"
          "  --ctr R         target click rate, 0 < R < 1 (0.22)\n"
          "  --id-bits B     keep the top B bits of each feature hash, 8..64 (64)\n"
          "  --max-vocab V   cap every field's vocabulary at V values (no cap)\n"
          "  --crosses K     add K crosses of two categorical fields, those with the most\n"
          "                  values first (0)\n"
          "  --signal-top N  only each field's N most frequent values carry planted weight;\n"
          "                  rarer ones are pure noise (0 = all values carry weight)\n"
          "  --threads T     threads writing files in parallel (CPUs)\n"
          "  --quiet         print only errors\n");
}

static int parse_count(const char *s, uint64_t *out) {
  char *e;
  errno = 0;
  double v = strtod(s, &e);
  if (e == s || errno) return -1;
  if (*e == 'k' || *e == 'K') v *= 1e3, e++;
  else if (*e == 'm' || *e == 'M') v *= 1e6, e++;
  else if (*e == 'g' || *e == 'G') v *= 1e9, e++;
  if (*e || !(v >= 0) || v > 9007199254740992.0 || v != floor(v)) return -1;
  *out = (uint64_t)v;
  return 0;
}

static int parse_u64(const char *s, uint64_t *out) {
  char *e;
  if (!*s || *s == '-') return -1;
  errno = 0;
  unsigned long long v = strtoull(s, &e, 10);
  if (*e || errno) return -1;
  *out = v;
  return 0;
}

static int mkdirs(const char *dir) {
  char p[4096];
  if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return -1;
  for (char *s = p + 1; *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    if (mkdir(p, 0755) != 0 && errno != EEXIST) return -1;
    *s = '/';
  }
  if (mkdir(p, 0755) != 0 && errno != EEXIST) return -1;
  struct stat st;
  if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) {
    errno = ENOTDIR;
    return -1;
  }
  return 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define BAD(...)                                                               \
  do {                                                                         \
    fprintf(stderr, "ctr_gen: " __VA_ARGS__);                                  \
    fputc('\n', stderr);                                                       \
    return 2;                                                                  \
  } while (0)

int main(int argc, char **argv) {
  static gen g;
  uint64_t rows = 1000000, test_rows = 100000, parts = 1, seed = 1, id_bits = 64,
           max_vocab = 0, threads = 0, signal_top = 0, crosses = 0;
  const char *dir = "ctr-data";
  int format = CTR_FMT_LIBSVM, quiet = 0;
  double ctr = 0.22;
  g.nint = 13;
  g.ncat = 26;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--quiet")) {
      quiet = 1;
      continue;
    }
    if (a[0] != '-' || a[1] != '-') BAD("unexpected argument '%s' (see --help)", a);
    const char *v = strchr(a, '=');
    char key[64];
    size_t kl = v ? (size_t)(v - a) : strlen(a);
    if (kl >= sizeof key) BAD("unknown option '%s' (see --help)", a);
    memcpy(key, a, kl);
    key[kl] = 0;
    if (v) v++;
    else if (i + 1 < argc) v = argv[++i];
    else BAD("option %s needs a value", a);
    if (!strcmp(key, "--rows")) {
      if (parse_count(v, &rows)) BAD("--rows: '%s' is not a count", v);
    } else if (!strcmp(key, "--test-rows")) {
      if (parse_count(v, &test_rows)) BAD("--test-rows: '%s' is not a count", v);
    } else if (!strcmp(key, "--parts")) {
      if (parse_count(v, &parts) || parts < 1 || parts > MAX_PARTS)
        BAD("--parts: '%s' is not in 1..%d", v, MAX_PARTS);
    } else if (!strcmp(key, "--out")) {
      if (!*v) BAD("--out: empty directory name");
      dir = v;
    } else if (!strcmp(key, "--fields")) {
      int ni, nc, len = 0;
      if (!strcmp(v, "criteo")) ni = 13, nc = 26;
      else if (sscanf(v, "%d,%d%n", &ni, &nc, &len) != 2 || v[len] || ni < 0 || nc < 0 ||
               ni + nc < 1 || ni + nc > MAX_FIELDS)
        BAD("--fields: '%s' is not INT,CAT with 1..%d fields in all", v, MAX_FIELDS);
      g.nint = ni;
      g.ncat = nc;
    } else if (!strcmp(key, "--seed")) {
      if (parse_u64(v, &seed)) BAD("--seed: '%s' is not an unsigned integer", v);
    } else if (!strcmp(key, "--format")) {
      format = ctr_format_parse(v);
      if (format < 0) BAD("--format: '%s' is not libsvm or bin", v);
    } else if (!strcmp(key, "--ctr")) {
      char *e;
      ctr = strtod(v, &e);
      if (*e || !(ctr > 0.001 && ctr < 0.999)) BAD("--ctr: '%s' is not in (0.001, 0.999)", v);
    } else if (!strcmp(key, "--id-bits")) {
      if (parse_u64(v, &id_bits) || id_bits < 8 || id_bits > 64)
        BAD("--id-bits: '%s' is not in 8..64", v);
    } else if (!strcmp(key, "--max-vocab")) {
      if (parse_count(v, &max_vocab) || max_vocab < 1) BAD("--max-vocab: '%s' is not a count >= 1", v);
    } else if (!strcmp(key, "--crosses")) {
      if (parse_u64(v, &crosses) || crosses > MAX_CROSSES) BAD("--crosses: '%s' is not in 0..%d", v, MAX_CROSSES);
    } else if (!strcmp(key, "--signal-top")) {
      if (parse_count(v, &signal_top)) BAD("--signal-top: '%s' is not a count", v);
    } else if (!strcmp(key, "--threads")) {
      if (parse_count(v, &threads) || threads < 1 || threads > 256)
        BAD("--threads: '%s' is not in 1..256", v);
    } else {
      BAD("unknown option '%s' (see --help)", key);
    }
  }
  if (!threads) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    threads = n > 0 ? (uint64_t)n : 1;
  }
  if (threads > parts + 1) threads = parts + 1;

  g.seed = seed;
  g.wseed = mix64(seed ^ (uint64_t)STREAM_WEIGHT << 60);
  g.id_bits = (int)id_bits;
  g.signal_top = signal_top;
  fields_init(&g, max_vocab);
  g.ncross = (int)crosses;
  if (crosses_init(&g))
    BAD("--crosses: %llu crosses need more categorical fields than %d (%d pairs)", (unsigned long long)crosses,
        g.ncat, g.ncat * (g.ncat - 1) / 2);

  if (mkdirs(dir) != 0) {
    fprintf(stderr, "ctr_gen: cannot create directory %s: %s\n", dir, strerror(errno));
    return 1;
  }
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/meta.txt", dir);
  if (unlink(path) != 0 && errno != ENOENT) {
    fprintf(stderr, "ctr_gen: cannot remove %s: %s\n", path, strerror(errno));
    return 1;
  }

  double t0 = now_s();
  g.bias = calibrate_bias(&g, ctr);

  job j = {.g = &g, .dir = dir, .format = format, .parts = (int)parts, .rows = rows,
           .test_rows = test_rows};
  atomic_init(&j.next, 0);
  atomic_init(&j.stop, 0);
  pthread_mutex_init(&j.mu, NULL);
  j.res = calloc(parts + 1, sizeof *j.res);
  if (test_rows <= EXACT_AUC_MAX) {
    j.t_score = malloc((test_rows ? test_rows : 1) * sizeof *j.t_score);
    j.t_label = malloc((test_rows ? test_rows : 1) * sizeof *j.t_label);
  } else if (ctr_auc_hist_new(&j.t_hist) != CTR_OK) {
    j.t_hist = NULL;
  }
  if (!j.res || (test_rows <= EXACT_AUC_MAX ? !j.t_score || !j.t_label : !j.t_hist)) {
    fprintf(stderr, "ctr_gen: out of memory\n");
    return 1;
  }

  pthread_t th[256];
  uint64_t started = 0;
  for (; started < threads; started++) {
    if (pthread_create(&th[started], NULL, worker, &j) != 0) {
      if (started == 0) worker(&j); /* no thread at all: do the work here */
      break;
    }
  }
  for (uint64_t i = 0; i < started; i++) pthread_join(th[i], NULL);
  if (j.err[0]) {
    fprintf(stderr, "ctr_gen: %s\n", j.err);
    return 1;
  }
  double elapsed = now_s() - t0;

  unit_result tr = {0};
  for (uint64_t p = 0; p < parts; p++) {
    tr.rows += j.res[p].rows;
    tr.positives += j.res[p].positives;
    tr.nnz += j.res[p].nnz;
    tr.bytes += j.res[p].bytes;
  }
  const unit_result *te = &j.res[parts];
  double auc = NAN, acc = test_rows ? (double)j.t_correct / (double)test_rows : NAN;
  if (j.t_score) {
    if (test_rows && ctr_auc(j.t_label, j.t_score, test_rows, &auc) != CTR_OK) auc = NAN;
  } else if (ctr_auc_hist_value(j.t_hist, &auc) != CTR_OK) {
    auc = NAN;
  }
  double pos_rate = rows ? (double)tr.positives / (double)rows : NAN;
  double test_rate = test_rows ? (double)te->positives / (double)test_rows : NAN;
  /* The constant predictor at the train click rate, for reference. */
  double base = NAN;
  if (test_rows && pos_rate > 0 && pos_rate < 1)
    base = -(test_rate * log(pos_rate) + (1 - test_rate) * log1p(-pos_rate));

  /* Remove train parts of an earlier run with more parts, then write meta.txt last. */
  for (uint64_t p = parts; p < MAX_PARTS; p++) {
    snprintf(tmp, sizeof tmp, "%s/train-%05u.%s", dir, (unsigned)p, ext(format));
    if (unlink(tmp) != 0) break;
  }
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *m = fopen(tmp, "w");
  if (!m) {
    fprintf(stderr, "ctr_gen: cannot create %s: %s\n", tmp, strerror(errno));
    return 1;
  }
  fprintf(m,
          "# ctr_gen dataset; this file is written last, so the directory is complete\n"
          "generator=ctr_gen %d\n"
          "seed=%llu\n"
          "format=%s\n"
          "rows=%llu\n"
          "test_rows=%llu\n"
          "parts=%llu\n"
          "train_files=train-%%05d.%s\n"
          "test_file=test.%s\n"
          "int_fields=%d\n"
          "cat_fields=%d\n"
          "fields=%d\n"
          "id_bits=%d\n"
          "id_hash=xxh64(le64 field, le64 value; seed 0)\n"
          "max_vocab=%llu\n"
          "signal_top=%llu\n"
          "crosses=%d\n"
          "target_ctr=%.6f\n"
          "bias=%.9f\n"
          "nnz=%llu\n"
          "test_nnz=%llu\n"
          "positive_rate=%.6f\n"
          "test_positive_rate=%.6f\n"
          "planted_test_logloss=%.6f\n"
          "planted_test_auc=%.6f\n"
          "planted_test_accuracy=%.6f\n"
          "constant_test_logloss=%.6f\n"
          "test_auc_method=%s\n",
          GEN_VERSION, (unsigned long long)seed, ctr_format_name(format),
          (unsigned long long)rows, (unsigned long long)test_rows, (unsigned long long)parts,
          ext(format), ext(format), g.nint, g.ncat, g.nfields, g.id_bits,
          (unsigned long long)max_vocab, (unsigned long long)signal_top, g.ncross, ctr, g.bias, (unsigned long long)tr.nnz,
          (unsigned long long)te->nnz, pos_rate, test_rate, j.t_logloss, auc, acc, base,
          j.t_score ? "exact" : "histogram");
  if (fflush(m) != 0 || ferror(m) || fclose(m) != 0) {
    fprintf(stderr, "ctr_gen: cannot write %s: %s\n", tmp, strerror(errno));
    unlink(tmp);
    return 1;
  }
  if (rename(tmp, path) != 0) {
    fprintf(stderr, "ctr_gen: cannot rename %s to %s: %s\n", tmp, path, strerror(errno));
    return 1;
  }

  if (!quiet) {
    uint64_t all = rows + test_rows;
    double mb = (double)(tr.bytes + te->bytes) / 1e6;
    printf("ctr_gen: %llu train rows in %llu part(s) + %llu test rows -> %s (%s), "
           "%d fields, %.1f features/row\n",
           (unsigned long long)rows, (unsigned long long)parts, (unsigned long long)test_rows,
           dir, ctr_format_name(format), g.nfields,
           all ? (double)(tr.nnz + te->nnz) / (double)all : 0.0);
    printf("click rate: train %.4f, test %.4f (target %.4f, bias %.4f)\n", pos_rate,
           test_rate, ctr, g.bias);
    printf("planted model on test: logloss %.4f, auc %.4f, accuracy %.4f "
           "(constant predictor: logloss %.4f)\n",
           j.t_logloss, auc, acc, base);
    printf("time %.2f s, %.0f rows/s, %.1f MB written (%.0f MB/s), %llu thread(s)\n", elapsed,
           elapsed > 0 ? (double)all / elapsed : 0.0, mb, elapsed > 0 ? mb / elapsed : 0.0,
           (unsigned long long)started);
  }
  free(j.res);
  free(j.t_score);
  free(j.t_label);
  ctr_auc_hist_free(j.t_hist);
  return 0;
}
