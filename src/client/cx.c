/*
 * cx.c - the worker's side of value compression: pushes encoded with their table's
 * push codec, with error feedback, and replies of tables with a pull codec decoded
 * into the caller's buffers (proto/codec.h has the codecs and their wire formats).
 *
 * Runs on callers' threads, once a request's parts are built (route.c): a push part's
 * values are gathered, the table's residual added, the sum encoded into a block the
 * request owns (its bytes are what every attempt of the part sends), and what the
 * encoding lost becomes the new residual. A pull part's reply is read into that block
 * and decoded when the request completes (ps__req_rows_done, on the loop or a lent
 * link's caller).
 *
 * Residuals (error feedback) are kept per table in a row map keyed like the table's
 * rows: a sparse table's keys, a dense table's slice numbers; a row holds the table's
 * width of floats and a stamp. Only rows the worker has pushed get one, so the memory
 * is one f32 per value pushed (plus the map's index), and it lives until the context
 * closes. A table's mutex covers the whole of one push's feedback, so concurrent
 * pushes to a table each see a consistent residual.
 *
 * With topk, what to send depends on the table's optimiser. SGD and momentum apply a
 * value in proportion to its size: the k gathered values of largest magnitude go. Adam,
 * Adagrad and FTRL divide each value's step by its running magnitude, so size counts
 * for little and a burst of gradients that cancel moves a value as far as one that
 * agrees: for them topk chooses by consistency. Such a row also holds, per value, the
 * sum of squares of the gradients gathered since the value was last sent, and the k
 * values sent are those of largest |gathered| / sqrt(sum of squares), a t-statistic of
 * the gathered gradient (docs/design.md, section 5a): a value whose gradients keep their
 * sign climbs as they gather, one whose gradients cancel stays near 1 and waits. Either
 * way what is sent is the gathered value itself, so error feedback conserves the same.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "client/client_int.h"
#include "store/store.h"

struct ps__cx_table {
  pthread_mutex_t mu;
  ps__rowmap *resid; /* rowlen floats per row: the residual, if scored the sums of squares,
                        then a stamp (u32 bits) */
  uint32_t width, rowlen;
  int scored;        /* topk choosing by consistency (a normalising optimiser) */
  uint32_t pushes;   /* stamps: 2 * pushes when a row's residual was added, + 1 when rewritten */
  uint64_t push_raw, push_wire, pull_raw, pull_wire; /* value bytes (atomics) */
};

ps__cx_table *ps__cx_table_new(const ps__table_spec *spec) {
  ps__cx_table *t = ps__calloc(1, sizeof *t);
  if (!t) return NULL;
  t->width = spec->width;
  ps__opt_kind o = spec->opt.kind;
  t->scored = spec->push_codec.kind == PS_CODEC_TOPK &&
              (o == PS__OPT_ADAM || o == PS__OPT_ADAGRAD || o == PS__OPT_FTRL);
  t->rowlen = (t->scored ? 2 * spec->width : spec->width) + 1;
  if (spec->push_codec.kind != PS_CODEC_RAW && !(t->resid = ps__rowmap_new(t->rowlen))) {
    free(t);
    return NULL;
  }
  pthread_mutex_init(&t->mu, NULL);
  return t;
}

