/*
 * test_frame.c - the wire codec: frame headers, control-body buffers, control bodies.
 *
 * Headers: a byte-exact layout pin, a round trip of every field at its extremes, and
 * each rejection with its error code and message. Buffers: ps__wbuf/ps__rbuf round
 * trips, sticky errors past the end, string bounds. Bodies: hello, membership and
 * declare round trips, every truncation of a valid body rejected, and member counts
 * bounded before anything is allocated. docs/protocol.md describes the same format.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/common.h"
#include "proto/frame.h"
#include "common/ring.h"
#include "proto/msg.h"

/* ---------------------------------------------------------------- helpers */

#define BIG_LIMIT UINT64_MAX

static ps__frame_hdr hdr_of(uint8_t type) {
  ps__frame_hdr h;
  memset(&h, 0, sizeof h);
  h.type = type;
  h.lr = -1.0f;
  return h;
}

static uint32_t f32_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

static float f32_of(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

/* Encode h and decode it back into out; returns the decoder's code. */
static int round_trip(const ps__frame_hdr *h, uint64_t max_payload, ps__frame_hdr *out) {
  uint8_t buf[PS_FRAME_HDR_SIZE];
  ps__clear_err();
  ps__frame_encode(h, buf);
  return ps__frame_decode(buf, max_payload, out);
}

static void assert_same_hdr(const ps__frame_hdr *a, const ps__frame_hdr *b) {
  cr_assert(eq(u8, a->type, b->type));
  cr_assert(eq(u8, a->flags, b->flags));
  cr_assert(eq(u8, a->xport, b->xport));
  cr_assert(eq(u8, a->codec, b->codec));
  cr_assert(eq(i32, a->status, b->status));
  cr_assert(eq(u32, a->sender, b->sender));
  cr_assert(eq(u64, a->req_id, b->req_id));
  cr_assert(eq(u32, a->table, b->table));
  cr_assert(eq(u32, a->batch, b->batch));
  cr_assert(eq(i64, a->clock, b->clock));
  cr_assert(eq(u64, a->epoch, b->epoch));
  cr_assert(eq(u32, a->seq, b->seq));
  cr_assert(eq(u64, a->inc, b->inc));
  cr_assert(eq(u32, a->nkeys, b->nkeys));
  cr_assert(eq(u32, f32_bits(a->lr), f32_bits(b->lr)), "lr bits %08x, want %08x", f32_bits(a->lr),
            f32_bits(b->lr));
  cr_assert(eq(u64, a->payload_len, b->payload_len));
}

/* h must be rejected with err and a message containing what. */
static void expect_reject(const ps__frame_hdr *h, uint64_t max_payload, int err, const char *what) {
  ps__frame_hdr out;
  int rc = round_trip(h, max_payload, &out);
  cr_assert(eq(int, rc, err), "type %u: got %s (%s), want %s", h->type, ps_err_name(rc), ps_errmsg(),
            ps_err_name(err));
  cr_assert(strstr(ps_errmsg(), what) != NULL, "message '%s' does not mention '%s'", ps_errmsg(), what);
}

static void expect_accept(const ps__frame_hdr *h, uint64_t max_payload) {
  ps__frame_hdr out;
  int rc = round_trip(h, max_payload, &out);
  cr_assert(eq(int, rc, 0), "type %u rejected: %s (%s)", h->type, ps_err_name(rc), ps_errmsg());
  assert_same_hdr(&out, h);
}

/* Raw header bytes with one byte patched after encoding. */
static int decode_patched(const ps__frame_hdr *h, size_t off, uint8_t v, ps__frame_hdr *out) {
  uint8_t buf[PS_FRAME_HDR_SIZE];
  ps__frame_encode(h, buf);
  buf[off] = v;
  ps__clear_err();
  return ps__frame_decode(buf, BIG_LIMIT, out);
}

/* ---------------------------------------------------------------- header layout */

Test(frame, byte_layout_is_pinned) {
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH);
  h.flags = 0x0a;
  h.status = 0;
  h.sender = 0x04030201u;
  h.req_id = 0x1817161514131211ull;
  h.table = 0x24232221u;
  h.batch = 0x28272625u;
  h.clock = (int64_t)0x3837363534333231ll;
  h.inc = 0x4847464544434241ull;  /* a push request: the incarnation in the epoch's place */
  h.seq = 0x0c0b0a09u;            /* and its sequence in the status's */
  h.nkeys = 2;
  h.lr = f32_of(0x3f800000u); /* 1.0f */
  h.payload_len = 16 + 8;
  static const uint8_t want[PS_FRAME_HDR_SIZE] = {
      0x50, 0x53, 0x48, 0x44,                         /* 0  magic "PSHD" */
      0x03, 0x09, 0x0a, 0x00,                         /* 4  version, type, flags, codec */
      0x09, 0x0a, 0x0b, 0x0c,                         /* 8  seq (status in other frames) */
      0x01, 0x02, 0x03, 0x04,                         /* 12 sender */
      0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, /* 16 req_id */
      0x21, 0x22, 0x23, 0x24,                         /* 24 table */
      0x25, 0x26, 0x27, 0x28,                         /* 28 batch */
      0x31, 0x32, 0x33, 0x34, 0x35, 0x36, 0x37, 0x38, /* 32 clock */
      0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x47, 0x48, /* 40 inc (epoch in other frames) */
      0x02, 0x00, 0x00, 0x00,                         /* 48 nkeys */
      0x00, 0x00, 0x80, 0x3f,                         /* 52 lr (f32 bits) */
      0x18, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, /* 56 payload_len */
  };
  uint8_t got[PS_FRAME_HDR_SIZE];
  ps__frame_encode(&h, got);
  for (size_t i = 0; i < sizeof got; i++)
    cr_assert(eq(u8, got[i], want[i]), "byte %zu is 0x%02x, want 0x%02x", i, got[i], want[i]);
  cr_assert(eq(u32, ps__get_u32(got), PS_FRAME_MAGIC));
  ps__frame_hdr out;
  cr_assert(eq(int, ps__frame_decode(want, BIG_LIMIT, &out), 0), "%s", ps_errmsg());
  assert_same_hdr(&out, &h);
  /* Any other frame has its status and epoch there (a pull reply: status 0). */
  h.type = PS_MSG_PULL | PS_FRAME_REPLY;
  h.nkeys = 0;
  h.epoch = 0x4847464544434241ull;
  h.inc = 0, h.seq = 0;
  ps__frame_encode(&h, got);
  for (size_t i = 0; i < sizeof got; i++)
    if (i != 5 && i != 48) cr_assert(eq(u8, got[i], i >= 8 && i < 12 ? 0 : want[i]), "byte %zu", i);
  cr_assert(eq(int, ps__frame_decode(got, BIG_LIMIT, &out), 0), "%s", ps_errmsg());
  assert_same_hdr(&out, &h);
}

Test(frame, a_push_request_carries_its_identity) {
  /* Every sequence is valid (it is not a status), and the incarnation is not an epoch. */
  uint32_t seqs[] = {0, 1, 0x7fffffffu, 0x80000000u, UINT32_MAX};
  for (size_t i = 0; i < sizeof seqs / sizeof seqs[0]; i++) {
    ps__frame_hdr h = hdr_of(i % 2 ? PS_MSG_PUSH : PS_MSG_PUSH_DENSE);
    h.seq = seqs[i];
    h.inc = UINT64_MAX - i;
    expect_accept(&h, BIG_LIMIT);
  }
  /* A reply to a push has a status again. */
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH | PS_FRAME_REPLY);
  h.status = PS_ERR_CLOCK;
  h.payload_len = 5;
  expect_accept(&h, BIG_LIMIT);
  h.status = -3;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "bad status");
}

