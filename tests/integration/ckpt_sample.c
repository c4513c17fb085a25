/*
 * ckpt_sample.c - write a sample checkpoint with the real writer (store/ckpt.c), for the
 * tests of the readers that are not C (python/tests/test_checkpoint.py) and of
 * `pshard checkpoint inspect`.
 *
 * Usage: ckpt_sample DIR ID [--servers S] [--clock C] [--big N]
 * Writes DIR/ckpt-ID/server-<rank>.psck for every rank and then DIR/ckpt-ID/MANIFEST.
 * Tables (ids 1..5) and their values, all exact in float (tests recompute them):
 *   w      dense 10 floats, opt=adam slice=4: parameter i = 0.5 i, m = -i, v = 0.25 i;
 *          slice k on server k % S
 *   emb    sparse dim 3, opt=adagrad: keys 1..20 and 2^40 + 7, element j = key + j/8,
 *          accumulator j = 2 key + j; key on server key % S
 *   bias   sparse dim 1, opt=sgd: keys 7 and 8, value 10 key
 *   empty  sparse dim 4, opt=momentum: no rows
 *   big    (with --big N) dense N floats, opt=sgd: parameter i = i mod 1000 - 500
 * Table versions are the clock, steps 3 * id. Exit 0, or 1 with the error.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/common.h"
#include "common/ring.h"
#include "store/ckpt.h"

static uint32_t S = 1;
static uint64_t big = 0;
static int64_t clock_ = 5;

static void die(const char *what) {
  fprintf(stderr, "ckpt_sample: %s: %s\n", what, ps_errmsg());
  exit(1);
}

static ps__ckpt_table table(uint32_t id, int kind, uint64_t size, const char *name, const char *opts,
                            uint32_t width, uint32_t nstate, uint64_t nrows) {
  ps__ckpt_table t;
  memset(&t, 0, sizeof t);
  t.decl.id = id;
  t.decl.kind = (uint8_t)kind;
  t.decl.size = size;
  snprintf(t.decl.name, sizeof t.decl.name, "%s", name);
  snprintf(t.decl.options, sizeof t.decl.options, "%s", opts);
  t.width = width;
  t.row_floats = width * (1 + nstate);
  t.step = 3 * id;
  t.version = clock_;
  t.nrows = nrows;
  return t;
}

static const uint64_t emb_keys[] = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
                                    12, 13, 14, 15, 16, 17, 18, 19, 20, (1ull << 40) + 7};
#define NEMB (sizeof emb_keys / sizeof emb_keys[0])
static const uint64_t bias_keys[] = {7, 8};

/* keys of server `rank` among all, sorted by ring position of table `id`. */
static uint32_t sparse_of(uint32_t id, uint32_t rank, const uint64_t *all, size_t n, uint64_t *out) {
  uint32_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (all[i] % S == rank) out[m++] = all[i];
  for (uint32_t i = 1; i < m; i++)
    for (uint32_t j = i; j > 0 && ps__ring_key_hash(id, out[j]) < ps__ring_key_hash(id, out[j - 1]); j--) {
      uint64_t x = out[j];
      out[j] = out[j - 1];
      out[j - 1] = x;
    }
  return m;
}

static uint64_t dense_slices_of(uint64_t nslices, uint32_t rank) {
  return nslices / S + (rank < nslices % S ? 1 : 0);
}

static void write_dense(ps__ckpt_writer *w, ps__ckpt_table t, uint32_t rank, uint32_t nstate) {
  uint64_t nslices = (t.decl.size + t.width - 1) / t.width;
  t.nrows = dense_slices_of(nslices, rank);
  if (ps__ckpt_write_table(w, &t)) die(t.decl.name);
  float *row = malloc((size_t)t.row_floats * sizeof *row);
  if (!row) die("out of memory");
  for (uint64_t k = rank; k < nslices; k += S) {
    memset(row, 0, (size_t)t.row_floats * sizeof *row);
    for (uint32_t j = 0; j < t.width && k * t.width + j < t.decl.size; j++) {
      uint64_t i = k * t.width + j;
      if (nstate == 0) {
        row[j] = (float)(int64_t)(i % 1000) - 500.0f;
      } else {
        row[j] = 0.5f * (float)i;
        row[t.width + j] = -(float)i;
        row[2 * t.width + j] = 0.25f * (float)i;
      }
    }
    if (ps__ckpt_write_rows(w, t.decl.id, t.row_floats, &k, row, 1, k, k)) die(t.decl.name);
  }
  free(row);
}

/* The big table's slice width: proto/spec.c's default slice, or the whole table. */
static uint32_t big_width(void) { return big < 65536 ? (uint32_t)big : 65536u; }

