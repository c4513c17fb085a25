/*
 * frame.h - the pshard wire format: frame header encode/decode and body helpers.
 *
 * No I/O. Every frame is a fixed 64-byte little-endian header followed by
 * `payload_len` bytes: for data frames the key array (nkeys x u64) then the values
 * (f32); for control frames a body written with the ps__wbuf/ps__rbuf helpers.
 * A push request (PUSH, PUSH_DENSE) carries its identity where other frames carry
 * their status and epoch: the push's sequence number in bytes 8-11 and the worker's
 * incarnation in bytes 40-47 (ps__frame_is_push_req; shard/once.h says what for).
 * docs/protocol.md is the normative description; keep the two in step.
 */
#ifndef PS_FRAME_H
#define PS_FRAME_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PS_FRAME_MAGIC 0x44485350u /* "PSHD" little-endian */
#define PS_FRAME_VERSION 3
#define PS_FRAME_HDR_SIZE 64
#define PS_FRAME_REPLY 0x80       /* type bit: this frame answers a request */
#define PS_CTRL_MAX_BODY (1u << 20) /* control bodies are small */

/* Frame types. Opcodes are never reused. */
enum {
  PS_MSG_HELLO = 1,      /* node -> scheduler: register */
  PS_MSG_MEMBERSHIP = 2, /* scheduler -> node: members, ring epoch, counts */
  PS_MSG_HEARTBEAT = 3,  /* node -> scheduler */
  PS_MSG_DECLARE = 4,    /* worker -> scheduler: declare a table, get its id */
  PS_MSG_CREATE = 5,     /* worker -> server: create table (idempotent) */
  PS_MSG_BARRIER = 6,    /* worker -> scheduler */
  PS_MSG_METRIC = 7,     /* worker -> scheduler (no reply) */
  PS_MSG_LEAVE = 8,      /* node -> scheduler: clean exit (no reply) */
  PS_MSG_PUSH = 9,       /* sparse push: keys + rows */
  PS_MSG_PULL = 10,      /* sparse pull: keys; reply: rows */
  PS_MSG_PUSH_DENSE = 11,/* dense push: segments (offset,count pairs) + values */
  PS_MSG_PULL_DENSE = 12,/* dense pull: segments; reply: values */
  PS_MSG_CLOCK = 13,     /* worker -> server: clock advanced (no reply) */
  PS_MSG_ERROR = 14,     /* reply-less error notice before a close */
  PS_MSG_STATS = 15,     /* anyone -> node: counters as text (reply) */
  PS_MSG_TASK_INIT = 16, /* worker -> scheduler: partitions (table), epochs (batch) */
  PS_MSG_TASK_NEXT = 17, /* worker -> scheduler; reply: partition (table), epoch (clock) */
  PS_MSG_TASK_DONE = 18, /* worker -> scheduler: partition (table), epoch (clock) */
  PS_MSG_CKPT = 19,      /* scheduler -> server: cut and write checkpoint (ps__ckpt_req); reply: ps__ckpt_done */
  PS_MSG_CHECKPOINT = 20,/* anyone -> scheduler: take a checkpoint at a clock; reply when it is complete */
  PS_MSG_FORWARD = 21,   /* server -> next server of a chain: a sparse push applied by the sender (ps__fwd) */
  PS_MSG_FORWARD_DENSE = 22, /* the same for a dense push */
  PS_MSG_STALL = 23,     /* server -> scheduler: workers holding a sync round back (ps__stall; no reply) */
  PS_MSG_FORWARD_AGG = 24,   /* server -> next server of a chain: an aggregation buffer applied by the sender */
  PS_MSG_FORWARD_ROUND = 25, /* server -> next server of a chain: a sync round applied by the sender */
  PS_MSG_REPLAYED = 26,      /* worker -> server: the pushes to a dead server not known to be on every copy */
  PS_MSG_NODE_METRICS = 27, /* node -> scheduler: its metrics as Prometheus text, about once a second (no reply) */
  PS_MSG_SYNC_ROWS = 28,     /* server -> a syncing replacement: rows of the chains it copies (reply: ok) */
  PS_MSG_SYNC_DONE = 29,     /* server -> a syncing replacement: the copy is complete (reply: ok) */
  PS_MSG_SYNCED = 30,        /* replacement -> scheduler: every copy it waited for is in (no reply) */
  PS_MSG__MAX = 31
};

