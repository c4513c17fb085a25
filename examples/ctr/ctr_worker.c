/*
 * ctr_worker.c - a click-through (sparse logistic regression) worker for pshard.
 *
 * Run it under `pshard run` (or any launcher that sets PSHARD_*). The weights live in a
 * sparse table of dimension 1 on the servers, updated with FTRL-proximal or Adagrad.
 * The training data (--data: a directory's train* files, one file, or a glob; libsvm
 * text or the ctr binary format, either of them gzip-compressed) is cut into
 * partitions: a binary or compressed file is one, an uncompressed text file is cut into
 * byte ranges on line boundaries, so that one file feeds any number of workers. Every
 * worker computes the same cut from the files' sizes. The scheduler hands out the
 * partitions as tasks; for each mini-batch the worker pulls only the rows the batch
 * touches, computes the mean logistic-loss gradient, pushes it and advances its clock.
 * The pull of the next batch's rows starts right after that clock, non-blocking, and
 * flies while the worker reads and indexes the batch after it and while its push is
 * acknowledged (two batches in turn: double buffering); in sync mode it thus answers
 * with the round just closed, and the model is the one --no-prefetch trains.
 *
 * Epochs: rank 0 evaluates test log-loss and AUC at the end of every epoch and prints
 * them beside the planted model's (from DIR/meta.txt when the data came from ctr_gen).
 * A small progress table on the servers counts the partitions done and the epochs
 * evaluated; a worker holding a partition of epoch e+1 waits (taking empty steps) until
 * rank 0 has evaluated epoch e, and rank 0 evaluates epoch e once all of its partitions
 * are counted done. So each epoch line shows the model exactly as that epoch left it.
 * --predict FILE --out FILE then writes rank 0's scores for FILE.
 *
 * Saving and loading the model: with --save DIR, once training ends rank 0 asks for a
 * checkpoint of the whole job into DIR (ps_checkpoint_to: DIR/ckpt-<id>, the weights
 * and the optimiser's state on every server). --load DIR goes with `pshard run
 * --restore DIR`, which is what puts the saved tables on the servers (onto any number
 * of them); the worker checks that its job did start from DIR's newest checkpoint, and
 * rank 0 evaluates the loaded model before anything else. --epochs N then trains N
 * more epochs; --epochs 0 only evaluates.
 *
 * In sync mode a round waits for every worker; a worker that has no partition to work
 * on (its epoch's partitions are all taken) takes empty steps - a pull that waits for
 * the round, then a clock - so that the others never wait on it.
 *
 * Feature ids: a row's key is the id as the data has it (any 64-bit value), or with
 * --id-bits B the top B bits of a mix of it (feature hashing into 2^B rows, the usual way
 * to bound a model whose ids come from an unbounded space); the bias is key 2^64 - 1,
 * outside every B < 64.
 *
 * Any bad data (missing file, bad label, unparsable feature) stops the worker with the
 * reader's "FILE:LINE: what" message and exit status 1.
 */
#include <dirent.h>
#include <errno.h>
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "ctr_data.h"
#include "pshard.h"

#define BIAS_KEY UINT64_MAX

/* --id-bits: 64 keeps the data's ids as they are. Set once, before any batch. */
static unsigned g_id_bits = 64;

/* A feature id's key: the id, or the top g_id_bits bits of its murmur3 finalizer (a
 * bijection of 64-bit values, so distinct ids collide only by the truncation). */
static uint64_t id_key(uint64_t id) {
  if (g_id_bits >= 64) return id;
  id ^= id >> 33;
  id *= 0xff51afd7ed558ccdull;
  id ^= id >> 33;
  id *= 0xc4ceb9fe1a85ec53ull;
  id ^= id >> 33;
  return id >> (64 - g_id_bits);
}

typedef struct opts {
  const char *data, *test, *opt;
  const char *table_opts; /* extra options of the weight table (agg_n=4 agg_ms=20, ...) */
  int epochs, batch, quiet;
  int slow_worker;      /* PSHARD_WORKER_INDEX of a worker to slow down (-1 none) */
  double slow_factor;   /* its steps take this many times as long */
  int eval_every;       /* rank 0: evaluate on the test set every N of its steps (0 off) */
  size_t eval_rows;     /* rows of the test set used by --eval-every (all) */
  double lr, l1, l2, beta;
  const char *predict, *out; /* --predict FILE --out FILE */
  const char *save, *load; /* --save DIR, --load DIR */
  long parts;              /* --parts N (0: max(files, 4 x workers)) */
  int shuffle;             /* --shuffle SEED given */
  int prefetch;            /* pull the next batch's rows during this step (--no-prefetch: 0) */
  uint64_t shuffle_seed;
} opts;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die_ps(const char *what, int rc) {
  fprintf(stderr, "ctr_worker: %s: %s (%s)\n", what, ps_errmsg(), ps_err_name(rc));
  exit(1);
}

#define PS_CHECK(what, call)   \
  do {                         \
    int rc_ = (call);          \
    if (rc_) die_ps(what, rc_); \
  } while (0)

/* ------------------------------------------------------------------ unique ids of a batch */

typedef struct idset {
  uint64_t *keys;
  uint32_t *idx, *gen;
  uint32_t cap, cur;
  uint64_t *uniq;
  size_t n, ucap;
} idset;

static uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static void idset_reset(idset *s, size_t need) {
  if (need * 2 > s->cap) {
    uint32_t cap = 1024;
    while (cap < need * 2) cap *= 2;
    free(s->keys);
    free(s->idx);
    free(s->gen);
    s->keys = malloc((size_t)cap * 8);
    s->idx = malloc((size_t)cap * 4);
    s->gen = calloc(cap, 4);
    s->cap = cap;
    s->cur = 0;
    if (!s->keys || !s->idx || !s->gen) {
      fprintf(stderr, "ctr_worker: out of memory\n");
      exit(1);
    }
  }
  if (need > s->ucap) {
    s->ucap = need;
    s->uniq = realloc(s->uniq, need * 8);
    if (!s->uniq) exit(1);
  }
  s->cur++;
  s->n = 0;
}

/* Index of key in the batch's unique list, adding it if new. */
static uint32_t idset_add(idset *s, uint64_t key) {
  uint32_t m = s->cap - 1, i = (uint32_t)mix(key) & m;
  for (;;) {
    if (s->gen[i] != s->cur) {
      s->gen[i] = s->cur;
      s->keys[i] = key;
      s->idx[i] = (uint32_t)s->n;
      s->uniq[s->n++] = key;
      return s->idx[i];
    }
    if (s->keys[i] == key) return s->idx[i];
    i = (i + 1) & m;
  }
}

/* ------------------------------------------------------------------ model */

