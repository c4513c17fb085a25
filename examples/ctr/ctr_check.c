/*
 * ctr_check.c - read click-log files end to end and report what they hold, or the first
 * error ("FILE:LINE: what"). Optionally converts one file to the other format.
 *
 *   ctr_check [--batch N] FILE...                 one line per file, exit 1 on error
 *   ctr_check --convert OUT [--format F] FILE     also write FILE's examples to OUT
 *   ctr_check --distinct FILE...                  also count the distinct feature ids of
 *                                                 all FILEs (in memory: 8 bytes an id)
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctr_data.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: ctr_check [--batch N] [--convert OUT [--format libsvm|bin]] FILE...\n"
          "Read libsvm or binary click-log files and print, for each,\n"
          "  FILE: rows=N nnz=M positives=P format=F\n"
          "or the first error, and exit 1. --convert writes the examples of the one FILE\n"
          "to OUT (format from --format, else from OUT's extension: .bin is binary).\n"
          "--distinct also prints the number of distinct feature ids of all FILEs\n"
          "(8 bytes of memory per distinct id, plus a buffer).\n");
}

/* The distinct ids seen: a sorted, unique prefix of n_sorted, then ids appended. */
typedef struct idset {
  uint64_t *a;
  size_t n, n_sorted, cap;
} idset;

static int cmp_u64(const void *x, const void *y) {
  uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
  return (a > b) - (a < b);
}

static void idset_compact(idset *d) {
  if (!d->n) return; /* (qsort and memcpy want a buffer, and there is none yet) */
  qsort(d->a, d->n, sizeof *d->a, cmp_u64); /* (a merge would do; this is a check tool) */
  size_t k = 0;
  for (size_t i = 0; i < d->n; i++)
    if (!k || d->a[k - 1] != d->a[i]) d->a[k++] = d->a[i];
  d->n = d->n_sorted = k;
}

static int idset_add(idset *d, const uint64_t *ids, size_t n) {
  if (d->n + n > d->cap) {
    idset_compact(d);
    if (d->n + n > d->cap / 2) { /* keep room for as many new ids as are kept */
      size_t cap = 2 * (d->n + n) + ((size_t)1 << 24);
      uint64_t *a = realloc(d->a, cap * sizeof *a);
      if (!a) return -1;
      d->a = a;
      d->cap = cap;
    }
  }
  if (n) memcpy(d->a + d->n, ids, n * sizeof *ids);
  d->n += n;
  return 0;
}

static int check(const char *path, size_t batch, const char *conv, int conv_fmt, idset *distinct) {
  ctr_reader *r = NULL;
  ctr_writer *w = NULL;
  ctr_batch b;
  ctr_batch_init(&b);
  uint64_t rows = 0, nnz = 0, pos = 0;
  int oom = 0;
  int rc = ctr_reader_open(path, &r);
  if (!rc && conv) rc = ctr_writer_open(conv, conv_fmt, &w);
  while (!rc) {
    rc = ctr_reader_next(r, batch, &b);
    if (rc || b.rows == 0) break;
    rows += b.rows;
    nnz += b.nnz;
    if (distinct && idset_add(distinct, b.ids, b.nnz)) {
      oom = 1;
      break;
    }
    for (size_t i = 0; i < b.rows; i++) {
      pos += b.labels[i] > 0.5f;
      if (w) {
        size_t o = (size_t)b.offsets[i], n = (size_t)(b.offsets[i + 1] - o);
        rc = ctr_writer_add(w, b.labels[i], b.ids + o, b.vals + o, n);
        if (rc) break;
      }
    }
  }
  int fmt = r ? ctr_reader_format(r) : 0;
  ctr_reader_close(r);
  ctr_batch_free(&b);
  if (!rc && !oom) rc = ctr_writer_close(w);
  else ctr_writer_abort(w);
  if (oom) {
    fprintf(stderr, "ctr_check: %s: out of memory counting distinct ids\n", path);
    return 1;
  }
  if (rc) {
    fprintf(stderr, "ctr_check: %s\n", ctr_errmsg());
    return 1;
  }
  printf("%s: rows=%" PRIu64 " nnz=%" PRIu64 " positives=%" PRIu64 " format=%s\n", path, rows,
         nnz, pos, ctr_format_name(fmt));
  return 0;
}

int main(int argc, char **argv) {
  size_t batch = 4096;
  const char *conv = NULL;
  int conv_fmt = -1, i = 1, count_distinct = 0;
  for (; i < argc && argv[i][0] == '-' && argv[i][1]; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--")) {
      i++;
      break;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--distinct")) {
      count_distinct = 1;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "ctr_check: option %s needs a value\n", a);
      return 2;
    }
    const char *v = argv[++i];
    if (!strcmp(a, "--batch")) {
      char *e;
      long long n = strtoll(v, &e, 10);
      if (*e || n < 1 || n > (1 << 24)) {
        fprintf(stderr, "ctr_check: --batch: '%s' is not in 1..16777216\n", v);
        return 2;
      }
      batch = (size_t)n;
    } else if (!strcmp(a, "--convert")) {
      conv = v;
    } else if (!strcmp(a, "--format")) {
      conv_fmt = ctr_format_parse(v);
      if (conv_fmt < 0) {
        fprintf(stderr, "ctr_check: --format: '%s' is not libsvm or bin\n", v);
        return 2;
      }
    } else {
      fprintf(stderr, "ctr_check: unknown option '%s'\n", a);
      usage(stderr);
      return 2;
    }
  }
  if (i >= argc || (conv && argc - i != 1)) {
    usage(stderr);
    return 2;
  }
  if (conv && conv_fmt < 0) {
    size_t n = strlen(conv);
    conv_fmt = n >= 4 && !strcmp(conv + n - 4, ".bin") ? CTR_FMT_BIN : CTR_FMT_LIBSVM;
  }
  int bad = 0;
  idset d = {0};
  for (; i < argc; i++) bad |= check(argv[i], batch, conv, conv_fmt, count_distinct ? &d : NULL);
  if (count_distinct && !bad) {
    idset_compact(&d);
    printf("distinct_ids=%zu\n", d.n);
  }
  free(d.a);
  return bad;
}
