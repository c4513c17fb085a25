/*
 * auth.h - the job secret's handshake: a challenge-response over fresh nonces from both
 * sides, as a state machine with no I/O (net/auth.c runs it on connections).
 *
 * Four frames, before any other on a connection (docs/protocol.md, "Authentication"):
 *
 *   connecting side (C)                         accepting side (S)
 *   AUTH_HELLO      version, role_c, node_c, nonce_c  ->
 *                <-  AUTH_HELLO|REPLY  role_s, node_s, nonce_s, mac_s
 *   AUTH_PROOF      mac_c                             ->
 *                <-  AUTH_PROOF|REPLY  (empty): authenticated
 *
 * mac_x = HMAC-SHA256(secret, label_x || transcript), where the transcript is the
 * protocol name, the job id, and both sides' roles, node ids and nonces, and label_x
 * says which side computed it ("server" or "client"), so one side's MAC is never
 * accepted as the other's. Each side checks the other's MAC over its own fresh nonce,
 * so a recorded exchange replayed later fails; a different secret or job id fails.
 * Any failure is PS_ERR_AUTH, whatever the cause, with the cause only in hs->why (for
 * the local log, never sent).
 *
 * The crypto is OpenSSL's libcrypto: HMAC (EVP_MAC), RAND_bytes (the OS random source)
 * and CRYPTO_memcmp for constant-time comparison.
 */
#ifndef PS_PROTO_AUTH_H
#define PS_PROTO_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "proto/frame.h"

/* Frame types of the handshake, in a range of their own (never reused for other frames). */
enum { PS_MSG_AUTH_HELLO = 0x70, PS_MSG_AUTH_PROOF = 0x71 };
static inline int ps__frame_is_auth(uint8_t type) {
  uint8_t t = type & (uint8_t)~PS_FRAME_REPLY;
  return t == PS_MSG_AUTH_HELLO || t == PS_MSG_AUTH_PROOF;
}

#define PS_AUTH_VERSION 1
#define PS_AUTH_NONCE 32
#define PS_AUTH_MAC 32
/* The largest frame body a connection accepts before it is authenticated. */
#define PS_AUTH_MAX_BODY 128u
#define PS_AUTH_SECRET_MIN 16
#define PS_AUTH_SECRET_MAX 1024
#define PS_AUTH_JOB_MAX 64
/* Body sizes of the four frames. */
#define PS_AUTH_HELLO_LEN (1 + 1 + 4 + PS_AUTH_NONCE)
#define PS_AUTH_CHALLENGE_LEN (1 + 4 + PS_AUTH_NONCE + PS_AUTH_MAC)
#define PS_AUTH_PROOF_LEN PS_AUTH_MAC

/* Roles in the handshake: the node roles of proto/msg.h, and a tool (a command asking
 * one question, such as `pshard checkpoint`), which registers as no node. */
#define PS_AUTH_ROLE_TOOL 4

/* The job's key: the secret and the job id it is bound to. */
typedef struct ps__auth_key {
  uint8_t secret[PS_AUTH_SECRET_MAX];
  size_t len;
  char job[PS_AUTH_JOB_MAX + 1];
} ps__auth_key;

enum {
  PS_HS_C_WAIT_CHALLENGE = 1,
  PS_HS_C_WAIT_OK,
  PS_HS_S_WAIT_HELLO,
  PS_HS_S_WAIT_PROOF,
  PS_HS_DONE,
  PS_HS_FAILED
};

typedef struct ps__hs {
  const ps__auth_key *key; /* borrowed for the handshake's life */
  int state;
  uint8_t self_role, peer_role;
  uint32_t self_node, peer_node;
  uint8_t nonce_c[PS_AUTH_NONCE], nonce_s[PS_AUTH_NONCE];
  uint8_t role_c, role_s;
  uint32_t node_c, node_s;
  int nonce_given; /* the server's nonce was given at the start (ps__hs_server_start_nonce) */
  char why[128]; /* why it failed, for the local log */
} ps__hs;

/* A frame to send: its type and body (type 0: nothing to send). */
typedef struct ps__hs_out {
  uint8_t type;
  uint8_t body[PS_AUTH_MAX_BODY];
  size_t len;
} ps__hs_out;

/* The connecting side: out is the AUTH_HELLO to send. 0, or PS_ERR_AUTH (no random
 * bytes: hs->why). */
int ps__hs_client_start(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node, ps__hs_out *out);
/* The accepting side: waits for AUTH_HELLO. */
void ps__hs_server_start(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node);
/* Both starts with this side's nonce given instead of drawn from the OS: for tests and
 * fuzzing only, where an exchange must be the same on every run (a fixed nonce makes
 * a recorded exchange replayable, so nothing else may call these). */
int ps__hs_client_start_nonce(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node,
                              const uint8_t nonce[PS_AUTH_NONCE], ps__hs_out *out);
void ps__hs_server_start_nonce(ps__hs *hs, const ps__auth_key *k, uint8_t role, uint32_t node,
                               const uint8_t nonce[PS_AUTH_NONCE]);
/* A frame arrived (its type and body): 0 with out set to what to send next (out->type
 * 0: nothing), the handshake complete when hs->state is PS_HS_DONE (peer_role and
 * peer_node are then the peer's authenticated identity); or PS_ERR_AUTH (state
 * PS_HS_FAILED, the reason in hs->why). A failed or complete handshake fails every
 * further frame. */
int ps__hs_recv(ps__hs *hs, uint8_t type, const uint8_t *body, size_t len, ps__hs_out *out);

/* HMAC-SHA256 of msg under key (out: PS_AUTH_MAC bytes). 0 or -1. */
int ps__hmac_sha256(const uint8_t *key, size_t klen, const uint8_t *msg, size_t mlen, uint8_t *out);
/* n bytes from the OS random source. 0 or -1. */
int ps__random_bytes(uint8_t *out, size_t n);

#endif