static float sigmoid(double z) {
  if (z > 35) z = 35;
  if (z < -35) z = -35;
  return (float)(1.0 / (1.0 + exp(-z)));
}

/* A mini-batch's distinct ids and what goes with them: each example's index into the
 * distinct ids, the weights pulled for them and their gradient. The worker keeps one
 * for evaluation and two for training, which alternate: while one batch computes, the
 * other's rows are being pulled (double buffering). */
typedef struct rows {
  idset ids;
  uint32_t *col; /* per nnz: index into ids.uniq */
  size_t col_cap;
  float *w, *g;
  double *gd;
  size_t wcap;
} rows;

typedef struct model {
  ps_ctx *ctx;
  uint32_t table;
  rows ev;          /* evaluation and prediction */
  rows tr[2];       /* training: the current batch and the next */
} model;

static void ensure(rows *r, size_t nnz, size_t nuniq) {
  if (nnz > r->col_cap) {
    r->col_cap = nnz;
    r->col = realloc(r->col, nnz * 4);
  }
  if (nuniq > r->wcap) {
    r->wcap = nuniq;
    r->w = realloc(r->w, nuniq * 4);
    r->g = realloc(r->g, nuniq * 4);
    r->gd = realloc(r->gd, nuniq * 8);
  }
  if ((nnz && !r->col) || !r->w || !r->g || !r->gd) {
    fprintf(stderr, "ctr_worker: out of memory\n");
    exit(1);
  }
}

static void rows_free(rows *r) {
  free(r->ids.keys);
  free(r->ids.idx);
  free(r->ids.gen);
  free(r->ids.uniq);
  free(r->col);
  free(r->w);
  free(r->g);
  free(r->gd);
}

static void model_free(model *m) {
  rows_free(&m->ev);
  rows_free(&m->tr[0]);
  rows_free(&m->tr[1]);
}

/* The batch's distinct ids (the bias first) and each example's index into them;
 * returns their count. */
static size_t index_batch(rows *r, const ctr_batch *b) {
  idset_reset(&r->ids, b->nnz + 1);
  ensure(r, b->nnz, b->nnz + 1);
  idset_add(&r->ids, BIAS_KEY);
  for (size_t j = 0; j < b->nnz; j++) r->col[j] = idset_add(&r->ids, id_key(b->ids[j]));
  ensure(r, b->nnz, r->ids.n);
  return r->ids.n;
}

/* Probabilities into p from the weights in r->w. */
static void score(const rows *r, const ctr_batch *b, float *p) {
  for (size_t i = 0; i < b->rows; i++) {
    double z = r->w[0];
    for (uint64_t j = b->offsets[i]; j < b->offsets[i + 1]; j++) z += (double)r->w[r->col[j]] * b->vals[j];
    p[i] = sigmoid(z);
  }
}

/* Pull the batch's weights and compute probabilities into p. Returns unique count. */
static size_t predict(model *m, const ctr_batch *b, float *p) {
  rows *r = &m->ev;
  index_batch(r, b);
  PS_CHECK("pull", ps_pull(m->ctx, m->table, r->ids.uniq, r->ids.n, r->w, -1));
  score(r, b, p);
  return r->ids.n;
}

/* The mean log-loss gradient of the batch into r->g, from the probabilities p. */
static void gradient(rows *r, const ctr_batch *b, const float *p) {
  size_t nu = r->ids.n;
  memset(r->gd, 0, nu * 8);
  for (size_t i = 0; i < b->rows; i++) {
    double e = (double)p[i] - b->labels[i];
    r->gd[0] += e;
    for (uint64_t j = b->offsets[i]; j < b->offsets[i + 1]; j++) r->gd[r->col[j]] += e * b->vals[j];
  }
  for (size_t k = 0; k < nu; k++) r->g[k] = (float)(r->gd[k] / (double)b->rows);
}

static float *pbuf_for(const ctr_batch *b, float **pbuf, size_t *pcap) {
  if (b->rows > *pcap) {
    *pcap = b->rows;
    *pbuf = realloc(*pbuf, b->rows * 4);
    if (!*pbuf) exit(1);
  }
  return *pbuf;
}

/* One training step on a batch, every call blocking (--no-prefetch); returns the
 * batch's mean log-loss before the update. */
static double train_step(model *m, const ctr_batch *b, float **pbuf, size_t *pcap) {
  float *p = pbuf_for(b, pbuf, pcap);
  rows *r = &m->tr[0];
  index_batch(r, b);
  PS_CHECK("pull", ps_pull(m->ctx, m->table, r->ids.uniq, r->ids.n, r->w, -1));
  score(r, b, p);
  gradient(r, b, p);
  PS_CHECK("push", ps_push(m->ctx, m->table, r->ids.uniq, r->ids.n, r->g, (uint32_t)b->rows, PS_LR_SCHEDULE, -1));
  PS_CHECK("clock", ps_clock(m->ctx));
  return ctr_logloss(b->labels, p, b->rows);
}

/* ------------------------------------------------------------------ epochs and progress */

/* The progress table (one sparse row of 2 counters, key 0, summed): partitions done over all epochs, and
 * epochs rank 0 has evaluated. Its name carries the job's starting clock, so that a job
 * restored from a checkpoint (which holds the old counters) starts from zero. */
#define PROG_DONE 0
#define PROG_EVALUATED 1

static void progress_add(model *m, uint32_t table, int which) {
  float g[2] = {0, 0};
  g[which] = -1; /* sgd with lr 1: w -= g */
  uint64_t key = 0;
  PS_CHECK("push progress", ps_push(m->ctx, table, &key, 1, g, 1, 1.0f, -1));
}

/* A step with no data: read the progress counters (a pull that waits for the round in
 * sync mode, like everyone else's), then advance. */
static void idle_step(model *m, uint32_t table, float prog[2]) {
  uint64_t key = 0;
  PS_CHECK("pull progress", ps_pull(m->ctx, table, &key, 1, prog, -1));
  PS_CHECK("clock", ps_clock(m->ctx));
  usleep(1000);
}