/* Header byte 6 holds the flags (bits 0-3, hdr.flags), the value transport (bits 4-5,
 * hdr.xport) and two reserved bits (6-7, zero). */
enum {
  PS_FLAG_NONE = 0,
  PS_FLAG_DROPPED = 1, /* push reply: acknowledged but not applied (late under sync:M) */
  /* Push request under replicas: the chain's tail may answer it itself. Push reply from
   * the tail of the push's chain, straight to the worker: its batch field names the
   * chain's head, which the worker sent the push to. In a FORWARD's answer up the
   * chain: the worker has been answered so (the head does not answer). */
  PS_FLAG_TAIL = 2,
  /* CKPT reply from a server still writing its file: rows went out since its last word
   * (no body; the final answer comes later, without the flag). */
  PS_FLAG_PROGRESS = 4,
  /* Push request by peer memory under replicas: its values are the copy the worker keeps
   * of it for a failover (client/keep.c), which the worker does not change before the
   * push's round is on every copy: the head may read them where they lie. */
  PS_FLAG_KEPT = 8
};
#define PS_FLAG_MASK 0x0fu
#define PS_XPORT_SHIFT 4
#define PS_XPORT_MASK 0x30u

/* Value transports (hdr.xport): where a data frame's values travel. */
enum {
  PS_XPORT_INLINE = 0,   /* in the frame, after the keys */
  /* Dense push/pull requests over a same-host AF_UNIX connection only: after the
   * segment list come the expiry, the shared-buffer hint and (u64 address, u64 length)
   * pairs naming the sender's own buffers, which the server reads (push) or writes
   * (pull) in place (net/peermem.c, net/shared.c). A pull's reply with this transport
   * has no payload: its values are already in those buffers; a server may instead
   * answer with the values inline. */
  PS_XPORT_PEER_MEM = 1
};

/* Value encodings (hdr.codec): how the values are encoded, wherever they travel. */
enum {
  PS_CODEC_RAW = 0,      /* little-endian f32 */
  PS_CODEC_FP16 = 1,     /* IEEE binary16, 2 bytes a value (proto/codec.h) */
  PS_CODEC_BF16 = 2,     /* bfloat16 (the top half of an f32), 2 bytes a value */
  PS_CODEC_INT8 = 3,     /* per block of 256 values an f32 scale, then one int8 a value */
  PS_CODEC_TOPK = 4,     /* (u32 index, f32 value) pairs, indices increasing; pushes only */
  PS_CODEC__MAX = 5
};

typedef struct ps__frame_hdr {
  uint8_t type;      /* PS_MSG_* , | PS_FRAME_REPLY for answers */
  uint8_t flags;     /* PS_FLAG_* (4 bits) */
  uint8_t xport;     /* value transport: PS_XPORT_* (2 bits, in the flags byte) */
  uint8_t codec;     /* value encoding: PS_CODEC_* */
  int32_t status;    /* ps_err code in replies, 0 in requests */
  uint32_t seq;      /* push requests, in status's place: the push's sequence number */
  uint64_t inc;      /* push requests, in epoch's place: the worker's incarnation (0: none) */
  uint32_t sender;   /* node id of the sender (0 before registration) */
  uint64_t req_id;   /* matches a reply to its request; 0 = no reply wanted */
  uint32_t table;
  uint32_t batch;    /* examples behind a push */
  int64_t clock;     /* worker clock of a push/pull/clock */
  uint64_t epoch;    /* membership epoch (0 in push requests, which carry inc there) */
  uint32_t nkeys;    /* u64 entries in the key array */
  float lr;          /* push learning rate; negative = table's schedule */
  uint64_t payload_len; /* bytes after the header */
} ps__frame_hdr;

