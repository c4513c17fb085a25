/*
 * config.h - typed access to ps_config values and the consistency-mode parser.
 */
#ifndef PS_CONFIG_H
#define PS_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "pshard.h"

#define PS_CFG_HOST_MAX 64
/* Longest directory path a key takes (checkpoint_dir, restore), NUL included: the
 * checkpoint frames carry directories of at most this size. */
#define PS_CFG_PATH_MAX 1024

/* Consistency models (DESIGN 5): sync (BSP), sync:M (first M of K), ssp:S (bounded
 * staleness S), async. */
typedef enum { PS__MODE_SYNC = 0, PS__MODE_SYNC_M = 1, PS__MODE_SSP = 2, PS__MODE_ASYNC = 3 } ps__mode_kind;
typedef struct ps__mode {
  ps__mode_kind kind;
  uint32_t param;
} ps__mode;

/* Parse "sync", "sync:M" (M >= 1), "ssp:S" (S >= 0) or "async". 0 or -1 (with a
 * message for ps__fail describing the problem in msg). */
int ps__mode_parse(const char *v, ps__mode *m, char *msg, size_t msglen);
/* A checkpoint period: N clocks ("100") or a duration ("500ms", "30s", "10m", "2h", at
 * most 30 days). One of *clocks, *ms is set, the other 0. 0 or -1. */
int ps__parse_every(const char *v, uint64_t *clocks, uint64_t *ms);
/* An on/off value: "on" or "1" is 1, "off" or "0" is 0, anything else -1. */
int ps__parse_switch(const char *v);
uint64_t ps__config_uint(const ps_config *c, const char *key, uint64_t dflt);
const char *ps__config_str(const ps_config *c, const char *key, const char *dflt);

#endif
