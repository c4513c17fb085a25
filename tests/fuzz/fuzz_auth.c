/*
 * fuzz_auth.c - fuzz target for the handshake (proto/auth.c): both sides' frame
 * decoders and the state machine, fed arbitrary frames in any order.
 *
 * An input (format in fuzz_auth.h) runs one accepting side (the server) and one
 * connecting side (the client) under fixed nonces, and delivers to either one frames of
 * the fuzzer's, the other side's real frames, or those with a byte changed. Every body
 * is passed in an allocation of exactly its length, so ASan sees any read past it.
 * Properties, checked after every step:
 *  - a step returns 0 or PS_ERR_AUTH; PS_ERR_AUTH leaves the state failed with a reason,
 *    and a failed or finished handshake fails every later frame;
 *  - every frame a side sends has the documented type and length;
 *  - the server goes on from its hello only for a 38-byte hello of version 1 and a
 *    known role, and its challenge carries its role, node, nonce and the MAC that an
 *    independent computation of the transcript gives;
 *  - the client goes on from a challenge only when the challenge's MAC is that MAC
 *    under the client's key, and then sends the proof the same computation gives;
 *  - the server finishes only on exactly that proof, and then names the hello's role
 *    and node as its peer; the client finishes only on an empty proof reply;
 *  - with different secrets or job ids neither side ever gets past the other's MAC.
 * A violated property aborts with a message, which libFuzzer and the replay driver
 * report as a crash.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "fuzz_auth.h"
#include "proto/auth.h"
#include "proto/frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "fuzz_auth: property violated at %s:%d: %s\n", __FILE__,       \
              __LINE__, #cond);                                                     \
      abort();                                                                      \
    }                                                                               \
  } while (0)

#define MAX_STEPS 64

static ps__auth_key make_key(const char *secret, const char *job) {
  ps__auth_key k;
  memset(&k, 0, sizeof k);
  k.len = strlen(secret);
  memcpy(k.secret, secret, k.len);
  snprintf(k.job, sizeof k.job, "%s", job);
  return k;
}

/* The MAC of one side over the transcript, computed here as docs/protocol.md states it,
 * without proto/auth.c. */
static void oracle_mac(const ps__auth_key *k, const char *label, uint8_t role_c, uint32_t node_c,
                       const uint8_t *nonce_c, uint8_t role_s, uint32_t node_s, const uint8_t *nonce_s,
                       uint8_t out[PS_AUTH_MAC]) {
  static const char proto[] = "pshard-auth-1";
  uint8_t m[256];
  size_t n = 0, job = strlen(k->job);
  memcpy(m + n, label, strlen(label) + 1), n += strlen(label) + 1;
  memcpy(m + n, proto, sizeof proto), n += sizeof proto;
  m[n++] = (uint8_t)job;
  memcpy(m + n, k->job, job), n += job;
  m[n++] = role_c;
  ps__put_u32(m + n, node_c), n += 4;
  memcpy(m + n, nonce_c, PS_AUTH_NONCE), n += PS_AUTH_NONCE;
  m[n++] = role_s;
  ps__put_u32(m + n, node_s), n += 4;
  memcpy(m + n, nonce_s, PS_AUTH_NONCE), n += PS_AUTH_NONCE;
  CHECK(ps__hmac_sha256(k->secret, k->len, m, n, out) == 0);
}

/* A frame one side sent, kept for relaying. */
typedef struct sent {
  int have;
  uint8_t type;
  uint8_t body[PS_AUTH_MAX_BODY];
  size_t len;
} sent;

typedef struct side {
  ps__hs hs;
  ps__auth_key key;
  uint8_t role;
  uint32_t node;
  uint8_t nonce[PS_AUTH_NONCE];
  sent last; /* what it sent last */
} side;