Test(frame, little_endian_helpers) {
  uint8_t b[8];
  ps__put_u16(b, 0xbeef);
  cr_assert(eq(u8, b[0], 0xef));
  cr_assert(eq(u8, b[1], 0xbe));
  cr_assert(eq(u16, ps__get_u16(b), 0xbeef));
  ps__put_u32(b, 0xdeadbeefu);
  cr_assert(eq(u8, b[0], 0xef));
  cr_assert(eq(u8, b[3], 0xde));
  cr_assert(eq(u32, ps__get_u32(b), 0xdeadbeefu));
  ps__put_u64(b, 0x0123456789abcdefull);
  cr_assert(eq(u8, b[0], 0xef));
  cr_assert(eq(u8, b[7], 0x01));
  cr_assert(eq(u64, ps__get_u64(b), 0x0123456789abcdefull));
  ps__put_u64(b, UINT64_MAX);
  cr_assert(eq(u64, ps__get_u64(b), UINT64_MAX));
}

/* ---------------------------------------------------------------- header round trips */

Test(frame, round_trip_every_field_at_max) {
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH);
  h.flags = PS_FLAG_MASK;
  h.status = 0;
  h.sender = UINT32_MAX;
  h.req_id = UINT64_MAX;
  h.table = UINT32_MAX;
  h.batch = UINT32_MAX;
  h.clock = INT64_MAX;
  h.inc = UINT64_MAX;
  h.seq = UINT32_MAX;
  h.nkeys = UINT32_MAX;
  h.lr = INFINITY;
  h.payload_len = UINT64_MAX - 3; /* keys fit and the rest is whole floats */
  expect_accept(&h, BIG_LIMIT);
}

Test(frame, round_trip_every_field_at_zero) {
  ps__frame_hdr h;
  memset(&h, 0, sizeof h);
  h.type = PS_MSG_HEARTBEAT;
  expect_accept(&h, 0);
}

Test(frame, round_trip_negative_clock) {
  int64_t clocks[] = {-1, -2, INT64_MIN, INT64_MIN + 1, 0, 1, INT64_MAX};
  for (size_t i = 0; i < sizeof clocks / sizeof clocks[0]; i++) {
    ps__frame_hdr h = hdr_of(PS_MSG_CLOCK);
    h.clock = clocks[i];
    expect_accept(&h, 0);
    h = hdr_of(PS_MSG_PULL | PS_FRAME_REPLY);
    h.clock = clocks[i];
    h.payload_len = 12;
    expect_accept(&h, 12);
  }
}

Test(frame, round_trip_lr_bits) {
  /* The learning rate travels as raw f32 bits: NaN payloads, signed zero, denormals and
   * the negative "use the schedule" marker must all survive unchanged. */
  uint32_t bits[] = {0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u /* -1 = schedule */,
                     0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7fa5a5a5u, 0xffffffffu,
                     0x00000001u, 0x807fffffu, 0x7f7fffffu};
  for (size_t i = 0; i < sizeof bits / sizeof bits[0]; i++) {
    ps__frame_hdr h = hdr_of(PS_MSG_PUSH_DENSE);
    h.lr = f32_of(bits[i]);
    h.nkeys = 2;
    h.payload_len = 16 + 4 * 3;
    ps__frame_hdr out;
    cr_assert(eq(int, round_trip(&h, BIG_LIMIT, &out), 0), "lr bits %08x: %s", bits[i], ps_errmsg());
    cr_assert(eq(u32, f32_bits(out.lr), bits[i]), "lr bits %08x came back as %08x", bits[i], f32_bits(out.lr));
  }
}

Test(frame, round_trip_status_and_reply_types) {
  for (int st = 0; st < PS_ERR__COUNT; st++) {
    ps__frame_hdr h = hdr_of(PS_MSG_PULL | PS_FRAME_REPLY);
    h.status = st;
    h.payload_len = 8; /* status 0: two floats; else an 8-byte message */
    expect_accept(&h, BIG_LIMIT);
    h = hdr_of(PS_MSG_ERROR);
    h.status = st;
    h.payload_len = 5;
    expect_accept(&h, BIG_LIMIT);
  }
  for (uint8_t t = 1; t < PS_MSG__MAX; t++) {
    ps__frame_hdr h = hdr_of(t);
    if (ps__frame_is_forward(t)) { /* a forward request carries its prefix (ps__fwd) */
      h.payload_len = PS_FWD_PREFIX;
      expect_accept(&h, PS_FWD_PREFIX);
      h.payload_len = 0;
      expect_reject(&h, 0, PS_ERR_PROTO, "do not fit");
    } else {
      expect_accept(&h, 0);
    }
    h.type = (uint8_t)(t | PS_FRAME_REPLY);
    h.payload_len = 0;
    expect_accept(&h, 0);
  }
}

Test(frame, forward_prefix_round_trips_and_bounds_the_keys) {
  uint8_t b[PS_FWD_PREFIX];
  ps__fwd f = {.epoch = 0x0102030405060708ull, .worker = 77, .step = 123456789012ull}, g;
  ps__fwd_put(b, &f);
  ps__fwd_get(b, &g);
  cr_assert(eq(u64, g.epoch, f.epoch));
  cr_assert(eq(u32, g.worker, f.worker));
  cr_assert(eq(u64, g.step, f.step));
  ps__frame_hdr h = hdr_of(PS_MSG_FORWARD);
  h.nkeys = 2;
  h.payload_len = PS_FWD_PREFIX + 16 + 8; /* two keys, two floats */
  expect_accept(&h, BIG_LIMIT);
  h.payload_len = PS_FWD_PREFIX + 8; /* the keys do not fit behind the prefix */
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "do not fit");
  h = hdr_of(PS_MSG_FORWARD_DENSE);
  h.nkeys = 1; /* odd segment list */
  h.payload_len = PS_FWD_PREFIX + 8;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "odd");
  h.nkeys = 2;
  h.payload_len = PS_FWD_PREFIX + 16 + 4;
  h.xport = PS_XPORT_PEER_MEM; /* naming the worker's memory: a tail of whole 16-byte words */
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "peer-memory request carries 4 bytes");
  h.payload_len = PS_FWD_PREFIX + 16 + 16 + 16; /* expiry and hint, one region */
  expect_accept(&h, BIG_LIMIT);
  h = hdr_of(PS_MSG_FORWARD); /* only a dense push's forward may */
  h.nkeys = 2;
  h.payload_len = PS_FWD_PREFIX + 16 + 32;
  h.xport = PS_XPORT_PEER_MEM;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "transport");
}

Test(frame, payload_at_the_limit_is_accepted) {
  ps__frame_hdr h = hdr_of(PS_MSG_PULL);
  h.nkeys = 4;
  h.payload_len = 32;
  expect_accept(&h, 32);
  h = hdr_of(PS_MSG_HELLO);
  h.payload_len = PS_CTRL_MAX_BODY;
  expect_accept(&h, PS_CTRL_MAX_BODY);
  expect_accept(&h, BIG_LIMIT);
}