/* Write h into out[PS_FRAME_HDR_SIZE]. */
void ps__frame_encode(const ps__frame_hdr *h, uint8_t *out);
/* Parse and validate a header: magic, version, known type, payload_len <= max_payload,
 * key array fits the payload, values a whole number of floats for data frames,
 * control bodies <= PS_CTRL_MAX_BODY. Returns 0 or PS_ERR_PROTO / PS_ERR_TOO_LARGE
 * (with a message via ps__fail). */
int ps__frame_decode(const uint8_t *in, uint64_t max_payload, ps__frame_hdr *h);
/* Does this type carry keys and float values? */
int ps__frame_is_data(uint8_t type);
/* Is this a push request (PUSH, PUSH_DENSE or a FORWARD of one, not a reply): seq and
 * inc in the header? */
static inline int ps__frame_is_push_req(uint8_t type) {
  return type == PS_MSG_PUSH || type == PS_MSG_PUSH_DENSE || type == PS_MSG_FORWARD || type == PS_MSG_FORWARD_DENSE;
}
/* Is this a push answer from the tail of the push's chain (PS_FLAG_TAIL), for a
 * request the worker sent to the chain's head (named by its batch field)? */
static inline int ps__frame_is_tail_answer(const ps__frame_hdr *h) {
  return (h->flags & PS_FLAG_TAIL) &&
         (h->type == (PS_MSG_PUSH | PS_FRAME_REPLY) || h->type == (PS_MSG_PUSH_DENSE | PS_FRAME_REPLY));
}
static inline int ps__frame_is_forward(uint8_t type) {
  uint8_t t = type & (uint8_t)~PS_FRAME_REPLY;
  return t == PS_MSG_FORWARD || t == PS_MSG_FORWARD_DENSE || t == PS_MSG_FORWARD_AGG || t == PS_MSG_FORWARD_ROUND;
}

/* A FORWARD request's body starts with this prefix, then the push's keys and values:
 * the ring epoch the sender forwarded under (a receiver at another epoch refuses it),
 * the worker that pushed (the header's sender is the forwarding server), the server the
 * worker sent the push to (the chain's head), the optimiser step the sender applied it
 * with (0: none, the receiver takes its own) and the worker's request id (0: the
 * forward answers no worker request: a buffer's, a round's). The header carries the
 * push's table, batch, clock, nkeys, identity (seq, inc) and the learning rate the
 * sender applied. The tail answers the worker's request itself (PS_FLAG_TAIL). */
#define PS_FWD_PREFIX 32u
typedef struct ps__fwd {
  uint64_t epoch;
  uint32_t worker;
  uint32_t head;
  uint64_t step;
  uint64_t up_req;
} ps__fwd;
static inline void ps__fwd_put(uint8_t *p, const ps__fwd *f);
/* A FORWARD_AGG request's body: the ps__fwd prefix (worker 0, the step the buffer was
 * applied with), then u32 nids, u32 per_row (rows divide by their weight sum), f64 the
 * global batch; nids push identities of PS_FWD_AGG_ID bytes each (u32 worker, u32 seq,
 * u64 incarnation, u32 chain, u32 zero: the pushes the buffer combined, each with the
 * chain of its keys: ring route, or 0x80000000 | the dense run); then the header's
 * nkeys keys (u64: row ids, or a dense table's slices) and their rows, width + 1 floats
 * each (the weighted sums, then the weight sum). The header carries the table and the
 * rate the buffer was applied with. */
#define PS_FWD_AGG_PREFIX 16u
/* A FORWARD_ROUND request's body: the ps__fwd prefix (worker 0, the round's step), then
 * i64 round, f64 denominator, f64 global batch, u32 nchains, u32 zero; nchains u32 chain
 * names (padded with a zero to a multiple of two: the rows' chains, whose copies are at
 * this round once the frame is applied; only the last frame of a round names them, the
 * frames before it carry rows only); then the header's nkeys keys (row ids, or a dense
 * table's slices) and their rows, width floats each, as applied by the head. */
