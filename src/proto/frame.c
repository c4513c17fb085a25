/*
 * frame.c - frame header codec and control-body helpers (no I/O).
 */
#include "proto/frame.h"

#include <string.h>

#include "common/common.h"
#include "proto/auth.h"

static const char *const type_names[PS_MSG__MAX] = {
    [PS_MSG_HELLO] = "hello",     [PS_MSG_MEMBERSHIP] = "membership",
    [PS_MSG_HEARTBEAT] = "heartbeat", [PS_MSG_DECLARE] = "declare",
    [PS_MSG_CREATE] = "create",   [PS_MSG_BARRIER] = "barrier",
    [PS_MSG_METRIC] = "metric",   [PS_MSG_LEAVE] = "leave",
    [PS_MSG_PUSH] = "push",       [PS_MSG_PULL] = "pull",
    [PS_MSG_PUSH_DENSE] = "push-dense", [PS_MSG_PULL_DENSE] = "pull-dense",
    [PS_MSG_CLOCK] = "clock",     [PS_MSG_ERROR] = "error",
    [PS_MSG_STATS] = "stats",     [PS_MSG_TASK_INIT] = "task-init",
    [PS_MSG_TASK_NEXT] = "task-next", [PS_MSG_TASK_DONE] = "task-done",
    [PS_MSG_CKPT] = "ckpt",       [PS_MSG_CHECKPOINT] = "checkpoint",
    [PS_MSG_FORWARD] = "forward", [PS_MSG_FORWARD_DENSE] = "forward-dense",
    [PS_MSG_STALL] = "stall", [PS_MSG_FORWARD_AGG] = "forward-agg", [PS_MSG_FORWARD_ROUND] = "forward-round",
    [PS_MSG_REPLAYED] = "replayed", [PS_MSG_NODE_METRICS] = "node-metrics",
    [PS_MSG_SYNC_ROWS] = "sync-rows", [PS_MSG_SYNC_DONE] = "sync-done", [PS_MSG_SYNCED] = "synced",
};

const char *ps__frame_type_name(uint8_t type) {
  uint8_t t = type & (uint8_t)~PS_FRAME_REPLY;
  if (t == PS_MSG_AUTH_HELLO) return "auth-hello";
  if (t == PS_MSG_AUTH_PROOF) return "auth-proof";
  return (t > 0 && t < PS_MSG__MAX && type_names[t]) ? type_names[t] : "unknown";
}

int ps__frame_is_data(uint8_t type) {
  uint8_t t = type & (uint8_t)~PS_FRAME_REPLY;
  return t == PS_MSG_PUSH || t == PS_MSG_PULL || t == PS_MSG_PUSH_DENSE || t == PS_MSG_PULL_DENSE ||
         t == PS_MSG_FORWARD || t == PS_MSG_FORWARD_DENSE || t == PS_MSG_FORWARD_AGG ||
         t == PS_MSG_FORWARD_ROUND;
}

void ps__frame_encode(const ps__frame_hdr *h, uint8_t *o) {
  uint32_t lr_bits;
  memcpy(&lr_bits, &h->lr, 4);
  ps__put_u32(o + 0, PS_FRAME_MAGIC);
  o[4] = PS_FRAME_VERSION;
  o[5] = h->type;
  o[6] = (uint8_t)((h->flags & PS_FLAG_MASK) | ((h->xport << PS_XPORT_SHIFT) & PS_XPORT_MASK));
  o[7] = h->codec;
  int push = ps__frame_is_push_req(h->type);
  ps__put_u32(o + 8, push ? h->seq : (uint32_t)h->status);
  ps__put_u32(o + 12, h->sender);
  ps__put_u64(o + 16, h->req_id);
  ps__put_u32(o + 24, h->table);
  ps__put_u32(o + 28, h->batch);
  ps__put_u64(o + 32, (uint64_t)h->clock);
  ps__put_u64(o + 40, push ? h->inc : h->epoch);
  ps__put_u32(o + 48, h->nkeys);
  ps__put_u32(o + 52, lr_bits);
  ps__put_u64(o + 56, h->payload_len);
}

