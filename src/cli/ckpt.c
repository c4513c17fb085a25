/*
 * ckpt.c - `pshard checkpoint`: `inspect DIR` verifies and describes a checkpoint on
 * disk; `HOST:PORT` asks a running job to write one (ps_cli_checkpoint_trigger).
 *
 * inspect reads every block of the manifest and of every data file it lists with the
 * checkpoint reader (store/ckpt.h), so every checksum is verified, and checks what
 * only the whole checkpoint shows: each data file is the one the manifest describes
 * (size, END checksum, rows, id, rank, base), its tables are the manifest's, the rows of
 * each table add up, and every table's options still parse to the row layout stored.
 * A checkpoint that is an increment is inspected with its chain (ps__ckpt_chain): every
 * checkpoint it builds on is verified the same way, newest first, their declarations
 * must be the newest's, and a last section gives each checkpoint's bytes and rows and
 * the chain's total. It prints the tables, the files and each block with its status,
 * and exits 0 when all of it verifies, 1 otherwise (2 for a usage error).
 */
#include <dirent.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cli/cli.h"
#include "common/common.h"
#include "proto/spec.h"
#include "store/ckpt.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: pshard checkpoint inspect [--summary] DIR\n"
          "       pshard checkpoint HOST:PORT\n\n"
          "inspect: verify every checksum of a checkpoint and describe it (tables, kinds,\n"
          "shapes, rows, optimiser, clock, id, files and blocks). DIR is a checkpoint\n"
          "directory (with a MANIFEST) or a directory of checkpoints (the newest complete\n"
          "one is inspected). An increment is verified with the checkpoints it builds on\n"
          "(its chain). Exit status 0 when everything verifies, 1 otherwise.\n"
          "  --summary   leave out the line per block; the chain on one line\n\n"
          "HOST:PORT: ask the scheduler of a running job to write a checkpoint.\n");
}

/* ---------------------------------------------------------------- inspect */

static const char *const opt_names[] = {"sgd", "momentum", "adagrad", "adam", "ftrl"};

typedef struct tinfo {
  ps__ckpt_table t;     /* as the manifest has it */
  uint64_t rows;        /* found in the data files */
} tinfo;

typedef struct inspect {
  char dir[4096];
  int summary;
  int failures;
  ps__ckpt_header h;    /* the manifest's */
  tinfo *tables;
  size_t ntables;
  ps__ckpt_file *files;
  size_t nfiles;
  size_t state_len;
  char merr[512];       /* why the manifest failed */
  int unread;           /* data files not read to their END: row totals unknown */
  uint64_t bytes, rows; /* of its files (the manifest included) and its data files */
} inspect;

/* Block 0, read when the file was opened. */
static void header_block_line(const inspect *in, const ps__ckpt_reader *r, const ps__ckpt_header *h) {
  if (in->summary) return;
  uint64_t len, sum;
  ps__ckpt_reader_header_block(r, &len, &sum);
  printf("    block %-4u %-6s offset %-10u length %-9" PRIu64 " checksum %016" PRIx64 " ok  format %d, ", 0, "HEADER", 0,
         len, sum, PS_CKPT_FORMAT);
  if (h->what == PS_CKPT_MANIFEST) printf("manifest\n");
  else printf("data of rank %u\n", h->rank);
}

static void block_line(const inspect *in, const ps__ckpt_block *b) {
  if (in->summary) return;
  printf("    block %-4u %-6s offset %-10" PRIu64 " length %-9" PRIu64 " checksum %016" PRIx64 " %s", b->index,
         ps__ckpt_kind_name(b->kind), b->offset, b->payload_len, b->checksum,
         b->kind == PS_CKPT_B_ROWS && !b->n ? "skipped" : "ok");
  if (b->kind == PS_CKPT_B_TABLE) printf("  table %u '%s'", b->table.decl.id, b->table.decl.name);
  if (b->kind == PS_CKPT_B_ROWS)
    printf("  table %u, %u rows, positions %" PRIu64 "..%" PRIu64, b->table_id, b->n, b->pos_lo, b->pos_hi);
  if (b->kind == PS_CKPT_B_FILE) printf("  %s (rank %u)", b->file.name, b->file.rank);
  if (b->kind == PS_CKPT_B_STATE) printf("  %zu bytes", b->state_len);
  printf("\n");
}