Test(frame, data_frames_within_rules) {
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH); /* empty push: counts the batch only */
  expect_accept(&h, 0);
  h = hdr_of(PS_MSG_PUSH_DENSE);
  h.nkeys = 4;
  h.payload_len = 32 + 4 * 10;
  expect_accept(&h, BIG_LIMIT);
  h = hdr_of(PS_MSG_PULL_DENSE | PS_FRAME_REPLY);
  h.payload_len = 4 * 10;
  expect_accept(&h, BIG_LIMIT);
  /* A data frame larger than the control limit is fine. */
  h = hdr_of(PS_MSG_PULL | PS_FRAME_REPLY);
  h.payload_len = 4ull * PS_CTRL_MAX_BODY;
  expect_accept(&h, BIG_LIMIT);
}

Test(frame, type_names_and_data_predicate) {
  cr_assert(eq(str, (char *)ps__frame_type_name(PS_MSG_PUSH), "push"));
  cr_assert(eq(str, (char *)ps__frame_type_name(PS_MSG_PULL_DENSE | PS_FRAME_REPLY), "pull-dense"));
  cr_assert(eq(str, (char *)ps__frame_type_name(PS_MSG_TASK_DONE), "task-done"));
  cr_assert(eq(str, (char *)ps__frame_type_name(0), "unknown"));
  for (uint8_t t = 1; t < PS_MSG__MAX; t++)
    cr_assert(strcmp(ps__frame_type_name(t), "unknown") != 0, "type %u has no name", t);
  cr_assert(eq(str, (char *)ps__frame_type_name(PS_MSG__MAX), "unknown"));
  cr_assert(eq(str, (char *)ps__frame_type_name(0xff), "unknown"));
  for (unsigned t = 0; t < 256; t++) {
    unsigned b = t & 0x7fu;
    int want = b == PS_MSG_PUSH || b == PS_MSG_PULL || b == PS_MSG_PUSH_DENSE || b == PS_MSG_PULL_DENSE ||
               b == PS_MSG_FORWARD || b == PS_MSG_FORWARD_DENSE || b == PS_MSG_FORWARD_AGG || b == PS_MSG_FORWARD_ROUND;
    cr_assert(eq(int, ps__frame_is_data((uint8_t)t), want), "type %u", t);
  }
}

/* ---------------------------------------------------------------- header rejections */

Test(frame, rejects_bad_magic) {
  ps__frame_hdr h = hdr_of(PS_MSG_HELLO), out;
  for (size_t i = 0; i < 4; i++) {
    int rc = decode_patched(&h, i, 0x00, &out);
    cr_assert(eq(int, rc, PS_ERR_PROTO), "magic byte %zu zeroed: %s", i, ps_err_name(rc));
    cr_assert(strstr(ps_errmsg(), "magic") != NULL, "%s", ps_errmsg());
  }
  /* Big-endian magic is not the magic. */
  uint8_t buf[PS_FRAME_HDR_SIZE];
  ps__frame_encode(&h, buf);
  buf[0] = 'D'; buf[1] = 'H'; buf[2] = 'S'; buf[3] = 'P';
  cr_assert(eq(int, ps__frame_decode(buf, BIG_LIMIT, &out), PS_ERR_PROTO));
}

Test(frame, rejects_bad_version) {
  ps__frame_hdr h = hdr_of(PS_MSG_HELLO), out;
  uint8_t versions[] = {0, 1, 2, 4, 0x81, 0xff};
  for (size_t i = 0; i < sizeof versions; i++) {
    int rc = decode_patched(&h, 4, versions[i], &out);
    cr_assert(eq(int, rc, PS_ERR_PROTO), "version %u: %s", versions[i], ps_err_name(rc));
    cr_assert(strstr(ps_errmsg(), "version") != NULL, "%s", ps_errmsg());
  }
}

Test(frame, rejects_unknown_type) {
  uint8_t types[] = {0, PS_FRAME_REPLY, PS_MSG__MAX, PS_MSG__MAX | PS_FRAME_REPLY, 0x7f, 0xff, 0x40};
  for (size_t i = 0; i < sizeof types; i++) {
    ps__frame_hdr h = hdr_of(types[i]);
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "unknown frame type");
  }
}

Test(frame, rejects_unknown_codec) {
  uint8_t codecs[] = {PS_CODEC__MAX, 7, 0x80, 0xff};
  for (size_t i = 0; i < sizeof codecs; i++) {
    ps__frame_hdr h = hdr_of(PS_MSG_PUSH);
    h.codec = codecs[i];
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "unknown codec");
  }
}

/* Encoded values ride on push requests and pull replies, inline, in any length (the
 * handler checks it against the count); anywhere else a codec is refused. */
Test(frame, codecs_only_where_values_are_encoded) {
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH);
  h.codec = PS_CODEC_INT8;
  h.nkeys = 1;
  h.payload_len = 8 + 4 + 3; /* one int8 block of 3 values: not whole floats */
  expect_accept(&h, BIG_LIMIT);
  h = hdr_of(PS_MSG_PULL_DENSE | PS_FRAME_REPLY);
  h.codec = PS_CODEC_FP16;
  h.payload_len = 6;
  expect_accept(&h, BIG_LIMIT);
  h = hdr_of(PS_MSG_PULL);
  h.codec = PS_CODEC_FP16;
  h.nkeys = 1;
  h.payload_len = 8;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "codec 1 on a");
  h = hdr_of(PS_MSG_STATS);
  h.codec = PS_CODEC_BF16;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "codec 2 on a");
  h = hdr_of(PS_MSG_PUSH_DENSE);
  h.codec = PS_CODEC_FP16;
  h.xport = PS_XPORT_PEER_MEM;
  h.nkeys = 2;
  h.payload_len = 16 + 16;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "travel inline");
  h = hdr_of(PS_MSG_PUSH);
  h.nkeys = 1;
  h.payload_len = 8 + 3; /* raw values must still be whole floats */
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "whole floats");
}

/* The flags byte: four flag bits, the value transport in bits 4-5, bits 6-7 reserved. */
Test(frame, value_transport_rides_in_the_flags_byte) {
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH_DENSE);
  h.xport = PS_XPORT_PEER_MEM;
  h.flags = PS_FLAG_DROPPED;
  h.nkeys = 2;
  h.payload_len = 16 + 16;
  uint8_t buf[PS_FRAME_HDR_SIZE];
  ps__frame_encode(&h, buf);
  cr_assert(eq(u8, buf[6], 0x11));
  cr_assert(eq(u8, buf[7], PS_CODEC_RAW));
  ps__frame_hdr out;
  cr_assert(eq(int, ps__frame_decode(buf, BIG_LIMIT, &out), 0), "%s", ps_errmsg());
  cr_assert(eq(u8, out.xport, PS_XPORT_PEER_MEM));
  cr_assert(eq(u8, out.flags, PS_FLAG_DROPPED));
  uint8_t bad[] = {0x21, 0x31, 0x40, 0x80, 0xc0};
  const char *why[] = {"value transport", "value transport", "reserved flag bits", "reserved flag bits",
                       "reserved flag bits"};
  for (size_t i = 0; i < sizeof bad; i++) {
    cr_assert(eq(int, decode_patched(&h, 6, bad[i], &out), PS_ERR_PROTO), "flags 0x%02x", bad[i]);
    cr_assert(strstr(ps_errmsg(), why[i]) != NULL, "flags 0x%02x: %s", bad[i], ps_errmsg());
  }
}

/* The peer-memory transport: dense requests carry (address, length) pairs after their
 * segments; a dense pull's reply with it has no payload. Nowhere else. */
