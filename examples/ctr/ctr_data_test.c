/*
 * ctr_data_test.c - self-test of the ctr_data library: metrics against known values
 * and a brute-force AUC, and write/read round trips in both formats across block and
 * batch boundaries, byte-range partitions of a text file (every line exactly once, for
 * any number of ranges, lines longer than a range), and gzip-compressed files. Usage: ctr_data_test [SCRATCH_DIR]; exits 1 on the first failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <xxhash.h>
#include <zlib.h>

#include "ctr_data.h"

static int failures;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s (%s)\n", __FILE__, __LINE__, #cond, \
              ctr_errmsg());                                                   \
      failures++;                                                              \
    }                                                                          \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                                  \
  do {                                                                         \
    double a_ = (a), b_ = (b);                                                 \
    if (!(fabs(a_ - b_) <= (tol))) {                                           \
      fprintf(stderr, "%s:%d: %s = %.12g, expected %s = %.12g\n", __FILE__, __LINE__, #a, \
              a_, #b, b_);                                                     \
      failures++;                                                              \
    }                                                                          \
  } while (0)

static uint64_t rs = 12345;
static uint64_t rnd(void) {
  rs ^= rs << 13;
  rs ^= rs >> 7;
  rs ^= rs << 17;
  return rs;
}

/* A random id with a random number of leading zero bits (two calls, in order). */
static uint64_t rnd_id(void) {
  uint64_t a = rnd();
  return a >> (rnd() % 64);
}

static double brute_auc(const float *y, const float *s, size_t n) {
  double win = 0, pairs = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++)
      if (y[i] > 0.5f && y[j] <= 0.5f) {
        pairs++;
        win += s[i] > s[j] ? 1.0 : s[i] == s[j] ? 0.5 : 0.0;
      }
  return win / pairs;
}

static void test_metrics(void) {
  double a;
  {
    float y[] = {0, 0, 1, 1}, s[] = {0.1f, 0.4f, 0.35f, 0.8f};
    CHECK(ctr_auc(y, s, 4, &a) == CTR_OK);
    CHECK_NEAR(a, 0.75, 1e-12);
  }
  {
    float y[] = {0, 1}, s[] = {0.5f, 0.5f};
    CHECK(ctr_auc(y, s, 2, &a) == CTR_OK);
    CHECK_NEAR(a, 0.5, 1e-12);
  }
  {
    float y[] = {0, 0, 1, 1, 1}, s[] = {1, 2, 2, 3, -1};
    CHECK(ctr_auc(y, s, 5, &a) == CTR_OK);
    CHECK_NEAR(a, 3.5 / 6, 1e-12);
  }
  {
    float y[] = {0, 1, 1}, s[] = {0.0f, -0.0f, -1e30f};
    CHECK(ctr_auc(y, s, 3, &a) == CTR_OK);
    CHECK_NEAR(a, 0.25, 1e-12); /* -0 ties +0, -1e30 loses */
  }
  {
    float y[] = {1, 1}, s[] = {0.1f, 0.2f};
    CHECK(ctr_auc(y, s, 2, &a) == CTR_ERR_INVALID);
    CHECK(isnan(a));
    float y2[] = {0, 1}, s2[] = {NAN, 0.2f};
    CHECK(ctr_auc(y2, s2, 2, &a) == CTR_ERR_INVALID);
    CHECK(ctr_auc(y2, s2, 0, &a) == CTR_ERR_INVALID);
  }
  /* random scores with many ties and both signs, against the O(n^2) definition */
  enum { N = 3000 };
  static float y[N], s[N];
  for (int trial = 0; trial < 4; trial++) {
    int levels = trial == 0 ? 3 : trial == 1 ? 50 : 100000;
    for (int i = 0; i < N; i++) {
      s[i] = (float)((int)(rnd() % (uint64_t)levels) - levels / 2) * 0.37f;
      if (trial == 3) s[i] = (float)ldexp((double)(rnd() >> 11), -53) * 1e6f - 5e5f;
      y[i] = (rnd() % 100) < (uint64_t)(30 + (s[i] > 0) * 20);
    }
    CHECK(ctr_auc(y, s, N, &a) == CTR_OK);
    CHECK_NEAR(a, brute_auc(y, s, N), 1e-12);
  }
  /* the histogram AUC is close to the exact one for probabilities */
  ctr_auc_hist *h;
  CHECK(ctr_auc_hist_new(&h) == CTR_OK);
  for (int i = 0; i < N; i++) {
    double p = ldexp((double)(rnd() >> 11), -53);
    s[i] = (float)p;
    y[i] = (double)(rnd() >> 11) * 0x1p-53 < p;
    ctr_auc_hist_add(h, y[i], p);
  }
  double ah;
  CHECK(ctr_auc(y, s, N, &a) == CTR_OK);
  CHECK(ctr_auc_hist_value(h, &ah) == CTR_OK);
  CHECK_NEAR(ah, a, 1e-4);
  ctr_auc_hist_free(h);

  float yl[] = {1, 0, 1, 0}, pl[] = {0.8f, 0.3f, 0.4f, 0.6f};
  CHECK_NEAR(ctr_logloss(yl, pl, 4),
             -(log(0.8f) + log(1 - 0.3f) + log(0.4f) + log(1 - 0.6f)) / 4, 1e-9);
  CHECK_NEAR(ctr_accuracy(yl, pl, 4, 0.5f), 0.5, 1e-12);
  float y1[] = {1}, p1[] = {1.0f};
  CHECK(isfinite(ctr_logloss(y1, p1, 1)) && ctr_logloss(y1, p1, 1) < 1e-12);
  float y0[] = {0};
  CHECK_NEAR(ctr_logloss(y0, p1, 1), -log(1e-15), 1e-2); /* clipped */
}