__attribute__((format(printf, 2, 3))) static void problem(inspect *in, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("    FAILED: ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  in->failures++;
}

static void header_line(const ps__ckpt_header *h, const char *path, const char *err) {
  if (!h) {
    printf("checkpoint %s\n  FAILED: %s\n", path, err);
    return;
  }
  char when[64] = "?";
  time_t secs = (time_t)(h->created_ms / 1000);
  struct tm tm;
  if (gmtime_r(&secs, &tm)) strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  printf("checkpoint %s\n  id %" PRIu64 ", clock %" PRId64 ", %u server%s, written %s\n", path, h->id, h->clock,
         h->nservers, h->nservers == 1 ? "" : "s", when);
}

static int grow_array(void **p, size_t n, size_t size) {
  if (n & (n - 1)) return 0; /* grows at powers of two */
  void *q = realloc(*p, (n ? 2 * n : 1) * size);
  if (!q) return -1;
  *p = q;
  return 0;
}

/* The manifest, every block verified: collect its tables, files and state (quietly), or
 * print its blocks (a second pass, once the tables are printed). */
static int read_manifest(inspect *in, const char *path, int collect) {
  ps__ckpt_reader *r;
  ps__ckpt_block b;
  if (!collect) printf("  MANIFEST\n");
  if (ps__ckpt_reader_open(&r, path, &in->h)) {
    if (collect) snprintf(in->merr, sizeof in->merr, "%s", ps_errmsg());
    return -1;
  }
  int rc = 0;
  if (!collect) header_block_line(in, r, &in->h);
  for (;;) {
    if (ps__ckpt_next(r, &b, NULL, NULL)) {
      if (collect) snprintf(in->merr, sizeof in->merr, "%s", ps_errmsg());
      rc = -1;
      break;
    }
    if (!collect) block_line(in, &b);
    if (b.kind == PS_CKPT_B_END) break;
    if (!collect) continue;
    if (b.kind == PS_CKPT_B_TABLE) {
      if (grow_array((void **)&in->tables, in->ntables, sizeof *in->tables)) {
        problem(in, "out of memory");
        rc = -1;
        break;
      }
      in->tables[in->ntables++] = (tinfo){.t = b.table, .rows = 0};
    } else if (b.kind == PS_CKPT_B_FILE) {
      if (grow_array((void **)&in->files, in->nfiles, sizeof *in->files)) {
        problem(in, "out of memory");
        rc = -1;
        break;
      }
      in->files[in->nfiles++] = b.file;
    } else if (b.kind == PS_CKPT_B_STATE) {
      in->state_len = b.state_len;
    }
  }
  ps__ckpt_reader_close(r);
  if (!rc && !collect)
    printf("    verified: %zu tables, %zu data files, scheduler state of %zu bytes\n", in->ntables, in->nfiles,
           in->state_len);
  return rc;
}

static tinfo *table_by_id(inspect *in, uint32_t id) {
  for (size_t i = 0; i < in->ntables; i++)
    if (in->tables[i].t.decl.id == id) return &in->tables[i];
  return NULL;
}

static int same_table(const ps__ckpt_table *a, const ps__ckpt_table *b) {
  return a->decl.kind == b->decl.kind && a->decl.size == b->decl.size && !strcmp(a->decl.name, b->decl.name) &&
         !strcmp(a->decl.options, b->decl.options) && a->width == b->width && a->row_floats == b->row_floats;
}

/* One data file, against its FILE entry in the manifest. */
static void read_data(inspect *in, const ps__ckpt_file *f) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", in->dir, f->name);
  printf("  %s (rank %u, %" PRIu64 " bytes, %" PRIu64 " rows)\n", f->name, f->rank, f->bytes, f->rows);
  ps__ckpt_reader *r;
  ps__ckpt_header h;
  ps__ckpt_block b;
  if (ps__ckpt_reader_open(&r, path, &h)) {
    problem(in, "%s", ps_errmsg());
    in->unread++;
    return;
  }
  int before = in->failures;
  header_block_line(in, r, &h);
  if (h.what != PS_CKPT_DATA) problem(in, "a manifest, not a data file");
  if (h.id != in->h.id) problem(in, "checkpoint id %" PRIu64 ", the manifest's is %" PRIu64, h.id, in->h.id);
  if (h.rank != f->rank) problem(in, "rank %u, the manifest says %u", h.rank, f->rank);
  if (h.nservers != in->h.nservers) problem(in, "written by %u servers, the manifest says %u", h.nservers, in->h.nservers);
  if (h.clock != in->h.clock) problem(in, "clock %" PRId64 ", the manifest's is %" PRId64, h.clock, in->h.clock);
  /* A whole file may stand in an increment (its server could not build on the base). */
  if (h.base && h.base != in->h.base)
    problem(in, "an increment on checkpoint %" PRIu64 ", the manifest's base is %" PRIu64, h.base, in->h.base);
  uint64_t rows = 0;
  for (;;) {
    if (ps__ckpt_next(r, &b, NULL, NULL)) {
      problem(in, "%s", ps_errmsg());
      in->unread++;
      break;
    }
    block_line(in, &b);
    if (b.kind == PS_CKPT_B_TABLE) {
      tinfo *t = table_by_id(in, b.table.decl.id);
      if (!t) problem(in, "table %u '%s' is not in the manifest", b.table.decl.id, b.table.decl.name);
      else if (!same_table(&t->t, &b.table))
        problem(in, "table %u '%s' differs from the manifest's declaration", b.table.decl.id, b.table.decl.name);
    } else if (b.kind == PS_CKPT_B_ROWS) {
      tinfo *t = table_by_id(in, b.table_id);
      if (t) t->rows += b.n;
      rows += b.n;
    } else if (b.kind == PS_CKPT_B_END) {
      if (b.end_bytes != f->bytes)
        problem(in, "%" PRIu64 " bytes, the manifest says %" PRIu64, b.end_bytes, f->bytes);
      if (b.end_checksum != f->checksum)
        problem(in, "checksum %016" PRIx64 ", the manifest says %016" PRIx64, b.end_checksum, f->checksum);
      if (rows != f->rows) problem(in, "%" PRIu64 " rows, the manifest says %" PRIu64, rows, f->rows);
      in->bytes += b.end_bytes;
      in->rows += rows;
      if (in->failures == before) printf("    verified\n");
      break;
    }
  }
  ps__ckpt_reader_close(r);
}

