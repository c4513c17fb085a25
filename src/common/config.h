/*
 * config.h - typed access to ps_config values and the consistency-mode parser.
 */
#ifndef PS_CONFIG_H
#define PS_CONFIG_H

#include <stdint.h>

#include "pshard.h"

#define PS_CFG_HOST_MAX 64

typedef enum { PS__MODE_SYNC = 0 } ps__mode_kind;
typedef struct ps__mode {
  ps__mode_kind kind;
  uint32_t param;
} ps__mode;

int ps__mode_parse(const char *v, ps__mode *m);
uint64_t ps__config_uint(const ps_config *c, const char *key, uint64_t dflt);
const char *ps__config_str(const ps_config *c, const char *key, const char *dflt);

#endif
