/*
 * ctr_data.h - reading and writing click-log data for the click-through example, and
 * the evaluation metrics a trainer reports (log-loss, AUC, accuracy).
 *
 * Two file formats hold the same thing, a sequence of examples (label in {0,1}, sparse
 * features as uint64 id and float value):
 *
 *  - libsvm text: one example a line, `label id:value id:value ...`. Labels 0/1 or
 *    -1/+1 (also written 0.0, 1.0, +1.0; -1 maps to 0). Ids are decimal uint64, values
 *    finite reals. Blank lines and lines starting with '#' are skipped, a trailing
 *    `# comment` is ignored, CR before LF is accepted. Ids need not be sorted.
 *  - binary (".bin"): a 24-byte file header (magic "CTRB", version, xxh64 of the
 *    header), blocks of up to 65536 examples each checked by an xxh64 over the block
 *    header and payload, and an end block carrying the totals, so a truncated or
 *    corrupt file is always detected. README.md describes the bytes.
 *
 * The reader detects the format from the first bytes, so callers open both the same
 * way, whatever the file's name; a gzip- or zstd-compressed file of either format is read
 * through zlib or libzstd. Batches are CSR (row offsets into one id and one value array).
 *
 * This library does not depend on pshard. Errors: every function that can fail returns
 * a ctr_err code; ctr_errmsg() gives the message of the calling thread's last failure,
 * of the form "FILE:LINE: what" for text ("data/part-0.txt:17: label '2' is not 0/1 or
 * -1/+1") and "FILE: block N at byte B: what" for binary files.
 *
 * Thread safety: a reader or writer is used by one thread at a time; different ones
 * may be used concurrently. The metric functions are reentrant.
 */
#ifndef CTR_DATA_H
#define CTR_DATA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ctr_err {
  CTR_OK = 0,
  CTR_ERR_INVALID = 1, /* bad argument (NULL path, unknown format, NaN score, ...) */
  CTR_ERR_NOMEM = 2,   /* allocation failed */
  CTR_ERR_IO = 3,      /* open, read, write or rename failed (message has strerror) */
  CTR_ERR_PARSE = 4,   /* malformed text line (message names file and line) */
  CTR_ERR_CORRUPT = 5, /* binary file truncated, bad magic, version or checksum */
} ctr_err;

typedef enum ctr_format {
  CTR_FMT_LIBSVM = 1,
  CTR_FMT_BIN = 2,
} ctr_format;

/* Message of the calling thread's last failure ("" if none). Valid until the next
 * failing call in this thread. */
const char *ctr_errmsg(void);
/* Short description of a code ("malformed line"). Never NULL. */
const char *ctr_strerror(int err);
/* "libsvm", "bin", or "?". */
const char *ctr_format_name(int format);
/* Parse "libsvm" (or "txt", "text") and "bin" (or "binary"); -1 if unknown. */
int ctr_format_parse(const char *s);

/* ---------------------------------------------------------------- batches */

/* A mini-batch in CSR form: example i has features ids[j], vals[j] for
 * j in [offsets[i], offsets[i+1]) and label labels[i] (0 or 1). Arrays are owned by the
 * batch and grow as needed; reuse one batch across reads to avoid allocation. */
typedef struct ctr_batch {
  size_t rows;       /* examples in the batch */
  size_t nnz;        /* features over all examples (= offsets[rows]) */
  uint64_t *offsets; /* rows + 1 entries */
  uint64_t *ids;     /* nnz feature ids */
  float *vals;       /* nnz feature values */
  float *labels;     /* rows labels, 0.0f or 1.0f */
  size_t cap_rows, cap_nnz;
} ctr_batch;

/* Set all fields to empty (no allocation). */
void ctr_batch_init(ctr_batch *b);
/* Free the arrays and reset to empty. NULL is a no-op. */
void ctr_batch_free(ctr_batch *b);

/* ---------------------------------------------------------------- reader */

typedef struct ctr_reader ctr_reader;

/* Open a data file (libsvm text or binary, detected from its first bytes).
 * On success *out owns the reader. Errors: CTR_ERR_IO (missing or unreadable file),
 * CTR_ERR_CORRUPT (binary header bad), CTR_ERR_NOMEM, CTR_ERR_INVALID. */
int ctr_reader_open(const char *path, ctr_reader **out);
/* Open the part of an uncompressed libsvm text file that holds the lines whose first
 * byte lies in [begin, end): ranges that tile the file (ctr_range) read every line
 * exactly once, including lines longer than a range (they belong to the range they
 * start in). begin 0 and end UINT64_MAX is the whole file, in any format. Parse errors
 * name the line's number in the whole file, as for ctr_reader_open. Errors: those of
 * ctr_reader_open, and
 * CTR_ERR_INVALID for a binary or compressed file (or begin > end). */
