/*
 * fuzz_config.c - fuzz target for the configuration parser (common/config.c):
 * ps_config_set, ps_config_from_env and the consistency-mode parser ps__mode_parse.
 *
 * An input is text, one setting per line: "KEY=VALUE" (split at the first '='); a line
 * without '=' is looked up as a key and parsed as a mode. Embedded NULs end a string
 * early, as they would in a C caller. Every line goes to one ps_config, in order, so
 * later lines overwrite earlier ones.
 *
 * Besides "does not crash or read out of bounds", the target checks what the parser
 * promises:
 *  - ps_config_set returns 0, PS_ERR_CONFIG or PS_ERR_NOMEM; on success the key reads
 *    back as the value, on failure it keeps its old value and a message is set;
 *  - the typed readers agree with the stored text (ps__config_uint parses it or gives
 *    the default, ps__config_str gives it or the default);
 *  - the same setting through the environment (PSHARD_<KEY>) is accepted exactly when
 *    it is accepted directly, with the same value, and a rejection names the variable;
 *  - ps__mode_parse returns 0 with a known mode whose parameter is in range (and that
 *    parses again to the same mode when written back), or -1 with a message that fits
 *    the buffer, for every buffer size.
 * A violated property aborts with a message, which libFuzzer and the replay driver
 * report as a crash. PSHARD_* variables inherited from the environment are cleared
 * first, so a run depends on its input only.
 */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "common/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

extern char **environ;

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "fuzz_config: property violated at %s:%d: %s\n", __FILE__,     \
              __LINE__, #cond);                                                     \
      abort();                                                                      \
    }                                                                               \
  } while (0)

#define MAX_LINE 4096

static void clear_pshard_env(void) {
  for (;;) {
    char name[256];
    char **e = environ;
    while (*e && strncmp(*e, "PSHARD_", 7) != 0) e++;
    if (!*e) return;
    const char *eq = strchr(*e, '=');
    size_t n = eq ? (size_t)(eq - *e) : strlen(*e);
    if (n >= sizeof name) n = sizeof name - 1;
    memcpy(name, *e, n);
    name[n] = '\0';
    CHECK(unsetenv(name) == 0);
  }
}

/* The mode parser on its own, with a few message buffer sizes. */
static void check_mode(const char *v) {
  static const size_t lens[] = {0, 1, 5, 160};
  ps__mode m;
  char msg[200];
  int first = 0;
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    memset(msg, 'z', sizeof msg);
    memset(&m, 0, sizeof m);
    int rc = ps__mode_parse(v, &m, msg, lens[i]);
    CHECK(rc == 0 || rc == -1);
    if (i == 0) first = rc;
    CHECK(rc == first);
    CHECK(msg[lens[i]] == 'z'); /* nothing written past msglen */
    if (rc == -1 && lens[i] > 0) CHECK(memchr(msg, 0, lens[i]) != NULL);
    if (rc == -1 && lens[i] > 1) CHECK(msg[0] != '\0');
  }
  if (first != 0) return;
  switch (m.kind) {
  case PS__MODE_SYNC: CHECK(m.param == 0); break;
  case PS__MODE_SYNC_M: CHECK(m.param >= 1); break;
  case PS__MODE_SSP: break;
  case PS__MODE_ASYNC: CHECK(m.param == 0); break;
  default: CHECK(0);
  }
  CHECK(m.param <= 1000000);
  /* Written back in canonical form, it parses to the same mode. */
  static const char *const names[] = {"sync", "sync:%u", "ssp:%u", "async"};
  char again[32];
  ps__mode m2;
  snprintf(again, sizeof again, names[m.kind], m.param);
  CHECK(ps__mode_parse(again, &m2, msg, sizeof msg) == 0);
  CHECK(m2.kind == m.kind && m2.param == m.param);
}

/* The typed readers agree with the stored text. */
static void check_readers(const ps_config *c, const char *key) {
  const char *v = ps_config_get(c, key);
  uint64_t u;
  if (v) CHECK(ps__config_str(c, key, "dflt") == v);
  else CHECK(!strcmp(ps__config_str(c, key, "dflt"), "dflt"));
  if (v && ps__parse_u64(v, &u) == 0) CHECK(ps__config_uint(c, key, 12345) == u);
  else CHECK(ps__config_uint(c, key, 12345) == 12345);
}

