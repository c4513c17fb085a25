/*
 * config.c - ps_config: string options with validation, and PSHARD_* environment.
 */
#include <ctype.h>
#include <string.h>

#include "common/common.h"
#include "common/config.h"
#include "common/fault.h"
#include "common/ring.h" /* PS_MAX_REPLICAS */

typedef enum { K_STR, K_UINT, K_COUNT, K_ROLE, K_MODE, K_TRANSPORT, K_HOSTPORT, K_FAULT, K_PATH, K_EVERY, K_SWITCH, K_HTTP_PORT } kind_t;

static const struct {
  const char *key;
  kind_t kind;
  uint64_t max;
} keys[] = {
    {"role", K_ROLE, 0},           {"scheduler", K_HOSTPORT, 0}, {"servers", K_UINT, 4096},
    {"workers", K_UINT, 4096},     {"embedded", K_UINT, 256},    {"mode", K_MODE, 0},
    {"timeout_ms", K_UINT, 86400000}, {"connect_timeout_ms", K_UINT, 86400000},
    {"heartbeat_ms", K_UINT, 600000}, {"heartbeat_timeout_ms", K_UINT, 86400000},
    {"rejoin_ms", K_UINT, 86400000}, {"retry_ms", K_UINT, 86400000},
    {"transport", K_TRANSPORT, 0}, {"host", K_STR, 0},           {"vnodes", K_UINT, 4096},
    {"max_frame_mb", K_UINT, 1u << 20}, {"port", K_UINT, 65535},
    {"direct", K_UINT, 1},         {"peer_mem", K_UINT, 1},      {"dedup", K_UINT, 1},
    {"colocate", K_UINT, 1},       {"fault", K_FAULT, 0},
    {"checkpoint_every", K_EVERY, 0}, {"checkpoint_dir", K_PATH, 0},
    {"checkpoint_keep", K_UINT, 1000000}, {"restore", K_PATH, 0}, {"checkpoint_full_every", K_UINT, 1000000},
    {"replicas", K_COUNT, PS_MAX_REPLICAS},
    /* a server's limits (server/budget.c; servers read them as PSHARD_* variables) */
    {"server_memory_mb", K_UINT, 1u << 30}, {"frame_budget_mb", K_UINT, 1u << 30},
    {"frame_deadline_ms", K_UINT, 86400000},
    {"metrics", K_SWITCH, 0},      {"http_port", K_HTTP_PORT, 0}, {"http_host", K_STR, 0},
    {"secret_file", K_PATH, 0},    {"job_id", K_STR, 0},         {"insecure", K_UINT, 1},
};
#define NKEYS (sizeof keys / sizeof keys[0])

struct ps_config {
  char *val[NKEYS];
};

static int key_index(const char *k) {
  for (size_t i = 0; i < NKEYS; i++)
    if (!strcmp(keys[i].key, k)) return (int)i;
  return -1;
}

int ps_config_new(ps_config **out) {
  if (!out) return ps__fail(PS_ERR_INVALID, "ps_config_new: out is NULL");
  *out = ps__calloc(1, sizeof **out);
  return *out ? 0 : ps__fail(PS_ERR_NOMEM, "out of memory");
}

void ps_config_free(ps_config *c) {
  if (!c) return;
  for (size_t i = 0; i < NKEYS; i++) free(c->val[i]);
  free(c);
}

int ps__mode_parse(const char *v, ps__mode *m, char *msg, size_t msglen) {
  const char *colon = strchr(v, ':');
  size_t n = colon ? (size_t)(colon - v) : strlen(v);
  int64_t p = 0;
  if (colon && ps__parse_i64(colon + 1, &p)) {
    snprintf(msg, msglen, "bad parameter '%s' in consistency mode '%s'", colon + 1, v);
    return -1;
  }
  if (n == 4 && !strncmp(v, "sync", 4)) {
    if (colon && p < 1) {
      snprintf(msg, msglen, "sync:M needs M >= 1 (got %lld)", (long long)p);
      return -1;
    }
    m->kind = colon ? PS__MODE_SYNC_M : PS__MODE_SYNC;
  } else if (n == 3 && !strncmp(v, "ssp", 3)) {
    if (!colon) {
      snprintf(msg, msglen, "ssp needs a staleness bound: ssp:S");
      return -1;
    }
    if (p < 0) {
      snprintf(msg, msglen, "negative staleness bound %lld in '%s'", (long long)p, v);
      return -1;
    }
    m->kind = PS__MODE_SSP;
  } else if (n == 5 && !strncmp(v, "async", 5) && !colon) {
    m->kind = PS__MODE_ASYNC;
  } else {
    snprintf(msg, msglen, "unknown consistency mode '%s' (sync, sync:M, ssp:S or async)", v);
    return -1;
  }
  if (p > 1000000) {
    snprintf(msg, msglen, "mode parameter %lld too large", (long long)p);
    return -1;
  }
  m->param = (uint32_t)p;
  return 0;
}

int ps__parse_every(const char *v, uint64_t *clocks, uint64_t *ms) {
  *clocks = *ms = 0;
  if (!v || *v < '0' || *v > '9') return -1;
  char num[24];
  size_t n = 0;
  while (v[n] >= '0' && v[n] <= '9' && n < sizeof num - 1) num[n] = v[n], n++;
  num[n] = '\0';
  uint64_t x;
  if (v[n] >= '0' && v[n] <= '9') return -1; /* too many digits */
  if (ps__parse_u64(num, &x)) return -1;
  const char *u = v + n;
  static const struct {
    const char *name;
    uint64_t ms;
  } units[] = {{"ms", 1}, {"s", 1000}, {"m", 60000}, {"h", 3600000}};
  if (!*u) {
    if (x > 1000000000u) return -1;
    *clocks = x;
    return 0;
  }
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
    if (!strcmp(u, units[i].name)) {
      if (x == 0 || x > 2592000000ull / units[i].ms) return -1; /* 30 days */
      *ms = x * units[i].ms;
      return 0;
    }
  return -1;
}