static void print_tables(inspect *in) {
  printf("tables:\n");
  if (!in->ntables) printf("  (none)\n");
  for (size_t i = 0; i < in->ntables; i++) {
    const ps__ckpt_table *t = &in->tables[i].t;
    char shape[96], opt[64];
    if (t->decl.kind == PS_DENSE)
      snprintf(shape, sizeof shape, "%" PRIu64 " floats, slices of %u", t->decl.size, t->width);
    else snprintf(shape, sizeof shape, "rows of dim %" PRIu64, t->decl.size);
    ps__table_spec spec;
    char err[160];
    unsigned nstate = t->row_floats / t->width - 1;
    if (ps__table_spec_parse(&spec, t->decl.name, t->decl.kind, t->decl.size, t->decl.options, err, sizeof err)) {
      snprintf(opt, sizeof opt, "?");
    } else {
      snprintf(opt, sizeof opt, "%s", opt_names[spec.opt.kind]);
      if (spec.width != t->width || ps__spec_row_floats(&spec) != t->row_floats)
        snprintf(err, sizeof err, "its options give rows of %u + %u floats, the checkpoint has %u + %u", spec.width,
                 (unsigned)ps__spec_row_floats(&spec) - spec.width, t->width, t->row_floats - t->width);
      else err[0] = '\0';
    }
    printf("  %-16s %-6s %-30s %-9s state %u x %u  rows %-10" PRIu64 " step %-8" PRIu64 " version %" PRId64
           "  [table %u, options '%s']\n",
           t->decl.name, t->decl.kind == PS_DENSE ? "dense" : "sparse", shape, opt, nstate, t->width, t->nrows,
           t->step, t->version, t->decl.id, t->decl.options);
    if (err[0]) problem(in, "table '%s': %s", t->decl.name, err);
  }
}