void ps__cx_table_free(ps__cx_table *t) {
  if (!t) return;
  ps__rowmap_free(t->resid);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

int ps__cx_stat(const ps__cx_table *t, const char *which, double *value) {
  const uint64_t *c = !strcmp(which, "push_raw_bytes")    ? &t->push_raw
                      : !strcmp(which, "push_wire_bytes") ? &t->push_wire
                      : !strcmp(which, "pull_raw_bytes")  ? &t->pull_raw
                      : !strcmp(which, "pull_wire_bytes") ? &t->pull_wire
                                                          : NULL;
  if (!c) return -1;
  *value = (double)__atomic_load_n(c, __ATOMIC_RELAXED);
  return 0;
}

/* A row's stamp: its last float (l = the table's rowlen). */
static inline uint32_t stamp_of(const float *row, uint32_t l) {
  uint32_t s;
  memcpy(&s, row + l - 1, 4);
  return s;
}
static inline void stamp_set(float *row, uint32_t l, uint32_t s) { memcpy(row + l - 1, &s, 4); }

/* A run of n values at position pos of a part's vector that belong to residual row key,
 * starting at `within` in that row. */
typedef struct run {
  uint64_t key;
  uint32_t within, n;
  size_t pos;
} run;

/* The runs of a part: sparse, one per key (n keys of width w); dense, each segment cut
 * at slice edges. Calls fn for each; stops at a nonzero return. */
static int walk_runs(int dense, const uv_buf_t *keys, uint32_t w, int (*fn)(void *, const run *), void *arg) {
  size_t nk = keys->len / 8, pos = 0;
  const uint8_t *kb = (const uint8_t *)keys->base;
  if (!dense) {
    for (size_t j = 0; j < nk; j++, pos += w) {
      run r = {ps__get_u64(kb + 8 * j), 0, w, pos};
      int rc = fn(arg, &r);
      if (rc) return rc;
    }
    return 0;
  }
  for (size_t j = 0; j + 1 < nk; j += 2) {
    uint64_t off = ps__get_u64(kb + 8 * j), cnt = ps__get_u64(kb + 8 * (j + 1));
    while (cnt) {
      uint32_t within = (uint32_t)(off % w), n = w - within;
      if (n > cnt) n = (uint32_t)cnt;
      run r = {off / w, within, n, pos};
      int rc = fn(arg, &r);
      if (rc) return rc;
      off += n, cnt -= n, pos += n;
    }
  }
  return 0;
}

typedef struct fb_arg {
  ps__cx_table *t;
  float *vals;     /* the part's vector: gradient + residual, then what encoding lost */
  float *score;    /* scored topk: each value's t-statistic, SENT once sent; else NULL */
  uint32_t stamp;  /* 2 * push number */
} fb_arg;

/* The score of a value once sent. A finite score |gathered| / sqrt(S) is at most
 * sqrt(places gathered), so an unsent value scores +Inf only if its gradient was not
 * finite or its S underflowed; restarting its S then does no harm. */
#define SENT INFINITY

/* Feedback in: a row's residual is added once per push (a key repeated in one push
 * takes it at its first place only). When scored, each place's gradient also adds its
 * square to the row's sums (non-finite ones do not), and gets its score: the gathered
 * value over the root of its sum of squares (the value itself where that sum is 0,
 * which a finite value reaches only by being 0). */
static int fb_add(void *arg, const run *r) {
  fb_arg *a = arg;
  int created;
  float *row = ps__rowmap_upsert(a->t->resid, r->key, &created);
  if (!row) return PS_ERR_NOMEM;
  uint32_t w = a->t->width, l = a->t->rowlen;
  int repeat = stamp_of(row, l) == a->stamp; /* a key's later place in this push */
  float *v = a->vals + r->pos; /* a new row is zero */
  if (a->score) {
    float *ss = row + w + r->within, *sc = a->score + r->pos;
    for (uint32_t i = 0; i < r->n; i++)
      if (isfinite(v[i])) ss[i] += v[i] * v[i];
    if (!repeat)
      for (uint32_t i = 0; i < r->n; i++) v[i] += row[r->within + i];
    for (uint32_t i = 0; i < r->n; i++) sc[i] = ss[i] > 0.0f ? v[i] / sqrtf(ss[i]) : v[i];
  } else if (!repeat) {
    const float *res = row + r->within;
    for (uint32_t i = 0; i < r->n; i++) v[i] += res[i];
  }
  stamp_set(row, l, a->stamp);
  return 0;
}

/* Feedback out: what this push's encoding lost becomes the row's residual (summed over
 * a key's places). Only the runs' part of a dense row is touched. */
static int fb_store(void *arg, const run *r) {
  fb_arg *a = arg;
  uint32_t w = a->t->width, l = a->t->rowlen;
  float *row = ps__rowmap_get(a->t->resid, r->key);
  PS_ASSERT(row);
  const float *e = a->vals + r->pos;
  float *res = row + r->within;
  if (stamp_of(row, l) != a->stamp + 1) {
    memcpy(res, e, (size_t)r->n * 4);
    stamp_set(row, l, a->stamp + 1);
  } else {
    for (uint32_t i = 0; i < r->n; i++) res[i] += e[i];
  }
  if (a->score) { /* a value sent starts gathering afresh */
    float *ss = row + w + r->within;
    const float *sc = a->score + r->pos;
    for (uint32_t i = 0; i < r->n; i++)
      if (sc[i] == SENT) ss[i] = 0.0f;
  }
  return 0;
}

/* A part's push values: send[0] keys or segments, then value regions. */
static size_t part_values(const part *p, float *out) {
  size_t n = 0;
  for (unsigned j = 1; j < p->nsend; j++) {
    if (out) memcpy(out + n, p->send[j].base, p->send[j].len);
    n += p->send[j].len / 4;
  }
  return n;
}

int ps__cx_encode_push(ps_ctx *ctx, ps_req *r, const table_info *ti) {
  const ps__codec *cx = &ti->push_codec;
  ps__cx_table *t = ti->cx;
  int dense = ti->kind == PS_DENSE;
  size_t total = 0, maxn = 0;
  for (unsigned i = 0; i < r->nparts; i++) {
    size_t n = part_values(&r->parts[i], NULL);
    size_t sz = ps__codec_size(cx, n);
    if (sz == SIZE_MAX) return ps__fail(PS_ERR_TOO_LARGE, "push of %zu values is too large to encode", n);
    total += sz;
    maxn = n > maxn ? n : maxn;
  }
  if (!maxn) return 0;
  int scored = t->scored;
  uint8_t *block = ps__malloc(total);
  float *vals = ps__ubuf_get(ctx, maxn * 4), *score = scored ? ps__ubuf_get(ctx, maxn * 4) : NULL;
  if (!block || !vals || (scored && !score)) {
    free(block);
    ps__ubuf_put(ctx, vals, maxn * 4);
    ps__ubuf_put(ctx, score, maxn * 4);
    return ps__fail(PS_ERR_NOMEM, "out of memory encoding a push");
  }
  int rc = 0;
  size_t at = 0;
  pthread_mutex_lock(&t->mu);
  for (unsigned i = 0; i < r->nparts && !rc; i++) {
    part *p = &r->parts[i];
    size_t n = part_values(p, vals), len = 0;
    if (!n) continue;
    fb_arg a = {t, vals, score, 2u * ++t->pushes};
    if (a.stamp == 0) a.stamp = 2u * ++t->pushes; /* after a wrap: never the stamp of a new row */
    if ((rc = walk_runs(dense, &p->send[0], t->width, fb_add, &a))) {
      ps__fail(rc, "out of memory keeping a push's residual");
      break;
    }
    /* on failure the residuals are untouched (the sums of squares count this push) */
    if ((rc = scored ? ps__codec_encode_topk_by(cx, vals, score, n, block + at, &len, vals)
                     : ps__codec_encode(cx, vals, n, block + at, &len, vals)))
      break;
    for (size_t j = 0; scored && j < len / 8; j++) score[ps__get_u32(block + at + 8 * j)] = SENT;
    walk_runs(dense, &p->send[0], t->width, fb_store, &a);
    p->send[1] = uv_buf_init((char *)block + at, 0);
    p->send[1].len = len;
    p->nsend = 2;
    p->hdr.codec = (uint8_t)cx->kind;
    at += len;
    __atomic_add_fetch(&t->push_raw, (uint64_t)n * 4, __ATOMIC_RELAXED);
    __atomic_add_fetch(&t->push_wire, (uint64_t)len, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&t->mu);
  ps__ubuf_put(ctx, vals, maxn * 4);
  ps__ubuf_put(ctx, score, maxn * 4);
  if (rc) {
    free(block);
    return rc;
  }
  r->cx_block = block;
  return 0;
}

int ps__cx_setup_pull(ps_req *r, const table_info *ti) {
  const ps__codec *cx = &ti->pull_codec;
  size_t total = 0;
  for (unsigned i = 0; i < r->nparts; i++) total += ps__codec_size(cx, r->parts[i].recv_len / 4);
  uint8_t *block = ps__malloc(total ? total : 1);
  if (!block) return ps__fail(PS_ERR_NOMEM, "out of memory for an encoded pull");
  size_t at = 0;
  for (unsigned i = 0; i < r->nparts; i++) {
    part *p = &r->parts[i];
    if (!p->recv) continue;
    size_t n = p->recv_len / 4, len = ps__codec_size(cx, n);
    p->cx_dst = p->recv;
    p->cx_ndst = p->nrecv;
    p->cx_n = n;
    p->cx_codec = cx->kind;
    p->cx_recv = uv_buf_init((char *)block + at, 0);
    p->cx_recv.len = len;
    p->recv = &p->cx_recv;
    p->nrecv = 1;
    p->recv_len = len;
    at += len;
  }
  r->cx_block = block;
  r->cx_table = ti->cx;
  return 0;
}

int ps__cx_reply_check(const part *p, const ps__frame_hdr *h) {
  uint32_t want = p->cx_dst ? p->cx_codec : PS_CODEC_RAW;
  if (h->status == 0 && p->recv && h->codec != want)
    return ps__fail(PS_ERR_PROTO, "pull reply encoded as %s where %s was expected", ps__codec_name(h->codec),
                    ps__codec_name(want));
  return 0;
}

void ps__cx_pull_done(ps_req *r) {
  for (unsigned i = 0; i < r->nparts; i++) {
    part *p = &r->parts[i];
    if (!p->cx_dst || !p->cx_n) continue;
    const uint8_t *enc = (const uint8_t *)p->cx_recv.base;
    size_t n = p->cx_n;
    float *tmp = p->cx_ndst == 1 ? (float *)(void *)p->cx_dst[0].base : ps__malloc(n * 4);
    int rc = tmp ? ps__codec_decode(p->cx_codec, enc, p->cx_recv.len, tmp, n) : ps__fail(PS_ERR_NOMEM, "out of memory");
    if (!rc && p->cx_ndst != 1) {
      size_t at = 0;
      for (unsigned j = 0; j < p->cx_ndst; j++) {
        memcpy(p->cx_dst[j].base, tmp + at, p->cx_dst[j].len);
        at += p->cx_dst[j].len / 4;
      }
    }
    if (p->cx_ndst != 1) free(tmp);
    if (rc) {
      char msg[256];
      snprintf(msg, sizeof msg, "pull reply from server %u: %s", p->target, ps_errmsg());
      ps__req_set_error(r, rc, msg);
      return;
    }
    if (r->cx_table) {
      __atomic_add_fetch(&r->cx_table->pull_raw, (uint64_t)n * 4, __ATOMIC_RELAXED);
      __atomic_add_fetch(&r->cx_table->pull_wire, (uint64_t)p->cx_recv.len, __ATOMIC_RELAXED);
    }
  }
}
