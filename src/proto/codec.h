/*
 * codec.h - value codecs: how a data frame's f32 values are compressed on the wire
 * (hdr.codec, PS_CODEC_* in proto/frame.h), and the error each one leaves.
 *
 * No I/O. A frame's values are encoded as one vector of n floats, where n is what the
 * frame's keys say (sparse: keys x dim; dense: the segments' counts), never what the
 * bytes say; a decoder refuses any size but the one its codec gives for n. Wire formats
 * (little-endian):
 *   fp16  n x IEEE binary16. Round to nearest, ties to even: a value fp16 represents
 *         (subnormals included) comes back exactly. A finite value beyond the fp16
 *         range saturates to +-65504; Inf and NaN stay Inf and NaN.
 *   bf16  n x bfloat16 (the high 16 bits of the f32), rounded to nearest even; finite
 *         values beyond its range saturate to +-3.3895e38, Inf and NaN stay.
 *   int8  per block of PS_CODEC_INT8_BLOCK values (the last one shorter): an f32 scale
 *         s = max|x| / 127, then one int8 q = round(x / s) per value (symmetric,
 *         |q| <= 127, round to nearest even); decoded x = q * s. The error of a value is
 *         at most s / 2 (plus f32 rounding). 4 * ceil(n / 256) + n bytes.
 *   topk  k (u32 index, f32 value) pairs, indices strictly increasing and < n: k values
 *         sent exactly, the others decode as 0. ps__codec_encode sends the k of largest
 *         magnitude (ties: the lower index), ps__codec_encode_topk_by the k of largest
 *         score the caller gives. k = F (F >= 1, at most n) or ceil(F * n) (F < 1) of
 *         topk:F.
 * Non-finite values are refused by the server after decoding (spec option nonfinite=),
 * so codecs carry them rather than judge them.
 *
 * Error feedback: ps__codec_encode can also write what the receiver will not see
 * (input - decoded), which the caller keeps and adds to the next vector (client/cx.c).
 *
 * A finite value of an int8 block sent as NaN (the block held a non-finite value) keeps
 * its whole value as its error: none of it arrives.
 *
 * fp16, bf16 and int8 run vectorised where the CPU allows (F16C and AVX2 chosen at run
 * time, so a build runs on any x86-64 CPU), with portable loops elsewhere.
 */
#ifndef PS_CODEC_H
#define PS_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "proto/frame.h"

#define PS_CODEC_INT8_BLOCK 256u
#define PS_CODEC_NAME_MAX 32 /* longest ps__codec_format text, NUL included */

/* A table's codec for one direction: kind PS_CODEC_* (RAW: none) and topk's F. */
typedef struct ps__codec {
  uint32_t kind;
  float topk;
} ps__codec;

/* Parse "none", "fp16", "bf16", "int8" or "topk:F" (F > 0 finite; F >= 1 a whole
 * count). 0, or -1 if malformed. */
int ps__codec_parse(const char *s, ps__codec *out);
/* The text ps__codec_parse reads back into c ("none" for RAW). */
void ps__codec_format(const ps__codec *c, char *buf, size_t cap);
/* "raw", "fp16", "bf16", "int8", "topk", or "unknown". */
const char *ps__codec_name(uint32_t kind);
/* Is kind a codec this build decodes (RAW included)? */
static inline int ps__codec_known(uint32_t kind) { return kind < PS_CODEC__MAX; }

/* Values topk:F keeps out of n. */
size_t ps__codec_topk_count(const ps__codec *c, size_t n);
/* Bytes c encodes n values into: exact for fp16, bf16, int8 and raw; for topk the size
 * with its k (ps__codec_topk_count). SIZE_MAX if that overflows. */
size_t ps__codec_size(const ps__codec *c, size_t n);

/* Encode in[0..n) into out (ps__codec_size(c, n) bytes of room); *len gets the bytes
 * written. err, when not NULL, gets in - decoded(out) for each value (err may be in
 * itself). 0, or PS_ERR_TOO_LARGE (topk of more than 2^32 values) / PS_ERR_NOMEM
 * (topk's selection scratch), with a message via ps__fail. */
int ps__codec_encode(const ps__codec *c, const float *in, size_t n, uint8_t *out, size_t *len, float *err);

/* topk (c->kind PS_CODEC_TOPK) with the choice made on another vector: the k values
 * whose score[i] has the largest magnitude (ties: the lower index; a NaN score ranks
 * first) are sent as (i, in[i]) pairs, the wire format above. err as for
 * ps__codec_encode: 0 where sent, in[i] elsewhere (0 if not finite); err may be in,
 * never score. 0, or the errors of ps__codec_encode (PS_ERR_INVALID for another codec). */
int ps__codec_encode_topk_by(const ps__codec *c, const float *in, const float *score, size_t n, uint8_t *out,
                              size_t *len, float *err);

/* Decode len bytes of codec kind into out[0..n). 0, or PS_ERR_PROTO with a message
 * (via ps__fail) for an unknown codec, a size that is not the codec's for n, or a
 * malformed body (a topk index out of order or out of range, a non-finite or negative
 * int8 scale); out is then unspecified. */
int ps__codec_decode(uint32_t kind, const uint8_t *in, size_t len, float *out, size_t n);

/* Let the codecs use the CPU's vector kernels (on, the default) or only the portable
 * loops (off), which give the same bits: for tests and benchmarks. Takes effect for
 * calls that start after it. */
void ps__codec_set_vector(int on);

/* Scalar conversions (exposed for tests): round to nearest even, as described above. */
uint16_t ps__f32_to_f16(float x);
float ps__f16_to_f32(uint16_t h);
uint16_t ps__f32_to_bf16(float x);
float ps__bf16_to_f32(uint16_t h);

#endif /* PS_CODEC_H */