/* Files in the directory that the manifest does not list (leftovers; not a failure). */
static void extra_files(const inspect *in) {
  DIR *d = opendir(in->dir);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.' || !strcmp(e->d_name, "MANIFEST")) continue;
    int listed = 0;
    for (size_t i = 0; i < in->nfiles && !listed; i++) listed = !strcmp(in->files[i].name, e->d_name);
    if (!listed) printf("  %s: not in the manifest, ignored\n", e->d_name);
  }
  closedir(d);
}

static int cmp_file(const void *a, const void *b) {
  return (int)((const ps__ckpt_file *)a)->rank - (int)((const ps__ckpt_file *)b)->rank;
}

/* The manifest's count of a table against the rows found: a dense table's is its
 * slices, all in the files of a whole checkpoint, some in an increment's; a sparse
 * table's is the rows over the files, or 0 when the writer did not count them (pshard's
 * scheduler does not: its servers report rows per file). */
static int rows_match(const inspect *in, const tinfo *t) {
  if (t->t.decl.kind == PS_DENSE) return in->h.base ? t->rows <= t->t.nrows : t->rows == t->t.nrows;
  return t->t.nrows == 0 || t->rows == t->t.nrows;
}

/* One checkpoint of the chain: its manifest and data files. newest is NULL for the
 * checkpoint asked about (its tables and chain, n links oldest first, are printed),
 * else that checkpoint, whose declarations an older one must share. */
static void inspect_one(inspect *in, const inspect *newest, const ps__ckpt_link *chain, size_t n) {
  char manifest[4200];
  snprintf(manifest, sizeof manifest, "%s/MANIFEST", in->dir);
  if (read_manifest(in, manifest, 1) != 0) {
    header_line(NULL, in->dir, in->merr);
    in->failures++;
    return;
  }
  struct stat st;
  if (stat(manifest, &st) == 0) in->bytes = (uint64_t)st.st_size;
  header_line(&in->h, in->dir, NULL);
  if (newest) printf("  in the chain of checkpoint %" PRIu64 "\n", newest->h.id);
  if (in->h.base) {
    printf("  an increment on checkpoint %" PRIu64, in->h.base);
    if (!newest && n > 1) {
      printf("; chain:");
      for (size_t j = 0; j < n; j++) printf(" %" PRIu64, chain[j].id);
    }
    printf("\n");
  }
  if (!newest) print_tables(in);
  printf("files:\n");
  read_manifest(in, manifest, 0);
  qsort(in->files, in->nfiles, sizeof *in->files, cmp_file);
  for (size_t i = 0; i < in->nfiles; i++) read_data(in, &in->files[i]);
  extra_files(in);
  for (size_t i = 0; i < in->ntables && !in->unread; i++)
    if (!rows_match(in, &in->tables[i])) {
      printf("  table '%s':\n", in->tables[i].t.decl.name);
      problem(in, "%" PRIu64 " rows in the data files, the manifest says %" PRIu64 "%s", in->tables[i].rows,
              in->tables[i].t.nrows, in->h.base && in->tables[i].t.decl.kind == PS_DENSE ? " in all" : "");
    }
  for (size_t i = 0; newest && i < in->ntables; i++) {
    const ps__ckpt_table *t = &in->tables[i].t;
    for (size_t j = 0; j < newest->ntables; j++)
      if (newest->tables[j].t.decl.id == t->decl.id && !same_table(&newest->tables[j].t, t)) {
        printf("  table '%s':\n", t->decl.name);
        problem(in, "table %u '%s' is not the one checkpoint %" PRIu64 " declares", t->decl.id, t->decl.name,
                newest->h.id);
      }
  }
}

/* Each checkpoint of the chain (oldest first) with its bytes and rows, and the total:
 * a line each, or one line with --summary. */