Test(frame, peer_memory_transport_only_where_it_means_something) {
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH_DENSE);
  h.xport = PS_XPORT_PEER_MEM;
  h.nkeys = 2;
  h.payload_len = 16 + 2 * 16;
  expect_accept(&h, BIG_LIMIT);
  h.type = PS_MSG_PULL_DENSE;
  expect_accept(&h, BIG_LIMIT);
  h.payload_len = 16 + 24; /* a pair and a half */
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "peer-memory request");
  ps__frame_hdr r = hdr_of(PS_MSG_PULL_DENSE | PS_FRAME_REPLY);
  r.xport = PS_XPORT_PEER_MEM;
  expect_accept(&r, BIG_LIMIT);
  r.payload_len = 4;
  expect_reject(&r, BIG_LIMIT, PS_ERR_PROTO, "peer-memory reply");
  r = hdr_of(PS_MSG_PUSH_DENSE | PS_FRAME_REPLY);
  r.xport = PS_XPORT_PEER_MEM;
  expect_reject(&r, BIG_LIMIT, PS_ERR_PROTO, "peer-memory transport");
  uint8_t others[] = {PS_MSG_PUSH, PS_MSG_PULL, PS_MSG_PULL | PS_FRAME_REPLY, PS_MSG_HELLO, PS_MSG_CLOCK};
  for (size_t i = 0; i < sizeof others; i++) {
    ps__frame_hdr o = hdr_of(others[i]);
    o.xport = PS_XPORT_PEER_MEM;
    expect_reject(&o, BIG_LIMIT, PS_ERR_PROTO, "transport");
  }
}

Test(frame, rejects_bad_status) {
  int32_t bad[] = {-1, INT32_MIN, PS_ERR__COUNT, PS_ERR__COUNT + 1, INT32_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ps__frame_hdr h = hdr_of(PS_MSG_PULL | PS_FRAME_REPLY);
    h.status = bad[i];
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "bad status");
    h = hdr_of(PS_MSG_ERROR);
    h.status = bad[i];
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "bad status");
  }
}

Test(frame, rejects_status_in_requests) {
  /* A pull with a status would pass as a control frame: 3 bytes of "values". (A push
   * request has its sequence there instead.) */
  ps__frame_hdr h = hdr_of(PS_MSG_PULL_DENSE);
  h.status = PS_ERR_INVALID;
  h.payload_len = 3;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "status 1 in a pull-dense request");
  h = hdr_of(PS_MSG_HELLO);
  h.status = PS_ERR_IO;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "request");
  h = hdr_of(PS_MSG_ERROR); /* the one non-reply type with a status */
  h.status = PS_ERR_PROTO;
  expect_accept(&h, BIG_LIMIT);
}

Test(frame, rejects_payload_over_limit) {
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH);
  h.nkeys = 1;
  h.payload_len = 8 + 4 * 16;
  expect_reject(&h, h.payload_len - 1, PS_ERR_TOO_LARGE, "exceeds the limit");
  h.payload_len = UINT64_MAX;
  expect_reject(&h, UINT64_MAX - 1, PS_ERR_TOO_LARGE, "exceeds the limit");
  /* The limit applies to control frames too, before the control cap. */
  h = hdr_of(PS_MSG_HELLO);
  h.payload_len = 100;
  expect_reject(&h, 99, PS_ERR_TOO_LARGE, "exceeds the limit");
  h = hdr_of(PS_MSG_HEARTBEAT);
  h.payload_len = 1;
  expect_reject(&h, 0, PS_ERR_TOO_LARGE, "exceeds the limit");
}

Test(frame, rejects_keys_not_fitting_payload) {
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH);
  h.nkeys = 2;
  h.payload_len = 15;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "do not fit");
  h = hdr_of(PS_MSG_PULL);
  h.nkeys = UINT32_MAX; /* 32 GiB of keys in an 8-byte payload */
  h.payload_len = 8;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "do not fit");
  h = hdr_of(PS_MSG_PULL_DENSE);
  h.nkeys = 2;
  h.payload_len = 0;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "do not fit");
}

Test(frame, rejects_values_not_whole_floats) {
  for (uint64_t extra = 1; extra < 4; extra++) {
    ps__frame_hdr h = hdr_of(PS_MSG_PUSH);
    h.nkeys = 3;
    h.payload_len = 24 + 8 + extra;
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "whole floats");
    h = hdr_of(PS_MSG_PULL | PS_FRAME_REPLY);
    h.payload_len = 40 + extra;
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "whole floats");
  }
}

Test(frame, rejects_odd_dense_segment_list) {
  uint8_t types[] = {PS_MSG_PUSH_DENSE, PS_MSG_PULL_DENSE};
  for (size_t i = 0; i < 2; i++) {
    ps__frame_hdr h = hdr_of(types[i]);
    h.nkeys = 3;
    h.payload_len = 24;
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "odd length");
    h.nkeys = 1;
    h.payload_len = 8 + 4;
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "odd length");
  }
  /* Sparse frames may carry any number of keys. */
  ps__frame_hdr h = hdr_of(PS_MSG_PULL);
  h.nkeys = 3;
  h.payload_len = 24;
  expect_accept(&h, BIG_LIMIT);
}

Test(frame, rejects_keys_in_control_frames) {
  uint8_t types[] = {PS_MSG_HELLO, PS_MSG_MEMBERSHIP, PS_MSG_HEARTBEAT, PS_MSG_DECLARE, PS_MSG_CREATE,
                     PS_MSG_BARRIER, PS_MSG_METRIC, PS_MSG_LEAVE, PS_MSG_CLOCK, PS_MSG_ERROR, PS_MSG_STATS,
                     PS_MSG_TASK_INIT, PS_MSG_TASK_NEXT, PS_MSG_TASK_DONE, PS_MSG_HELLO | PS_FRAME_REPLY,
                     PS_MSG_STATS | PS_FRAME_REPLY, PS_MSG_TASK_NEXT | PS_FRAME_REPLY};
  for (size_t i = 0; i < sizeof types; i++) {
    ps__frame_hdr h = hdr_of(types[i]);
    h.nkeys = 1;
    h.payload_len = 8;
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "keys in a");
  }
  /* A data frame with a non-zero status is an error reply: a control body, no keys. */
  ps__frame_hdr h = hdr_of(PS_MSG_PUSH | PS_FRAME_REPLY);
  h.status = PS_ERR_MOVED;
  h.nkeys = 1;
  h.payload_len = 8;
  expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "keys in a push frame");
}

Test(frame, rejects_control_body_over_cap) {
  uint8_t types[] = {PS_MSG_HELLO, PS_MSG_MEMBERSHIP, PS_MSG_ERROR, PS_MSG_STATS | PS_FRAME_REPLY};
  for (size_t i = 0; i < sizeof types; i++) {
    ps__frame_hdr h = hdr_of(types[i]);
    h.payload_len = (uint64_t)PS_CTRL_MAX_BODY + 1;
    expect_reject(&h, BIG_LIMIT, PS_ERR_TOO_LARGE, "control body");
    h.payload_len = UINT64_MAX;
    expect_reject(&h, BIG_LIMIT, PS_ERR_TOO_LARGE, "control body");
  }
  /* Error replies to data requests are control bodies and capped alike. */
  ps__frame_hdr h = hdr_of(PS_MSG_PULL | PS_FRAME_REPLY);
  h.status = PS_ERR_NO_TABLE;
  h.payload_len = (uint64_t)PS_CTRL_MAX_BODY + 4;
  expect_reject(&h, BIG_LIMIT, PS_ERR_TOO_LARGE, "control body");
}