/* Write the same examples in both formats, read each back in several batch sizes and
 * compare with what was written. */
static void test_roundtrip(const char *dir) {
  enum { ROWS = 150000 }; /* more than two binary blocks */
  char path[2][512];
  snprintf(path[0], sizeof path[0], "%s/rt.txt", dir);
  snprintf(path[1], sizeof path[1], "%s/rt.bin", dir);
  for (int f = 0; f < 2; f++) {
    ctr_writer *w;
    CHECK(ctr_writer_open(path[f], f ? CTR_FMT_BIN : CTR_FMT_LIBSVM, &w) == CTR_OK);
    if (!w) return;
    CHECK(access(path[f], F_OK) != 0); /* not under its final name until closed */
    rs = 99;
    for (uint64_t r = 0; r < ROWS; r++) {
      uint64_t ids[8];
      float vals[8];
      size_t n = rnd() % 9;
      for (size_t i = 0; i < n; i++) {
        ids[i] = rnd_id();
        vals[i] = r >= 70000 && r < 80000 ? (float)(int)(rnd() % 1000) / 7.0f - 50 : 1.0f;
      }
      CHECK(ctr_writer_add(w, (float)(rnd() & 1), ids, vals, n) == CTR_OK);
    }
    float nan = NAN;
    uint64_t one = 1;
    CHECK(ctr_writer_add(w, 1, &one, &nan, 1) == CTR_ERR_INVALID);
    CHECK(ctr_writer_close(w) == CTR_OK);
  }
  static const size_t batches[] = {1, 7, 4096, 65536, 1000000};
  for (int f = 0; f < 2; f++)
    for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
      if (batches[bi] == 1 && f == 0) continue; /* slow and adds nothing */
      ctr_reader *r;
      CHECK(ctr_reader_open(path[f], &r) == CTR_OK);
      if (!r) return;
      CHECK(ctr_reader_format(r) == (f ? CTR_FMT_BIN : CTR_FMT_LIBSVM));
      ctr_batch b;
      ctr_batch_init(&b);
      rs = 99;
      uint64_t row = 0;
      int bad = 0;
      for (;;) {
        int rc = ctr_reader_next(r, batches[bi], &b);
        CHECK(rc == CTR_OK);
        if (rc || b.rows == 0) break;
        CHECK(b.rows <= batches[bi]);
        CHECK(b.offsets[0] == 0 && b.offsets[b.rows] == b.nnz);
        for (size_t i = 0; i < b.rows && !bad; i++, row++) {
          size_t n = rnd() % 9;
          bad |= b.offsets[i + 1] - b.offsets[i] != n;
          for (size_t k = 0; k < n && !bad; k++) {
            uint64_t id = rnd_id();
            float v = row >= 70000 && row < 80000 ? (float)(int)(rnd() % 1000) / 7.0f - 50
                                                  : 1.0f;
            bad |= b.ids[b.offsets[i] + k] != id || b.vals[b.offsets[i] + k] != v;
          }
          bad |= b.labels[i] != (float)(rnd() & 1);
        }
      }
      CHECK(!bad);
      CHECK(row == ROWS);
      CHECK(ctr_reader_rows(r) == ROWS);
      ctr_batch_free(&b);
      ctr_reader_close(r);
    }
  unlink(path[0]);
  unlink(path[1]);

  /* an aborted writer leaves nothing behind */
  ctr_writer *w;
  CHECK(ctr_writer_open(path[1], CTR_FMT_BIN, &w) == CTR_OK);
  ctr_writer_abort(w);
  CHECK(access(path[1], F_OK) != 0);
  char tmp[600];
  snprintf(tmp, sizeof tmp, "%s.tmp", path[1]);
  CHECK(access(tmp, F_OK) != 0);
}

