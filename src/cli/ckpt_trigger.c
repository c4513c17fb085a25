/*
 * ckpt_trigger.c - `pshard checkpoint HOST:PORT [--timeout MS]`: ask a running job's
 * scheduler for a checkpoint now and wait until it is complete.
 *
 * The request is a CHECKPOINT frame with clock -1 ("pick one": the scheduler cuts at a
 * clock every server can still reach) sent through the one-shot request of
 * net/oneshot.h, as any tool that asks a node one question. The scheduler answers once
 * the checkpoint's manifest is written, with the cut clock in the header and the
 * checkpoint's id and directory in the body (ps__ckpt_info).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/common.h"
#include "common/config.h"
#include "net/oneshot.h"
#include "proto/frame.h"
#include "proto/msg.h"

/* Longer than the scheduler's own deadline for the servers' answers (120 s), so that
 * a slow server's error reaches us rather than our timeout. */
#define TRIGGER_TIMEOUT_MS 130000u

static void trigger_usage(FILE *f) {
  fprintf(f,
          "usage: pshard checkpoint HOST:PORT [--timeout MS]\n\n"
          "Ask the scheduler at HOST:PORT for a checkpoint of the whole job now, wait until it is\n"
          "complete, and print its id, clock and directory. The scheduler must have been started\n"
          "with --checkpoint-dir. Exits 0, or 1 with the reason.\n\n"
          "options:\n"
          "  --timeout MS   give up after MS milliseconds (%u)\n"
          "  -h, --help     this text\n",
          TRIGGER_TIMEOUT_MS);
}

int ps_cli_checkpoint_trigger(int argc, char **argv) {
  static const struct option opts[] = {
      {"timeout", required_argument, 0, 't'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  uint64_t timeout = TRIGGER_TIMEOUT_MS;
  int c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
    case 't':
      if (ps__parse_u64(optarg, &timeout) || timeout == 0 || timeout > 86400000u) {
        fprintf(stderr, "pshard checkpoint: bad value '%s' for --timeout (milliseconds, 1..86400000)\n", optarg);
        return 2;
      }
      break;
    case 'h': trigger_usage(stdout); return 0;
    default:
      fprintf(stderr, "pshard checkpoint: unknown or incomplete option '%s'\n", argv[optind - 1]);
      trigger_usage(stderr);
      return 2;
    }
  }
  if (optind + 1 != argc) {
    fprintf(stderr, "pshard checkpoint: %s\n", optind >= argc ? "the scheduler's HOST:PORT is required"
                                                               : "one HOST:PORT expected");
    trigger_usage(stderr);
    return 2;
  }
  const char *addr = argv[optind];
  char host[PS_CFG_HOST_MAX];
  int port;
  if (ps__parse_hostport(addr, host, sizeof host, &port) || port == 0) {
    fprintf(stderr, "pshard checkpoint: bad scheduler address '%s' (HOST:PORT)\n", addr);
    trigger_usage(stderr);
    return 2;
  }
  ps__frame_hdr h = {.type = PS_MSG_CHECKPOINT, .req_id = 1, .clock = -1};
  ps__frame_hdr reply;
  void *body = NULL;
  size_t n = 0;
  if (ps__oneshot(addr, &h, NULL, 0, timeout, sizeof(ps__ckpt_info) + 64, &reply, &body, &n)) {
    fprintf(stderr, "pshard checkpoint: %s\n", ps_errmsg());
    return 1;
  }
  ps__ckpt_info info;
  int rc = ps__ckpt_info_decode(body, n, &info);
  free(body);
  if (rc) {
    fprintf(stderr, "pshard checkpoint: the scheduler at %s sent a malformed answer: %s\n", addr, ps_errmsg());
    return 1;
  }
  printf("checkpoint %llu at clock %lld in %s\n", (unsigned long long)info.id, (long long)reply.clock, info.dir);
  return 0;
}