static void write_server(const char *cdir, uint32_t rank, uint64_t id, ps__ckpt_file *f) {
  char path[4200];
  snprintf(f->name, sizeof f->name, "server-%u.psck", rank);
  snprintf(path, sizeof path, "%s/%s", cdir, f->name);
  ps__ckpt_header h = {.what = PS_CKPT_DATA, .id = id, .clock = clock_, .rank = rank, .nservers = S};
  ps__ckpt_writer *w;
  if (ps__ckpt_writer_open(&w, path, &h)) die(path);

  write_dense(w, table(1, PS_DENSE, 10, "w", "opt=adam slice=4", 4, 2, 0), rank, 2);

  uint64_t keys[NEMB];
  float rows[NEMB * 6];
  uint32_t n = sparse_of(2, rank, emb_keys, NEMB, keys);
  ps__ckpt_table t = table(2, PS_SPARSE, 3, "emb", "opt=adagrad", 3, 1, n);
  if (ps__ckpt_write_table(w, &t)) die("emb");
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < 3; j++) {
      rows[i * 6 + j] = (float)keys[i] + 0.125f * (float)j;
      rows[i * 6 + 3 + j] = 2.0f * (float)keys[i] + (float)j;
    }
  if (ps__ckpt_write_rows(w, 2, 6, keys, rows, n, 0, UINT64_MAX)) die("emb");

  n = sparse_of(3, rank, bias_keys, 2, keys);
  t = table(3, PS_SPARSE, 1, "bias", "opt=sgd", 1, 0, n);
  if (ps__ckpt_write_table(w, &t)) die("bias");
  for (uint32_t i = 0; i < n; i++) rows[i] = 10.0f * (float)keys[i];
  if (ps__ckpt_write_rows(w, 3, 1, keys, rows, n, 0, UINT64_MAX)) die("bias");

  t = table(4, PS_SPARSE, 4, "empty", "opt=momentum", 4, 1, 0);
  if (ps__ckpt_write_table(w, &t)) die("empty");

  if (big) write_dense(w, table(5, PS_DENSE, big, "big", "opt=sgd", big_width(), 0, 0), rank, 0);

  ps__ckpt_summary sum;
  if (ps__ckpt_writer_close(w, 1, &sum)) die(path);
  f->rank = rank;
  f->bytes = sum.bytes;
  f->checksum = sum.checksum;
  f->rows = sum.rows;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: ckpt_sample DIR ID [--servers S] [--clock C] [--big N]\n");
    return 2;
  }
  uint64_t id, v;
  if (ps__parse_u64(argv[2], &id)) return fprintf(stderr, "ckpt_sample: bad id '%s'\n", argv[2]), 2;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (ps__parse_u64(argv[i + 1], &v)) return fprintf(stderr, "ckpt_sample: bad value '%s'\n", argv[i + 1]), 2;
    if (!strcmp(argv[i], "--servers") && v >= 1 && v <= 64) S = (uint32_t)v;
    else if (!strcmp(argv[i], "--clock")) clock_ = (int64_t)v;
    else if (!strcmp(argv[i], "--big")) big = v;
    else return fprintf(stderr, "ckpt_sample: bad flag '%s'\n", argv[i]), 2;
  }
  char cdir[4096];
  ps__ckpt_dir_of(argv[1], id, cdir, sizeof cdir);
  if (mkdir(argv[1], 0755) != 0 && errno != EEXIST) return perror(argv[1]), 1;
  if (mkdir(cdir, 0755) != 0 && errno != EEXIST) return perror(cdir), 1;

  ps__ckpt_file files[64];
  for (uint32_t r = 0; r < S; r++) write_server(cdir, r, id, &files[r]);

  char path[4200];
  snprintf(path, sizeof path, "%s/MANIFEST", cdir);
  ps__ckpt_header h = {.what = PS_CKPT_MANIFEST, .id = id, .clock = clock_, .rank = 0, .nservers = S};
  ps__ckpt_writer *w;
  if (ps__ckpt_writer_open(&w, path, &h)) die(path);
  ps__ckpt_table ts[] = {table(1, PS_DENSE, 10, "w", "opt=adam slice=4", 4, 2, 3),
                         table(2, PS_SPARSE, 3, "emb", "opt=adagrad", 3, 1, NEMB),
                         table(3, PS_SPARSE, 1, "bias", "opt=sgd", 1, 0, 2),
                         table(4, PS_SPARSE, 4, "empty", "opt=momentum", 4, 1, 0),
                         table(5, PS_DENSE, big, "big", "opt=sgd", big_width(), 0,
                               big ? (big + big_width() - 1) / big_width() : 0)};
  for (size_t i = 0; i < (big ? 5u : 4u); i++)
    if (ps__ckpt_write_table(w, &ts[i])) die("manifest");
  for (uint32_t r = 0; r < S; r++)
    if (ps__ckpt_write_file(w, &files[r])) die("manifest");
  static const char state[] = "sample scheduler state";
  if (ps__ckpt_write_state(w, state, sizeof state - 1)) die("manifest");
  if (ps__ckpt_writer_close(w, 1, NULL)) die(path);
  printf("%s\n", cdir);
  return 0;
}