/* The setting key=value through PSHARD_<KEY> on a fresh config: accepted exactly when
 * ps_config_set accepted it (rc_direct), with the same value. */
static void check_env(const char *key, const char *value, int rc_direct) {
  /* putenv with one buffer of our own, not setenv: glibc never frees the strings setenv
   * copies, which a long fuzzing run would pile up. */
  static char var[2 * MAX_LINE + 16];
  char name[MAX_LINE + 16];
  size_t j = (size_t)snprintf(name, sizeof name, "PSHARD_");
  for (const char *k = key; *k && j + 1 < sizeof name; k++) name[j++] = (char)toupper((unsigned char)*k);
  name[j] = '\0';
  /* ps_config_from_env reads PSHARD_ and the upper-case form of each known key: a key
   * with capitals ("MODE") is unknown to ps_config_set yet names a known variable. */
  for (const char *k = key; *k; k++)
    if (isupper((unsigned char)*k)) return;
  if (!*key || !*value) return; /* an empty variable is ignored, by design */
  snprintf(var, sizeof var, "%s=%s", name, value);
  CHECK(putenv(var) == 0);
  ps_config *c = NULL;
  CHECK(ps_config_new(&c) == 0);
  int rc = ps_config_from_env(c);
  if (rc_direct == 0) {
    CHECK(rc == 0);
    CHECK(ps_config_get(c, key) && !strcmp(ps_config_get(c, key), value));
  } else if (rc_direct == PS_ERR_CONFIG) {
    /* Unknown keys are not read from the environment at all; known ones fail alike. */
    CHECK(rc == 0 || rc == PS_ERR_CONFIG);
    if (rc) CHECK(!strncmp(ps_errmsg(), name, strlen(name)));
    if (rc == 0) CHECK(ps_config_get(c, key) == NULL);
  }
  ps_config_free(c);
  CHECK(unsetenv(name) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int env_cleared;
  if (!env_cleared) {
    clear_pshard_env();
    env_cleared = 1;
  }
  ps_config *c = NULL;
  CHECK(ps_config_new(&c) == 0);
  size_t pos = 0;
  while (pos < size) {
    const uint8_t *nl = memchr(data + pos, '\n', size - pos);
    size_t n = nl ? (size_t)(nl - (data + pos)) : size - pos;
    char line[MAX_LINE + 1];
    size_t m = n < MAX_LINE ? n : MAX_LINE;
    memcpy(line, data + pos, m);
    line[m] = '\0';
    pos += n + 1;

    char *eq = strchr(line, '=');
    if (!eq) {
      check_readers(c, line);
      check_mode(line);
      continue;
    }
    *eq = '\0';
    const char *key = line, *value = eq + 1;
    const char *old = ps_config_get(c, key);
    char *old_copy = old ? strdup(old) : NULL;
    int rc = ps_config_set(c, key, value);
    CHECK(rc == 0 || rc == PS_ERR_CONFIG || rc == PS_ERR_NOMEM);
    const char *now = ps_config_get(c, key);
    if (rc == 0) {
      CHECK(now && !strcmp(now, value));
      if (!strcmp(key, "mode")) {
        ps__mode md;
        char msg[160];
        CHECK(ps__mode_parse(value, &md, msg, sizeof msg) == 0);
      }
    } else {
      CHECK(ps_errmsg()[0] != '\0');
      CHECK((now == NULL) == (old_copy == NULL));
      if (now) CHECK(!strcmp(now, old_copy));
    }
    free(old_copy);
    check_readers(c, key);
    check_mode(value);
    check_env(key, value, rc);
  }
  /* NULL arguments are refused, not dereferenced. */
  CHECK(ps_config_set(c, NULL, "x") == PS_ERR_INVALID);
  CHECK(ps_config_set(c, "mode", NULL) == PS_ERR_INVALID);
  CHECK(ps_config_get(c, NULL) == NULL && ps_config_get(NULL, "mode") == NULL);
  ps_config_free(c);
  return 0;
}
