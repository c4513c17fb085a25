/*
 * auth.c - the handshake's state machine and its MACs (see auth.h). No I/O.
 *
 * Every frame is checked for its exact type, state and length before a field is read;
 * whatever is wrong, the step fails with PS_ERR_AUTH and the handshake stays failed.
 */
#include "proto/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"

#define PROTO_NAME "pshard-auth-1"

int ps__hmac_sha256(const uint8_t *key, size_t klen, const uint8_t *msg, size_t mlen, uint8_t *out) {
  unsigned int olen = 0;
  if (klen > (size_t)INT32_MAX) return -1;
  if (!HMAC(EVP_sha256(), key, (int)klen, msg, mlen, out, &olen) || olen != PS_AUTH_MAC) return -1;
  return 0;
}

int ps__random_bytes(uint8_t *out, size_t n) {
  if (n > (size_t)INT32_MAX) return -1;
  return RAND_bytes(out, (int)n) == 1 ? 0 : -1;
}

static int fail(ps__hs *hs, const char *why) {
  hs->state = PS_HS_FAILED;
  snprintf(hs->why, sizeof hs->why, "%s", why);
  return PS_ERR_AUTH;
}

/* The MAC of one side (label "server" or "client") over the whole exchange. */
static int side_mac(const ps__hs *hs, const char *label, uint8_t *out) {
  uint8_t m[16 + sizeof PROTO_NAME + 1 + PS_AUTH_JOB_MAX + 2 * (1 + 4 + PS_AUTH_NONCE)];
  size_t n = 0, lab = strlen(label) + 1, job = strlen(hs->key->job);
  memcpy(m + n, label, lab);
  n += lab;
  memcpy(m + n, PROTO_NAME, sizeof PROTO_NAME);
  n += sizeof PROTO_NAME;
  m[n++] = (uint8_t)job;
  memcpy(m + n, hs->key->job, job);
  n += job;
  m[n++] = hs->role_c;
  ps__put_u32(m + n, hs->node_c);
  n += 4;
  memcpy(m + n, hs->nonce_c, PS_AUTH_NONCE);
  n += PS_AUTH_NONCE;
  m[n++] = hs->role_s;
  ps__put_u32(m + n, hs->node_s);
  n += 4;
  memcpy(m + n, hs->nonce_s, PS_AUTH_NONCE);
  n += PS_AUTH_NONCE;
  return ps__hmac_sha256(hs->key->secret, hs->key->len, m, n, out);
}

static int role_ok(uint8_t r) { return r >= 1 && r <= PS_AUTH_ROLE_TOOL; }

/* The client's first step, its nonce either given or drawn (nonce NULL). */
static int client_start(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node, const uint8_t *nonce,
                        ps__hs_out *out) {
  memset(hs, 0, sizeof *hs);
  memset(out, 0, sizeof *out);
  hs->key = k;
  hs->self_role = hs->role_c = role;
  hs->self_node = hs->node_c = node;
  if (nonce) memcpy(hs->nonce_c, nonce, PS_AUTH_NONCE);
  else if (ps__random_bytes(hs->nonce_c, PS_AUTH_NONCE)) return fail(hs, "no random bytes for a nonce");
  out->type = PS_MSG_AUTH_HELLO;
  out->body[0] = PS_AUTH_VERSION;
  out->body[1] = role;
  ps__put_u32(out->body + 2, node);
  memcpy(out->body + 6, hs->nonce_c, PS_AUTH_NONCE);
  out->len = PS_AUTH_HELLO_LEN;
  hs->state = PS_HS_C_WAIT_CHALLENGE;
  return 0;
}

int ps__hs_client_start(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node, ps__hs_out *out) {
  return client_start(hs, k, role, node, NULL, out);
}

int ps__hs_client_start_nonce(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node,
                              const uint8_t nonce[PS_AUTH_NONCE], ps__hs_out *out) {
  return client_start(hs, k, role, node, nonce, out);
}

void ps__hs_server_start(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node) {
  memset(hs, 0, sizeof *hs);
  hs->key = k;
  hs->self_role = hs->role_s = role;
  hs->self_node = hs->node_s = node;
  hs->state = PS_HS_S_WAIT_HELLO;
}

void ps__hs_server_start_nonce(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node,
                               const uint8_t nonce[PS_AUTH_NONCE]) {
  ps__hs_server_start(hs, k, role, node);
  memcpy(hs->nonce_s, nonce, PS_AUTH_NONCE);
  hs->nonce_given = 1;
}

