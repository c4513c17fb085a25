/*
 * ctr_data.c - libsvm text and binary click-log files, and evaluation metrics.
 *
 * The reader keeps one buffer per file: for text, a window of the file that always
 * holds at least one whole line (grown up to MAX_LINE); for binary, the current block,
 * verified against its checksum before any of it is decoded. All counts read from a
 * binary file are bounded, and checked against the bytes left in the file, before
 * anything is allocated for them. Integers in binary files are little-endian and
 * encoded with explicit put/get helpers.
 *
 * A gzip- or zstd-compressed file (recognised by its magic bytes, whatever its name) is
 * read through zlib or libzstd and holds either format; a zstd file may hold several
 * frames (as `zstd` and `cat a.zst b.zst` write them) and must end with a whole one. An uncompressed text file can also be read by
 * byte range: the range [begin, end) holds the lines whose first byte lies in it, so
 * ranges that tile a file read each line exactly once, however long the lines are.
 */
#include "ctr_data.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#include <zlib.h>
#include <zstd.h>

#define TEXT_CHUNK (1u << 20)     /* read size and initial text buffer */
#define MAX_LINE (64u << 20)      /* longest accepted text line */
#define MAX_ROW_NNZ 0x7fffffffull /* most features in one example */

#define BIN_MAGIC "CTRB"
#define BIN_VERSION 1u
#define BIN_HDR 24u /* magic, version, flags, header size, xxh64 */
#define BLK_HDR 40u /* tag, flags, rows, reserved, nnz, payload bytes, xxh64 */
#define BLK_TAG_ROWS "ROWS"
#define BLK_TAG_END "CEND"
#define BLK_F_ONES 1u /* every value is 1: the value array is omitted */
#define BLK_WRITE_ROWS 65536u
#define BLK_WRITE_NNZ (1u << 21)
#define BLK_READ_ROWS (1u << 24)
#define BLK_READ_NNZ (1ull << 31)

/* ---------------------------------------------------------------- errors */

static _Thread_local char errbuf[1024];

const char *ctr_errmsg(void) { return errbuf; }

const char *ctr_strerror(int err) {
  switch (err) {
  case CTR_OK: return "success";
  case CTR_ERR_INVALID: return "invalid argument";
  case CTR_ERR_NOMEM: return "out of memory";
  case CTR_ERR_IO: return "i/o error";
  case CTR_ERR_PARSE: return "malformed line";
  case CTR_ERR_CORRUPT: return "corrupt file";
  default: return "unknown error";
  }
}

static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(errbuf, sizeof errbuf, fmt, ap);
  va_end(ap);
  return code;
}

const char *ctr_format_name(int format) {
  return format == CTR_FMT_LIBSVM ? "libsvm" : format == CTR_FMT_BIN ? "bin" : "?";
}

int ctr_format_parse(const char *s) {
  if (!s) return -1;
  if (!strcmp(s, "libsvm") || !strcmp(s, "txt") || !strcmp(s, "text"))
    return CTR_FMT_LIBSVM;
  if (!strcmp(s, "bin") || !strcmp(s, "binary")) return CTR_FMT_BIN;
  return -1;
}

/* Copy at most 40 bytes of s into dst for a message, '?' for unprintable bytes. */
static const char *quote(char *dst, size_t cap, const char *s, size_t n) {
  size_t lim = n > 40 ? 40 : n, j = 0;
  for (size_t i = 0; i < lim && j + 1 < cap; i++) {
    unsigned char c = (unsigned char)s[i];
    dst[j++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
  }
  if (n > lim && j + 4 < cap) {
    memcpy(dst + j, "...", 3);
    j += 3;
  }
  dst[j] = 0;
  return dst;
}

/* ---------------------------------------------------------------- little-endian helpers */

static inline void put_le32(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)v;
  p[1] = (unsigned char)(v >> 8);
  p[2] = (unsigned char)(v >> 16);
  p[3] = (unsigned char)(v >> 24);
}
static inline void put_le64(unsigned char *p, uint64_t v) {
  put_le32(p, (uint32_t)v);
  put_le32(p + 4, (uint32_t)(v >> 32));
}
static inline uint32_t get_le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}
static inline uint64_t get_le64(const unsigned char *p) {
  return (uint64_t)get_le32(p) | (uint64_t)get_le32(p + 4) << 32;
}
static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ---------------------------------------------------------------- i/o helpers */

