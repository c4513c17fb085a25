/*
 * web_assets.h - the dashboard's files (web/: the page, its script and style, and the
 * chart library uPlot), built into the binary as byte arrays by a CMake rule
 * (cmake/embed_assets.cmake), so the dashboard works with no network and no files.
 */
#ifndef PS_WEB_ASSETS_H
#define PS_WEB_ASSETS_H

#include <stddef.h>

typedef struct ps__web_asset {
  const char *path;  /* served at, e.g. "/" */
  const char *ctype; /* Content-Type */
  const unsigned char *data;
  size_t len;
} ps__web_asset;

extern const ps__web_asset ps__web_assets[];
extern const size_t ps__web_nassets;

#endif