int ctr_reader_open_range(const char *path, uint64_t begin, uint64_t end, ctr_reader **out);

/* What ctr_reader_open finds in a file. */
typedef struct ctr_file_info {
  int format;     /* CTR_FMT_LIBSVM or CTR_FMT_BIN */
  int gzip;       /* 1 if gzip-compressed */
  int zstd;       /* 1 if zstd-compressed */
  int splittable; /* 1 if ctr_reader_open_range can cut it (uncompressed regular text file) */
  uint64_t size;  /* bytes on disk */
} ctr_file_info;
/* Inspect a data file without reading its examples. Errors: those of ctr_reader_open. */
int ctr_file_probe(const char *path, ctr_file_info *info);
/* Range i of n (0 <= i < n) of a file of size bytes: [size*i/n, size*(i+1)/n). The n
 * ranges tile [0, size). */
void ctr_range(uint64_t size, uint32_t n, uint32_t i, uint64_t *begin, uint64_t *end);

/* Read up to max_rows (> 0) examples into b, replacing its content. At the end of the
 * file it returns CTR_OK with b->rows == 0. On an error b is left empty, nothing of the
 * failing batch is returned, and every later call returns the same error. */
int ctr_reader_next(ctr_reader *r, size_t max_rows, ctr_batch *b);
/* The file's format (CTR_FMT_LIBSVM or CTR_FMT_BIN). */
int ctr_reader_format(const ctr_reader *r);
/* Examples returned so far. */
uint64_t ctr_reader_rows(const ctr_reader *r);
/* Close the file and free the reader. NULL is a no-op. */
void ctr_reader_close(ctr_reader *r);

/* ---------------------------------------------------------------- writer */

typedef struct ctr_writer ctr_writer;

/* Create a data file. The data goes to "PATH.tmp" and is renamed to PATH by a
 * successful ctr_writer_close, so a file under its final name is always complete.
 * An existing PATH is replaced. Errors: CTR_ERR_IO, CTR_ERR_NOMEM, CTR_ERR_INVALID. */
int ctr_writer_open(const char *path, int format, ctr_writer **out);
/* Append one example. label is 0 or 1 (anything > 0.5 counts as 1); vals may be NULL,
 * meaning every value is 1 (stored compactly in both formats). Errors: CTR_ERR_IO,
 * CTR_ERR_NOMEM, CTR_ERR_INVALID (non-finite value, too many features). */
int ctr_writer_add(ctr_writer *w, float label, const uint64_t *ids, const float *vals,
                   size_t n);
/* Flush, finish the file and rename it into place; frees w. Returns the first error
 * of any earlier call or of the close itself; on error the temporary file is removed
 * and PATH is left as it was. NULL is a no-op returning CTR_OK. */
int ctr_writer_close(ctr_writer *w);
/* Give up: remove the temporary file and free w. NULL is a no-op. */
void ctr_writer_abort(ctr_writer *w);

/* ---------------------------------------------------------------- metrics */

/* Mean logistic log-loss of probabilities p against labels y (y > 0.5 is positive);
 * p is clipped to [1e-15, 1 - 1e-15]. 0 for n == 0. */
double ctr_logloss(const float *y, const float *p, size_t n);
/* Fraction of examples with (p > threshold) == (y > 0.5). 0 for n == 0. */
double ctr_accuracy(const float *y, const float *p, size_t n, float threshold);
/* Exact area under the ROC curve of scores s against labels y: the probability that a
 * random positive scores above a random negative, ties counting one half. Sorts a copy
 * (O(n) radix sort), so any monotone score (probability or logit) gives the same
 * value. Errors: CTR_ERR_INVALID if a score is NaN or only one class is present
 * (*auc is NaN then), CTR_ERR_NOMEM. */
int ctr_auc(const float *y, const float *s, size_t n, double *auc);

/* Streaming AUC in constant memory: probabilities are counted in 2^20 equal-width
 * bins, so examples in one bin count as tied (the error is at most the mass of pairs
 * sharing a bin, negligible for calibrated scores). For test sets too large to keep. */
typedef struct ctr_auc_hist ctr_auc_hist;
int ctr_auc_hist_new(ctr_auc_hist **out);
void ctr_auc_hist_add(ctr_auc_hist *h, float y, double p);
int ctr_auc_hist_value(const ctr_auc_hist *h, double *auc);
void ctr_auc_hist_free(ctr_auc_hist *h);

#ifdef __cplusplus
}
#endif
#endif