static int evaluate(model *m, const char *path, int batch, size_t max_rows, double *logloss, double *auc, double *acc,
                    size_t *rows) {
  ctr_reader *r;
  ctr_batch b;
  size_t n = 0, cap = 0;
  float *y = NULL, *p = NULL;
  if (ctr_reader_open(path, &r)) {
    fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
    return 1;
  }
  ctr_batch_init(&b);
  for (;;) {
    if (ctr_reader_next(r, (size_t)batch, &b)) {
      fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
      ctr_reader_close(r);
      ctr_batch_free(&b);
      free(y);
      free(p);
      return 1;
    }
    if (b.rows == 0 || (max_rows && n >= max_rows)) break;
    if (n + b.rows > cap) {
      cap = (n + b.rows) * 2;
      y = realloc(y, cap * 4);
      p = realloc(p, cap * 4);
      if (!y || !p) exit(1);
    }
    predict(m, &b, p + n);
    memcpy(y + n, b.labels, b.rows * 4);
    n += b.rows;
  }
  ctr_reader_close(r);
  ctr_batch_free(&b);
  *logloss = ctr_logloss(y, p, n);
  *acc = ctr_accuracy(y, p, n, 0.5f);
  if (ctr_auc(y, p, n, auc)) *auc = NAN;
  *rows = n;
  free(y);
  free(p);
  return 0;
}

/* Write a score for every example of path into out, in the format of liblinear's
 * `predict -b 1`: a header "labels 1 0", then "PREDICTED P(1) P(0)" a line. Written to
 * OUT.tmp and renamed into place. 0, or 1 with the reason on stderr. */
static int predict_file(model *m, const char *path, const char *out, int batch) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", out);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    fprintf(stderr, "ctr_worker: --out %s: cannot write %s: %s\n", out, tmp, strerror(errno));
    return 1;
  }
  ctr_reader *r;
  if (ctr_reader_open(path, &r)) {
    fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
    fclose(f);
    unlink(tmp);
    return 1;
  }
  ctr_batch b;
  ctr_batch_init(&b);
  float *p = malloc((size_t)batch * 4);
  size_t n = 0, right = 0;
  int rc = p ? 0 : 1;
  fputs("labels 1 0\n", f);
  while (!rc) {
    if (ctr_reader_next(r, (size_t)batch, &b)) {
      fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
      rc = 1;
      break;
    }
    if (b.rows == 0) break;
    predict(m, &b, p);
    for (size_t i = 0; i < b.rows; i++) {
      int label = p[i] >= 0.5f;
      right += label == (b.labels[i] > 0.5f);
      fprintf(f, "%d %.6g %.6g\n", label, p[i], 1.0 - p[i]);
    }
    n += b.rows;
  }
  ctr_reader_close(r);
  ctr_batch_free(&b);
  free(p);
  if (fclose(f) != 0 && !rc) {
    fprintf(stderr, "ctr_worker: --out %s: cannot write %s: %s\n", out, tmp, strerror(errno));
    rc = 1;
  }
  if (!rc && rename(tmp, out) != 0) {
    fprintf(stderr, "ctr_worker: --out %s: cannot rename %s: %s\n", out, tmp, strerror(errno));
    rc = 1;
  }
  if (rc) {
    unlink(tmp);
    return 1;
  }
  printf("predictions: %zu examples of %s in %s (accuracy %.4f against its labels)\n", n, path, out,
         n ? (double)right / (double)n : 0.0);
  fflush(stdout);
  return 0;
}

/* ------------------------------------------------------------------ partitions */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int is_regular(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && !strcmp(s + n - k, suffix);
}

static void push_name(char ***v, size_t *n, const char *name) {
  char **nv = realloc(*v, (*n + 1) * sizeof **v);
  if (!nv || !(nv[*n] = strdup(name))) {
    fprintf(stderr, "ctr_worker: out of memory\n");
    exit(1);
  }
  *v = nv;
  (*n)++;
}

static void free_names(char **v, size_t n) {
  for (size_t i = 0; i < n; i++) free(v[i]);
  free(v);
}

/* The files PREFIX* of a directory (not *.tmp, which writers rename when complete),
 * sorted by name. */
static char **dir_files(const char *dir, const char *prefix, size_t *n) {
  DIR *d = opendir(dir);
  char **v = NULL;
  *n = 0;
  if (!d) return NULL;
  struct dirent *e;
  while ((e = readdir(d))) {
    char path[4096];
    if (strncmp(e->d_name, prefix, strlen(prefix)) || ends_with(e->d_name, ".tmp")) continue;
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= sizeof path || !is_regular(path)) continue;
    push_name(&v, n, path);
  }
  closedir(d);
  if (*n) qsort(v, *n, sizeof *v, cmp_str);
  return v;
}

/* The training files of --data: a directory's train* files, one file, or the matches
 * of a glob pattern, sorted. *is_dir says whether spec was a directory. Exits with a
 * message if there are none. */
static char **data_files(const char *spec, int *is_dir, size_t *n) {
  struct stat st;
  char **v = NULL;
  *n = 0;
  *is_dir = 0;
  if (stat(spec, &st) == 0 && S_ISDIR(st.st_mode)) {
    *is_dir = 1;
    v = dir_files(spec, "train", n);
    if (!*n) {
      fprintf(stderr, "ctr_worker: --data %s: no train* files in that directory (give a file or a quoted glob)\n",
              spec);
      exit(1);
    }
    return v;
  }
  if (stat(spec, &st) == 0) {
    push_name(&v, n, spec);
    return v;
  }
  if (strpbrk(spec, "*?[")) {
    glob_t g;
    int rc = glob(spec, 0, NULL, &g);
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; i++)
        if (is_regular(g.gl_pathv[i])) push_name(&v, n, g.gl_pathv[i]);
    if (rc == 0 || rc == GLOB_NOMATCH) globfree(&g);
    if (!*n) {
      fprintf(stderr, "ctr_worker: --data %s: the pattern matches no file\n", spec);
      exit(1);
    }
    return v;
  }
  fprintf(stderr, "ctr_worker: --data %s: %s\n", spec, strerror(errno));
  exit(1);
}

#define MIN_RANGE (64u << 10) /* smallest byte range a text file is cut into */

/* A training partition: a whole file, or the byte range [begin, end) of a text file. */
typedef struct source {
  const char *path; /* one of the data files */
  uint64_t begin, end;
} source;

/* Cut the files into about `target` partitions (at least one a file): a binary or
 * compressed file is one partition; uncompressed text files share the rest in
 * proportion to their sizes, each cut into equal byte ranges of at least MIN_RANGE. A pure function of the
 * files' sizes, so every worker computes the same partitions. */
