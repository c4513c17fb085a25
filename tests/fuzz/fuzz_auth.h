/*
 * fuzz_auth.h - what the handshake fuzz target (fuzz_auth.c) and the corpus generator
 * (gen_corpus.c) share: the keys, the fixed nonces that make every exchange the same
 * on every run, and the input format.
 *
 * An input is a configuration byte and then steps. The configuration byte:
 *   bits 0-1  the client's role - 1 (1..4: server, worker, scheduler, tool)
 *   bits 2-3  the server's role - 1
 *   bit 4     the server holds another secret (nothing may authenticate)
 *   bit 5     the server is bound to another job id (nothing may authenticate)
 * A step is one byte, then its operands:
 *   0x00 | side            a frame of the fuzzer's: type byte, length byte (taken mod
 *                          PS_AUTH_MAX_BODY + 1, cut to what is left), body
 *   0x80 | side            the other side's last frame, as it sent it
 *   0xc0 | side            the other side's last frame with one byte changed: position
 *                          byte (mod its length), xor byte
 * side (bit 0): 0 delivers to the server (the accepting side), 1 to the client. Other
 * step bytes are read with bits 1-5 ignored.
 */
#ifndef PS_FUZZ_AUTH_H
#define PS_FUZZ_AUTH_H

#include <stdint.h>

#include "proto/auth.h"

#define FUZZ_AUTH_SECRET "fuzz-secret-0123456789"
#define FUZZ_AUTH_OTHER_SECRET "fuzz-secret-9876543210"
#define FUZZ_AUTH_JOB "fuzz"
#define FUZZ_AUTH_OTHER_JOB "fuzz2"
#define FUZZ_AUTH_NODE_C 2u
#define FUZZ_AUTH_NODE_S 1u

enum { FUZZ_AUTH_TO_SERVER = 0, FUZZ_AUTH_TO_CLIENT = 1 };
enum { FUZZ_AUTH_OP_FRAME = 0x00, FUZZ_AUTH_OP_RELAY = 0x80, FUZZ_AUTH_OP_CORRUPT = 0xc0 };
enum { FUZZ_AUTH_OTHER_KEY = 0x10, FUZZ_AUTH_OTHER_JOB_ID = 0x20 };

/* The client's nonce is 0x00..0x1f, the server's 0x20..0x3f. */
static inline void fuzz_auth_nonces(uint8_t c[PS_AUTH_NONCE], uint8_t s[PS_AUTH_NONCE]) {
  for (int i = 0; i < PS_AUTH_NONCE; i++) {
    c[i] = (uint8_t)i;
    s[i] = (uint8_t)(PS_AUTH_NONCE + i);
  }
}

#endif
