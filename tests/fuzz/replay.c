/*
 * replay.c - run a fuzz target without libFuzzer: every corpus file, then a fixed
 * number of deterministic mutations of each (SQLite fuzzcheck style), so CI replays the
 * corpus and every saved crash on each build, under the sanitizers when enabled.
 *
 * Usage: <driver> [-t] [-n MUTATIONS] [-s SEED] PATH...   (PATH: a file or a directory)
 * MUTATIONS defaults to $PSHARD_FUZZ_MUTATIONS or 32 (ctest passes -n 256). Each input is copied into an
 * allocation of exactly its size so out-of-bounds reads are caught by ASan. Mutations
 * know the frame layout: besides bit flips, byte stores, truncation and splicing they
 * overwrite header fields with boundary values and re-aim payload_len at the real body
 * length so mutated frames get past the first checks. With -t the inputs are text
 * (configuration lines, table options) and the mutations work on words instead: a
 * word becomes a boundary value, a word is repeated, dropped or taken from another
 * input, a separator changes.
 */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define HDR 64
#define REPLAY_MAX_INPUT (4u << 20)

typedef struct input {
  char *path;
  uint8_t *data;
  size_t size;
} input;

static input *inputs;
static size_t ninputs, cap_inputs;

static uint64_t rng_state;
static uint64_t rnd(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}
static size_t rnd_below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

static uint64_t fnv1a(const void *p, size_t n, uint64_t h) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

static int add_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s: %s\n", path, strerror(errno));
    return -1;
  }
  uint8_t *buf = malloc(REPLAY_MAX_INPUT);
  size_t n = buf ? fread(buf, 1, REPLAY_MAX_INPUT, f) : 0;
  fclose(f);
  if (!buf) return -1;
  if (ninputs == cap_inputs) {
    cap_inputs = cap_inputs ? 2 * cap_inputs : 64;
    input *ni = realloc(inputs, cap_inputs * sizeof *ni);
    if (!ni) {
      free(buf);
      return -1;
    }
    inputs = ni;
  }
  uint8_t *exact = malloc(n ? n : 1);
  if (!exact) {
    free(buf);
    return -1;
  }
  memcpy(exact, buf, n);
  free(buf);
  inputs[ninputs].path = strdup(path);
  inputs[ninputs].data = exact;
  inputs[ninputs].size = n;
  ninputs++;
  return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int add_path(const char *path) {
  struct stat st;
  if (stat(path, &st) != 0) {
    fprintf(stderr, "replay: cannot stat %s: %s\n", path, strerror(errno));
    return -1;
  }
  if (!S_ISDIR(st.st_mode)) return add_file(path);
  DIR *d = opendir(path);
  if (!d) return -1;
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 64;
      char **nn = realloc(names, cap * sizeof *nn);
      if (!nn) break;
      names = nn;
    }
    names[n++] = strdup(e->d_name);
  }
  closedir(d);
  if (n) qsort(names, n, sizeof *names, cmp_str); /* readdir order is not stable */
  int rc = 0;
  for (size_t i = 0; i < n; i++) {
    char full[4096];
    snprintf(full, sizeof full, "%s/%s", path, names[i]);
    struct stat fs;
    if (stat(full, &fs) == 0 && S_ISREG(fs.st_mode) && add_file(full) != 0) rc = -1;
    free(names[i]);
  }
  free(names);
  return rc;
}

/* Header field offsets and widths (docs/protocol.md). */
static const struct { uint8_t off, width; } fields[] = {
    {0, 4}, {4, 1}, {5, 1}, {6, 1}, {7, 1}, {8, 4}, {12, 4}, {16, 8},
    {24, 4}, {28, 4}, {32, 8}, {40, 8}, {48, 4}, {52, 4}, {56, 8},
};