Test(frame, rejects_keys_in_data_reply) {
  uint8_t types[] = {PS_MSG_PUSH, PS_MSG_PULL, PS_MSG_PUSH_DENSE, PS_MSG_PULL_DENSE};
  for (size_t i = 0; i < sizeof types; i++) {
    ps__frame_hdr h = hdr_of((uint8_t)(types[i] | PS_FRAME_REPLY));
    h.nkeys = 2;
    h.payload_len = 16 + 8;
    expect_reject(&h, BIG_LIMIT, PS_ERR_PROTO, "keys in a");
  }
}

Test(frame, rejection_order_is_magic_version_type_status_codec_size) {
  /* A header wrong in several ways reports the first check that fails. */
  ps__frame_hdr h = hdr_of(0);
  h.status = -1;
  h.codec = 9;
  h.payload_len = UINT64_MAX;
  expect_reject(&h, 0, PS_ERR_PROTO, "unknown frame type");
  h.type = PS_MSG_PULL;
  expect_reject(&h, 0, PS_ERR_PROTO, "bad status");
  h.status = 0;
  expect_reject(&h, 0, PS_ERR_PROTO, "codec");
  h.codec = 0;
  expect_reject(&h, 0, PS_ERR_TOO_LARGE, "exceeds the limit");
  ps__frame_hdr out;
  cr_assert(eq(int, decode_patched(&h, 4, 7, &out), PS_ERR_PROTO));
  cr_assert(strstr(ps_errmsg(), "version") != NULL, "%s", ps_errmsg());
}

/* ---------------------------------------------------------------- wbuf / rbuf */

Test(buf, scalar_round_trip) {
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__wbuf_u8(&w, 0);
  ps__wbuf_u8(&w, 0xff);
  ps__wbuf_u32(&w, 0);
  ps__wbuf_u32(&w, UINT32_MAX);
  ps__wbuf_u32(&w, 0x01020304u);
  ps__wbuf_u64(&w, UINT64_MAX);
  ps__wbuf_u64(&w, 0x0102030405060708ull);
  ps__wbuf_f64(&w, -0.0);
  ps__wbuf_f64(&w, 3.25);
  ps__wbuf_f64(&w, NAN);
  ps__wbuf_f64(&w, -INFINITY);
  cr_assert(eq(int, w.oom, 0));
  cr_assert(eq(sz, w.len, 2 + 12 + 16 + 32));
  cr_assert(eq(u8, w.data[2 + 8], 0x04), "u32 is little-endian");

  ps__rbuf r;
  ps__rbuf_init(&r, w.data, w.len);
  cr_assert(eq(u8, ps__rbuf_u8(&r), 0));
  cr_assert(eq(u8, ps__rbuf_u8(&r), 0xff));
  cr_assert(eq(u32, ps__rbuf_u32(&r), 0));
  cr_assert(eq(u32, ps__rbuf_u32(&r), UINT32_MAX));
  cr_assert(eq(u32, ps__rbuf_u32(&r), 0x01020304u));
  cr_assert(eq(u64, ps__rbuf_u64(&r), UINT64_MAX));
  cr_assert(eq(u64, ps__rbuf_u64(&r), 0x0102030405060708ull));
  double z = ps__rbuf_f64(&r);
  cr_assert(z == 0.0 && signbit(z), "-0.0 came back as %g", z);
  cr_assert(eq(dbl, ps__rbuf_f64(&r), 3.25));
  cr_assert(isnan(ps__rbuf_f64(&r)));
  cr_assert(eq(dbl, ps__rbuf_f64(&r), -INFINITY));
  cr_assert(eq(int, r.err, 0));
  cr_assert(eq(sz, r.off, w.len));
  ps__wbuf_free(&w);
  cr_assert(eq(ptr, w.data, NULL));
  cr_assert(eq(sz, w.len, 0));
}

Test(buf, string_encoding_and_round_trip) {
  char big[1000];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__wbuf_str(&w, "abc");
  ps__wbuf_str(&w, "");
  ps__wbuf_str(&w, NULL);
  ps__wbuf_str(&w, big);
  ps__wbuf_bytes(&w, "\x01\x02", 2);
  /* "abc" is a u32 length then the bytes, no terminator. */
  static const uint8_t head[] = {3, 0, 0, 0, 'a', 'b', 'c', 0, 0, 0, 0, 0, 0, 0, 0, 0xe7, 0x03, 0, 0};
  cr_assert(eq(int, memcmp(w.data, head, sizeof head), 0));
  cr_assert(eq(sz, w.len, 7 + 4 + 4 + 4 + 999 + 2));

  ps__rbuf r;
  char s[1000];
  ps__rbuf_init(&r, w.data, w.len);
  ps__rbuf_str(&r, s, sizeof s);
  cr_assert(eq(str, s, "abc"));
  ps__rbuf_str(&r, s, 1); /* an empty string fits a 1-byte buffer */
  cr_assert(eq(str, s, ""));
  ps__rbuf_str(&r, s, sizeof s);
  cr_assert(eq(str, s, ""));
  ps__rbuf_str(&r, s, sizeof s);
  cr_assert(eq(str, s, big));
  cr_assert(eq(u8, ps__rbuf_u8(&r), 1));
  cr_assert(eq(u8, ps__rbuf_u8(&r), 2));
  cr_assert(eq(int, r.err, 0));
  cr_assert(eq(sz, r.off, w.len));
  ps__wbuf_free(&w);
}

Test(buf, empty_writes_on_an_empty_buffer) {
  /* clang's UBSan reported "applying zero offset to null pointer" here. */
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__wbuf_bytes(&w, NULL, 0);
  ps__wbuf_bytes(&w, "x", 0);
  cr_assert(eq(sz, w.len, 0));
  cr_assert(eq(int, w.oom, 0));
  ps__wbuf_u8(&w, 7);
  cr_assert(eq(sz, w.len, 1));
  ps__wbuf_free(&w);
}

Test(buf, grows_over_many_writes) {
  ps__wbuf w;
  ps__wbuf_init(&w);
  for (uint64_t i = 0; i < 100000; i++) ps__wbuf_u64(&w, i * 0x9e3779b97f4a7c15ull);
  cr_assert(eq(int, w.oom, 0));
  cr_assert(eq(sz, w.len, 800000));
  cr_assert(w.cap >= w.len);
  ps__rbuf r;
  ps__rbuf_init(&r, w.data, w.len);
  for (uint64_t i = 0; i < 100000; i++) {
    uint64_t v = ps__rbuf_u64(&r);
    if (v != i * 0x9e3779b97f4a7c15ull) {
      cr_assert(eq(u64, v, i * 0x9e3779b97f4a7c15ull), "entry %llu", (unsigned long long)i);
    }
  }
  ps__wbuf_free(&w);
}