int ps__frame_decode(const uint8_t *in, uint64_t max_payload, ps__frame_hdr *h) {
  uint32_t lr_bits;
  if (ps__get_u32(in) != PS_FRAME_MAGIC) return ps__fail(PS_ERR_PROTO, "bad frame magic 0x%08x", ps__get_u32(in));
  if (in[4] != PS_FRAME_VERSION) return ps__fail(PS_ERR_PROTO, "unsupported frame version %u", in[4]);
  memset(h, 0, sizeof *h);
  h->type = in[5];
  h->flags = in[6] & PS_FLAG_MASK;
  h->xport = (uint8_t)((in[6] & PS_XPORT_MASK) >> PS_XPORT_SHIFT);
  h->codec = in[7];
  if (ps__frame_is_push_req(h->type))
    h->seq = ps__get_u32(in + 8); /* a push request's identity; its status is 0 */
  else
    h->status = (int32_t)ps__get_u32(in + 8);
  h->sender = ps__get_u32(in + 12);
  h->req_id = ps__get_u64(in + 16);
  h->table = ps__get_u32(in + 24);
  h->batch = ps__get_u32(in + 28);
  h->clock = (int64_t)ps__get_u64(in + 32);
  if (ps__frame_is_push_req(h->type))
    h->inc = ps__get_u64(in + 40);
  else
    h->epoch = ps__get_u64(in + 40);
  h->nkeys = ps__get_u32(in + 48);
  lr_bits = ps__get_u32(in + 52);
  memcpy(&h->lr, &lr_bits, 4);
  h->payload_len = ps__get_u64(in + 56);

  uint8_t t = h->type & (uint8_t)~PS_FRAME_REPLY;
  if (t == 0 || (t >= PS_MSG__MAX && !ps__frame_is_auth(t))) return ps__fail(PS_ERR_PROTO, "unknown frame type %u", h->type);
  if (h->status < 0 || h->status >= PS_ERR__COUNT)
    return ps__fail(PS_ERR_PROTO, "bad status %d in %s frame", h->status, ps__frame_type_name(h->type));
  /* Only replies and ERROR frames carry a status. A request with one would be checked
   * as a control frame below and skip the data-frame rules its handler relies on. */
  if (h->status != 0 && !(h->type & PS_FRAME_REPLY) && h->type != PS_MSG_ERROR)
    return ps__fail(PS_ERR_PROTO, "status %d in a %s request", h->status, ps__frame_type_name(h->type));
  if (in[6] & ~(PS_FLAG_MASK | PS_XPORT_MASK)) return ps__fail(PS_ERR_PROTO, "reserved flag bits set (0x%02x)", in[6]);
  if (h->xport > PS_XPORT_PEER_MEM) return ps__fail(PS_ERR_PROTO, "unknown value transport %u", h->xport);
  if (h->codec >= PS_CODEC__MAX) return ps__fail(PS_ERR_PROTO, "unknown codec %u", h->codec);
  if (h->payload_len > max_payload)
    return ps__fail(PS_ERR_TOO_LARGE, "%s frame payload of %llu bytes exceeds the limit of %llu",
                    ps__frame_type_name(h->type), (unsigned long long)h->payload_len,
                    (unsigned long long)max_payload);
  if (ps__frame_is_data(h->type) && h->status == 0) {
    int reply = (h->type & PS_FRAME_REPLY) != 0;
    /* A forward's keys follow its prefix (ps__fwd); the prefix counts as keys here. */
    uint64_t pre = ps__frame_is_forward(h->type) && !reply ? PS_FWD_PREFIX : 0;
    uint64_t kbytes = (uint64_t)h->nkeys * 8u + pre;
    if (reply && h->nkeys != 0) return ps__fail(PS_ERR_PROTO, "keys in a %s reply", ps__frame_type_name(h->type));
    if (kbytes > h->payload_len)
      return ps__fail(PS_ERR_PROTO, "%u keys do not fit a payload of %llu bytes", h->nkeys,
                      (unsigned long long)h->payload_len);
    /* Encoded values (proto/codec.h) are checked against their count where it is known:
     * by the handler, which knows the table. */
    if (h->codec == PS_CODEC_RAW && (h->payload_len - kbytes) % 4u)
      return ps__fail(PS_ERR_PROTO, "values of %llu bytes are not whole floats",
                      (unsigned long long)(h->payload_len - kbytes));
    if (h->codec != PS_CODEC_RAW) {
      int carries = reply ? (t == PS_MSG_PULL || t == PS_MSG_PULL_DENSE) : (t == PS_MSG_PUSH || t == PS_MSG_PUSH_DENSE);
      if (!carries) return ps__fail(PS_ERR_PROTO, "codec %u on a %s frame", h->codec, ps__frame_type_name(h->type));
      if (h->xport != PS_XPORT_INLINE)
        return ps__fail(PS_ERR_PROTO, "codec %u with value transport %u: encoded values travel inline", h->codec,
                        h->xport);
    }
    /* Of the forwards only a dense push's and a sync round's may name their values in
     * the sending server's memory (a round's tail follows its rows' keys, which the
     * handler finds: checked there). */
    if (ps__frame_is_forward(h->type) && h->xport != PS_XPORT_INLINE &&
        (reply || (t != PS_MSG_FORWARD_DENSE && t != PS_MSG_FORWARD_ROUND)))
      return ps__fail(PS_ERR_PROTO, "value transport %u on a %s frame", h->xport, ps__frame_type_name(h->type));
    if ((t == PS_MSG_PUSH_DENSE || t == PS_MSG_PULL_DENSE || t == PS_MSG_FORWARD_DENSE) && !reply && (h->nkeys % 2u))
      return ps__fail(PS_ERR_PROTO, "dense segment list has an odd length %u", h->nkeys);
    if (h->xport == PS_XPORT_PEER_MEM && t != PS_MSG_FORWARD_ROUND) {
      if (t != PS_MSG_PULL_DENSE && ((t != PS_MSG_PUSH_DENSE && t != PS_MSG_FORWARD_DENSE) || reply))
        return ps__fail(PS_ERR_PROTO, "peer-memory transport on a %s frame", ps__frame_type_name(h->type));
      if (reply ? h->payload_len != 0 : (h->payload_len - kbytes) % 16u || h->payload_len - kbytes < 16u)
        return ps__fail(PS_ERR_PROTO, "a peer-memory %s carries %llu bytes after its keys", reply ? "reply" : "request",
                        (unsigned long long)(h->payload_len - kbytes));
    }
  } else {
    if (h->xport != PS_XPORT_INLINE && h->status == 0)
      return ps__fail(PS_ERR_PROTO, "value transport %u on a %s frame", h->xport, ps__frame_type_name(h->type));
    if (h->codec != PS_CODEC_RAW)
      return ps__fail(PS_ERR_PROTO, "codec %u on a %s frame", h->codec, ps__frame_type_name(h->type));
    if (h->payload_len > PS_CTRL_MAX_BODY)
      return ps__fail(PS_ERR_TOO_LARGE, "%s control body of %llu bytes exceeds %u",
                      ps__frame_type_name(h->type), (unsigned long long)h->payload_len, PS_CTRL_MAX_BODY);
    if (h->nkeys != 0) return ps__fail(PS_ERR_PROTO, "keys in a %s frame", ps__frame_type_name(h->type));
  }
  return 0;
}

