/*
 * What every fake GPU driver library of the tests shares (fake_cuda.c, fake_amdhip64.c and
 * the inline fake libcuda of test_driver_cuda.py): environment reads, failure injection, the
 * JSON-lines call log, hex text and the FNV-1a digest the tests recompute in Python.
 *
 * Define before including:
 *   FAKE_LOG_ENV   the variable naming the log file, e.g. "FAKEHIP_LOG" (no log when unset)
 *   FAKE_FAIL_ENV  the variable of injected failures, "call=code,..." (optional)
 *
 * compile_shared (tests/helpers/fake_driver.py) puts this folder on the include path.
 */

#ifndef AOTRITON_TESTS_FAKE_DRIVER_H
#define AOTRITON_TESTS_FAKE_DRIVER_H

#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FAKE_LOG_ENV
#error "define FAKE_LOG_ENV (the variable naming the log file) before including fake_driver.h"
#endif

/* An integer from the environment, read at each call so a test may change it between calls. */
static inline int env_int(const char *name, int fallback) {
  const char *v = getenv(name);
  return (v && *v) ? atoi(v) : fallback;
}

static inline const char *env_str(const char *name, const char *fallback) {
  const char *v = getenv(name);
  return (v && *v) ? v : fallback;
}

#ifdef FAKE_FAIL_ENV
/* FAKE_FAIL_ENV="callA=209,callB=2": the named call returns that code (0: no failure). */
static inline int injected_failure(const char *call) {
  const char *spec = getenv(FAKE_FAIL_ENV);
  size_t n = strlen(call);
  while (spec && *spec) {
    if (strncmp(spec, call, n) == 0 && spec[n] == '=') return atoi(spec + n + 1);
    spec = strchr(spec, ',');
    if (spec) spec++;
  }
  return 0;
}
#endif

/* Append one line (printf-style) to the log named by FAKE_LOG_ENV. */
static inline void log_line(const char *fmt, ...) {
  const char *path = getenv(FAKE_LOG_ENV);
  if (!path || !*path) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  char *line = malloc((size_t)n + 2);
  if (!line) return;
  va_start(ap, fmt);
  vsnprintf(line, (size_t)n + 1, fmt, ap);
  va_end(ap);
  line[n] = '\n';
  /* One write of the whole line with O_APPEND keeps lines whole across threads. */
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd >= 0) {
    ssize_t ignored = write(fd, line, (size_t)n + 1);
    (void)ignored;
    close(fd);
  }
  free(line);
}

/* Lowercase hex text of size bytes, malloc'ed (the caller frees it); NULL when out of memory. */
static inline char *hex(const unsigned char *data, size_t size) {
  static const char digits[] = "0123456789abcdef";
  char *out = malloc(2 * size + 1);
  if (!out) return NULL;
  for (size_t i = 0; i < size; i++) {
    out[2 * i] = digits[data[i] >> 4];
    out[2 * i + 1] = digits[data[i] & 15];
  }
  out[2 * size] = 0;
  return out;
}

/* FNV-1a 64: tests.helpers.fake_driver.fnv1a64 computes the same digest in Python. */
static inline uint64_t fnv1a64(const unsigned char *data, size_t size) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < size; i++) {
    h ^= data[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

#endif