/* An error is sticky and names file and line. */
static void test_errors(const char *dir) {
  char path[512];
  snprintf(path, sizeof path, "%s/bad.txt", dir);
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (!f) return;
  fputs("1 1:1\n0 2:1\n\n1 3:1\n+1 4:2.5 x:1\n0 5:1\n", f);
  fclose(f);
  ctr_reader *r;
  ctr_batch b;
  ctr_batch_init(&b);
  CHECK(ctr_reader_open(path, &r) == CTR_OK);
  if (!r) return;
  CHECK(ctr_reader_next(r, 2, &b) == CTR_OK && b.rows == 2);
  CHECK(ctr_reader_next(r, 2, &b) == CTR_ERR_PARSE && b.rows == 0);
  char want[600];
  snprintf(want, sizeof want, "%s:5: feature id 'x' does not parse", path);
  CHECK(!strcmp(ctr_errmsg(), want));
  CHECK(ctr_reader_next(r, 2, &b) == CTR_ERR_PARSE && !strcmp(ctr_errmsg(), want));
  ctr_reader_close(r);
  ctr_batch_free(&b);
  unlink(path);
  /* a binary file of a later format version, with a valid header checksum */
  snprintf(path, sizeof path, "%s/v2.bin", dir);
  unsigned char h[24] = {'C', 'T', 'R', 'B', 2, 0, 0, 0, 0, 0, 0, 0, 24, 0, 0, 0};
  uint64_t sum = XXH64(h, 16, 0);
  for (int i = 0; i < 8; i++) h[16 + i] = (unsigned char)(sum >> (8 * i));
  f = fopen(path, "wb");
  CHECK(f != NULL);
  if (!f) return;
  fwrite(h, 1, sizeof h, f);
  fclose(f);
  CHECK(ctr_reader_open(path, &r) == CTR_ERR_CORRUPT && r == NULL);
  snprintf(want, sizeof want, "%s: unsupported binary format version 2 (this reader knows 1)",
           path);
  CHECK(!strcmp(ctr_errmsg(), want));
  unlink(path);
  CHECK(ctr_reader_open("/nonexistent/x.txt", &r) == CTR_ERR_IO && r == NULL);
  CHECK(!strcmp(ctr_errmsg(), "cannot open /nonexistent/x.txt: No such file or directory"));
}

/* Read path as n byte ranges, in order, with batches of `batch` rows: the first feature
 * id of every example goes to ids (the test files number their lines that way). Returns
 * the examples read, or -1 on a reader error. */