void ps__wbuf_init(ps__wbuf *w) { memset(w, 0, sizeof *w); }
void ps__wbuf_free(ps__wbuf *w) {
  free(w->data);
  memset(w, 0, sizeof *w);
}

static uint8_t *wbuf_grow(ps__wbuf *w, size_t n) {
  if (w->oom || n == 0) return NULL; /* n == 0 on an empty buffer: no NULL + 0 */
  if (w->len + n > w->cap) {
    size_t cap = w->cap ? w->cap : 64;
    while (cap < w->len + n) cap *= 2;
    uint8_t *d = ps__realloc(w->data, cap);
    if (!d) {
      w->oom = 1;
      return NULL;
    }
    w->data = d;
    w->cap = cap;
  }
  uint8_t *p = w->data + w->len;
  w->len += n;
  return p;
}

void ps__wbuf_u8(ps__wbuf *w, uint8_t v) {
  uint8_t *p = wbuf_grow(w, 1);
  if (p) *p = v;
}
void ps__wbuf_u32(ps__wbuf *w, uint32_t v) {
  uint8_t *p = wbuf_grow(w, 4);
  if (p) ps__put_u32(p, v);
}
void ps__wbuf_u64(ps__wbuf *w, uint64_t v) {
  uint8_t *p = wbuf_grow(w, 8);
  if (p) ps__put_u64(p, v);
}
void ps__wbuf_f64(ps__wbuf *w, double v) {
  uint64_t b;
  memcpy(&b, &v, 8);
  ps__wbuf_u64(w, b);
}
void ps__wbuf_bytes(ps__wbuf *w, const void *src, size_t n) {
  uint8_t *p = wbuf_grow(w, n);
  if (p && n) memcpy(p, src, n);
}
void ps__wbuf_str(ps__wbuf *w, const char *s) {
  size_t n = s ? strlen(s) : 0;
  ps__wbuf_u32(w, (uint32_t)n);
  ps__wbuf_bytes(w, s, n);
}

void ps__rbuf_init(ps__rbuf *r, const void *p, size_t len) {
  r->p = p;
  r->len = len;
  r->off = 0;
  r->err = 0;
}

static const uint8_t *rbuf_take(ps__rbuf *r, size_t n) {
  if (r->err || r->len - r->off < n) {
    r->err = 1;
    return NULL;
  }
  const uint8_t *p = r->p + r->off;
  r->off += n;
  return p;
}

uint8_t ps__rbuf_u8(ps__rbuf *r) {
  const uint8_t *p = rbuf_take(r, 1);
  return p ? *p : 0;
}
uint32_t ps__rbuf_u32(ps__rbuf *r) {
  const uint8_t *p = rbuf_take(r, 4);
  return p ? ps__get_u32(p) : 0;
}
uint64_t ps__rbuf_u64(ps__rbuf *r) {
  const uint8_t *p = rbuf_take(r, 8);
  return p ? ps__get_u64(p) : 0;
}
double ps__rbuf_f64(ps__rbuf *r) {
  uint64_t b = ps__rbuf_u64(r);
  double v;
  memcpy(&v, &b, 8);
  return v;
}
void ps__rbuf_str(ps__rbuf *r, char *out, size_t cap) {
  uint32_t n = ps__rbuf_u32(r);
  if (r->err || n >= cap) {
    r->err = 1;
    if (cap) out[0] = '\0';
    return;
  }
  const uint8_t *p = rbuf_take(r, n);
  if (!p) {
    if (cap) out[0] = '\0';
    return;
  }
  memcpy(out, p, n);
  out[n] = '\0';
}