Test(buf, read_past_end_fails_and_returns_zero) {
  const uint8_t bytes[7] = {1, 2, 3, 4, 5, 6, 7};
  ps__rbuf r;

  ps__rbuf_init(&r, bytes, 0);
  cr_assert(eq(u8, ps__rbuf_u8(&r), 0));
  cr_assert(eq(int, r.err, 1));

  ps__rbuf_init(&r, bytes, 3);
  cr_assert(eq(u32, ps__rbuf_u32(&r), 0));
  cr_assert(eq(int, r.err, 1));
  cr_assert(eq(sz, r.off, 0), "a failed read consumes nothing");
  /* Sticky: later reads fail even where bytes remain. */
  cr_assert(eq(u8, ps__rbuf_u8(&r), 0));
  cr_assert(eq(int, r.err, 1));

  ps__rbuf_init(&r, bytes, 7);
  cr_assert(eq(u64, ps__rbuf_u64(&r), 0));
  cr_assert(eq(int, r.err, 1));

  ps__rbuf_init(&r, bytes, 7);
  cr_assert(eq(dbl, ps__rbuf_f64(&r), 0.0));
  cr_assert(eq(int, r.err, 1));

  ps__rbuf_init(&r, bytes, 7);
  cr_assert(eq(u32, ps__rbuf_u32(&r), 0x04030201u));
  cr_assert(eq(u32, ps__rbuf_u32(&r), 0));
  cr_assert(eq(int, r.err, 1));
  cr_assert(eq(sz, r.off, 4));

  ps__rbuf_init(&r, NULL, 0);
  cr_assert(eq(u64, ps__rbuf_u64(&r), 0));
  cr_assert(eq(int, r.err, 1));
}

Test(buf, string_bounds) {
  ps__wbuf w;
  char s[8];
  ps__rbuf r;

  /* cap-1 bytes fit; cap bytes do not. */
  ps__wbuf_init(&w);
  ps__wbuf_str(&w, "1234567");
  ps__rbuf_init(&r, w.data, w.len);
  memset(s, 'z', sizeof s);
  ps__rbuf_str(&r, s, sizeof s);
  cr_assert(eq(int, r.err, 0));
  cr_assert(eq(str, s, "1234567"));
  ps__wbuf_free(&w);

  ps__wbuf_init(&w);
  ps__wbuf_str(&w, "12345678");
  ps__rbuf_init(&r, w.data, w.len);
  memset(s, 'z', sizeof s);
  ps__rbuf_str(&r, s, sizeof s);
  cr_assert(eq(int, r.err, 1));
  cr_assert(eq(str, s, ""), "a rejected string leaves an empty output");
  ps__wbuf_free(&w);

  /* A capacity of zero takes nothing, not even an empty string, and writes nothing. */
  ps__wbuf_init(&w);
  ps__wbuf_str(&w, "");
  ps__rbuf_init(&r, w.data, w.len);
  s[0] = 'q';
  ps__rbuf_str(&r, s, 0);
  cr_assert(eq(int, r.err, 1));
  cr_assert(eq(chr, s[0], 'q'));
  ps__wbuf_free(&w);

  /* A length prefix beyond the buffer. */
  const uint8_t trunc[] = {5, 0, 0, 0, 'a', 'b'};
  ps__rbuf_init(&r, trunc, sizeof trunc);
  memset(s, 'z', sizeof s);
  ps__rbuf_str(&r, s, sizeof s);
  cr_assert(eq(int, r.err, 1));
  cr_assert(eq(str, s, ""));

  /* A huge length prefix is refused by the capacity check before any read. */
  const uint8_t huge[] = {0xff, 0xff, 0xff, 0xff, 'a'};
  ps__rbuf_init(&r, huge, sizeof huge);
  ps__rbuf_str(&r, s, sizeof s);
  cr_assert(eq(int, r.err, 1));
  cr_assert(eq(str, s, ""));

  /* A missing length prefix. */
  ps__rbuf_init(&r, huge, 2);
  ps__rbuf_str(&r, s, sizeof s);
  cr_assert(eq(int, r.err, 1));
  cr_assert(eq(str, s, ""));
}

/* ---------------------------------------------------------------- control bodies */

static ps__hello sample_hello(void) {
  ps__hello h;
  memset(&h, 0, sizeof h);
  h.role = PS_ROLE_SERVER;
  h.port = 65535;
  h.pid = UINT32_MAX;
  memset(h.host, 'h', PS_HOST_MAX - 1);
  memset(h.unix_path, 'p', PS_PATH_MAX - 1);
  memset(h.hostid, 'i', PS_HOST_MAX - 1);
  h.caps = PS_CAP_PEER_MEM;
  return h;
}

static void assert_same_hello(const ps__hello *a, const ps__hello *b) {
  cr_assert(eq(u8, a->role, b->role));
  cr_assert(eq(u16, a->port, b->port));
  cr_assert(eq(u32, a->pid, b->pid));
  cr_assert(eq(str, (char *)a->host, (char *)b->host));
  cr_assert(eq(str, (char *)a->unix_path, (char *)b->unix_path));
  cr_assert(eq(str, (char *)a->hostid, (char *)b->hostid));
  cr_assert(eq(u8, a->caps, b->caps));
}

static ps__wbuf encode_hello(const ps__hello *h) {
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__hello_encode(&w, h);
  cr_assert(eq(int, w.oom, 0));
  return w;
}

Test(msg, hello_round_trip) {
  ps__hello in = sample_hello(), out;
  ps__wbuf w = encode_hello(&in);
  cr_assert(eq(sz, w.len, 1 + 4 + 4 + 3 * 4 + 63 + 107 + 63 + 1));
  cr_assert(eq(int, ps__hello_decode(w.data, w.len, &out), 0), "%s", ps_errmsg());
  assert_same_hello(&out, &in);
  ps__wbuf_free(&w);

  memset(&in, 0, sizeof in);
  in.role = PS_ROLE_WORKER;
  strcpy(in.hostid, "host-1");
  w = encode_hello(&in);
  cr_assert(eq(int, ps__hello_decode(w.data, w.len, &out), 0), "%s", ps_errmsg());
  assert_same_hello(&out, &in);
  ps__wbuf_free(&w);
}

Test(msg, hello_rejections) {
  ps__hello in = sample_hello(), out;
  uint8_t roles[] = {0, PS_ROLE_SCHEDULER, 4, 0xff};
  for (size_t i = 0; i < sizeof roles; i++) {
    in.role = roles[i];
    ps__wbuf w = encode_hello(&in);
    cr_assert(eq(int, ps__hello_decode(w.data, w.len, &out), PS_ERR_PROTO), "role %u", roles[i]);
    cr_assert(strstr(ps_errmsg(), "bad role") != NULL, "%s", ps_errmsg());
    ps__wbuf_free(&w);
  }
  in = sample_hello();
  ps__wbuf w = encode_hello(&in);
  ps__put_u32(w.data + 1, 65536); /* port is a u32 on the wire, at most 65535 */
  cr_assert(eq(int, ps__hello_decode(w.data, w.len, &out), PS_ERR_PROTO));
  cr_assert(strstr(ps_errmsg(), "bad port") != NULL, "%s", ps_errmsg());
  ps__put_u32(w.data + 1, UINT32_MAX);
  cr_assert(eq(int, ps__hello_decode(w.data, w.len, &out), PS_ERR_PROTO));
  ps__wbuf_free(&w);

  /* A host name one byte too long for PS_HOST_MAX. */
  ps__wbuf_init(&w);
  char host[PS_HOST_MAX + 1];
  memset(host, 'a', PS_HOST_MAX);
  host[PS_HOST_MAX] = '\0';
  ps__wbuf_u8(&w, PS_ROLE_WORKER);
  ps__wbuf_u32(&w, 1);
  ps__wbuf_u32(&w, 1);
  ps__wbuf_str(&w, host);
  ps__wbuf_str(&w, "");
  ps__wbuf_str(&w, "");
  cr_assert(eq(int, ps__hello_decode(w.data, w.len, &out), PS_ERR_PROTO));
  ps__wbuf_free(&w);
}

