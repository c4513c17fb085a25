/*
 * ckpt_int.h - what the checkpoint writer (ckpt.c) and reader (ckpt_read.c) share: the
 * format's constants and the rules both keep.
 */
#ifndef PS_CKPT_INT_H
#define PS_CKPT_INT_H

#include "store/ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH64_state_t on the stack */
#include <xxhash.h>

#include "common/common.h"
#include "common/ring.h"
#include "proto/spec.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint rows are written and read in place as little-endian floats"
#endif

#define HEADER_LEN 56           /* a HEADER payload (format 2) */
#define HEADER_LEN_V1 48        /* format 1: no base */
#define HEADER_MIN 8            /* file magic and format: the part every version keeps */
#define HEADER_MAX 4096         /* what a reader accepts before looking at the format */
#define END_LEN 16
#define TABLE_FIXED 48          /* a TABLE payload without its two strings */
#define TABLE_MAX (TABLE_FIXED + 8 + PS_NAME_MAX + PS_OPTS_MAX)
#define FILE_MAX (4 + 64 + 4 + 8 + 8 + 8)
#define FILE_NAME_MAX 64
#define MAX_STATE_BLOCKS 3      /* parameters + adam's or ftrl's two blocks */
#define MAX_WIDTH (1u << 20)    /* proto/spec.c's widest row */


static inline void frame_put(uint8_t *p, int kind, uint64_t len) {
  ps__put_u32(p, PS_CKPT_BLOCK_MAGIC);
  ps__put_u16(p + 4, (uint16_t)kind);
  ps__put_u16(p + 6, 0);
  ps__put_u64(p + 8, len);
}

/* The slices of a dense table, or 0 for a sparse one. */
static inline uint64_t dense_slices(int kind, uint64_t size, uint32_t width) {
  return kind == PS_DENSE && width ? (size + width - 1) / width : 0;
}

/* The position a row is sorted and skipped by: its slice, or its ring position. */
static inline uint64_t row_pos(int kind, uint32_t table, uint64_t key) {
  return kind == PS_DENSE ? key : ps__ring_key_hash(table, key);
}

/* A data file's name in a manifest: a plain name in this directory. */
static inline int name_ok(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n >= FILE_NAME_MAX || s[0] == '.') return 0;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
          c == '_'))
      return 0;
  }
  return 1;
}

/* The rules a TABLE block obeys, for the writer and the reader; NULL when it does. */
static inline const char *table_problem(const ps__ckpt_table *t, int what) {
  const ps__declare *d = &t->decl;
  if (d->kind != PS_DENSE && d->kind != PS_SPARSE) return "kind is neither dense nor sparse";
  if (d->size == 0) return "size 0";
  if (!d->name[0]) return "empty name";
  if (t->width == 0 || t->width > MAX_WIDTH) return "width out of range";
  if (d->kind == PS_SPARSE && t->width != d->size) return "a sparse table's width is not its dim";
  if (d->kind == PS_DENSE && t->width > d->size) return "slice width larger than the table";
  if (t->row_floats % t->width != 0 || t->row_floats / t->width < 1 || t->row_floats / t->width > MAX_STATE_BLOCKS)
    return "row_floats is not 1 to 3 times the width";
  uint64_t slices = dense_slices(d->kind, d->size, t->width);
  if (d->kind == PS_DENSE && t->nrows > slices) return "more rows than the table has slices";
  if (d->kind == PS_DENSE && what == PS_CKPT_MANIFEST && t->nrows != slices)
    return "a dense table's rows in all files are not its slices";
  return NULL;
}

/* ---------------------------------------------------------------- writing */

#endif /* PS_CKPT_INT_H */