static void chain_report(const inspect *v, size_t n, int summary) {
  uint64_t bytes = 0, rows = 0;
  printf(summary ? "chain:" : "chain (oldest first):\n");
  for (size_t i = n; i-- > 0;) {
    const inspect *c = &v[i];
    const char *what = c->h.base ? "increment" : "whole";
    if (summary)
      printf(" %" PRIu64 " (%s, %" PRIu64 " bytes, %" PRIu64 " rows)%s", c->h.id, what, c->bytes, c->rows,
             i ? "," : ";");
    else
      printf("  checkpoint %-8" PRIu64 " %-9s clock %-8" PRId64 " %" PRIu64 " bytes, %" PRIu64 " rows\n", c->h.id,
             what, c->h.clock, c->bytes, c->rows);
    bytes += c->bytes;
    rows += c->rows;
  }
  if (summary) printf(" total %zu checkpoints, %" PRIu64 " bytes, %" PRIu64 " rows\n", n, bytes, rows);
  else printf("  total: %zu checkpoints, %" PRIu64 " bytes, %" PRIu64 " rows\n", n, bytes, rows);
}

static int inspect_dir(const char *arg, int summary) {
  char dir[4096], manifest[4200];
  struct stat st;
  snprintf(manifest, sizeof manifest, "%s/MANIFEST", arg);
  if (stat(arg, &st) != 0 || !S_ISDIR(st.st_mode)) {
    fprintf(stderr, "pshard: %s is not a directory\n", arg);
    return 1;
  }
  if (stat(manifest, &st) == 0) {
    snprintf(dir, sizeof dir, "%s", arg);
  } else {
    uint64_t id;
    if (ps__ckpt_latest(arg, &id, dir, sizeof dir)) {
      fprintf(stderr, "pshard: %s has no MANIFEST, and %s\n", arg, ps_errmsg());
      return 1;
    }
  }
  /* The chain, newest first: the checkpoint asked about, then its bases. A chain that
   * cannot be followed is a failure; the checkpoint itself is still inspected. */
  size_t dlen = strlen(dir);
  while (dlen > 1 && dir[dlen - 1] == '/') dir[--dlen] = '\0'; /* its bases are beside it */
  ps__ckpt_link *links = NULL;
  size_t n = 0;
  char cerr[600] = "";
  if (ps__ckpt_chain(dir, &links, &n)) {
    snprintf(cerr, sizeof cerr, "%s", ps_errmsg());
    n = 0;
  }
  size_t count = n ? n : 1;
  inspect *v = calloc(count, sizeof *v);
  if (!v) {
    free(links);
    fprintf(stderr, "pshard: out of memory\n");
    return 1;
  }
  int failures = 0;
  for (size_t i = 0; i < count; i++) {
    inspect *in = &v[i];
    in->summary = summary;
    snprintf(in->dir, sizeof in->dir, "%s", n ? links[n - 1 - i].dir : dir);
    inspect_one(in, i ? &v[0] : NULL, links, n);
    failures += in->failures;
  }
  if (cerr[0]) {
    printf("chain:\n    FAILED: %s\n", cerr);
    failures++;
  } else if (n > 1) {
    chain_report(v, n, summary);
  }
  if (failures) printf("result: FAILED (%d problem%s)\n", failures, failures == 1 ? "" : "s");
  else printf("result: verified\n");
  for (size_t i = 0; i < count; i++) {
    free(v[i].tables);
    free(v[i].files);
  }
  free(v);
  free(links);
  return failures ? 1 : 0;
}

static int ps_cli_checkpoint_inspect(int argc, char **argv) {
  int summary = 0;
  const char *dir = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      usage(stdout);
      return 0;
    } else if (!strcmp(argv[i], "--summary")) {
      summary = 1;
    } else if (argv[i][0] == '-' || dir) {
      fprintf(stderr, "pshard: checkpoint inspect: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    } else {
      dir = argv[i];
    }
  }
  if (!dir) {
    fprintf(stderr, "pshard: checkpoint inspect: no directory given\n");
    usage(stderr);
    return 2;
  }
  return inspect_dir(dir, summary);
}

/* ---------------------------------------------------------------- dispatch */

int ps_cli_checkpoint(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(argv[1], "inspect")) return ps_cli_checkpoint_inspect(argc - 1, argv + 1);
  return ps_cli_checkpoint_trigger(argc, argv);
}