static long read_ranges(const char *path, uint64_t size, uint32_t n, size_t batch, uint64_t *ids, size_t cap) {
  ctr_batch b;
  ctr_batch_init(&b);
  size_t got = 0;
  for (uint32_t i = 0; i < n; i++) {
    uint64_t beg, end;
    ctr_range(size, n, i, &beg, &end);
    ctr_reader *r;
    if (ctr_reader_open_range(path, beg, end, &r) != CTR_OK) {
      ctr_batch_free(&b);
      return -1;
    }
    for (;;) {
      if (ctr_reader_next(r, batch, &b) != CTR_OK) {
        ctr_reader_close(r);
        ctr_batch_free(&b);
        return -1;
      }
      if (b.rows == 0) break;
      for (size_t k = 0; k < b.rows && got < cap; k++) ids[got++] = b.ids[b.offsets[k]];
    }
    ctr_reader_close(r);
  }
  ctr_batch_free(&b);
  return (long)got;
}

/* Byte ranges that tile a text file read every example exactly once, in file order. */
static void test_ranges(const char *dir) {
  char path[512];
  snprintf(path, sizeof path, "%s/ranges.svm", dir);
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (!f) return;
  enum { LINES = 400 };
  for (int i = 0; i < LINES; i++) {
    if (i % 37 == 5) fputs("# a comment line\n\n", f);
    fprintf(f, "%d %d:1", i % 3 == 0, i);
    /* most lines are short; some are far longer than a range */
    int extra = i % 50 == 7 ? 3000 : (int)(rnd() % 6);
    for (int j = 0; j < extra; j++) fprintf(f, " %d:%d", 1000000 + j, j % 4);
    fputs(i % 11 == 3 ? "\r\n" : "\n", f);
  }
  fputs("1 400:1", f); /* the last line lacks its newline */
  fclose(f);
  ctr_file_info info;
  CHECK(ctr_file_probe(path, &info) == CTR_OK);
  CHECK(info.format == CTR_FMT_LIBSVM && !info.gzip && info.splittable && info.size > 100000);
  uint64_t *ids = calloc(2 * LINES, sizeof *ids);
  CHECK(ids != NULL);
  if (!ids) return;
  const uint32_t ns[] = {1, 2, 3, 4, 5, 7, 16, 63, 100, 401, 1000, 4099};
  for (size_t t = 0; t < sizeof ns / sizeof ns[0]; t++) {
    long got = read_ranges(path, info.size, ns[t], 1 + t % 5 * 7, ids, 2 * LINES);
    if (got != LINES + 1) {
      fprintf(stderr, "%s:%d: %u ranges read %ld examples, want %d (%s)\n", __FILE__, __LINE__, ns[t], got,
              LINES + 1, ctr_errmsg());
      failures++;
      continue;
    }
    for (long i = 0; i <= LINES; i++)
      if (ids[i] != (uint64_t)i) {
        fprintf(stderr, "%s:%d: %u ranges: example %ld has id %llu\n", __FILE__, __LINE__, ns[t], i,
                (unsigned long long)ids[i]);
        failures++;
        break;
      }
  }
  unlink(path);

  /* A small file cut into as many ranges as it has bytes, and more (empty ranges). */
  snprintf(path, sizeof path, "%s/tiny.txt", dir);
  f = fopen(path, "w");
  CHECK(f != NULL);
  if (!f) return;
  fputs("1 0:1\n0 1:1\n\n1 2:1 9:1\r\n0 3:2.5\n", f);
  fclose(f);
  CHECK(ctr_file_probe(path, &info) == CTR_OK);
  for (uint32_t n = (uint32_t)info.size - 3; n <= info.size + 5; n++) {
    long got = read_ranges(path, info.size, n, 1, ids, 2 * LINES);
    CHECK(got == 4);
    for (long i = 0; i < 4 && got == 4; i++) CHECK(ids[i] == (uint64_t)i);
  }
  /* A parse error in a range after byte 0 names the line's number in the file. */
  f = fopen(path, "w");
  if (f) {
    fputs("1 0:1\n0 1:1\n7 2:1\n", f);
    fclose(f);
  }
  ctr_reader *r;
  ctr_batch b;
  ctr_batch_init(&b);
  CHECK(ctr_reader_open_range(path, 3, 100, &r) == CTR_OK);
  if (r) {
    CHECK(ctr_reader_next(r, 10, &b) == CTR_ERR_PARSE);
    char want[600];
    snprintf(want, sizeof want, "%s:3: label '7' is not 0/1 or -1/+1", path);
    CHECK(!strcmp(ctr_errmsg(), want));
    ctr_reader_close(r);
  }
  ctr_batch_free(&b);
  unlink(path);
  free(ids);
}