static ps__membership sample_membership(uint32_t n) {
  ps__membership m;
  memset(&m, 0, sizeof m);
  m.epoch = UINT64_MAX - 1;
  m.servers_expected = 3;
  m.workers_expected = UINT32_MAX;
  m.started = 1;
  m.n = n;
  m.m = calloc(n ? n : 1, sizeof *m.m);
  cr_assert_not_null(m.m);
  for (uint32_t i = 0; i < n; i++) {
    ps__member *x = &m.m[i];
    x->id = i + 1;
    x->role = (uint8_t)(i % 3 + 1);
    x->alive = (uint8_t)(i & 1);
    x->rank = i * 7;
    x->port = (uint16_t)(1000 + i);
    snprintf(x->host, sizeof x->host, "10.0.0.%u", i);
    if (i % 2) snprintf(x->unix_path, sizeof x->unix_path, "/tmp/pshard-%u.sock", i);
    snprintf(x->hostid, sizeof x->hostid, "host-%u", i / 2);
    x->caps = (uint8_t)(i % 2);
    x->late = x->alive && i % 4 == 1 ? i * 3 + 1 : 0;
    x->syncing = (uint8_t)(x->late && i % 8 == 1);
  }
  if (n > 0) {
    memset(m.m[0].host, 'h', PS_HOST_MAX - 1);
    memset(m.m[0].unix_path, 'u', PS_PATH_MAX - 1);
    m.m[0].port = 65535;
    m.m[0].id = UINT32_MAX;
    m.m[0].rank = UINT32_MAX;
  }
  return m;
}

static void assert_same_membership(const ps__membership *a, const ps__membership *b) {
  cr_assert(eq(u64, a->epoch, b->epoch));
  cr_assert(eq(u32, a->servers_expected, b->servers_expected));
  cr_assert(eq(u32, a->workers_expected, b->workers_expected));
  cr_assert(eq(u8, a->started, b->started));
  cr_assert(eq(u32, a->n, b->n));
  for (uint32_t i = 0; i < a->n; i++) {
    const ps__member *x = &a->m[i], *y = &b->m[i];
    cr_assert(eq(u32, x->id, y->id), "member %u", i);
    cr_assert(eq(u8, x->role, y->role), "member %u", i);
    cr_assert(eq(u8, x->alive, y->alive), "member %u", i);
    cr_assert(eq(u32, x->rank, y->rank), "member %u", i);
    cr_assert(eq(u16, x->port, y->port), "member %u", i);
    cr_assert(eq(str, (char *)x->host, (char *)y->host), "member %u", i);
    cr_assert(eq(str, (char *)x->unix_path, (char *)y->unix_path), "member %u", i);
    cr_assert(eq(str, (char *)x->hostid, (char *)y->hostid), "member %u", i);
    cr_assert(eq(u8, x->caps, y->caps), "member %u", i);
    cr_assert(eq(u32, x->late, y->late), "member %u", i);
    cr_assert(eq(u8, x->syncing, y->syncing), "member %u", i);
  }
}

/* A replacement's flags travel in the alive byte, its admission number after caps; an
 * unknown bit, or a number that disagrees with the late bit, is refused. */
Test(msg, membership_late_and_syncing) {
  ps__membership in = sample_membership(3), out;
  in.m[0].alive = 1, in.m[0].late = 0, in.m[0].syncing = 0;
  in.m[1].alive = 1, in.m[1].late = 7, in.m[1].syncing = 1;
  in.m[2].alive = 1, in.m[2].late = 0x80000001u, in.m[2].syncing = 0;
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &in);
  cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), 0), "%s", ps_errmsg());
  assert_same_membership(&out, &in);
  cr_assert(eq(u8, ps__member_chain_state(&out.m[1]), PS_CHAIN_SYNCING));
  cr_assert(eq(u8, ps__member_chain_state(&out.m[2]), PS_CHAIN_LATE));
  out.m[2].alive = 0;
  cr_assert(eq(u8, ps__member_chain_state(&out.m[2]), PS_CHAIN_DEAD));
  ps__membership_clear(&out);
  /* the alive byte of member 0: after epoch, counts, started, count, id and role */
  size_t at = 8 + 4 + 4 + 1 + 4 + 4 + 1;
  w.data[at] = 8;
  cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), PS_ERR_PROTO));
  w.data[at] = 1 | 2; /* late, but its number (0) says not */
  cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), PS_ERR_PROTO));
  w.data[at] = 1;
  cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), 0), "%s", ps_errmsg());
  ps__membership_clear(&out);
  /* member 0's number, last of its fields: 0 -> 5 while its late bit is clear */
  size_t num = at + 1 + 4 + 4 + 4 + strlen(in.m[0].host) + 4 + strlen(in.m[0].unix_path) + 4 + strlen(in.m[0].hostid) + 1;
  cr_assert(eq(u32, (uint32_t)w.data[num] | (uint32_t)w.data[num + 1] << 8, 0));
  w.data[num] = 5;
  cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), PS_ERR_PROTO));
  ps__wbuf_free(&w);
  free(in.m);
}

Test(msg, hello_join_byte) {
  ps__hello h = {.role = PS_ROLE_SERVER, .port = 7, .pid = 9, .join = 1}, o;
  snprintf(h.host, sizeof h.host, "127.0.0.1");
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &h);
  cr_assert(eq(int, ps__hello_decode(w.data, w.len, &o), 0), "%s", ps_errmsg());
  cr_assert(eq(u8, o.join, 1));
  cr_assert(eq(int, ps__hello_decode(w.data, w.len - 1, &o), 0)); /* without it: not a join */
  cr_assert(eq(u8, o.join, 0));
  w.data[w.len - 1] = 2;
  cr_assert(eq(int, ps__hello_decode(w.data, w.len, &o), PS_ERR_PROTO));
  ps__wbuf_free(&w);
}

Test(msg, hello_token) {
  ps__hello h = {.role = PS_ROLE_WORKER, .pid = 9, .token = 0x0123456789abcdefull}, o;
  for (int join = 0; join < 2; join++) {
    h.join = (uint8_t)join;
    ps__wbuf w;
    ps__wbuf_init(&w);
    ps__hello_encode(&w, &h);
    cr_assert(eq(int, ps__hello_decode(w.data, w.len, &o), 0), "%s", ps_errmsg());
    cr_assert(eq(u64, o.token, h.token));
    cr_assert(eq(u8, o.join, join));
    w.data[w.len - 9] = 2; /* the join byte before a token is 0 or 1 */
    cr_assert(eq(int, ps__hello_decode(w.data, w.len, &o), PS_ERR_PROTO));
    w.data[w.len - 9] = (uint8_t)join;
    memset(w.data + w.len - 8, 0, 8); /* a token sent is never 0 */
    cr_assert(eq(int, ps__hello_decode(w.data, w.len, &o), PS_ERR_PROTO));
    cr_assert(eq(int, ps__hello_decode(w.data, w.len - 4, &o), PS_ERR_PROTO)); /* cut short */
    ps__wbuf_free(&w);
  }
}

Test(msg, membership_round_trip) {
  uint32_t sizes[] = {0, 1, 3, 17};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    ps__membership in = sample_membership(sizes[k]), out;
    ps__wbuf w;
    ps__wbuf_init(&w);
    ps__membership_encode(&w, &in);
    cr_assert(eq(int, w.oom, 0));
    cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), 0), "n=%u: %s", sizes[k], ps_errmsg());
    assert_same_membership(&out, &in);
    ps__membership_clear(&out);
    cr_assert(eq(ptr, out.m, NULL));
    cr_assert(eq(u32, out.n, 0));
    ps__wbuf_free(&w);
    free(in.m);
  }
}