static int write_full(int fd, const void *buf, size_t n) {
  size_t done = 0;
  while (done < n) {
    ssize_t k = write(fd, (const char *)buf + done, n - done);
    if (k < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    done += (size_t)k;
  }
  return 0;
}

static char *dupstr(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

/* ---------------------------------------------------------------- batches */

void ctr_batch_init(ctr_batch *b) { memset(b, 0, sizeof *b); }

void ctr_batch_free(ctr_batch *b) {
  if (!b) return;
  free(b->offsets);
  free(b->ids);
  free(b->vals);
  free(b->labels);
  ctr_batch_init(b);
}

static int batch_reserve_rows(ctr_batch *b, size_t rows) {
  if (rows <= b->cap_rows && b->offsets) return CTR_OK;
  size_t cap = b->cap_rows ? b->cap_rows : 256;
  while (cap < rows) cap *= 2;
  uint64_t *o = realloc(b->offsets, (cap + 1) * sizeof *o);
  if (!o) return fail(CTR_ERR_NOMEM, "out of memory for a batch of %zu rows", rows);
  b->offsets = o;
  float *l = realloc(b->labels, cap * sizeof *l);
  if (!l) return fail(CTR_ERR_NOMEM, "out of memory for a batch of %zu rows", rows);
  b->labels = l;
  b->cap_rows = cap;
  return CTR_OK;
}

static int batch_reserve_nnz(ctr_batch *b, size_t nnz) {
  if (nnz <= b->cap_nnz) return CTR_OK;
  size_t cap = b->cap_nnz ? b->cap_nnz : 4096;
  while (cap < nnz) cap *= 2;
  uint64_t *i = realloc(b->ids, cap * sizeof *i);
  if (!i) return fail(CTR_ERR_NOMEM, "out of memory for a batch of %zu features", nnz);
  b->ids = i;
  float *v = realloc(b->vals, cap * sizeof *v);
  if (!v) return fail(CTR_ERR_NOMEM, "out of memory for a batch of %zu features", nnz);
  b->vals = v;
  b->cap_nnz = cap;
  return CTR_OK;
}

static void batch_clear(ctr_batch *b) {
  b->rows = 0;
  b->nnz = 0;
  if (b->offsets) b->offsets[0] = 0;
}

/* ---------------------------------------------------------------- reader */

struct ctr_reader {
  char *path;
  int fd;         /* -1 once a gzip stream owns the descriptor */
  gzFile gz;      /* gzip-compressed file, else NULL */
  ZSTD_DStream *zs; /* zstd-compressed file (read from fd), else NULL */
  unsigned char *zin; /* compressed bytes read, zin[zin_pos .. zin_len) not yet decoded */
  size_t zin_cap, zin_pos, zin_len;
  int zeof;         /* the compressed file is at its end */
  int zwhole;       /* the last zstd frame decoded is complete */
  const char *zmsg; /* libzstd's message for the last error, else NULL */
  int format;
  int err;        /* sticky: once set, every call fails with it */
  char *errsave;  /* the message that goes with err */
  uint64_t rows;  /* examples returned */
  /* text */
  char *buf;
  size_t cap, beg, end;
  int eof;
  uint64_t line;
  uint64_t buf_off;  /* file offset of buf[0] */
  uint64_t line_at;  /* file offset of the line being parsed */
  uint64_t rbeg, rend; /* byte range: lines starting in [rbeg, rend) (0, UINT64_MAX) */
  int skip_first;    /* a range not at offset 0: drop the line it starts inside */
  /* binary */
  uint64_t size;   /* file size, UINT64_MAX if not a regular file */
  uint64_t pos;    /* bytes consumed */
  uint64_t block;  /* blocks loaded */
  unsigned char *blk;
  size_t blk_cap;
  uint32_t blk_rows, blk_next;
  int blk_ones;
  uint64_t blk_feat; /* next feature of the block */
  const unsigned char *p_ids, *p_vals, *p_lens, *p_labels;
  uint64_t seen_rows, seen_nnz;
  int done;
};

static ssize_t raw_read(int fd, void *buf, size_t n) {
  ssize_t k;
  do k = read(fd, buf, n);
  while (k < 0 && errno == EINTR);
  return k;
}

/* Decode zstd into buf: bytes out (> 0), 0 at the end of the last whole frame, or -1
 * with errno set (EIO with r->zmsg for a corrupt or truncated stream). */
static ssize_t zstd_read(ctr_reader *r, void *buf, size_t n) {
  ZSTD_outBuffer out = {buf, n, 0};
  while (out.pos == 0 && n > 0) {
    if (r->zin_pos == r->zin_len) {
      if (r->zeof) {
        if (r->zwhole) return 0;
        r->zmsg = "truncated zstd stream (the last frame is not complete)";
        errno = EIO;
        return -1;
      }
      ssize_t k = raw_read(r->fd, r->zin, r->zin_cap);
      if (k < 0) return -1;
      r->zin_pos = 0;
      r->zin_len = (size_t)k;
      r->zeof = k == 0;
      continue;
    }
    ZSTD_inBuffer in = {r->zin, r->zin_len, r->zin_pos};
    size_t ret = ZSTD_decompressStream(r->zs, &out, &in);
    r->zin_pos = in.pos;
    if (ZSTD_isError(ret)) {
      r->zmsg = ZSTD_getErrorName(ret);
      errno = EIO;
      return -1;
    }
    r->zwhole = ret == 0;
  }
  return (ssize_t)out.pos;
}

/* One read from the file (decompressing a gzip or zstd file): bytes read, 0 at end, or
 * -1 with errno set (EIO for a decompression error, whose text r_strerror gives). */
static ssize_t r_read(ctr_reader *r, void *buf, size_t n) {
  if (r->gz) {
    int k = gzread(r->gz, buf, (unsigned)(n > (1u << 30) ? (1u << 30) : n));
    if (k < 0) errno = EIO;
    return k;
  }
  if (r->zs) return zstd_read(r, buf, n);
  return raw_read(r->fd, buf, n);
}

static ssize_t r_read_full(ctr_reader *r, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = r_read(r, (char *)buf + got, n - got);
    if (k < 0) return -1;
    if (k == 0) break;
    got += (size_t)k;
  }
  return (ssize_t)got;
}

/* strerror, or zlib's or libzstd's message for a compressed stream. */
static const char *r_strerror(ctr_reader *r) {
  if (r->zs && r->zmsg) return r->zmsg;
  if (r->gz) {
    int zerr;
    const char *m = gzerror(r->gz, &zerr);
    if (zerr != Z_OK && zerr != Z_STREAM_END && m && *m) return m;
  }
  return strerror(errno);
}

/* The number in the file of the line being parsed: counted as it goes from byte 0, or
 * for a range starting later, by counting the newlines before it (on errors only). */
static uint64_t line_number(ctr_reader *r) {
  if (r->rbeg == 0) return r->line;
  char buf[65536];
  uint64_t n = 1, off = 0;
  while (off < r->line_at) {
    size_t want = r->line_at - off < sizeof buf ? (size_t)(r->line_at - off) : sizeof buf;
    ssize_t k = pread(r->fd, buf, want, (off_t)off);
    if (k <= 0) break;
    for (ssize_t i = 0; i < k; i++) n += buf[i] == '\n';
    off += (uint64_t)k;
  }
  return n;
}

/* Record a sticky error on r: the thread's message, saved for later calls. */
static int rfail(ctr_reader *r, int code) {
  r->err = code;
  free(r->errsave);
  r->errsave = dupstr(errbuf);
  return code;
}

#define PARSE_FAIL(r, ...)                                                     \
  do {                                                                         \
    char m_[512];                                                              \
    snprintf(m_, sizeof m_, __VA_ARGS__);                                      \
    fail(CTR_ERR_PARSE, "%s:%llu: %s", (r)->path, (unsigned long long)line_number(r), m_); \
    return rfail((r), CTR_ERR_PARSE);                                          \
  } while (0)

#define BIN_FAIL(r, at, ...)                                                   \
  do {                                                                         \
    char m_[512];                                                              \
    snprintf(m_, sizeof m_, __VA_ARGS__);                                      \
    fail(CTR_ERR_CORRUPT, "%s: block %llu at byte %llu: %s", (r)->path,        \
         (unsigned long long)(r)->block, (unsigned long long)(at), m_);        \
    return rfail((r), CTR_ERR_CORRUPT);                                        \
  } while (0)

static int check_bin_header(ctr_reader *r, const unsigned char *h) {
  if (XXH64(h, 16, 0) != get_le64(h + 16)) {
    fail(CTR_ERR_CORRUPT, "%s: binary file header checksum mismatch (file is corrupt)",
         r->path);
    return CTR_ERR_CORRUPT;
  }
  uint32_t ver = get_le32(h + 4);
  if (ver != BIN_VERSION) {
    fail(CTR_ERR_CORRUPT, "%s: unsupported binary format version %u (this reader knows %u)",
         r->path, ver, BIN_VERSION);
    return CTR_ERR_CORRUPT;
  }
  if (get_le32(h + 8) != 0 || get_le32(h + 12) != BIN_HDR) {
    fail(CTR_ERR_CORRUPT, "%s: unknown flags or header size in binary file header", r->path);
    return CTR_ERR_CORRUPT;
  }
  return CTR_OK;
}

int ctr_reader_open(const char *path, ctr_reader **out) {
  if (!path || !out) return fail(CTR_ERR_INVALID, "ctr_reader_open: NULL argument");
  *out = NULL;
  ctr_reader *r = calloc(1, sizeof *r);
  if (!r) return fail(CTR_ERR_NOMEM, "out of memory");
  r->fd = -1;
  r->path = dupstr(path);
  if (!r->path) {
    free(r);
    return fail(CTR_ERR_NOMEM, "out of memory");
  }
  int rc;
  r->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (r->fd < 0) {
    rc = fail(CTR_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    goto bad;
  }
  struct stat st;
  if (fstat(r->fd, &st) != 0) {
    rc = fail(CTR_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    goto bad;
  }
  if (S_ISDIR(st.st_mode)) {
    rc = fail(CTR_ERR_IO, "cannot read %s: is a directory", path);
    goto bad;
  }
  r->size = S_ISREG(st.st_mode) ? (uint64_t)st.st_size : UINT64_MAX;
  r->rend = UINT64_MAX;

  unsigned char h[BIN_HDR];
  ssize_t n = r_read_full(r, h, sizeof h);
  if (n < 0) {
    rc = fail(CTR_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    goto bad;
  }
  if (n >= 2 && h[0] == 0x1f && h[1] == 0x8b) {
    /* gzip: start again through zlib, which then owns the descriptor. */
    if (lseek(r->fd, 0, SEEK_SET) != 0) {
      rc = fail(CTR_ERR_IO, "cannot read %s: a gzip file must be seekable", path);
      goto bad;
    }
    r->gz = gzdopen(r->fd, "rb");
    if (!r->gz) {
      rc = fail(CTR_ERR_NOMEM, "out of memory");
      goto bad;
    }
    r->fd = -1;
    gzbuffer(r->gz, 1u << 17);
    r->size = UINT64_MAX;
    n = r_read_full(r, h, sizeof h);
    if (n < 0) {
      rc = fail(CTR_ERR_IO, "cannot read %s: %s", path, r_strerror(r));
      goto bad;
    }
  } else if (n >= 4 && h[0] == 0x28 && h[1] == 0xb5 && h[2] == 0x2f && h[3] == 0xfd) {
    /* zstd: the bytes read so far are the first input of the decoder, so a pipe works. */
    r->zs = ZSTD_createDStream();
    r->zin_cap = ZSTD_DStreamInSize();
    r->zin = r->zs ? malloc(r->zin_cap > sizeof h ? r->zin_cap : sizeof h) : NULL;
    if (!r->zin || ZSTD_isError(ZSTD_initDStream(r->zs))) {
      rc = fail(CTR_ERR_NOMEM, "out of memory");
      goto bad;
    }
    memcpy(r->zin, h, (size_t)n);
    r->zin_len = (size_t)n;
    r->size = UINT64_MAX;
    n = r_read_full(r, h, sizeof h);
    if (n < 0) {
      rc = fail(CTR_ERR_IO, "cannot read %s: %s", path, r_strerror(r));
      goto bad;
    }
  }
  r->pos = (uint64_t)n;
  if (n >= 4 && !memcmp(h, BIN_MAGIC, 4)) {
    r->format = CTR_FMT_BIN;
    if (n < (ssize_t)BIN_HDR) {
      rc = fail(CTR_ERR_CORRUPT, "%s: truncated binary file header (%zd of %u bytes)", path,
                n, BIN_HDR);
      goto bad;
    }
    if ((rc = check_bin_header(r, h)) != CTR_OK) goto bad;
  } else {
    r->format = CTR_FMT_LIBSVM;
    r->cap = TEXT_CHUNK;
    r->buf = malloc(r->cap);
    if (!r->buf) {
      rc = fail(CTR_ERR_NOMEM, "out of memory");
      goto bad;
    }
    memcpy(r->buf, h, (size_t)n);
    r->end = (size_t)n;
  }
  *out = r;
  return CTR_OK;
bad:
  ctr_reader_close(r);
  return rc;
}

void ctr_reader_close(ctr_reader *r) {
  if (!r) return;
  if (r->fd >= 0) close(r->fd);
  if (r->gz) gzclose(r->gz);
  ZSTD_freeDStream(r->zs);
  free(r->zin);
  free(r->path);
  free(r->errsave);
  free(r->buf);
  free(r->blk);
  free(r);
}

int ctr_reader_open_range(const char *path, uint64_t begin, uint64_t end, ctr_reader **out) {
  if (!out) return fail(CTR_ERR_INVALID, "ctr_reader_open_range: NULL argument");
  *out = NULL;
  if (begin > end) return fail(CTR_ERR_INVALID, "%s: byte range begins after its end", path ? path : "?");
  ctr_reader *r;
  int rc = ctr_reader_open(path, &r);
  if (rc) return rc;
  if (begin == 0 && end == UINT64_MAX) {
    *out = r;
    return CTR_OK;
  }
  if (r->format != CTR_FMT_LIBSVM || r->gz || r->zs || r->size == UINT64_MAX) {
    ctr_reader_close(r);
    return fail(CTR_ERR_INVALID, "%s: only an uncompressed libsvm text file can be read by byte range", path);
  }
  r->rbeg = begin;
  r->rend = end;
  if (begin > 0) {
    /* Start one byte early and drop up to the first newline: if byte begin-1 is a
     * newline the dropped line is empty and the range starts with the line at begin. */
    if (lseek(r->fd, (off_t)(begin - 1), SEEK_SET) < 0) {
      rc = fail(CTR_ERR_IO, "cannot seek in %s: %s", path, strerror(errno));
      ctr_reader_close(r);
      return rc;
    }
    r->beg = r->end = 0;
    r->buf_off = begin - 1;
    r->skip_first = 1;
  }
  *out = r;
  return CTR_OK;
}

int ctr_file_probe(const char *path, ctr_file_info *info) {
  if (!path || !info) return fail(CTR_ERR_INVALID, "ctr_file_probe: NULL argument");
  memset(info, 0, sizeof *info);
  ctr_reader *r;
  int rc = ctr_reader_open(path, &r);
  if (rc) return rc;
  struct stat st;
  info->format = r->format;
  info->gzip = r->gz != NULL;
  info->zstd = r->zs != NULL;
  if (stat(path, &st) == 0) info->size = (uint64_t)st.st_size;
  info->splittable = r->format == CTR_FMT_LIBSVM && !r->gz && !r->zs && r->size != UINT64_MAX;
  ctr_reader_close(r);
  return CTR_OK;
}

void ctr_range(uint64_t size, uint32_t n, uint32_t i, uint64_t *begin, uint64_t *end) {
  if (n == 0) n = 1;
  if (i >= n) i = n - 1;
  *begin = (uint64_t)((unsigned __int128)size * i / n);
  *end = (uint64_t)((unsigned __int128)size * (i + 1) / n);
}

int ctr_reader_format(const ctr_reader *r) { return r->format; }
uint64_t ctr_reader_rows(const ctr_reader *r) { return r->rows; }

/* Next line of a text file into line and len (without the newline): 1, 0 at end of
 * file, or an error code (negative of it). */
static int text_line(ctr_reader *r, char **line, size_t *len) {
  for (;;) {
    char *nl = r->beg < r->end ? memchr(r->buf + r->beg, '\n', r->end - r->beg) : NULL;
    if (nl || (r->eof && r->beg < r->end)) {
      uint64_t at = r->buf_off + r->beg;
      if (at >= r->rend) return 0; /* the next range's line */
      *line = r->buf + r->beg;
      *len = nl ? (size_t)(nl - *line) : r->end - r->beg;
      r->beg += *len + (nl ? 1 : 0);
      if (r->skip_first) { /* the tail of the line the range starts inside */
        r->skip_first = 0;
        continue;
      }
      r->line_at = at;
      return 1;
    }
    if (r->eof) return 0;
    if (r->beg > 0) {
      memmove(r->buf, r->buf + r->beg, r->end - r->beg);
      r->end -= r->beg;
      r->buf_off += r->beg;
      r->beg = 0;
    }
    if (r->end == r->cap) {
      if (r->cap >= MAX_LINE) {
        r->line++;
        fail(CTR_ERR_PARSE, "%s:%llu: line is longer than %u MiB", r->path,
             (unsigned long long)r->line, MAX_LINE >> 20);
        return -rfail(r, CTR_ERR_PARSE);
      }
      char *nb = realloc(r->buf, r->cap * 2);
      if (!nb) {
        fail(CTR_ERR_NOMEM, "%s: out of memory for a long line", r->path);
        return -rfail(r, CTR_ERR_NOMEM);
      }
      r->buf = nb;
      r->cap *= 2;
    }
    size_t want = r->cap - r->end;
    if (want > TEXT_CHUNK) want = TEXT_CHUNK;
    ssize_t k = r_read(r, r->buf + r->end, want);
    if (k < 0) {
      fail(CTR_ERR_IO, "%s:%llu: read error: %s", r->path, (unsigned long long)r->line + 1,
           r_strerror(r));
      return -rfail(r, CTR_ERR_IO);
    }
    if (k == 0) r->eof = 1;
    r->end += (size_t)k;
  }
}

static inline int is_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

/* Parse one text line into b. Returns CTR_OK (the line may have been a blank or
 * comment line: *added says whether an example was appended) or an error. */
static int text_parse(ctr_reader *r, char *s, size_t n, ctr_batch *b, int *added) {
  char q[64], tok[64];
  char *end = s + n;
  char *hash = memchr(s, '#', n);
  if (hash) end = hash;
  while (s < end && is_space(*s)) s++;
  while (end > s && is_space(end[-1])) end--;
  *added = 0;
  if (s == end) return CTR_OK;

  /* label */
  char *t = s;
  while (t < end && !is_space(*t)) t++;
  size_t tl = (size_t)(t - s);
  double lab = NAN;
  if (tl < sizeof tok) {
    memcpy(tok, s, tl);
    tok[tl] = 0;
    char *e;
    lab = strtod(tok, &e);
    if (e != tok + tl) lab = NAN;
  }
  float label;
  if (lab == 1.0) label = 1.0f;
  else if (lab == 0.0 || lab == -1.0) label = 0.0f;
  else PARSE_FAIL(r, "label '%s' is not 0/1 or -1/+1", quote(q, sizeof q, s, tl));

  int rc = batch_reserve_rows(b, b->rows + 1);
  if (rc) return rfail(r, rc);
  size_t nnz = b->nnz;
  s = t;
  for (;;) {
    while (s < end && is_space(*s)) s++;
    if (s == end) break;
    t = s;
    while (t < end && !is_space(*t)) t++;
    tl = (size_t)(t - s);
    char *colon = memchr(s, ':', tl);
    if (!colon)
      PARSE_FAIL(r, "feature '%s' is not id:value", quote(q, sizeof q, s, tl));
    /* id: decimal uint64 */
    size_t il = (size_t)(colon - s);
    uint64_t id = 0;
    int ok = il > 0 && il <= 20;
    for (size_t i = 0; ok && i < il; i++) {
      unsigned d = (unsigned)(unsigned char)s[i] - '0';
      if (d > 9 || id > (UINT64_MAX - d) / 10) ok = 0;
      else id = id * 10 + d;
    }
    if (!ok) PARSE_FAIL(r, "feature id '%s' does not parse", quote(q, sizeof q, s, il));
    /* value: a finite real; "1" is by far the most common */
    char *v = colon + 1;
    size_t vl = (size_t)(t - v);
    float val;
    if (vl == 1 && *v == '1') {
      val = 1.0f;
    } else {
      ok = vl > 0 && vl < sizeof tok;
      if (ok) {
        memcpy(tok, v, vl);
        tok[vl] = 0;
        char *e;
        errno = 0;
        val = strtof(tok, &e);
        ok = e == tok + vl;
      }
      if (!ok)
        PARSE_FAIL(r, "value '%s' of feature %llu does not parse",
                   quote(q, sizeof q, v, vl), (unsigned long long)id);
      if (!isfinite(val))
        PARSE_FAIL(r, "value '%s' of feature %llu is not a finite number",
                   quote(q, sizeof q, v, vl), (unsigned long long)id);
    }
    if (nnz - b->nnz >= MAX_ROW_NNZ) PARSE_FAIL(r, "too many features in one example");
    if ((rc = batch_reserve_nnz(b, nnz + 1)) != CTR_OK) return rfail(r, rc);
    b->ids[nnz] = id;
    b->vals[nnz] = val;
    nnz++;
    s = t;
  }
  b->labels[b->rows] = label;
  b->rows++;
  b->nnz = nnz;
  b->offsets[b->rows] = nnz;
  *added = 1;
  return CTR_OK;
}

static int text_next(ctr_reader *r, size_t max_rows, ctr_batch *b) {
  while (b->rows < max_rows) {
    char *line;
    size_t len;
    int k = text_line(r, &line, &len);
    if (k < 0) return -k;
    if (k == 0) break;
    r->line++;
    int added, rc = text_parse(r, line, len, b, &added);
    if (rc) return rc;
  }
  return CTR_OK;
}

/* Read and verify the next binary block. Sets r->done at the end block. */
static int bin_load(ctr_reader *r) {
  uint64_t at = r->pos;
  unsigned char h[BLK_HDR];
  ssize_t n = r_read_full(r, h, BLK_HDR);
  if (n < 0) {
    fail(CTR_ERR_IO, "%s: read error at byte %llu: %s", r->path, (unsigned long long)at,
         r_strerror(r));
    return rfail(r, CTR_ERR_IO);
  }
  r->pos += (uint64_t)n;
  if (n == 0)
    BIN_FAIL(r, at, "file is truncated: it ends after %llu rows without an end block",
             (unsigned long long)r->seen_rows);
  if (n < (ssize_t)BLK_HDR)
    BIN_FAIL(r, at, "file is truncated inside a block header (%zd of %u bytes)", n, BLK_HDR);
  int is_end = !memcmp(h, BLK_TAG_END, 4);
  if (!is_end && memcmp(h, BLK_TAG_ROWS, 4))
    BIN_FAIL(r, at, "bad block tag (file is corrupt)");
  uint32_t flags = get_le32(h + 4), rows = get_le32(h + 8), resv = get_le32(h + 12);
  uint64_t nnz = get_le64(h + 16), plen = get_le64(h + 24), sum = get_le64(h + 32);
  uint64_t want;
  if (is_end) {
    if (flags || rows || resv || plen != 8)
      BIN_FAIL(r, at, "malformed end block header (file is corrupt)");
    want = 8;
  } else {
    if ((flags & ~BLK_F_ONES) || resv || rows == 0 || rows > BLK_READ_ROWS ||
        nnz > BLK_READ_NNZ)
      BIN_FAIL(r, at, "malformed block header: rows=%u nnz=%llu flags=%u (file is corrupt)",
               rows, (unsigned long long)nnz, flags);
    want = nnz * 8 + ((flags & BLK_F_ONES) ? 0 : nnz * 4) + (uint64_t)rows * 5;
    if (plen != want)
      BIN_FAIL(r, at, "block payload is %llu bytes, its counts need %llu (file is corrupt)",
               (unsigned long long)plen, (unsigned long long)want);
  }
  if (r->size != UINT64_MAX && plen > r->size - r->pos)
    BIN_FAIL(r, at, "file is truncated: block needs %llu payload bytes, %llu remain",
             (unsigned long long)plen, (unsigned long long)(r->size - r->pos));
  if (plen > r->blk_cap) {
    unsigned char *nb = realloc(r->blk, (size_t)plen);
    if (!nb) {
      fail(CTR_ERR_NOMEM, "%s: out of memory for a block of %llu bytes", r->path,
           (unsigned long long)plen);
      return rfail(r, CTR_ERR_NOMEM);
    }
    r->blk = nb;
    r->blk_cap = (size_t)plen;
  }
  n = r_read_full(r, r->blk, (size_t)plen);
  if (n < 0) {
    fail(CTR_ERR_IO, "%s: read error at byte %llu: %s", r->path,
         (unsigned long long)r->pos, r_strerror(r));
    return rfail(r, CTR_ERR_IO);
  }
  r->pos += (uint64_t)n;
  if ((uint64_t)n < plen)
    BIN_FAIL(r, at, "file is truncated: block needs %llu payload bytes, %zd remain",
             (unsigned long long)plen, n);
  if (XXH64(r->blk, (size_t)plen, XXH64(h, 32, 0)) != sum)
    BIN_FAIL(r, at, "checksum mismatch (file is corrupt)");

  if (is_end) {
    uint64_t trows = get_le64(r->blk);
    if (trows != r->seen_rows || nnz != r->seen_nnz)
      BIN_FAIL(r, at, "end block says %llu rows and %llu features, the file has %llu and %llu",
               (unsigned long long)trows, (unsigned long long)nnz,
               (unsigned long long)r->seen_rows, (unsigned long long)r->seen_nnz);
    unsigned char extra;
    n = r_read_full(r, &extra, 1);
    if (n != 0) BIN_FAIL(r, r->pos, "unexpected bytes after the end block");
    r->done = 1;
    r->blk_rows = r->blk_next = 0;
    return CTR_OK;
  }

  r->blk_ones = (flags & BLK_F_ONES) != 0;
  r->p_ids = r->blk;
  r->p_vals = r->blk + nnz * 8;
  r->p_lens = r->p_vals + (r->blk_ones ? 0 : nnz * 4);
  r->p_labels = r->p_lens + (uint64_t)rows * 4;
  uint64_t total = 0;
  for (uint32_t i = 0; i < rows; i++) total += get_le32(r->p_lens + 4 * (size_t)i);
  if (total != nnz)
    BIN_FAIL(r, at, "row lengths add up to %llu features, the header says %llu",
             (unsigned long long)total, (unsigned long long)nnz);
  for (uint32_t i = 0; i < rows; i++)
    if (r->p_labels[i] > 1)
      BIN_FAIL(r, at, "label %u of row %u is not 0 or 1", r->p_labels[i], i);
  if (!r->blk_ones)
    for (uint64_t j = 0; j < nnz; j++)
      if (!isfinite(bits_f32(get_le32(r->p_vals + 4 * j))))
        BIN_FAIL(r, at, "value %llu is not a finite number", (unsigned long long)j);
  r->block++;
  r->blk_rows = rows;
  r->blk_next = 0;
  r->blk_feat = 0;
  r->seen_rows += rows;
  r->seen_nnz += nnz;
  return CTR_OK;
}

static int bin_next(ctr_reader *r, size_t max_rows, ctr_batch *b) {
  while (b->rows < max_rows) {
    if (r->blk_next == r->blk_rows) {
      if (r->done) break;
      int rc = bin_load(r);
      if (rc) return rc;
      continue;
    }
    size_t k = r->blk_rows - r->blk_next;
    if (k > max_rows - b->rows) k = max_rows - b->rows;
    uint64_t nnz = 0;
    for (size_t i = 0; i < k; i++) nnz += get_le32(r->p_lens + 4 * (size_t)(r->blk_next + i));
    int rc = batch_reserve_rows(b, b->rows + k);
    if (!rc) rc = batch_reserve_nnz(b, b->nnz + (size_t)nnz);
    if (rc) return rfail(r, rc);
    uint64_t *ids = b->ids + b->nnz;
    float *vals = b->vals + b->nnz;
    const unsigned char *pi = r->p_ids + 8 * r->blk_feat;
    for (uint64_t j = 0; j < nnz; j++) ids[j] = get_le64(pi + 8 * j);
    if (r->blk_ones) {
      for (uint64_t j = 0; j < nnz; j++) vals[j] = 1.0f;
    } else {
      const unsigned char *pv = r->p_vals + 4 * r->blk_feat;
      for (uint64_t j = 0; j < nnz; j++) vals[j] = bits_f32(get_le32(pv + 4 * j));
    }
    uint64_t off = b->nnz;
    for (size_t i = 0; i < k; i++) {
      uint32_t row = r->blk_next + (uint32_t)i;
      off += get_le32(r->p_lens + 4 * (size_t)row);
      b->offsets[b->rows + i + 1] = off;
      b->labels[b->rows + i] = (float)r->p_labels[row];
    }
    b->rows += k;
    b->nnz += (size_t)nnz;
    r->blk_next += (uint32_t)k;
    r->blk_feat += nnz;
  }
  return CTR_OK;
}

int ctr_reader_next(ctr_reader *r, size_t max_rows, ctr_batch *b) {
  if (!r || !b || max_rows == 0)
    return fail(CTR_ERR_INVALID, "ctr_reader_next: NULL argument or max_rows == 0");
  if (r->err) {
    batch_clear(b);
    fail(r->err, "%s", r->errsave ? r->errsave : ctr_strerror(r->err));
    return r->err;
  }
  int rc = batch_reserve_rows(b, 1);
  if (rc) return rc;
  batch_clear(b);
  rc = r->format == CTR_FMT_BIN ? bin_next(r, max_rows, b) : text_next(r, max_rows, b);
  if (rc) {
    batch_clear(b);
    return rc;
  }
  r->rows += b->rows;
  return CTR_OK;
}

/* ---------------------------------------------------------------- writer */

struct ctr_writer {
  char *path, *tmp;
  int fd;
  int format;
  int err;
  char *errsave;
  /* text: output buffer */
  char *out;
  size_t out_len, out_cap;
  /* binary: the open block, already in little-endian byte form */
  unsigned char *b_ids, *b_vals, *b_lens, *b_labels;
  size_t rows, nnz, cap_rows, cap_nnz;
  int ones;
  uint64_t tot_rows, tot_nnz;
};

static int wfail(ctr_writer *w, int code) {
  if (!w->err) {
    w->err = code;
    free(w->errsave);
    w->errsave = dupstr(errbuf);
  }
  return code;
}

static int wwrite(ctr_writer *w, const void *p, size_t n) {
  if (write_full(w->fd, p, n) != 0) {
    fail(CTR_ERR_IO, "cannot write %s: %s", w->tmp, strerror(errno));
    return wfail(w, CTR_ERR_IO);
  }
  return CTR_OK;
}

int ctr_writer_open(const char *path, int format, ctr_writer **out) {
  if (!path || !out || (format != CTR_FMT_LIBSVM && format != CTR_FMT_BIN))
    return fail(CTR_ERR_INVALID, "ctr_writer_open: NULL argument or unknown format");
  *out = NULL;
  ctr_writer *w = calloc(1, sizeof *w);
  if (!w) return fail(CTR_ERR_NOMEM, "out of memory");
  w->fd = -1;
  w->format = format;
  w->path = dupstr(path);
  w->tmp = malloc(strlen(path) + 5);
  if (!w->path || !w->tmp) {
    ctr_writer_abort(w);
    return fail(CTR_ERR_NOMEM, "out of memory");
  }
  strcpy(w->tmp, path);
  strcat(w->tmp, ".tmp");
  w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd < 0) {
    int rc = fail(CTR_ERR_IO, "cannot create %s: %s", w->tmp, strerror(errno));
    free(w->tmp);
    w->tmp = NULL; /* nothing to remove */
    ctr_writer_abort(w);
    return rc;
  }
  if (format == CTR_FMT_LIBSVM) {
    w->out_cap = TEXT_CHUNK;
    w->out = malloc(w->out_cap);
    if (!w->out) {
      ctr_writer_abort(w);
      return fail(CTR_ERR_NOMEM, "out of memory");
    }
  } else {
    unsigned char h[BIN_HDR];
    memcpy(h, BIN_MAGIC, 4);
    put_le32(h + 4, BIN_VERSION);
    put_le32(h + 8, 0);
    put_le32(h + 12, BIN_HDR);
    put_le64(h + 16, XXH64(h, 16, 0));
    int rc = wwrite(w, h, sizeof h);
    if (rc) {
      ctr_writer_abort(w);
      return rc;
    }
    w->ones = 1;
  }
  *out = w;
  return CTR_OK;
}

/* Decimal digits of v at p; returns the length. */
static size_t put_u64(char *p, uint64_t v) {
  static const char d2[] =
      "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
      "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
      "8081828384858687888990919293949596979899";
  char tmp[20];
  size_t n = 20;
  while (v >= 100) {
    unsigned k = (unsigned)(v % 100) * 2;
    v /= 100;
    tmp[--n] = d2[k + 1];
    tmp[--n] = d2[k];
  }
  if (v >= 10) {
    tmp[--n] = d2[v * 2 + 1];
    tmp[--n] = d2[v * 2];
  } else {
    tmp[--n] = (char)('0' + v);
  }
  memcpy(p, tmp + n, 20 - n);
  return 20 - n;
}

/* The shortest of %.6g .. %.9g that reads back as v (%.9g always does); at most 16
 * characters. */
static size_t put_float(char *p, float v) {
  char tmp[32];
  int k = 0;
  for (int prec = 6; prec <= 9; prec++) {
    k = snprintf(tmp, sizeof tmp, "%.*g", prec, (double)v);
    if (strtof(tmp, NULL) == v) break;
  }
  memcpy(p, tmp, (size_t)k);
  return (size_t)k;
}

static int text_add(ctr_writer *w, float label, const uint64_t *ids, const float *vals,
                    size_t n) {
  size_t need = 3 + n * 48; /* label, newline; per feature: space, 20 digits, ':', %.9g */
  if (w->out_len + need > w->out_cap) {
    int rc = wwrite(w, w->out, w->out_len);
    if (rc) return rc;
    w->out_len = 0;
    if (need > w->out_cap) {
      char *nb = realloc(w->out, need);
      if (!nb) {
        fail(CTR_ERR_NOMEM, "out of memory writing %s", w->tmp);
        return wfail(w, CTR_ERR_NOMEM);
      }
      w->out = nb;
      w->out_cap = need;
    }
  }
  char *p = w->out + w->out_len;
  *p++ = label > 0.5f ? '1' : '0';
  for (size_t i = 0; i < n; i++) {
    *p++ = ' ';
    p += put_u64(p, ids[i]);
    *p++ = ':';
    if (!vals || vals[i] == 1.0f) {
      *p++ = '1';
    } else {
      p += put_float(p, vals[i]);
    }
  }
  *p++ = '\n';
  w->out_len = (size_t)(p - w->out);
  return CTR_OK;
}

static int bin_flush(ctr_writer *w, int end) {
  unsigned char h[BLK_HDR];
  uint64_t plen;
  XXH64_state_t *st = XXH64_createState();
  if (!st) {
    fail(CTR_ERR_NOMEM, "out of memory");
    return wfail(w, CTR_ERR_NOMEM);
  }
  unsigned char tail[8];
  if (end) {
    memcpy(h, BLK_TAG_END, 4);
    put_le32(h + 4, 0);
    put_le32(h + 8, 0);
    put_le32(h + 12, 0);
    put_le64(h + 16, w->tot_nnz);
    plen = 8;
    put_le64(tail, w->tot_rows);
  } else {
    memcpy(h, BLK_TAG_ROWS, 4);
    put_le32(h + 4, w->ones ? BLK_F_ONES : 0);
    put_le32(h + 8, (uint32_t)w->rows);
    put_le32(h + 12, 0);
    put_le64(h + 16, w->nnz);
    plen = w->nnz * 8 + (w->ones ? 0 : w->nnz * 4) + w->rows * 5;
  }
  put_le64(h + 24, plen);
  XXH64_reset(st, XXH64(h, 32, 0));
  if (end) {
    XXH64_update(st, tail, 8);
  } else {
    XXH64_update(st, w->b_ids, w->nnz * 8);
    if (!w->ones) XXH64_update(st, w->b_vals, w->nnz * 4);
    XXH64_update(st, w->b_lens, w->rows * 4);
    XXH64_update(st, w->b_labels, w->rows);
  }
  put_le64(h + 32, XXH64_digest(st));
  XXH64_freeState(st);
  int rc = wwrite(w, h, BLK_HDR);
  if (!rc && end) rc = wwrite(w, tail, 8);
  if (!rc && !end) {
    rc = wwrite(w, w->b_ids, w->nnz * 8);
    if (!rc && !w->ones) rc = wwrite(w, w->b_vals, w->nnz * 4);
    if (!rc) rc = wwrite(w, w->b_lens, w->rows * 4);
    if (!rc) rc = wwrite(w, w->b_labels, w->rows);
  }
  w->rows = w->nnz = 0;
  w->ones = 1;
  return rc;
}

/* Make room for rows+1 examples and nnz+n features in the open block. */
static int bin_reserve(ctr_writer *w, size_t n) {
  if (w->rows + 1 > w->cap_rows) {
    size_t c = w->cap_rows ? w->cap_rows * 2 : 1024;
    unsigned char *l = realloc(w->b_lens, c * 4);
    if (!l) return -1;
    w->b_lens = l;
    unsigned char *y = realloc(w->b_labels, c);
    if (!y) return -1;
    w->b_labels = y;
    w->cap_rows = c;
  }
  if (w->nnz + n > w->cap_nnz) {
    size_t c = w->cap_nnz ? w->cap_nnz : 16384;
    while (c < w->nnz + n) c *= 2;
    unsigned char *i = realloc(w->b_ids, c * 8);
    if (!i) return -1;
    w->b_ids = i;
    unsigned char *v = realloc(w->b_vals, c * 4);
    if (!v) return -1;
    w->b_vals = v;
    w->cap_nnz = c;
  }
  return 0;
}

static int bin_add(ctr_writer *w, float label, const uint64_t *ids, const float *vals,
                   size_t n) {
  int rc;
  if (w->rows > 0 && (w->rows == BLK_WRITE_ROWS || w->nnz + n > BLK_WRITE_NNZ))
    if ((rc = bin_flush(w, 0)) != CTR_OK) return rc;
  if (bin_reserve(w, n) != 0) {
    fail(CTR_ERR_NOMEM, "out of memory writing %s", w->tmp);
    return wfail(w, CTR_ERR_NOMEM);
  }
  unsigned char *pi = w->b_ids + 8 * w->nnz, *pv = w->b_vals + 4 * w->nnz;
  for (size_t i = 0; i < n; i++) {
    put_le64(pi + 8 * i, ids[i]);
    float v = vals ? vals[i] : 1.0f;
    if (v != 1.0f) w->ones = 0;
    put_le32(pv + 4 * i, f32_bits(v));
  }
  put_le32(w->b_lens + 4 * w->rows, (uint32_t)n);
  w->b_labels[w->rows] = label > 0.5f;
  w->rows++;
  w->nnz += n;
  return CTR_OK;
}

int ctr_writer_add(ctr_writer *w, float label, const uint64_t *ids, const float *vals,
                   size_t n) {
  if (!w) return fail(CTR_ERR_INVALID, "ctr_writer_add: NULL writer");
  if (w->err) {
    fail(w->err, "%s", w->errsave ? w->errsave : ctr_strerror(w->err));
    return w->err;
  }
  if (n > 0 && !ids) return fail(CTR_ERR_INVALID, "ctr_writer_add: NULL ids");
  if (n > MAX_ROW_NNZ)
    return fail(CTR_ERR_INVALID, "%s: example %llu has %zu features (limit %llu)", w->path,
                (unsigned long long)w->tot_rows + 1, n, MAX_ROW_NNZ);
  if (vals)
    for (size_t i = 0; i < n; i++)
      if (!isfinite(vals[i]))
        return fail(CTR_ERR_INVALID, "%s: example %llu: value of feature %llu is not finite",
                    w->path, (unsigned long long)w->tot_rows + 1,
                    (unsigned long long)ids[i]);
  int rc = w->format == CTR_FMT_BIN ? bin_add(w, label, ids, vals, n)
                                    : text_add(w, label, ids, vals, n);
  if (rc) return rc;
  w->tot_rows++;
  w->tot_nnz += n;
  return CTR_OK;
}

static void writer_free(ctr_writer *w) {
  if (w->fd >= 0) close(w->fd);
  free(w->path);
  free(w->tmp);
  free(w->errsave);
  free(w->out);
  free(w->b_ids);
  free(w->b_vals);
  free(w->b_lens);
  free(w->b_labels);
  free(w);
}

void ctr_writer_abort(ctr_writer *w) {
  if (!w) return;
  if (w->tmp) unlink(w->tmp);
  writer_free(w);
}

int ctr_writer_close(ctr_writer *w) {
  if (!w) return CTR_OK;
  int rc = w->err;
  if (!rc) {
    if (w->format == CTR_FMT_LIBSVM) {
      rc = wwrite(w, w->out, w->out_len);
    } else {
      if (w->rows > 0) rc = bin_flush(w, 0);
      if (!rc) rc = bin_flush(w, 1);
    }
  }
  if (!rc) {
    int fd = w->fd;
    w->fd = -1;
    if (close(fd) != 0) rc = fail(CTR_ERR_IO, "cannot write %s: %s", w->tmp, strerror(errno));
  }
  if (!rc && rename(w->tmp, w->path) != 0)
    rc = fail(CTR_ERR_IO, "cannot rename %s to %s: %s", w->tmp, w->path, strerror(errno));
  if (rc) {
    if (w->errsave) fail(rc, "%s", w->errsave);
    ctr_writer_abort(w);
    return rc;
  }
  writer_free(w);
  return CTR_OK;
}

/* ---------------------------------------------------------------- metrics */

double ctr_logloss(const float *y, const float *p, size_t n) {
  if (n == 0) return 0.0;
  double sum = 0.0;
  for (size_t i = 0; i < n; i++) {
    double q = p[i];
    if (q < 1e-15) q = 1e-15;
    if (q > 1.0 - 1e-15) q = 1.0 - 1e-15;
    sum -= y[i] > 0.5f ? log(q) : log1p(-q);
  }
  return sum / (double)n;
}

double ctr_accuracy(const float *y, const float *p, size_t n, float threshold) {
  if (n == 0) return 0.0;
  size_t ok = 0;
  for (size_t i = 0; i < n; i++) ok += (p[i] > threshold) == (y[i] > 0.5f);
  return (double)ok / (double)n;
}

/* AUC from counts of positives and negatives per score group, in ascending score
 * order: each positive beats the negatives of lower groups and ties half of its own. */
typedef struct auc_acc {
  double num2; /* twice the number of (positive, negative) pairs won */
  double neg_below, pos, neg;
} auc_acc;

static inline void auc_group(auc_acc *a, double pos, double neg) {
  a->num2 += 2.0 * pos * a->neg_below + pos * neg;
  a->neg_below += neg;
  a->pos += pos;
  a->neg += neg;
}

static int auc_finish(const auc_acc *a, double *auc) {
  if (a->pos == 0 || a->neg == 0) {
    *auc = NAN;
    return fail(CTR_ERR_INVALID, "auc is undefined: %s",
                a->pos == 0 ? "no positive examples" : "no negative examples");
  }
  *auc = a->num2 / (2.0 * a->pos * a->neg);
  return CTR_OK;
}

int ctr_auc(const float *y, const float *s, size_t n, double *auc) {
  if (!auc || (n && (!y || !s))) return fail(CTR_ERR_INVALID, "ctr_auc: NULL argument");
  *auc = NAN;
  if (n == 0) return fail(CTR_ERR_INVALID, "auc is undefined: no examples");
  /* Sort (order-preserving key of the score) << 1 | label, by the key only: an LSD
   * radix sort over the key's 32 bits in digits of 11, 11 and 10 bits. */
  uint64_t *a = malloc(n * sizeof *a), *t = malloc(n * sizeof *t);
  size_t *cnt = malloc(2048 * sizeof *cnt);
  if (!a || !t || !cnt) {
    free(a);
    free(t);
    free(cnt);
    return fail(CTR_ERR_NOMEM, "out of memory computing the auc of %zu examples", n);
  }
  for (size_t i = 0; i < n; i++) {
    float f = s[i];
    if (isnan(f)) {
      free(a);
      free(t);
      free(cnt);
      return fail(CTR_ERR_INVALID, "auc: score %zu is NaN", i);
    }
    if (f == 0.0f) f = 0.0f; /* -0 and +0 are one score */
    uint32_t u = f32_bits(f);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    a[i] = (uint64_t)u << 1 | (y[i] > 0.5f);
  }
  static const int shift[3] = {1, 12, 23}, width[3] = {11, 11, 10};
  for (int pass = 0; pass < 3; pass++) {
    size_t nb = (size_t)1 << width[pass], mask = nb - 1;
    memset(cnt, 0, nb * sizeof *cnt);
    for (size_t i = 0; i < n; i++) cnt[(a[i] >> shift[pass]) & mask]++;
    size_t sum = 0;
    for (size_t d = 0; d < nb; d++) {
      size_t c = cnt[d];
      cnt[d] = sum;
      sum += c;
    }
    for (size_t i = 0; i < n; i++) t[cnt[(a[i] >> shift[pass]) & mask]++] = a[i];
    uint64_t *x = a;
    a = t;
    t = x;
  }
  auc_acc acc = {0};
  for (size_t i = 0; i < n;) {
    uint64_t key = a[i] >> 1;
    double pos = 0, neg = 0;
    for (; i < n && a[i] >> 1 == key; i++) {
      if (a[i] & 1) pos++;
      else neg++;
    }
    auc_group(&acc, pos, neg);
  }
  free(a);
  free(t);
  free(cnt);
  return auc_finish(&acc, auc);
}

#define HIST_BINS (1u << 20)

struct ctr_auc_hist {
  uint64_t pos[HIST_BINS], neg[HIST_BINS];
};

int ctr_auc_hist_new(ctr_auc_hist **out) {
  *out = calloc(1, sizeof **out);
  return *out ? CTR_OK : fail(CTR_ERR_NOMEM, "out of memory for an auc histogram");
}

void ctr_auc_hist_add(ctr_auc_hist *h, float y, double p) {
  double x = p * HIST_BINS;
  uint32_t bin = x >= HIST_BINS ? HIST_BINS - 1 : x > 0 ? (uint32_t)x : 0;
  if (y > 0.5f) h->pos[bin]++;
  else h->neg[bin]++;
}

int ctr_auc_hist_value(const ctr_auc_hist *h, double *auc) {
  auc_acc acc = {0};
  for (uint32_t i = 0; i < HIST_BINS; i++)
    if (h->pos[i] | h->neg[i]) auc_group(&acc, (double)h->pos[i], (double)h->neg[i]);
  return auc_finish(&acc, auc);
}

void ctr_auc_hist_free(ctr_auc_hist *h) { free(h); }
