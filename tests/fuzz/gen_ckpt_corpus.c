/*
 * gen_ckpt_corpus.c - write the seed corpus of the checkpoint fuzz target.
 *
 * Usage: fuzz_gen_ckpt_corpus DIR. Writes small valid files of each kind with the real
 * writer (store/ckpt.c), in the format it writes (2): data files with dense and sparse
 * tables of every optimiser's row layout, a table without rows, rows in more than one
 * ROWS block, a data file with no table; manifests with and without tables and a STATE
 * block; an increment (base 2): a data file with some of a dense table's slices and a
 * few sparse rows, and its manifest. The output is committed under
 * tests/fuzz/corpus/ckpt: `cmake --build build --target fuzz_gen_ckpt_corpus &&
 * build/tests/fuzz/fuzz_gen_ckpt_corpus tests/fuzz/corpus/ckpt`; rerun after a format
 * change and commit the difference. Files of an older format stay there as seeds of
 * their own (data-v1-*.psck, manifest-v1.psck: format 1, read still). Every value is
 * fixed (created_ms included), so reruns give the same bytes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "common/ring.h"
#include "store/ckpt.h"

static const char *dir;

static void die(const char *what) {
  fprintf(stderr, "fuzz_gen_ckpt_corpus: %s: %s\n", what, ps_errmsg());
  exit(1);
}

/* A file of checkpoint 3 (clock 8), an increment on base (0: whole). */
static ps__ckpt_writer *start_on(const char *name, uint32_t what, uint32_t rank, uint32_t nservers, uint64_t base) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  ps__ckpt_header h = {.what = what, .id = 3, .clock = 8, .rank = rank,
                       .nservers = nservers, .created_ms = 1700000000000ull, .base = base};
  ps__ckpt_writer *w;
  if (ps__ckpt_writer_open(&w, path, &h)) die(name);
  return w;
}

static ps__ckpt_writer *start(const char *name, uint32_t what, uint32_t rank, uint32_t nservers) {
  return start_on(name, what, rank, nservers, 0);
}

static void finish(ps__ckpt_writer *w, const char *name, ps__ckpt_summary *sum) {
  if (ps__ckpt_writer_close(w, 1, sum)) die(name);
}

static ps__ckpt_table table(uint32_t id, int kind, uint64_t size, const char *name, const char *opts,
                            uint64_t nrows) {
  ps__ckpt_table t;
  memset(&t, 0, sizeof t);
  t.decl.id = id;
  t.decl.kind = (uint8_t)kind;
  t.decl.size = size;
  snprintf(t.decl.name, sizeof t.decl.name, "%s", name);
  snprintf(t.decl.options, sizeof t.decl.options, "%s", opts);
  t.step = 17;
  t.version = 4;
  t.nrows = nrows;
  return t;
}

/* A table and its rows: dense slices 0..n-1 (or keys0, increasing, when given), or
 * sparse keys sorted by ring position; split into `calls` write_rows calls (one ROWS
 * block each). */