static void put_le(uint8_t *p, uint64_t v, unsigned width) {
  for (unsigned i = 0; i < width; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t interesting(size_t size) {
  static const uint64_t vals[] = {0, 1, 2, 3, 4, 7, 8, 15, 16, 0x7f, 0x80, 0xff, 0x100, 0x7fff, 0xffff,
                                  0x10000, 0x100000, 0x100001, 0x7fffffff, 0x80000000u, 0xffffffffu,
                                  0x100000000ull, 0x7fffffffffffffffull, 0x8000000000000000ull, UINT64_MAX,
                                  UINT64_MAX - 1};
  size_t n = sizeof vals / sizeof vals[0];
  size_t k = rnd_below(n + 3);
  if (k < n) return vals[k];
  if (k == n) return size > HDR ? size - HDR : 0; /* the real body length */
  if (k == n + 1) return size;
  return rnd();
}

/* Apply 1..4 mutations to buf (capacity cap); returns the new size. */
static size_t mutate(uint8_t *buf, size_t size, size_t cap, const input *other) {
  unsigned steps = 1 + (unsigned)rnd_below(4);
  for (unsigned s = 0; s < steps; s++) {
    switch (rnd_below(9)) {
    case 0: /* bit flip */
      if (size) buf[rnd_below(size)] ^= (uint8_t)(1u << rnd_below(8));
      break;
    case 1: /* random byte */
      if (size) buf[rnd_below(size)] = (uint8_t)rnd();
      break;
    case 2: /* header field := boundary value */
    case 3: {
      unsigned f = (unsigned)rnd_below(sizeof fields / sizeof fields[0]);
      if (size >= fields[f].off + fields[f].width) put_le(buf + fields[f].off, interesting(size), fields[f].width);
      break;
    }
    case 4: /* payload_len := real body length, keys := a count that fits it */
      if (size >= HDR) {
        uint64_t body = size - HDR;
        put_le(buf + 56, body, 8);
        if (rnd_below(2)) put_le(buf + 48, rnd_below(body / 8 + 1), 4);
      }
      break;
    case 5: /* truncate */
      if (size) size = rnd_below(size + 1);
      break;
    case 6: /* extend with random bytes */
    {
      size_t add = 1 + rnd_below(64);
      if (size + add > cap) add = cap - size;
      for (size_t i = 0; i < add; i++) buf[size + i] = (uint8_t)rnd();
      size += add;
      break;
    }
    case 7: /* splice: our prefix + another input's suffix (or a whole other frame) */
      if (other && other->size) {
        size_t at = rnd_below(size + 1), from = rnd_below(other->size);
        size_t n = other->size - from;
        if (at + n > cap) n = cap - at;
        memcpy(buf + at, other->data + from, n);
        size = at + n;
      }
      break;
    default: /* overwrite a body position with a 32-bit boundary value (string lengths) */
      if (size > HDR + 4) put_le(buf + HDR + rnd_below(size - HDR - 3), interesting(size), 4);
      break;
    }
  }
  return size;
}

/* ---------------------------------------------------------------- text mutations */

/* Values at the edges of what the text parsers accept. */
static const char *const text_values[] = {
    "0", "1", "-1", "-0", "+1", "00", "0x10", "1e3", "1.5", "-0.0", "0.999", "1.0", "1e-45", "1e-50",
    "3.4e38", "1e39", "nan", "inf", "-inf", "255", "256", "65535", "65536", "1048576", "1048577",
    "1000000", "1000001", "1000000000", "1000000001", "4096", "4097", "86400000", "86400001",
    "2147483647", "2147483648", "4294967295", "4294967296", "18446744073709551615",
    "18446744073709551616", "99999999999999999999", "", " ", "=", ":", "::", "sync", "sync:0",
    "sync:1", "ssp", "ssp:-1", "ssp:0", "async", "async:1", "const", "step:1:1", "step:0:0.5",
    "cos:1", "cos:1:0", "cos:1:-0", "zero", "uniform:-1", "normal:0", "const:-0", "127.0.0.1:0",
    "[::1]:80", "sgd", "adam", "ftrl", "mean", "sum", "dense", "sparse", "x",
};

static int is_word(uint8_t c) { return c > ' ' && c != '=' && c != ':' && c < 0x7f; }

static int word_starts(const uint8_t *buf, size_t i) { return is_word(buf[i]) && (i == 0 || !is_word(buf[i - 1])); }

/* A word of buf[0, size), chosen at random: its start and length (0 if buf has none). */
static size_t pick_word(const uint8_t *buf, size_t size, size_t *start) {
  size_t count = 0;
  for (size_t i = 0; i < size; i++) count += word_starts(buf, i);
  if (!count) return 0;
  size_t k = rnd_below(count);
  for (size_t i = 0; i < size; i++) {
    if (!word_starts(buf, i) || k-- != 0) continue;
    size_t j = i;
    while (j < size && is_word(buf[j])) j++;
    *start = i;
    return j - i;
  }
  return 0;
}

/* Replace buf[at, at + n) with rep[0, m); returns the new size (cap permitting). */
static size_t splice_in(uint8_t *buf, size_t size, size_t cap, size_t at, size_t n, const void *rep, size_t m) {
  if (size - n + m > cap) return size;
  memmove(buf + at + m, buf + at + n, size - at - n);
  memcpy(buf + at, rep, m);
  return size - n + m;
}

static size_t mutate_text(uint8_t *buf, size_t size, size_t cap, const input *other) {
  static const char seps[] = " \t\n\r=:";
  unsigned steps = 1 + (unsigned)rnd_below(4);
  for (unsigned s = 0; s < steps; s++) {
    size_t at = 0, n = pick_word(buf, size, &at);
    switch (rnd_below(8)) {
    case 0: /* a word becomes a boundary value */
    case 1: {
      const char *v = text_values[rnd_below(sizeof text_values / sizeof text_values[0])];
      if (n) size = splice_in(buf, size, cap, at, n, v, strlen(v));
      break;
    }
    case 2: /* a word is repeated after a blank */
      if (n && size + n + 1 <= cap) {
        uint8_t w[512];
        size_t m = n < sizeof w - 1 ? n : sizeof w - 1;
        w[0] = ' ';
        memcpy(w + 1, buf + at, m);
        size = splice_in(buf, size, cap, at + n, 0, w, m + 1);
      }
      break;
    case 3: /* a word is dropped */
      if (n) size = splice_in(buf, size, cap, at, n, "", 0);
      break;
    case 4: /* a word from another input replaces one here */
      if (other && other->size) {
        size_t oat = 0, on = pick_word(other->data, other->size, &oat);
        if (on && n) size = splice_in(buf, size, cap, at, n, other->data + oat, on);
      }
      break;
    case 5: /* a separator changes */
      if (size) {
        size_t i = rnd_below(size);
        if (!is_word(buf[i])) buf[i] = (uint8_t)seps[rnd_below(sizeof seps - 1)];
      }
      break;
    case 6: /* a line of another input is appended */
      if (other && other->size && size + 1 <= cap) {
        size_t from = rnd_below(other->size);
        while (from > 0 && other->data[from - 1] != '\n') from--;
        size_t to = from;
        while (to < other->size && other->data[to] != '\n') to++;
        buf[size++] = '\n';
        size = splice_in(buf, size, cap, size, 0, other->data + from, to - from);
      }
      break;
    default: /* a byte */
      if (size) buf[rnd_below(size)] = (uint8_t)rnd();
      break;
    }
  }
  return size;
}

int main(int argc, char **argv) {
  unsigned long mutations = 32;
  int text = 0;
  unsigned long long seed = 1;
  const char *env = getenv("PSHARD_FUZZ_MUTATIONS");
  if (env && *env) mutations = strtoul(env, NULL, 10);
  int i = 1;
  for (; i < argc; i++) {
    if (!strcmp(argv[i], "-t")) text = 1;
    else if (!strcmp(argv[i], "-n") && i + 1 < argc) mutations = strtoul(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "-s") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
    else if (argv[i][0] == '-') {
      fprintf(stderr, "usage: %s [-t] [-n MUTATIONS] [-s SEED] PATH...\n", argv[0]);
      return 2;
    } else if (add_path(argv[i]) != 0) {
      return 2;
    }
  }
  if (ninputs == 0) {
    fprintf(stderr, "replay: no inputs\n");
    return 2;
  }
  size_t runs = 0;
  for (size_t k = 0; k < ninputs; k++) {
    const input *in = &inputs[k];
    uint8_t *copy = malloc(in->size ? in->size : 1);
    memcpy(copy, in->data, in->size);
    LLVMFuzzerTestOneInput(copy, in->size);
    free(copy);
    runs++;
    const char *base = strrchr(in->path, '/');
    base = base ? base + 1 : in->path;
    for (unsigned long m = 0; m < mutations; m++) {
      rng_state = fnv1a(base, strlen(base), 0xcbf29ce484222325ull ^ seed) ^ (m * 0x9e3779b97f4a7c15ull);
      if (!rng_state) rng_state = 1;
      size_t cap = in->size + 4096;
      uint8_t *buf = malloc(cap);
      memcpy(buf, in->data, in->size);
      const input *other = &inputs[rnd_below(ninputs)];
      size_t n = text ? mutate_text(buf, in->size, cap, other) : mutate(buf, in->size, cap, other);
      uint8_t *exact = malloc(n ? n : 1);
      memcpy(exact, buf, n);
      free(buf);
      LLVMFuzzerTestOneInput(exact, n);
      free(exact);
      runs++;
    }
  }
  printf("replay: %zu inputs, %lu mutations each, %zu runs, no failures\n", ninputs, mutations, runs);
  for (size_t k = 0; k < ninputs; k++) {
    free(inputs[k].path);
    free(inputs[k].data);
  }
  free(inputs);
  return 0;
}