static int on_hello(ps__hs *hs, const uint8_t *b, size_t len, ps__hs_out *out) {
  if (len != PS_AUTH_HELLO_LEN) return fail(hs, "hello of the wrong length");
  if (b[0] != PS_AUTH_VERSION) return fail(hs, "hello of another handshake version");
  if (!role_ok(b[1])) return fail(hs, "hello with an unknown role");
  hs->role_c = b[1];
  hs->node_c = ps__get_u32(b + 2);
  memcpy(hs->nonce_c, b + 6, PS_AUTH_NONCE);
  if (!hs->nonce_given && ps__random_bytes(hs->nonce_s, PS_AUTH_NONCE)) return fail(hs, "no random bytes for a nonce");
  out->type = PS_MSG_AUTH_HELLO | PS_FRAME_REPLY;
  out->body[0] = hs->role_s;
  ps__put_u32(out->body + 1, hs->node_s);
  memcpy(out->body + 5, hs->nonce_s, PS_AUTH_NONCE);
  if (side_mac(hs, "server", out->body + 5 + PS_AUTH_NONCE)) return fail(hs, "hmac failed");
  out->len = PS_AUTH_CHALLENGE_LEN;
  hs->state = PS_HS_S_WAIT_PROOF;
  return 0;
}

static int on_challenge(ps__hs *hs, const uint8_t *b, size_t len, ps__hs_out *out) {
  uint8_t want[PS_AUTH_MAC];
  if (len != PS_AUTH_CHALLENGE_LEN) return fail(hs, "challenge of the wrong length");
  if (!role_ok(b[0])) return fail(hs, "challenge with an unknown role");
  hs->role_s = b[0];
  hs->node_s = ps__get_u32(b + 1);
  memcpy(hs->nonce_s, b + 5, PS_AUTH_NONCE);
  if (side_mac(hs, "server", want)) return fail(hs, "hmac failed");
  if (CRYPTO_memcmp(want, b + 5 + PS_AUTH_NONCE, PS_AUTH_MAC) != 0)
    return fail(hs, "the peer does not know this job's secret (wrong secret or job id)");
  out->type = PS_MSG_AUTH_PROOF;
  if (side_mac(hs, "client", out->body)) return fail(hs, "hmac failed");
  out->len = PS_AUTH_PROOF_LEN;
  hs->state = PS_HS_C_WAIT_OK;
  return 0;
}

static int on_proof(ps__hs *hs, const uint8_t *b, size_t len, ps__hs_out *out) {
  uint8_t want[PS_AUTH_MAC];
  if (len != PS_AUTH_PROOF_LEN) return fail(hs, "proof of the wrong length");
  if (side_mac(hs, "client", want)) return fail(hs, "hmac failed");
  if (CRYPTO_memcmp(want, b, PS_AUTH_MAC) != 0)
    return fail(hs, "the peer does not know this job's secret (wrong secret or job id, or a replayed proof)");
  out->type = PS_MSG_AUTH_PROOF | PS_FRAME_REPLY;
  out->len = 0;
  hs->peer_role = hs->role_c;
  hs->peer_node = hs->node_c;
  hs->state = PS_HS_DONE;
  return 0;
}

int ps__hs_recv(ps__hs *hs, uint8_t type, const uint8_t *body, size_t len, ps__hs_out *out) {
  memset(out, 0, sizeof *out);
  if (len && !body) return fail(hs, "frame without its body");
  switch (hs->state) {
  case PS_HS_S_WAIT_HELLO:
    if (type != PS_MSG_AUTH_HELLO) return fail(hs, "first frame is not an authentication hello");
    return on_hello(hs, body, len, out);
  case PS_HS_S_WAIT_PROOF:
    if (type != PS_MSG_AUTH_PROOF) return fail(hs, "expected an authentication proof");
    return on_proof(hs, body, len, out);
  case PS_HS_C_WAIT_CHALLENGE:
    if (type != (PS_MSG_AUTH_HELLO | PS_FRAME_REPLY)) return fail(hs, "expected an authentication challenge");
    return on_challenge(hs, body, len, out);
  case PS_HS_C_WAIT_OK:
    if (type != (PS_MSG_AUTH_PROOF | PS_FRAME_REPLY) || len != 0) return fail(hs, "expected the end of the handshake");
    hs->peer_role = hs->role_s;
    hs->peer_node = hs->node_s;
    hs->state = PS_HS_DONE;
    return 0;
  default:
    return fail(hs, "frame after the handshake ended");
  }
}