static source *plan_partitions(char **files, size_t nfiles, uint64_t target, size_t *nsrc, uint64_t *bytes) {
  ctr_file_info *info = calloc(nfiles, sizeof *info);
  if (!info) exit(1);
  uint64_t split_bytes = 0, whole = 0;
  *bytes = 0;
  for (size_t i = 0; i < nfiles; i++) {
    if (ctr_file_probe(files[i], &info[i])) {
      fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
      exit(1);
    }
    *bytes += info[i].size;
    if (info[i].splittable) split_bytes += info[i].size;
    else whole++;
  }
  uint64_t share = target > nfiles && target > whole ? target - whole : 0;
  source *v = NULL;
  size_t n = 0;
  for (size_t i = 0; i < nfiles; i++) {
    uint64_t k = 1;
    if (info[i].splittable && share && split_bytes) {
      k = (uint64_t)llround((double)share * (double)info[i].size / (double)split_bytes);
      if (k < 1) k = 1;
      uint64_t most = (info[i].size + MIN_RANGE - 1) / MIN_RANGE; /* ranges of at least MIN_RANGE */
      if (k > most) k = most ? most : 1;
    }
    v = realloc(v, (n + k) * sizeof *v);
    if (!v) exit(1);
    for (uint64_t j = 0; j < k; j++) {
      v[n].path = files[i];
      if (k == 1) {
        v[n].begin = 0;
        v[n].end = UINT64_MAX;
      } else {
        ctr_range(info[i].size, (uint32_t)k, (uint32_t)j, &v[n].begin, &v[n].end);
      }
      n++;
    }
  }
  free(info);
  *nsrc = n;
  return v;
}

/* Reads one partition as mini-batches, in file order or shuffled. With --shuffle the
 * whole partition is read into `pool` first and its examples are handed out in a
 * permutation that depends only on (seed, partition, epoch). */
typedef struct part_reader {
  ctr_reader *r;
  ctr_batch pool; /* --shuffle: every example of the partition */
  size_t *perm, next;
  int shuffled;
} part_reader;

static uint64_t splitmix(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Append b's examples to pool. */
static void pool_append(ctr_batch *pool, const ctr_batch *b) {
  if (!pool->offsets) {
    pool->offsets = calloc(1, 8);
    if (!pool->offsets) exit(1);
  }
  size_t rows = pool->rows + b->rows, nnz = pool->nnz + b->nnz;
  if (rows > pool->cap_rows) {
    size_t cap = pool->cap_rows ? pool->cap_rows : 1024;
    while (cap < rows) cap *= 2;
    pool->offsets = realloc(pool->offsets, (cap + 1) * 8);
    pool->labels = realloc(pool->labels, cap * 4);
    pool->cap_rows = cap;
  }
  if (nnz > pool->cap_nnz) {
    size_t cap = pool->cap_nnz ? pool->cap_nnz : 16384;
    while (cap < nnz) cap *= 2;
    pool->ids = realloc(pool->ids, cap * 8);
    pool->vals = realloc(pool->vals, cap * 4);
    pool->cap_nnz = cap;
  }
  if (!pool->offsets || !pool->labels || (nnz && (!pool->ids || !pool->vals))) {
    fprintf(stderr, "ctr_worker: out of memory holding a partition for --shuffle (use more --parts)\n");
    exit(1);
  }
  memcpy(pool->ids + pool->nnz, b->ids, b->nnz * 8);
  memcpy(pool->vals + pool->nnz, b->vals, b->nnz * 4);
  memcpy(pool->labels + pool->rows, b->labels, b->rows * 4);
  for (size_t i = 0; i < b->rows; i++) pool->offsets[pool->rows + i + 1] = pool->nnz + b->offsets[i + 1];
  pool->rows = rows;
  pool->nnz = nnz;
}

/* Open partition src; 0, or 1 with the reader's message on stderr. */
static int part_open(part_reader *pr, const source *src, const opts *o, uint32_t partition, uint32_t epoch,
                     ctr_batch *tmp) {
  pr->shuffled = o->shuffle;
  pr->next = 0;
  if (ctr_reader_open_range(src->path, src->begin, src->end, &pr->r)) {
    fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
    return 1;
  }
  if (!o->shuffle) return 0;
  pr->pool.rows = pr->pool.nnz = 0;
  for (;;) {
    if (ctr_reader_next(pr->r, 4096, tmp)) {
      fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
      return 1;
    }
    if (tmp->rows == 0) break;
    pool_append(&pr->pool, tmp);
  }
  free(pr->perm);
  pr->perm = malloc((pr->pool.rows + 1) * sizeof *pr->perm);
  if (!pr->perm) exit(1);
  uint64_t key[3] = {o->shuffle_seed, partition, epoch}, x = XXH64(key, sizeof key, 0);
  for (size_t i = 0; i < pr->pool.rows; i++) pr->perm[i] = i;
  for (size_t i = pr->pool.rows; i > 1; i--) {
    size_t j = (size_t)(splitmix(&x) % i), t = pr->perm[i - 1];
    pr->perm[i - 1] = pr->perm[j];
    pr->perm[j] = t;
  }
  return 0;
}

/* The next mini-batch of up to max_rows examples into b (b->rows 0 at the end). */
static int part_next(part_reader *pr, size_t max_rows, ctr_batch *b) {
  if (!pr->shuffled) {
    if (ctr_reader_next(pr->r, max_rows, b)) {
      fprintf(stderr, "ctr_worker: %s\n", ctr_errmsg());
      return 1;
    }
    return 0;
  }
  b->rows = b->nnz = 0;
  if (b->offsets) b->offsets[0] = 0;
  ctr_batch one;
  while (b->rows < max_rows && pr->next < pr->pool.rows) {
    size_t i = pr->perm[pr->next++];
    uint64_t o0 = pr->pool.offsets[i], o1 = pr->pool.offsets[i + 1];
    uint64_t offs[2] = {0, o1 - o0};
    one.rows = 1;
    one.nnz = (size_t)(o1 - o0);
    one.offsets = offs;
    one.ids = pr->pool.ids + o0;
    one.vals = pr->pool.vals + o0;
    one.labels = pr->pool.labels + i;
    pool_append(b, &one);
  }
  return 0;
}

static void part_close(part_reader *pr) {
  ctr_reader_close(pr->r);
  pr->r = NULL;
}

/* ------------------------------------------------------------------ prefetching */

/* Wait for a started request and free it; a failure stops the worker with its message. */
static void req_finish(ps_req **req, const char *what) {
  int rc = ps_req_wait(*req, -1);
  if (rc) die_ps(what, rc); /* before the free: the message is the wait's */
  ps_req_free(*req);
  *req = NULL;
}

/* The prefetching pipeline over one partition's batches. The rows of batch k+1 are
 * pulled while batch k+2 is read and indexed and while batch k's push travels; the
 * pull of batch k+1 starts right after the clock of batch k, so that in sync mode it
 * answers with round k applied, exactly as the blocking pull of --no-prefetch would.
 * Frames on a connection keep the order of the calls, so the push of batch k (started,
 * not finished) is in the round that batch k's clock closes. */
typedef struct pipeline {
  ctr_batch b[2];   /* the current batch and the next (b[i] goes with m->tr[i]) */
  ps_req *pull[2], *push;
  int cur;
} pipeline;

/* Start the pull of batch i's rows (b[i] holds a batch). */
static void pipe_pull(model *m, pipeline *pl, int i) {
  rows *r = &m->tr[i];
  index_batch(r, &pl->b[i]);
  PS_CHECK("pull", ps_pull_start(m->ctx, m->table, r->ids.uniq, r->ids.n, r->w, &pl->pull[i]));
}

/* Read the partition's first batch and start its pull; 1 on a read error. */
static int pipe_open(model *m, pipeline *pl, part_reader *pr, size_t batch) {
  pl->cur = 0;
  if (part_next(pr, batch, &pl->b[0])) return 1;
  if (pl->b[0].rows) pipe_pull(m, pl, 0);
  return 0;
}

/* One step on the current batch (pl->b[pl->cur], rows > 0): read the next batch, wait
 * for the current rows, compute, push, clock, start the next batch's pull, wait for
 * the push. Returns the batch's log-loss into *loss; 1 on a read error. The batch
 * just trained on is pl->b[pl->cur ^ 1] after the call. */
static int pipe_step(model *m, pipeline *pl, part_reader *pr, size_t batch, float **pbuf, size_t *pcap,
                     double *loss) {
  int c = pl->cur, n = c ^ 1;
  const ctr_batch *b = &pl->b[c];
  rows *r = &m->tr[c];
  if (part_next(pr, batch, &pl->b[n])) return 1;
  if (pl->b[n].rows) index_batch(&m->tr[n], &pl->b[n]);
  float *p = pbuf_for(b, pbuf, pcap);
  req_finish(&pl->pull[c], "pull");
  score(r, b, p);
  gradient(r, b, p);
  PS_CHECK("push", ps_push_start(m->ctx, m->table, r->ids.uniq, r->ids.n, r->g, (uint32_t)b->rows,
                                 PS_LR_SCHEDULE, &pl->push));
  PS_CHECK("clock", ps_clock(m->ctx));
  if (pl->b[n].rows)
    PS_CHECK("pull", ps_pull_start(m->ctx, m->table, m->tr[n].ids.uniq, m->tr[n].ids.n, m->tr[n].w, &pl->pull[n]));
  req_finish(&pl->push, "push");
  *loss = ctr_logloss(b->labels, p, b->rows);
  pl->cur = n;
  return 0;
}

static void pipe_free(pipeline *pl) {
  for (int i = 0; i < 2; i++) {
    ps_req_free(pl->pull[i]);
    pl->pull[i] = NULL;
    ctr_batch_free(&pl->b[i]);
  }
  ps_req_free(pl->push);
  pl->push = NULL;
}

static int meta_value(const char *dir, const char *key, double *out) {
  char path[4096], line[512];
  snprintf(path, sizeof path, "%s/meta.txt", dir);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t kl = strlen(key);
  int rc = -1;
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, key, kl) && line[kl] == '=') {
      *out = strtod(line + kl + 1, NULL);
      rc = 0;
    }
  fclose(f);
  return rc;
}