/* A gzip-compressed text or binary file reads like the uncompressed one, whatever its
 * name; it cannot be cut into byte ranges. */
static void test_gzip(const char *dir) {
  char path[512], bin[512];
  snprintf(path, sizeof path, "%s/data.svm.gz", dir);
  gzFile g = gzopen(path, "wb");
  CHECK(g != NULL);
  if (!g) return;
  for (int i = 0; i < 5000; i++) gzprintf(g, "%d %d:1 77:0.5\n", i % 2, i);
  gzclose(g);
  ctr_file_info info;
  CHECK(ctr_file_probe(path, &info) == CTR_OK);
  CHECK(info.format == CTR_FMT_LIBSVM && info.gzip && !info.splittable);
  uint64_t *ids = calloc(5000, sizeof *ids);
  if (!ids) return;
  ctr_reader *r;
  CHECK(ctr_reader_open_range(path, 0, 100, &r) == CTR_ERR_INVALID && r == NULL); /* a range of a gzip file */
  ctr_batch b;
  ctr_batch_init(&b);
  size_t got = 0;
  CHECK(ctr_reader_open(path, &r) == CTR_OK);
  while (r && ctr_reader_next(r, 999, &b) == CTR_OK && b.rows > 0)
    for (size_t k = 0; k < b.rows; k++, got++) CHECK(b.ids[b.offsets[k]] == got && b.labels[k] == (float)(got % 2));
  CHECK(got == 5000);
  ctr_reader_close(r);
  /* binary, then gzip-compressed under a name that says nothing */
  snprintf(bin, sizeof bin, "%s/data.bin", dir);
  ctr_writer *w;
  CHECK(ctr_writer_open(bin, CTR_FMT_BIN, &w) == CTR_OK);
  for (uint64_t i = 0; i < 3000 && w; i++) CHECK(ctr_writer_add(w, (float)(i % 2), &i, NULL, 1) == CTR_OK);
  CHECK(ctr_writer_close(w) == CTR_OK);
  FILE *f = fopen(bin, "rb");
  snprintf(path, sizeof path, "%s/data.blob", dir);
  g = gzopen(path, "wb");
  CHECK(f && g);
  char buf[4096];
  size_t k;
  while (f && g && (k = fread(buf, 1, sizeof buf, f)) > 0) gzwrite(g, buf, (unsigned)k);
  if (f) fclose(f);
  if (g) gzclose(g);
  CHECK(ctr_file_probe(path, &info) == CTR_OK && info.format == CTR_FMT_BIN && info.gzip);
  got = 0;
  CHECK(ctr_reader_open(path, &r) == CTR_OK);
  while (r && ctr_reader_next(r, 1000, &b) == CTR_OK && b.rows > 0)
    for (size_t j = 0; j < b.rows; j++, got++) CHECK(b.ids[b.offsets[j]] == got);
  CHECK(got == 3000);
  ctr_reader_close(r);
  /* a truncated gzip stream is an error, not a short file */
  f = fopen(path, "r+b");
  if (f) {
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fclose(f);
    CHECK(truncate(path, sz / 2) == 0);
  }
  CHECK(ctr_reader_open(path, &r) == CTR_OK);
  int rc = CTR_OK;
  while (r && (rc = ctr_reader_next(r, 1000, &b)) == CTR_OK && b.rows > 0) {
  }
  CHECK(rc != CTR_OK);
  ctr_reader_close(r);
  ctr_batch_free(&b);
  unlink(path);
  unlink(bin);
  snprintf(path, sizeof path, "%s/data.svm.gz", dir);
  unlink(path);
  free(ids);
}

int main(int argc, char **argv) {
  const char *dir = argc > 1 ? argv[1] : ".";
  test_metrics();
  test_roundtrip(dir);
  test_errors(dir);
  test_ranges(dir);
  test_gzip(dir);
  if (failures) {
    fprintf(stderr, "ctr_data_test: %d check(s) failed\n", failures);
    return 1;
  }
  printf("ctr_data_test: all checks passed\n");
  return 0;
}