static void table_rows(ps__ckpt_writer *w, ps__ckpt_table t, uint32_t row_floats, const uint64_t *keys0, uint32_t n,
                       uint32_t calls) {
  t.row_floats = row_floats;
  if (ps__ckpt_write_table(w, &t)) die(t.decl.name);
  uint64_t keys[64];
  float rows[64 * 12];
  for (uint32_t i = 0; i < n; i++) keys[i] = keys0 ? keys0[i] : i;
  if (t.decl.kind == PS_SPARSE)
    for (uint32_t i = 1; i < n; i++)
      for (uint32_t j = i; j > 0 && ps__ring_key_hash(t.decl.id, keys[j]) < ps__ring_key_hash(t.decl.id, keys[j - 1]);
           j--) {
        uint64_t x = keys[j];
        keys[j] = keys[j - 1];
        keys[j - 1] = x;
      }
  for (uint32_t i = 0; i < n * row_floats; i++) rows[i] = (float)i * 0.25f - 1.0f;
  uint32_t per = (n + calls - 1) / calls;
  for (uint32_t i = 0; i < n; i += per) {
    uint32_t m = n - i < per ? n - i : per;
    if (ps__ckpt_write_rows(w, t.decl.id, row_floats, keys + i, rows + (size_t)i * row_floats, m, 0, UINT64_MAX))
      die(t.decl.name);
  }
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  dir = argv[1];
  static const uint64_t keys[] = {1, 2, 3, 99, 100000, 0xffffffffffffull};
  ps__ckpt_summary s1, s2;

  ps__ckpt_writer *w = start("data-dense-sparse.psck", PS_CKPT_DATA, 1, 2);
  table_rows(w, table(1, PS_DENSE, 10, "w", "opt=adam slice=4", 3), 12, NULL, 3, 1);
  table_rows(w, table(2, PS_SPARSE, 2, "emb", "opt=adagrad lr=0.1", 6), 4, keys, 6, 2);
  finish(w, "data-dense-sparse.psck", &s1);

  w = start("data-kinds.psck", PS_CKPT_DATA, 0, 2);
  table_rows(w, table(3, PS_SPARSE, 1, "bias", "opt=sgd", 3), 1, keys, 3, 1);
  table_rows(w, table(4, PS_DENSE, 5, "m", "opt=momentum", 1), 10, NULL, 1, 1);
  table_rows(w, table(5, PS_SPARSE, 2, "f", "opt=ftrl mode=async", 2), 6, keys + 3, 2, 1);
  ps__ckpt_table empty = table(6, PS_SPARSE, 8, "unused", "", 0);
  empty.row_floats = 8;
  if (ps__ckpt_write_table(w, &empty)) die("unused");
  finish(w, "data-kinds.psck", &s2);

  w = start("data-empty.psck", PS_CKPT_DATA, 0, 1);
  finish(w, "data-empty.psck", NULL);

  w = start("manifest.psck", PS_CKPT_MANIFEST, 0, 2);
  ps__ckpt_table t = table(1, PS_DENSE, 10, "w", "opt=adam slice=4", 3);
  t.row_floats = 12;
  if (ps__ckpt_write_table(w, &t)) die("manifest");
  t = table(2, PS_SPARSE, 2, "emb", "opt=adagrad lr=0.1", 6);
  t.row_floats = 4;
  if (ps__ckpt_write_table(w, &t)) die("manifest");
  ps__ckpt_file f0 = {.name = "server-0.psck", .rank = 0, .bytes = s2.bytes, .checksum = s2.checksum, .rows = s2.rows};
  ps__ckpt_file f1 = {.name = "server-1.psck", .rank = 1, .bytes = s1.bytes, .checksum = s1.checksum, .rows = s1.rows};
  if (ps__ckpt_write_file(w, &f1) || ps__ckpt_write_file(w, &f0)) die("manifest");
  static const char state[] = "task table 7: 4 partitions, 2 done; clocks 8 8";
  if (ps__ckpt_write_state(w, state, sizeof state - 1)) die("manifest");
  finish(w, "manifest.psck", NULL);

  w = start("manifest-bare.psck", PS_CKPT_MANIFEST, 0, 1);
  if (ps__ckpt_write_file(w, &f0)) die("manifest-bare");
  finish(w, "manifest-bare.psck", NULL);

  /* An increment on checkpoint 2: the rows changed since, slice 2 of w's three and two
   * keys of emb; its manifest still counts w's slices in all. */
  static const uint64_t changed[] = {2};
  ps__ckpt_summary s3;
  w = start_on("data-increment.psck", PS_CKPT_DATA, 0, 1, 2);
  table_rows(w, table(1, PS_DENSE, 10, "w", "opt=adam slice=4", 1), 12, changed, 1, 1);
  table_rows(w, table(2, PS_SPARSE, 2, "emb", "opt=adagrad lr=0.1", 2), 4, keys + 2, 2, 1);
  finish(w, "data-increment.psck", &s3);

  w = start_on("manifest-increment.psck", PS_CKPT_MANIFEST, 0, 1, 2);
  t = table(1, PS_DENSE, 10, "w", "opt=adam slice=4", 3);
  t.row_floats = 12;
  if (ps__ckpt_write_table(w, &t)) die("manifest-increment");
  t = table(2, PS_SPARSE, 2, "emb", "opt=adagrad lr=0.1", 2);
  t.row_floats = 4;
  if (ps__ckpt_write_table(w, &t)) die("manifest-increment");
  ps__ckpt_file f3 = {.name = "server-0.psck", .rank = 0, .bytes = s3.bytes, .checksum = s3.checksum, .rows = s3.rows};
  if (ps__ckpt_write_file(w, &f3) || ps__ckpt_write_state(w, state, sizeof state - 1)) die("manifest-increment");
  finish(w, "manifest-increment.psck", NULL);
  return 0;
}