/* ------------------------------------------------------------------ a saved model */

static uint64_t le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static uint32_t le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The manifest of DIR's newest complete checkpoint (DIR itself when it is one) into
 * path. 0, or -1 when there is none. */
static int newest_manifest(const char *dir, char *path, size_t cap) {
  snprintf(path, cap, "%s/MANIFEST", dir);
  if (!access(path, R_OK)) return 0;
  DIR *d = opendir(dir);
  if (!d) return -1;
  unsigned long long best = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    char *end, m[4096];
    if (strncmp(e->d_name, "ckpt-", 5) || e->d_name[5] < '1' || e->d_name[5] > '9') continue;
    unsigned long long id = strtoull(e->d_name + 5, &end, 10);
    snprintf(m, sizeof m, "%s/%s/MANIFEST", dir, e->d_name);
    if (!*end && id > best && !access(m, R_OK)) best = id;
  }
  closedir(d);
  if (!best) return -1;
  snprintf(path, cap, "%s/ckpt-%llu/MANIFEST", dir, best);
  return 0;
}

/* The clock of DIR's newest checkpoint, from its manifest's HEADER block
 * (docs/checkpoint.md, 3 and 4.1): -1 when its job had no sync table. 0, or 1 with the
 * reason on stderr. */
static int saved_clock(const char *dir, int64_t *clock) {
  char path[4200];
  unsigned char b[80]; /* block framing 16, HEADER payload 48 (format 1) or 56 (2), checksum 8 */
  if (newest_manifest(dir, path, sizeof path)) {
    fprintf(stderr, "ctr_worker: --load %s: no complete checkpoint there (save one with --save %s)\n", dir, dir);
    return 1;
  }
  FILE *f = fopen(path, "rb");
  size_t n = f ? fread(b, 1, sizeof b, f) : 0;
  if (f) fclose(f);
  uint64_t len = n >= 16 ? le64(b + 8) : 0;
  uint32_t format = n >= 24 ? le32(b + 20) : 0;
  if (n < 16 + len + 8 || le32(b) != 0x42435350u || (b[4] | b[5] << 8) != 1 || len != (format == 1 ? 48u : 56u) ||
      XXH64(b, 16 + len, 0) != le64(b + 16 + len) || le32(b + 16) != 0x4b435350u || le32(b + 24) != 2) {
    fprintf(stderr, "ctr_worker: --load %s: %s is not a readable checkpoint manifest\n", dir, path);
    return 1;
  }
  *clock = (int64_t)le64(b + 48);
  return 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: ctr_worker --data DIR|FILE|'GLOB' [options]   (run under `pshard run`)\n"
          "  --data X        training data: a directory's train* files, one file, or a quoted glob\n"
          "                  ('data/day-*.svm.gz'); libsvm text or the ctr binary format, found by\n"
          "                  content whatever the name, either of them gzip- or zstd-compressed\n"
          "  --test FILE     test set, any of those formats (default DIR/test* when --data is a\n"
          "                  directory; needed otherwise)\n"
          "  --parts N       cut the data into about N partitions, the unit a worker takes: an\n"
          "                  uncompressed text file is cut into byte ranges on line boundaries, a\n"
          "                  binary or .gz file is one partition (default max(files, 4 x workers))\n"
          "  --shuffle SEED  shuffle the examples within each partition, differently every epoch\n"
          "                  but the same on every run (holds one partition in memory)\n"
          "  --epochs N      passes over the data (1); with --load, more passes (0: only evaluate)\n"
          "  --batch N       examples per mini-batch (1000)\n"
          "  --opt ftrl|adagrad  server-side optimiser (ftrl)\n"
          "  --table-opts S  more options of the weight table, e.g. 'agg_n=4 agg_ms=20' (see pshard.h)\n"
          "  --id-bits B     hash every feature id into B bits, 1..64 (64: the ids as they are, any\n"
          "                  64-bit value); the table then has at most 2^B rows (+1, the bias).\n"
          "                  A model saved with --id-bits B is loaded with the same B\n"
          "  --lr X --l1 X --l2 X --beta X   optimiser settings (ftrl: 0.1 0.003 0.001 0.001;\n"
          "                  adagrad: 0.1). The servers see the batch-mean gradient, so l1, l2 and\n"
          "                  beta are in its units (per-example FTRL values divided by the batch)\n"
          "  --predict FILE --out OUT   after training (or with --load DIR --epochs 0), write a\n"
          "                  score for every example of FILE into OUT as liblinear's `predict -b 1`\n"
          "                  does: a line 'labels 1 0', then 'PREDICTED P(1) P(0)' a line\n"
          "  --quiet         no per-epoch lines from workers other than rank 0\n"
          "  --no-prefetch   pull each batch's rows when it starts, not during the step before\n"
          "                  (prefetching gives the same model; this measures what it hides)\n"
          "  --slow-worker I --slow-factor F   worker index I (PSHARD_WORKER_INDEX) takes F times\n"
          "                  as long per step (it sleeps (F-1) x its step time), to study stragglers\n"
          "  --eval-every N  rank 0 prints 'eval t=SECONDS examples=N logloss=X auc=Y steps=S\n"
          "                  train_t=SECONDS' every N of its steps, on the first --eval-rows test\n"
          "                  rows (10000; 0: all); train_t leaves out the time spent evaluating\n"
          "  --save DIR      when training ends, checkpoint the whole job's tables into DIR/ckpt-<id>\n"
          "                  (DIR on a file system every server sees; made if missing)\n"
          "  --load DIR      start from the model saved in DIR: run the job as\n"
          "                  `pshard run --restore DIR ...` (any number of servers); rank 0 first\n"
          "                  prints 'loaded model: test logloss X  auc Y ...'\n"
          "tuning: the defaults suit millions of examples. On small data (thousands to a few\n"
          "  hundred thousand examples) take more, smaller steps: --batch 32 --lr 1 --epochs 20\n"
          "  did much better than the defaults; watch the epoch lines and stop adding epochs\n"
          "  when the test logloss no longer falls.\n");
}