#define PS_FWD_ROUND_PREFIX 32u
/* A REPLAYED body: u32 the dead server, u32 n, then n entries of PS_REPLAYED_ENTRY bytes:
 * u32 table, u32 batch, i64 clock, u64 incarnation, u32 seq, u32 nchain, u32 chain[3]
 * (the push's chain, by server ids), u32 zero. */
#define PS_REPLAYED_ENTRY 48u
/* A SYNC_ROWS body (header: table, batch = n rows): u32 stream, u32 row_floats, the
 * table's declaration (ps__declare_encode, u32-length-prefixed), then n u64 keys (row
 * ids, or a dense table's slices) and n rows of row_floats floats (parameters and
 * optimiser state, whole). A SYNC_DONE body: u32 stream, u32 ntables, then per table
 * u32 id, u32 zero, u64 step, i64 version (as at the cut), then the sender's
 * exactly-once windows (ps__once_set_encode). */
#define PS_SYNC_ROWS_PREFIX 8u
#define PS_FWD_AGG_ID 24u
#define PS_FWD_DENSE_CHAIN 0x80000000u
static inline void ps__fwd_get(const uint8_t *p, ps__fwd *f);
const char *ps__frame_type_name(uint8_t type);

/* Little-endian put/get. */
static inline void ps__put_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void ps__put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void ps__put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t ps__get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
/* The gets are one (unaligned) load, swapped on a big-endian host: GCC 12 compiles the
 * byte-by-byte form to eight loads, which shows in loops over millions of keys. */
static inline uint32_t ps__get_u32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap32(v);
#endif
  return v;
}
static inline uint64_t ps__get_u64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

static inline void ps__fwd_put(uint8_t *p, const ps__fwd *f) {
  ps__put_u64(p, f->epoch);
  ps__put_u32(p + 8, f->worker);
  ps__put_u32(p + 12, f->head);
  ps__put_u64(p + 16, f->step);
  ps__put_u64(p + 24, f->up_req);
}
static inline void ps__fwd_get(const uint8_t *p, ps__fwd *f) {
  f->epoch = ps__get_u64(p);
  f->worker = ps__get_u32(p + 8);
  f->head = ps__get_u32(p + 12);
  f->step = ps__get_u64(p + 16);
  f->up_req = ps__get_u64(p + 24);
}

/* A growable write buffer for control bodies. */
typedef struct ps__wbuf {
  uint8_t *data;
  size_t len, cap;
  int oom; /* set when a growth failed; later puts are ignored */
} ps__wbuf;
void ps__wbuf_init(ps__wbuf *w);
void ps__wbuf_free(ps__wbuf *w);
void ps__wbuf_u8(ps__wbuf *w, uint8_t v);
void ps__wbuf_u32(ps__wbuf *w, uint32_t v);
void ps__wbuf_u64(ps__wbuf *w, uint64_t v);
void ps__wbuf_f64(ps__wbuf *w, double v);
void ps__wbuf_str(ps__wbuf *w, const char *s); /* u32 length + bytes */
void ps__wbuf_bytes(ps__wbuf *w, const void *p, size_t n);

/* A bounds-checked reader: every get fails (returns -1, sets err) past the end. */
typedef struct ps__rbuf {
  const uint8_t *p;
  size_t len, off;
  int err;
} ps__rbuf;
void ps__rbuf_init(ps__rbuf *r, const void *p, size_t len);
uint8_t ps__rbuf_u8(ps__rbuf *r);
uint32_t ps__rbuf_u32(ps__rbuf *r);
uint64_t ps__rbuf_u64(ps__rbuf *r);
double ps__rbuf_f64(ps__rbuf *r);
/* Copy a string of at most cap-1 bytes into out (NUL-terminated); longer fails. */
void ps__rbuf_str(ps__rbuf *r, char *out, size_t cap);

#endif