/* Deliver a frame to x; check the step against the properties. */
static void deliver(side *x, side *peer, int is_server, uint8_t type, const uint8_t *body, size_t len) {
  ps__hs_out out;
  int before = x->hs.state;
  /* An exact copy, so that a read past the body is out of bounds. */
  uint8_t *copy = len ? malloc(len) : NULL;
  CHECK(!len || copy);
  if (len) memcpy(copy, body, len);
  int rc = ps__hs_recv(&x->hs, type, copy, len, &out);
  CHECK(rc == 0 || rc == PS_ERR_AUTH);
  CHECK(out.len <= PS_AUTH_MAX_BODY);
  if (rc) {
    CHECK(x->hs.state == PS_HS_FAILED && x->hs.why[0] != '\0' && memchr(x->hs.why, 0, sizeof x->hs.why));
    CHECK(out.type == 0 && out.len == 0);
    free(copy);
    return;
  }
  CHECK(before != PS_HS_FAILED && before != PS_HS_DONE); /* finished handshakes take nothing */
  uint8_t mac[PS_AUTH_MAC];
  if (is_server && before == PS_HS_S_WAIT_HELLO) {
    CHECK(type == PS_MSG_AUTH_HELLO && len == PS_AUTH_HELLO_LEN);
    CHECK(copy[0] == PS_AUTH_VERSION && copy[1] >= 1 && copy[1] <= PS_AUTH_ROLE_TOOL);
    CHECK(x->hs.state == PS_HS_S_WAIT_PROOF);
    CHECK(out.type == (PS_MSG_AUTH_HELLO | PS_FRAME_REPLY) && out.len == PS_AUTH_CHALLENGE_LEN);
    CHECK(out.body[0] == x->role && ps__get_u32(out.body + 1) == x->node);
    CHECK(memcmp(out.body + 5, x->nonce, PS_AUTH_NONCE) == 0);
    oracle_mac(&x->key, "server", copy[1], ps__get_u32(copy + 2), copy + 6, x->role, x->node, x->nonce, mac);
    CHECK(memcmp(out.body + 5 + PS_AUTH_NONCE, mac, PS_AUTH_MAC) == 0);
  } else if (is_server) {
    CHECK(before == PS_HS_S_WAIT_PROOF && type == PS_MSG_AUTH_PROOF && len == PS_AUTH_PROOF_LEN);
    CHECK(x->hs.state == PS_HS_DONE);
    CHECK(out.type == (PS_MSG_AUTH_PROOF | PS_FRAME_REPLY) && out.len == 0);
    CHECK(!memcmp(&x->key, &peer->key, sizeof x->key)); /* only the right secret and job get here */
    oracle_mac(&x->key, "client", x->hs.role_c, x->hs.node_c, x->hs.nonce_c, x->role, x->node, x->nonce, mac);
    CHECK(memcmp(copy, mac, PS_AUTH_MAC) == 0);
    CHECK(x->hs.peer_role == x->hs.role_c && x->hs.peer_node == x->hs.node_c);
  } else if (before == PS_HS_C_WAIT_CHALLENGE) {
    CHECK(type == (PS_MSG_AUTH_HELLO | PS_FRAME_REPLY) && len == PS_AUTH_CHALLENGE_LEN);
    CHECK(copy[0] >= 1 && copy[0] <= PS_AUTH_ROLE_TOOL);
    CHECK(!memcmp(&x->key, &peer->key, sizeof x->key));
    oracle_mac(&x->key, "server", x->role, x->node, x->nonce, copy[0], ps__get_u32(copy + 1), copy + 5, mac);
    CHECK(memcmp(copy + 5 + PS_AUTH_NONCE, mac, PS_AUTH_MAC) == 0);
    CHECK(x->hs.state == PS_HS_C_WAIT_OK);
    CHECK(out.type == PS_MSG_AUTH_PROOF && out.len == PS_AUTH_PROOF_LEN);
    oracle_mac(&x->key, "client", x->role, x->node, x->nonce, copy[0], ps__get_u32(copy + 1), copy + 5, mac);
    CHECK(memcmp(out.body, mac, PS_AUTH_MAC) == 0);
  } else {
    CHECK(before == PS_HS_C_WAIT_OK && type == (PS_MSG_AUTH_PROOF | PS_FRAME_REPLY) && len == 0);
    CHECK(x->hs.state == PS_HS_DONE && out.type == 0);
    CHECK(x->hs.peer_role == x->hs.role_s && x->hs.peer_node == x->hs.node_s);
  }
  if (out.type) {
    x->last.have = 1;
    x->last.type = out.type;
    memcpy(x->last.body, out.body, out.len);
    x->last.len = out.len;
  }
  free(copy);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  side S, C;
  uint8_t nc[PS_AUTH_NONCE], ns[PS_AUTH_NONCE];
  ps__hs_out hello;
  if (size == 0) return 0;
  uint8_t cfg = data[0];
  memset(&S, 0, sizeof S);
  memset(&C, 0, sizeof C);
  fuzz_auth_nonces(nc, ns);
  C.key = make_key(FUZZ_AUTH_SECRET, FUZZ_AUTH_JOB);
  S.key = make_key(cfg & FUZZ_AUTH_OTHER_KEY ? FUZZ_AUTH_OTHER_SECRET : FUZZ_AUTH_SECRET,
                   cfg & FUZZ_AUTH_OTHER_JOB_ID ? FUZZ_AUTH_OTHER_JOB : FUZZ_AUTH_JOB);
  C.role = (uint8_t)(1 + (cfg & 3));
  S.role = (uint8_t)(1 + ((cfg >> 2) & 3));
  C.node = FUZZ_AUTH_NODE_C;
  S.node = FUZZ_AUTH_NODE_S;
  memcpy(C.nonce, nc, sizeof nc);
  memcpy(S.nonce, ns, sizeof ns);

  CHECK(ps__hs_client_start_nonce(&C.hs, &C.key, C.role, C.node, C.nonce, &hello) == 0);
  CHECK(C.hs.state == PS_HS_C_WAIT_CHALLENGE);
  CHECK(hello.type == PS_MSG_AUTH_HELLO && hello.len == PS_AUTH_HELLO_LEN && hello.body[0] == PS_AUTH_VERSION &&
        hello.body[1] == C.role && ps__get_u32(hello.body + 2) == C.node && !memcmp(hello.body + 6, nc, sizeof nc));
  C.last.have = 1;
  C.last.type = hello.type;
  memcpy(C.last.body, hello.body, hello.len);
  C.last.len = hello.len;
  ps__hs_server_start_nonce(&S.hs, &S.key, S.role, S.node, S.nonce);
  CHECK(S.hs.state == PS_HS_S_WAIT_HELLO);

  size_t pos = 1;
  for (unsigned step = 0; step < MAX_STEPS && pos < size; step++) {
    uint8_t op = data[pos++];
    int to_client = op & 1;
    side *x = to_client ? &C : &S, *peer = to_client ? &S : &C;
    if ((op & 0x80) == 0) { /* a frame of the fuzzer's */
      if (size - pos < 2) break;
      uint8_t type = data[pos];
      size_t len = data[pos + 1] % (PS_AUTH_MAX_BODY + 1);
      pos += 2;
      if (len > size - pos) len = size - pos;
      deliver(x, peer, !to_client, type, data + pos, len);
      pos += len;
    } else if (peer->last.have) { /* the other side's last frame, perhaps with a byte changed */
      sent f = peer->last;
      if ((op & 0xc0) == FUZZ_AUTH_OP_CORRUPT) {
        if (size - pos < 2) break;
        if (f.len) f.body[data[pos] % f.len] ^= data[pos + 1];
        else f.type ^= data[pos + 1];
        pos += 2;
      }
      deliver(x, peer, !to_client, f.type, f.body, f.len);
    }
  }
  /* Finished or failed handshakes refuse whatever comes next. */
  side *both[2] = {&S, &C};
  for (int i = 0; i < 2; i++) {
    side *x = both[i];
    if (x->hs.state != PS_HS_DONE && x->hs.state != PS_HS_FAILED) continue;
    ps__hs_out out;
    CHECK(ps__hs_recv(&x->hs, PS_MSG_AUTH_PROOF, NULL, 0, &out) == PS_ERR_AUTH && x->hs.state == PS_HS_FAILED);
  }
  return 0;
}