/* Rank 0: evaluate epoch `epoch` (1-based) on the test set and print its line; with
 * --eval-every also as an eval line (examples and steps so far, train_t the training
 * time without evaluations), so that the eval lines end with each epoch's model. */
static int epoch_line(model *m, const opts *o, int epoch, double t0, uint64_t examples, uint64_t steps,
                      double train_t) {
  double ll, auc, acc;
  size_t n;
  if (evaluate(m, o->test, 10000, 0, &ll, &auc, &acc, &n)) return 1;
  if (o->eval_every)
    printf("eval t=%.3f examples=%llu logloss=%.5f auc=%.5f steps=%llu train_t=%.3f\n", now_s() - t0,
           (unsigned long long)examples, ll, auc, (unsigned long long)steps, train_t);
  printf("epoch %d: test logloss %.4f  auc %.4f  accuracy %.4f  (%zu examples, %.1f s)\n", epoch, ll, auc, acc, n,
         now_s() - t0);
  fflush(stdout);
  ps_metric(m->ctx, "test_auc", auc);
  ps_metric(m->ctx, "test_logloss", ll);
  return 0;
}

int main(int argc, char **argv) {
  opts o = {.epochs = 1, .batch = 1000, .opt = "ftrl", .lr = -1, .l1 = 0.003, .l2 = 0.001, .beta = 0.001,
            .slow_worker = -1, .slow_factor = 1, .eval_rows = 10000, .prefetch = 1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--quiet")) {
      o.quiet = 1;
      continue;
    }
    if (!strcmp(a, "--no-prefetch")) {
      o.prefetch = 0;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "ctr_worker: option %s needs a value\n", a);
      usage(stderr);
      return 2;
    }
    const char *v = argv[++i];
    char *end = NULL;
    if (!strcmp(a, "--data")) o.data = v;
    else if (!strcmp(a, "--test")) o.test = v;
    else if (!strcmp(a, "--opt")) o.opt = v;
    else if (!strcmp(a, "--table-opts")) o.table_opts = v;
    else if (!strcmp(a, "--id-bits")) {
      long b = strtol(v, &end, 10);
      if (b < 1 || b > 64) {
        fprintf(stderr, "ctr_worker: --id-bits takes 1 to 64, not '%s'\n", v);
        return 2;
      }
      g_id_bits = (unsigned)b;
    }
    else if (!strcmp(a, "--epochs")) o.epochs = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--batch")) o.batch = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--parts")) o.parts = strtol(v, &end, 10);
    else if (!strcmp(a, "--shuffle")) {
      o.shuffle = 1;
      o.shuffle_seed = strtoull(v, &end, 10);
    } else if (!strcmp(a, "--lr")) o.lr = strtod(v, &end);
    else if (!strcmp(a, "--l1")) o.l1 = strtod(v, &end);
    else if (!strcmp(a, "--l2")) o.l2 = strtod(v, &end);
    else if (!strcmp(a, "--beta")) o.beta = strtod(v, &end);
    else if (!strcmp(a, "--slow-worker")) o.slow_worker = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--slow-factor")) o.slow_factor = strtod(v, &end);
    else if (!strcmp(a, "--eval-every")) o.eval_every = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--eval-rows")) o.eval_rows = (size_t)strtoull(v, &end, 10);
    else if (!strcmp(a, "--predict")) o.predict = v;
    else if (!strcmp(a, "--out")) o.out = v;
    else if (!strcmp(a, "--save")) o.save = v;
    else if (!strcmp(a, "--load")) o.load = v;
    else {
      fprintf(stderr, "ctr_worker: unknown option %s\n", a);
      usage(stderr);
      return 2;
    }
    if ((end && *end) || (end && end == v)) {
      fprintf(stderr, "ctr_worker: bad value '%s' for %s\n", v, a);
      return 2;
    }
  }
  if (!o.data || o.epochs < 0 || o.batch < 1 || (strcmp(o.opt, "ftrl") && strcmp(o.opt, "adagrad")) ||
      o.slow_factor < 1 || o.eval_every < 0) {
    fprintf(stderr, "ctr_worker: need --data, epochs >= 0, batch >= 1, --opt ftrl or adagrad\n");
    usage(stderr);
    return 2;
  }
  if (o.parts < 0 || o.parts > (1l << 20)) {
    fprintf(stderr, "ctr_worker: --parts must be in 1 .. 1048576 (0: the default)\n");
    return 2;
  }
  if (o.epochs == 0 && !o.load) {
    fprintf(stderr, "ctr_worker: --epochs 0 only evaluates a loaded model: it needs --load DIR\n");
    return 2;
  }
  if ((o.save && !*o.save) || (o.load && !*o.load)) {
    fprintf(stderr, "ctr_worker: --save and --load need a directory\n");
    return 2;
  }
  if (!o.predict != !o.out || (o.predict && (!*o.predict || !*o.out))) {
    fprintf(stderr, "ctr_worker: --predict FILE and --out FILE go together\n");
    return 2;
  }
  if (o.lr < 0) o.lr = 0.1;
  if (o.predict && !is_regular(o.predict)) {
    fprintf(stderr, "ctr_worker: --predict %s: %s\n", o.predict,
            access(o.predict, F_OK) ? strerror(errno) : "not a file");
    return 2;
  }
  int data_is_dir;
  size_t nfiles;
  char **files = data_files(o.data, &data_is_dir, &nfiles);
  char **tests = NULL;
  size_t ntests = 0;
  if (!o.test) {
    if (data_is_dir) tests = dir_files(o.data, "test", &ntests);
    if (!ntests) {
      fprintf(stderr, "ctr_worker: no test set: give --test FILE%s\n",
              data_is_dir ? " (or put a test* file beside the train* files)" : "");
      free_names(files, nfiles);
      return 2;
    }
    o.test = tests[0];
  } else if (!is_regular(o.test)) {
    fprintf(stderr, "ctr_worker: --test %s: %s\n", o.test, access(o.test, F_OK) ? strerror(errno) : "not a file");
    free_names(files, nfiles);
    return 2;
  }

  model m;
  memset(&m, 0, sizeof m);
  PS_CHECK("connect", ps_ctx_open_env(&m.ctx));
  int rank = ps_ctx_rank(m.ctx), nworkers = ps_ctx_num_workers(m.ctx);
  uint64_t target = o.parts ? (uint64_t)o.parts : 4 * (uint64_t)(nworkers > 0 ? nworkers : 1);
  if (target < nfiles) target = nfiles;
  size_t nparts;
  uint64_t data_bytes;
  source *parts = plan_partitions(files, nfiles, target, &nparts, &data_bytes);
  if (rank == 0 && o.epochs > 0) {
    printf("data: %zu file%s (%.1f MB), %zu partition%s for %d worker%s; test set %s\n", nfiles,
           nfiles == 1 ? "" : "s", (double)data_bytes / 1e6, nparts, nparts == 1 ? "" : "s", nworkers,
           nworkers == 1 ? "" : "s", o.test);
    fflush(stdout);
    if (nparts < (size_t)nworkers)
      fprintf(stderr,
              "ctr_worker: warning: %zu partition%s for %d workers: %zu worker%s will have nothing to train on "
              "(raise --parts; a binary or .gz file is one partition)\n",
              nparts, nparts == 1 ? "" : "s", nworkers, (size_t)nworkers - nparts,
              (size_t)nworkers - nparts == 1 ? "" : "s");
  }
  const char *idx_env = getenv("PSHARD_WORKER_INDEX");
  int slow = o.slow_worker >= 0 && idx_env && atoi(idx_env) == o.slow_worker && o.slow_factor > 1;
  uint64_t steps = 0;
  char topts[256];
  if (!strcmp(o.opt, "ftrl"))
    snprintf(topts, sizeof topts, "opt=ftrl lr=%g l1=%g l2=%g beta=%g", o.lr, o.l1, o.l2, o.beta);
  else
    snprintf(topts, sizeof topts, "opt=adagrad lr=%g acc0=0.1", o.lr);
  if (o.table_opts && *o.table_opts) {
    size_t used = strlen(topts);
    if ((size_t)snprintf(topts + used, sizeof topts - used, " %s", o.table_opts) >= sizeof topts - used) {
      fprintf(stderr, "ctr_worker: --table-opts too long\n");
      return 2;
    }
  }
  int64_t start_clock = ps_ctx_clock(m.ctx);
  if (o.load) {
    /* The servers hold the saved tables only if the job was restored from DIR. */
    int64_t want, have = start_clock;
    if (saved_clock(o.load, &want)) return 1;
    if (want >= 0 ? have != want : have <= 0) {
      fprintf(stderr,
              "ctr_worker: --load %s: this job did not start from that checkpoint (its clock is %lld, the job's "
              "%lld): run it as `pshard run --restore %s ...`\n",
              o.load, (long long)want, (long long)have, o.load);
      return 1;
    }
  }
  PS_CHECK("declare table", ps_table_declare(m.ctx, "ctr_weights", PS_SPARSE, 1, topts, &m.table));
  double t0 = now_s();
  if (o.load && rank == 0) {
    double ll, auc, acc;
    size_t n;
    if (evaluate(&m, o.test, 10000, 0, &ll, &auc, &acc, &n)) return 1;
    printf("loaded model: test logloss %.4f  auc %.4f  accuracy %.4f  (%zu examples, %.1f s)\n", ll, auc, acc, n,
           now_s() - t0);
    fflush(stdout);
  }
  uint32_t prog_table = 0;
  if (o.epochs > 0) {
    char pname[64];
    snprintf(pname, sizeof pname, "ctr_progress@%lld", (long long)start_clock);
    PS_CHECK("declare progress table", ps_table_declare(m.ctx, pname, PS_SPARSE, 2, "opt=sgd lr=1 update=sum",
                                                        &prog_table));
    PS_CHECK("declare tasks", ps_tasks_init(m.ctx, (uint32_t)nparts, (uint32_t)o.epochs));
  }

  ctr_batch b, tmp;
  ctr_batch_init(&b);
  ctr_batch_init(&tmp);
  pipeline pl;
  memset(&pl, 0, sizeof pl);
  ctr_batch_init(&pl.b[0]);
  ctr_batch_init(&pl.b[1]);
  part_reader pr;
  memset(&pr, 0, sizeof pr);
  float *pbuf = NULL;
  size_t pcap = 0;
  double last_report = t0, loss_acc = 0;
  double eval_s = 0; /* rank 0: seconds spent evaluating (train_t in the eval lines leaves them out) */
  uint64_t examples = 0, ex_since = 0, loss_n = 0;
  int evaluated = 0; /* epochs evaluated: rank 0's own count; others', as last read */
  float prog[2] = {0, 0};
  while (o.epochs > 0) {
    ps_task task;
    int rc = ps_task_next(m.ctx, &task, 0);
    if (rc && rc != PS_ERR_DONE && rc != PS_ERR_TIMEOUT) die_ps("next task", rc);
    /* Epochs before `gate` must be evaluated before this worker goes on: all of them
     * for the next partition's epoch, or every epoch once the tasks are done. */
    int gate = rc == PS_ERR_DONE ? o.epochs : rc == PS_ERR_TIMEOUT ? evaluated : (int)task.epoch;
    if (rc == PS_ERR_DONE && rank != 0) break;
    for (;;) {
      if (rank == 0) {
        /* Evaluate every epoch whose partitions the counters (as of a finished round)
         * show done; nobody trains on the next epoch meanwhile. */
        while (evaluated < o.epochs && prog[PROG_DONE] >= (float)nparts * (float)(evaluated + 1)) {
          double te = now_s();
          if (epoch_line(&m, &o, evaluated + 1, t0, examples, steps, te - t0 - eval_s)) return 1;
          eval_s += now_s() - te;
          evaluated++;
          progress_add(&m, prog_table, PROG_EVALUATED);
        }
      } else if ((int)prog[PROG_EVALUATED] > evaluated) {
        evaluated = (int)prog[PROG_EVALUATED];
      }
      if (evaluated >= gate && rc != PS_ERR_TIMEOUT) break;
      idle_step(&m, prog_table, prog);
      if (rc == PS_ERR_TIMEOUT) break;
    }
    if (rc == PS_ERR_DONE) break;
    if (rc == PS_ERR_TIMEOUT) continue;
    if (part_open(&pr, &parts[task.partition], &o, task.partition, task.epoch, &tmp)) return 1;
    if (o.prefetch && pipe_open(&m, &pl, &pr, (size_t)o.batch)) return 1;
    for (;;) {
      const ctr_batch *bp;
      double ts = now_s(), loss;
      if (o.prefetch) {
        if (pl.b[pl.cur].rows == 0) break;
        if (pipe_step(&m, &pl, &pr, (size_t)o.batch, &pbuf, &pcap, &loss)) return 1;
        bp = &pl.b[pl.cur ^ 1];
      } else {
        if (part_next(&pr, (size_t)o.batch, &b)) return 1;
        if (b.rows == 0) break;
        loss = train_step(&m, &b, &pbuf, &pcap);
        bp = &b;
      }
      loss_acc += loss;
      steps++;
      if (slow) usleep((useconds_t)((now_s() - ts) * (o.slow_factor - 1) * 1e6));
      if (rank == 0 && o.eval_every && steps % (uint64_t)o.eval_every == 0) {
        double ll, auc, acc, te = now_s(), train_t = te - t0 - eval_s;
        size_t n;
        if (evaluate(&m, o.test, 10000, o.eval_rows, &ll, &auc, &acc, &n)) return 1;
        eval_s += now_s() - te;
        printf("eval t=%.3f examples=%llu logloss=%.5f auc=%.5f steps=%llu train_t=%.3f\n", now_s() - t0,
               (unsigned long long)examples, ll, auc, (unsigned long long)steps, train_t);
        fflush(stdout);
      }
      loss_n++;
      examples += bp->rows;
      ex_since += bp->rows;
      double t = now_s();
      if (t - last_report >= 0.5) {
        ps_metric(m.ctx, "loss", loss_acc / (double)loss_n);
        ps_metric(m.ctx, "examples_per_s", (double)ex_since / (t - last_report));
        loss_acc = 0;
        loss_n = 0;
        ex_since = 0;
        last_report = t;
      }
    }
    part_close(&pr);
    PS_CHECK("task done", ps_task_done(m.ctx, &task));
    /* The count goes in a round of its own, closed even if this was the last task. */
    progress_add(&m, prog_table, PROG_DONE);
    PS_CHECK("clock", ps_clock(m.ctx));
  }
  double dt = now_s() - t0;
  if (o.epochs > 0 && (!o.quiet || rank == 0))
    printf("trained on %llu examples in %.1f s (%.0f examples/s)\n", (unsigned long long)examples, dt,
           (double)examples / dt);
  if (o.epochs > 0 && (!o.quiet || rank == 0)) {
    double pw = 0, uw = 0, cs = 0;
    ps_ctx_stat(m.ctx, "pull_wait_s", &pw);
    ps_ctx_stat(m.ctx, "push_wait_s", &uw);
    ps_ctx_stat(m.ctx, "compute_s", &cs);
    printf("waits: pull %.3f s  push %.3f s  compute %.3f s  training %.3f s  (prefetch %s)\n", pw, uw, cs, dt,
           o.prefetch ? "on" : "off");
    /* Payload bytes as sent: pushes count their values encoded (the push codec's
     * counters), pulls count what arrived. */
    double pushed = 0, pulled = 0, praw = 0, pwire = 0;
    ps_ctx_stat(m.ctx, "bytes_pushed", &pushed);
    ps_ctx_stat(m.ctx, "bytes_pulled", &pulled);
    ps_ctx_stat(m.ctx, "push_raw_bytes", &praw);
    ps_ctx_stat(m.ctx, "push_wire_bytes", &pwire);
    printf("traffic: steps %llu  pushed %.0f B  pulled %.0f B  (payload as sent, this worker)\n",
           (unsigned long long)steps, pushed - praw + pwire, pulled);
  }
  if (o.save && rank == 0) {
    /* The whole job's tables, cut at this clock: every worker's pushes are in it. A
     * server holding 10^8 rows or more writes for minutes; the scheduler fails the
     * checkpoint when a server stops getting on with its file (--checkpoint-timeout-ms),
     * so this deadline only bounds a write that goes on for more than an hour. */
    uint64_t id;
    PS_CHECK("save", ps_checkpoint_to(m.ctx, o.save, &id, 3600000));
    printf("saved the model: checkpoint %llu in %s (clock %lld)\n", (unsigned long long)id, o.save,
           (long long)ps_ctx_clock(m.ctx));
    fflush(stdout);
  }
  if (rank == 0 && o.epochs > 0 && data_is_dir) {
    double pll, pauc;
    if (!meta_value(o.data, "planted_test_logloss", &pll) && !meta_value(o.data, "planted_test_auc", &pauc))
      printf("planted model (the best achievable): test logloss %.4f  auc %.4f\n", pll, pauc);
  }
  if (rank == 0 && o.predict && predict_file(&m, o.predict, o.out, 10000)) return 1;
  ctr_batch_free(&b);
  ctr_batch_free(&tmp);
  pipe_free(&pl);
  ctr_batch_free(&pr.pool);
  free(pr.perm);
  free(pbuf);
  free(parts);
  free_names(files, nfiles);
  free_names(tests, ntests);
  ps_ctx_close(m.ctx);
  model_free(&m);
  return 0;
}