Test(msg, membership_member_count_bounds) {
  /* Exactly PS_MAX_MEMBERS members decode. */
  ps__membership in = sample_membership(PS_MAX_MEMBERS), out;
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &in);
  cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), 0), "%s", ps_errmsg());
  cr_assert(eq(u32, out.n, PS_MAX_MEMBERS));
  ps__membership_clear(&out);
  ps__wbuf_free(&w);
  free(in.m);

  /* Counts above the bound fail on the count alone: no member array is allocated, so
   * the output is left empty (nothing to free), however short the body. */
  uint32_t counts[] = {PS_MAX_MEMBERS + 1, 1u << 20, 0x7fffffffu, UINT32_MAX};
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
    ps__wbuf_init(&w);
    ps__wbuf_u64(&w, 9);
    ps__wbuf_u32(&w, 1);
    ps__wbuf_u32(&w, 1);
    ps__wbuf_u8(&w, 1);
    ps__wbuf_u32(&w, counts[i]);
    memset(&out, 0xa5, sizeof out);
    cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), PS_ERR_PROTO), "count %u", counts[i]);
    cr_assert(eq(ptr, out.m, NULL), "count %u allocated a member array", counts[i]);
    cr_assert(eq(u32, out.n, 0));
    ps__wbuf_free(&w);
  }
}

Test(msg, membership_bad_member_port) {
  ps__membership in = sample_membership(2), out;
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &in);
  /* Header 21 bytes, then member 0: id(4) role(1) alive(1) rank(4) port(4). */
  ps__put_u32(w.data + 21 + 10, 70000);
  memset(&out, 0xa5, sizeof out);
  cr_assert(eq(int, ps__membership_decode(w.data, w.len, &out), PS_ERR_PROTO));
  cr_assert(eq(ptr, out.m, NULL), "a failed decode frees its member array");
  ps__wbuf_free(&w);
  free(in.m);
}

static ps__declare sample_declare(void) {
  ps__declare d;
  memset(&d, 0, sizeof d);
  d.id = 65535;
  d.kind = PS_DENSE;
  d.size = UINT64_MAX;
  memset(d.name, 'n', PS_NAME_MAX - 1);
  memset(d.options, 'o', PS_OPTS_MAX - 1);
  return d;
}

Test(msg, declare_round_trip) {
  ps__declare in = sample_declare(), out;
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &in);
  cr_assert(eq(sz, w.len, 4 + 1 + 8 + 4 + 127 + 4 + 1023));
  cr_assert(eq(int, ps__declare_decode(w.data, w.len, &out), 0), "%s", ps_errmsg());
  cr_assert(eq(u32, out.id, in.id));
  cr_assert(eq(u8, out.kind, in.kind));
  cr_assert(eq(u64, out.size, in.size));
  cr_assert(eq(str, out.name, in.name));
  cr_assert(eq(str, out.options, in.options));
  ps__wbuf_free(&w);

  memset(&in, 0, sizeof in);
  strcpy(in.name, "emb");
  in.kind = PS_SPARSE;
  in.size = 16;
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &in);
  cr_assert(eq(int, ps__declare_decode(w.data, w.len, &out), 0), "%s", ps_errmsg());
  cr_assert(eq(str, out.name, "emb"));
  cr_assert(eq(str, out.options, ""));
  cr_assert(eq(u32, out.id, 0));
  ps__wbuf_free(&w);
}

Test(msg, declare_rejections) {
  ps__declare in, out;
  ps__wbuf w;
  memset(&in, 0, sizeof in);
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &in);
  cr_assert(eq(int, ps__declare_decode(w.data, w.len, &out), PS_ERR_INVALID));
  cr_assert(strstr(ps_errmsg(), "empty table name") != NULL, "%s", ps_errmsg());
  ps__wbuf_free(&w);

  /* Name of PS_NAME_MAX bytes: one too many. */
  char name[PS_NAME_MAX + 1];
  memset(name, 'n', PS_NAME_MAX);
  name[PS_NAME_MAX] = '\0';
  ps__wbuf_init(&w);
  ps__wbuf_u32(&w, 0);
  ps__wbuf_u8(&w, 0);
  ps__wbuf_u64(&w, 1);
  ps__wbuf_str(&w, name);
  ps__wbuf_str(&w, "");
  cr_assert(eq(int, ps__declare_decode(w.data, w.len, &out), PS_ERR_PROTO));
  ps__wbuf_free(&w);
}

/* Every proper prefix of a valid body, and the body with one byte appended, is
 * rejected; the decoder reads nothing outside [p, p + n) (ASan checks: each prefix is
 * copied into an allocation of exactly its length). */
typedef int (*decode_fn)(const void *p, size_t n, void *out);

static int dec_hello(const void *p, size_t n, void *out) { return ps__hello_decode(p, n, out); }
static int dec_declare(const void *p, size_t n, void *out) { return ps__declare_decode(p, n, out); }
static int dec_membership(const void *p, size_t n, void *out) {
  ps__membership *m = out;
  int rc = ps__membership_decode(p, n, m);
  if (rc) {
    cr_assert(eq(ptr, m->m, NULL), "failed decode of %zu bytes left a member array", n);
  } else {
    ps__membership_clear(m);
  }
  return rc;
}

static void check_truncations(const char *what, const uint8_t *body, size_t len, decode_fn fn) {
  union {
    ps__hello h;
    ps__membership m;
    ps__declare d;
  } out;
  uint8_t *copy = malloc(len + 1);
  cr_assert_not_null(copy);
  memcpy(copy, body, len);
  cr_assert(eq(int, fn(copy, len, &out), 0), "%s: the full body of %zu bytes is rejected: %s", what, len,
            ps_errmsg());
  free(copy);
  for (size_t n = 0; n < len; n++) {
    uint8_t *p = n ? malloc(n) : NULL;
    if (n) memcpy(p, body, n);
    int rc = fn(p, n, &out);
    cr_assert(eq(int, rc, PS_ERR_PROTO), "%s: prefix of %zu/%zu bytes gave %s", what, n, len, ps_err_name(rc));
    free(p);
  }
  copy = malloc(len + 1);
  memcpy(copy, body, len);
  copy[len] = 0;
  cr_assert(eq(int, fn(copy, len + 1, &out), PS_ERR_PROTO), "%s: a trailing byte is accepted", what);
  free(copy);
}

Test(msg, every_truncation_is_rejected) {
  ps__wbuf w;
  ps__hello h = sample_hello();
  strcpy(h.host, "node-a");
  strcpy(h.unix_path, "/tmp/x.sock");
  strcpy(h.hostid, "hid");
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &h);
  check_truncations("hello", w.data, w.len, dec_hello);
  ps__wbuf_free(&w);

  ps__membership m = sample_membership(3);
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &m);
  check_truncations("membership", w.data, w.len, dec_membership);
  ps__wbuf_free(&w);
  free(m.m);

  m = sample_membership(0);
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &m);
  check_truncations("empty membership", w.data, w.len, dec_membership);
  ps__wbuf_free(&w);
  free(m.m);

  ps__declare d;
  memset(&d, 0, sizeof d);
  d.id = 3;
  d.kind = PS_SPARSE;
  d.size = 8;
  strcpy(d.name, "emb");
  strcpy(d.options, "opt=adam lr=0.1");
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &d);
  check_truncations("declare", w.data, w.len, dec_declare);
  ps__wbuf_free(&w);
}