int ps_config_set(ps_config *c, const char *key, const char *value) {
  if (!c || !key || !value) return ps__fail(PS_ERR_INVALID, "ps_config_set: NULL argument");
  int i = key_index(key);
  if (i < 0) return ps__fail(PS_ERR_CONFIG, "unknown configuration key '%s'", key);
  uint64_t u;
  char host[PS_CFG_HOST_MAX];
  int port;
  ps__mode mode;
  switch (keys[i].kind) {
  case K_UINT:
  case K_COUNT: {
    unsigned long long lo = keys[i].kind == K_COUNT; /* a count of copies is at least 1 */
    if (ps__parse_u64(value, &u) || u > keys[i].max || u < lo)
      return ps__fail(PS_ERR_CONFIG, "bad value '%s' for '%s' (an integer in [%llu, %llu] is expected)", value, key, lo,
                      (unsigned long long)keys[i].max);
    break;
  }
  case K_ROLE:
    if (strcmp(value, "worker") && strcmp(value, "server") && strcmp(value, "scheduler"))
      return ps__fail(PS_ERR_CONFIG, "bad role '%s' (worker, server or scheduler)", value);
    break;
  case K_MODE: {
    char msg[160];
    if (ps__mode_parse(value, &mode, msg, sizeof msg)) return ps__fail(PS_ERR_CONFIG, "%s", msg);
    break;
  }
  case K_TRANSPORT:
    if (strcmp(value, "auto") && strcmp(value, "tcp"))
      return ps__fail(PS_ERR_CONFIG, "bad transport '%s' (auto or tcp)", value);
    break;
  case K_HOSTPORT:
    if (ps__parse_hostport(value, host, sizeof host, &port) || port == 0)
      return ps__fail(PS_ERR_CONFIG, "bad scheduler address '%s' (host:port expected)", value);
    break;
  case K_FAULT: {
    /* Checked here so that a bad spec fails where it is set; armed by the role. */
    ps__fault_set set;
    char msg[256];
    if (ps__fault_parse(value, &set, msg, sizeof msg)) return ps__fail(PS_ERR_CONFIG, "%s", msg);
    break;
  }
  case K_EVERY: {
    uint64_t cl, ms;
    if (ps__parse_every(value, &cl, &ms))
      return ps__fail(PS_ERR_CONFIG,
                      "bad value '%s' for '%s' (N clocks, 0 = off, or a duration: 500ms, 30s, 10m, 2h; at most 30 days)",
                      value, key);
    break;
  }
  case K_HTTP_PORT:
    if (strcmp(value, "off") && (ps__parse_u64(value, &u) || u > 65535))
      return ps__fail(PS_ERR_CONFIG, "bad value '%s' for '%s' (a port from 0 to 65535, or off)", value, key);
    break;
  case K_SWITCH:
    if (ps__parse_switch(value) < 0)
      return ps__fail(PS_ERR_CONFIG, "bad value '%s' for '%s' (on or off)", value, key);
    break;
  case K_PATH:
    if (!*value || strlen(value) >= PS_CFG_PATH_MAX)
      return ps__fail(PS_ERR_CONFIG, "bad value for '%s' (a directory path of 1..%d bytes)", key, PS_CFG_PATH_MAX - 1);
    break;
  case K_STR:
    if (!*value || strlen(value) >= PS_CFG_HOST_MAX) return ps__fail(PS_ERR_CONFIG, "bad value '%s' for '%s'", value, key);
    break;
  }
  char *dup = ps__strdup(value);
  if (!dup) return ps__fail(PS_ERR_NOMEM, "out of memory");
  free(c->val[i]);
  c->val[i] = dup;
  return 0;
}

const char *ps_config_get(const ps_config *c, const char *key) {
  int i = c && key ? key_index(key) : -1;
  return i < 0 ? NULL : c->val[i];
}

int ps_config_from_env(ps_config *c) {
  char name[64];
  if (!c) return ps__fail(PS_ERR_INVALID, "ps_config_from_env: NULL config");
  for (size_t i = 0; i < NKEYS; i++) {
    size_t j = 0;
    j = (size_t)snprintf(name, sizeof name, "PSHARD_");
    for (const char *k = keys[i].key; *k && j + 1 < sizeof name; k++) name[j++] = (char)toupper((unsigned char)*k);
    name[j] = '\0';
    const char *v = getenv(name);
    if (v && *v) {
      int rc = ps_config_set(c, keys[i].key, v);
      if (rc) {
        /* ps_errmsg() is the buffer ps__fail writes into: copy it first. */
        char msg[256];
        snprintf(msg, sizeof msg, "%s", ps_errmsg());
        return ps__fail(rc, "%s: %s", name, msg);
      }
    }
  }
  return 0;
}

int ps__parse_switch(const char *v) {
  if (!v) return -1;
  if (!strcmp(v, "on") || !strcmp(v, "1")) return 1;
  if (!strcmp(v, "off") || !strcmp(v, "0")) return 0;
  return -1;
}

uint64_t ps__config_uint(const ps_config *c, const char *key, uint64_t dflt) {
  const char *v = ps_config_get(c, key);
  uint64_t u;
  return (v && !ps__parse_u64(v, &u)) ? u : dflt;
}

const char *ps__config_str(const ps_config *c, const char *key, const char *dflt) {
  const char *v = ps_config_get(c, key);
  return v ? v : dflt;
}
