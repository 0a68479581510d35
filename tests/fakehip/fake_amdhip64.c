/*
 * A fake libamdhip64 for CPU-only tests of aotriton_rt.drivers.hip.
 *
 * It implements the HIP runtime entry points that both HIP backends call (ctypes and
 * hip-python), pretends to own FAKEHIP_DEVICES GPUs of arch FAKEHIP_ARCH, and records
 * every call as one JSON line in the file named by FAKEHIP_LOG, so a test can assert
 * exactly what reached the "driver": image sizes and digests, function names, and for
 * each launch the grid, block, shared size, stream and the bytes of the argument buffer.
 *
 * Environment (read at each call, so a test may change it between calls):
 *   FAKEHIP_LOG       path of the JSON-lines log (no log when unset)
 *   FAKEHIP_DEVICES   number of devices (default 1; 0 makes hipGetDeviceCount fail)
 *   FAKEHIP_ARCH      gcnArchName of every device (default gfx942:sramecc+:xnack-)
 *   FAKEHIP_NAME      marketing name (default "Fake AMD Instinct")
 *   FAKEHIP_LDS       LDS bytes per workgroup, opt-in limit (default 65536)
 *   FAKEHIP_CAPTURING comma-separated stream handles (decimal) reported as capturing
 *   FAKEHIP_FAIL      comma-separated call=code pairs: that call returns that code
 *
 * Module images must be AMDGPU ELF code objects (what Triton writes as .hsaco): the image
 * size is taken from the ELF header (the section header table ends the file) and the
 * EF_AMDGPU_MACH byte of e_flags must name the device's gfx target, else
 * hipErrorNoBinaryForGpu, as a real runtime answers for an image of another arch.
 *
 * Build: gcc -shared -fPIC -O1 -Wl,-soname,libamdhip64.so -o libamdhip64.so fake_amdhip64.c
 */

#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int hipError_t;

enum {
  hipSuccess = 0,
  hipErrorInvalidValue = 1,
  hipErrorOutOfMemory = 2,
  hipErrorNotInitialized = 3,
  hipErrorInvalidConfiguration = 9,
  hipErrorNoDevice = 100,
  hipErrorInvalidDevice = 101,
  hipErrorInvalidImage = 200,
  hipErrorInvalidContext = 201,
  hipErrorNoBinaryForGpu = 209,
  hipErrorInvalidHandle = 400,
  hipErrorNotFound = 500,
  hipErrorLaunchOutOfResources = 701,
  hipErrorNotSupported = 801,
  hipErrorUnknown = 999,
};

/* Offsets in hipDeviceProp_tR0600 (sizeof 1472 on LP64), the layout that
 * hipGetDevicePropertiesR0600 fills in ROCm 6.x and 7.x. The Python driver reads the same
 * offsets; tests cross-check them against hip-python's generated struct. */
#define PROP_SIZE 1472
#define PROP_NAME 0
#define PROP_TOTAL_GLOBAL_MEM 288
#define PROP_SHARED_PER_BLOCK 296
#define PROP_WARP_SIZE 308
#define PROP_MAX_THREADS_PER_BLOCK 320
#define PROP_MAJOR 360
#define PROP_MINOR 364
#define PROP_MULTIPROCESSOR_COUNT 388
#define PROP_SHARED_PER_BLOCK_OPTIN 696
#define PROP_GCN_ARCH_NAME 1160

#define MODULE_MAGIC 0x4d4f44554c454148ull  /* "HAELUDOM" */
#define FUNCTION_MAGIC 0x46554e4354494f4eull

typedef struct {
  uint64_t magic;
  int device;
  size_t size;
  unsigned char *data;
} FakeModule;

typedef struct {
  uint64_t magic;
  FakeModule *module;
  char name[256];
  int max_dynamic_shared;
} FakeFunction;

static __thread int current_device = 0;

/* ---------------------------------------------------------------- environment */

static int env_int(const char *name, int fallback) {
  const char *v = getenv(name);
  return (v && *v) ? atoi(v) : fallback;
}

static const char *env_str(const char *name, const char *fallback) {
  const char *v = getenv(name);
  return (v && *v) ? v : fallback;
}

static int device_count(void) { return env_int("FAKEHIP_DEVICES", 1); }

/* FAKEHIP_FAIL="hipModuleLoadData=209,hipMalloc=2": the named call returns that code. */
static int injected_failure(const char *call) {
  const char *spec = getenv("FAKEHIP_FAIL");
  size_t n = strlen(call);
  while (spec && *spec) {
    if (strncmp(spec, call, n) == 0 && spec[n] == '=') return atoi(spec + n + 1);
    spec = strchr(spec, ',');
    if (spec) spec++;
  }
  return 0;
}

/* ---------------------------------------------------------------- the log */

static void log_line(const char *fmt, ...) {
  const char *path = getenv("FAKEHIP_LOG");
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

static char *hex(const unsigned char *data, size_t size) {
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

/* FNV-1a 64: tests/fakehip.fnv1a64 computes the same digest in Python. */
static uint64_t fnv1a64(const unsigned char *data, size_t size) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < size; i++) {
    h ^= data[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

/* Names and strings for the codes this fake returns (and a few more). */
static const struct {
  int code;
  const char *name;
  const char *text;
} errors[] = {
    {hipSuccess, "hipSuccess", "no error"},
    {hipErrorInvalidValue, "hipErrorInvalidValue", "invalid argument"},
    {hipErrorOutOfMemory, "hipErrorOutOfMemory", "out of memory"},
    {hipErrorNotInitialized, "hipErrorNotInitialized", "initialization error"},
    {hipErrorInvalidConfiguration, "hipErrorInvalidConfiguration",
     "invalid configuration argument"},
    {hipErrorNoDevice, "hipErrorNoDevice", "no ROCm-capable device is detected"},
    {hipErrorInvalidDevice, "hipErrorInvalidDevice", "invalid device ordinal"},
    {hipErrorInvalidImage, "hipErrorInvalidImage", "device kernel image is invalid"},
    {hipErrorInvalidContext, "hipErrorInvalidContext", "invalid device context"},
    {hipErrorNoBinaryForGpu, "hipErrorNoBinaryForGpu",
     "no kernel image is available for execution on the device"},
    {hipErrorInvalidHandle, "hipErrorInvalidHandle", "invalid resource handle"},
    {hipErrorNotFound, "hipErrorNotFound", "named symbol not found"},
    {hipErrorLaunchOutOfResources, "hipErrorLaunchOutOfResources",
     "too many resources requested for launch"},
    {hipErrorNotSupported, "hipErrorNotSupported", "operation not supported"},
    {hipErrorUnknown, "hipErrorUnknown", "unknown error"},
};

const char *hipGetErrorName(hipError_t code) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].code == code) return errors[i].name;
  return "hipErrorUnknown";
}

const char *hipGetErrorString(hipError_t code) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].code == code) return errors[i].text;
  return "unknown error";
}

/* Every call but the error-string ones passes here: log it and apply FAKEHIP_FAIL. */
static int enter(const char *call) {
  int code = injected_failure(call);
  if (code) log_line("{\"call\":\"%s\",\"status\":%d}", call, code);
  return code;
}

static int valid_device(int device) { return device >= 0 && device < device_count(); }

/* ---------------------------------------------------------------- devices */

hipError_t hipInit(unsigned int flags) {
  int code = enter("hipInit");
  if (code) return code;
  if (flags != 0) return hipErrorInvalidValue;
  log_line("{\"call\":\"hipInit\",\"status\":0}");
  return hipSuccess;
}

hipError_t hipGetDeviceCount(int *count) {
  int code = enter("hipGetDeviceCount");
  if (code) return code;
  if (!count) return hipErrorInvalidValue;
  *count = device_count();
  return *count > 0 ? hipSuccess : hipErrorNoDevice;
}

hipError_t hipGetDevice(int *device) {
  int code = enter("hipGetDevice");
  if (code) return code;
  if (!device) return hipErrorInvalidValue;
  *device = current_device;
  return hipSuccess;
}

hipError_t hipSetDevice(int device) {
  int code = enter("hipSetDevice");
  if (code) return code;
  if (!valid_device(device)) return hipErrorInvalidDevice;
  current_device = device;
  return hipSuccess;
}

static void put_int(unsigned char *p, size_t at, int v) { memcpy(p + at, &v, sizeof v); }
static void put_size(unsigned char *p, size_t at, size_t v) { memcpy(p + at, &v, sizeof v); }

hipError_t hipGetDevicePropertiesR0600(void *prop, int device) {
  int code = enter("hipGetDevicePropertiesR0600");
  if (code) return code;
  if (!prop) return hipErrorInvalidValue;
  if (!valid_device(device)) return hipErrorInvalidDevice;
  unsigned char *p = prop;
  memset(p, 0, PROP_SIZE);
  snprintf((char *)p + PROP_NAME, 256, "%s", env_str("FAKEHIP_NAME", "Fake AMD Instinct"));
  snprintf((char *)p + PROP_GCN_ARCH_NAME, 256, "%s",
           env_str("FAKEHIP_ARCH", "gfx942:sramecc+:xnack-"));
  put_size(p, PROP_TOTAL_GLOBAL_MEM, (size_t)192 << 30);
  put_size(p, PROP_SHARED_PER_BLOCK, 65536);
  put_size(p, PROP_SHARED_PER_BLOCK_OPTIN, (size_t)env_int("FAKEHIP_LDS", 65536));
  put_int(p, PROP_WARP_SIZE, 64);
  put_int(p, PROP_MAX_THREADS_PER_BLOCK, 1024);
  put_int(p, PROP_MAJOR, 9);
  put_int(p, PROP_MINOR, 4);
  put_int(p, PROP_MULTIPROCESSOR_COUNT, 304);
  log_line("{\"call\":\"hipGetDevicePropertiesR0600\",\"status\":0,\"device\":%d}", device);
  return hipSuccess;
}

hipError_t hipDeviceGetName(char *name, int len, int device) {
  int code = enter("hipDeviceGetName");
  if (code) return code;
  if (!name || len <= 0) return hipErrorInvalidValue;
  if (!valid_device(device)) return hipErrorInvalidDevice;
  snprintf(name, (size_t)len, "%s", env_str("FAKEHIP_NAME", "Fake AMD Instinct"));
  return hipSuccess;
}

hipError_t hipDeviceSynchronize(void) {
  int code = enter("hipDeviceSynchronize");
  if (code) return code;
  log_line("{\"call\":\"hipDeviceSynchronize\",\"status\":0,\"device\":%d}", current_device);
  return hipSuccess;
}

hipError_t hipRuntimeGetVersion(int *version) {
  int code = enter("hipRuntimeGetVersion");
  if (code) return code;
  if (!version) return hipErrorInvalidValue;
  *version = 70200000;  /* HIP_VERSION encoding: major * 10^7 + minor * 10^5 + patch */
  return hipSuccess;
}

/* ---------------------------------------------------------------- memory and streams */

hipError_t hipMalloc(void **ptr, size_t size) {
  int code = enter("hipMalloc");
  if (code) return code;
  if (!ptr) return hipErrorInvalidValue;
  if (size == 0) {
    *ptr = NULL;
    return hipSuccess;
  }
  /* Host memory stands in for device memory: aligned like a real allocation (256 B). */
  void *p = NULL;
  if (posix_memalign(&p, 256, size) != 0) return hipErrorOutOfMemory;
  memset(p, 0, size);
  *ptr = p;
  log_line("{\"call\":\"hipMalloc\",\"status\":0,\"device\":%d,\"size\":%zu,\"ptr\":%llu}",
           current_device, size, (unsigned long long)(uintptr_t)p);
  return hipSuccess;
}

hipError_t hipFree(void *ptr) {
  int code = enter("hipFree");
  if (code) return code;
  free(ptr);
  return hipSuccess;
}

hipError_t hipStreamIsCapturing(void *stream, int *status) {
  int code = enter("hipStreamIsCapturing");
  if (code) return code;
  if (!status) return hipErrorInvalidValue;
  *status = 0; /* hipStreamCaptureStatusNone */
  const char *spec = getenv("FAKEHIP_CAPTURING");
  while (spec && *spec) {
    if (strtoull(spec, NULL, 10) == (unsigned long long)(uintptr_t)stream) {
      *status = 1; /* hipStreamCaptureStatusActive */
      break;
    }
    spec = strchr(spec, ',');
    if (spec) spec++;
  }
  log_line("{\"call\":\"hipStreamIsCapturing\",\"status\":0,\"stream\":%llu,\"capture\":%d}",
           (unsigned long long)(uintptr_t)stream, *status);
  return hipSuccess;
}

/* ---------------------------------------------------------------- modules */

/* gfx name -> EF_AMDGPU_MACH value (the low byte of e_flags), for the targets the project
 * builds; values checked against code objects Triton writes for each target. */
static int mach_of(const char *gfx) {
  static const struct {
    const char *gfx;
    int mach;
  } table[] = {{"gfx90a", 0x3f}, {"gfx942", 0x4c}, {"gfx950", 0x4f},
               {"gfx1100", 0x41}, {"gfx1201", 0x4e}};
  size_t n = strcspn(gfx, ":");
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
    if (strlen(table[i].gfx) == n && strncmp(table[i].gfx, gfx, n) == 0) return table[i].mach;
  return -1;
}

/* Size of an ELF64 image: Triton's code objects end with the section header table. */
static size_t elf_size(const unsigned char *image) {
  uint64_t shoff;
  uint16_t shentsize, shnum;
  memcpy(&shoff, image + 40, 8);
  memcpy(&shentsize, image + 58, 2);
  memcpy(&shnum, image + 60, 2);
  return (size_t)(shoff + (uint64_t)shentsize * shnum);
}

hipError_t hipModuleLoadData(void **module, const void *image) {
  int code = enter("hipModuleLoadData");
  if (code) return code;
  if (!module || !image) return hipErrorInvalidValue;
  const unsigned char *bytes = image;
  if (memcmp(bytes, "\177ELF", 4) != 0 || bytes[4] != 2 /* ELFCLASS64 */) {
    log_line("{\"call\":\"hipModuleLoadData\",\"status\":%d,\"reason\":\"not an ELF64 image\"}",
             hipErrorInvalidImage);
    return hipErrorInvalidImage;
  }
  uint16_t machine;
  uint32_t flags;
  memcpy(&machine, bytes + 18, 2);
  memcpy(&flags, bytes + 48, 4);
  size_t size = elf_size(bytes);
  int want = mach_of(env_str("FAKEHIP_ARCH", "gfx942:sramecc+:xnack-"));
  if (machine != 224 /* EM_AMDGPU */ || (int)(flags & 0xff) != want) {
    log_line("{\"call\":\"hipModuleLoadData\",\"status\":%d,\"size\":%zu,\"mach\":%u}",
             hipErrorNoBinaryForGpu, size, flags & 0xff);
    return hipErrorNoBinaryForGpu;
  }
  FakeModule *m = calloc(1, sizeof *m);
  if (!m) return hipErrorOutOfMemory;
  m->magic = MODULE_MAGIC;
  m->device = current_device;
  m->size = size;
  /* Keep a copy, as the real runtime may parse the image later than this call. */
  m->data = malloc(size);
  memcpy(m->data, bytes, size);
  char *head = hex(bytes, size < 16 ? size : 16);
  log_line("{\"call\":\"hipModuleLoadData\",\"status\":0,\"device\":%d,\"size\":%zu,"
           "\"fnv1a64\":\"%016llx\",\"head\":\"%s\",\"module\":%llu}",
           m->device, size, (unsigned long long)fnv1a64(bytes, size), head ? head : "",
           (unsigned long long)(uintptr_t)m);
  free(head);
  *module = m;
  return hipSuccess;
}

hipError_t hipModuleUnload(void *module) {
  int code = enter("hipModuleUnload");
  if (code) return code;
  FakeModule *m = module;
  if (!m || m->magic != MODULE_MAGIC) return hipErrorInvalidHandle;
  m->magic = 0;
  free(m->data);
  free(m);
  return hipSuccess;
}

/* A symbol exists when its name, NUL-terminated, is in the image (its string table). */
static int has_symbol(const FakeModule *m, const char *name) {
  size_t n = strlen(name) + 1;
  for (size_t i = 0; i + n <= m->size; i++)
    if (memcmp(m->data + i, name, n) == 0 && (i == 0 || m->data[i - 1] == 0)) return 1;
  return 0;
}

hipError_t hipModuleGetFunction(void **function, void *module, const char *name) {
  int code = enter("hipModuleGetFunction");
  if (code) return code;
  FakeModule *m = module;
  if (!function || !name || !*name) return hipErrorInvalidValue;
  if (!m || m->magic != MODULE_MAGIC) return hipErrorInvalidHandle;
  if (strlen(name) >= sizeof(((FakeFunction *)0)->name) || !has_symbol(m, name)) {
    log_line("{\"call\":\"hipModuleGetFunction\",\"status\":%d,\"name\":\"%.200s\"}",
             hipErrorNotFound, name);
    return hipErrorNotFound;
  }
  FakeFunction *f = calloc(1, sizeof *f);
  if (!f) return hipErrorOutOfMemory;
  f->magic = FUNCTION_MAGIC;
  f->module = m;
  strcpy(f->name, name);
  log_line("{\"call\":\"hipModuleGetFunction\",\"status\":0,\"name\":\"%s\",\"module\":%llu,"
           "\"function\":%llu}",
           name, (unsigned long long)(uintptr_t)m, (unsigned long long)(uintptr_t)f);
  *function = f;
  return hipSuccess;
}

hipError_t hipFuncSetAttribute(const void *function, int attr, int value) {
  int code = enter("hipFuncSetAttribute");
  if (code) return code;
  FakeFunction *f = (FakeFunction *)function;
  if (!f || f->magic != FUNCTION_MAGIC) return hipErrorInvalidHandle;
  if (attr == 8 /* hipFuncAttributeMaxDynamicSharedMemorySize */) {
    if (value < 0 || value > env_int("FAKEHIP_LDS", 65536)) return hipErrorInvalidValue;
    f->max_dynamic_shared = value;
  }
  log_line("{\"call\":\"hipFuncSetAttribute\",\"status\":0,\"name\":\"%s\",\"attr\":%d,"
           "\"value\":%d}",
           f->name, attr, value);
  return hipSuccess;
}

/* ---------------------------------------------------------------- launches */

hipError_t hipModuleLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz,
                                 unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                 void *stream, void **kernel_params, void **extra) {
  int code = enter("hipModuleLaunchKernel");
  if (code) return code;
  FakeFunction *f = function;
  if (!f || f->magic != FUNCTION_MAGIC) return hipErrorInvalidHandle;
  /* A function runs on the device its module was loaded on: that device must be current. */
  if (f->module->device != current_device) return hipErrorInvalidDevice;
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 ||
      (unsigned long long)bx * by * bz > 1024)
    return hipErrorInvalidConfiguration;
  if (shared > (unsigned)env_int("FAKEHIP_LDS", 65536)) return hipErrorInvalidValue;
  /* The argument buffer must come the HIP way: {BUFFER_POINTER=1, buf, BUFFER_SIZE=2,
   * &size, END=3}. CUDA ends with 0 instead of 3: reject that mix-up loudly. */
  if (kernel_params != NULL || extra == NULL || (uintptr_t)extra[0] != 1 || extra[1] == NULL ||
      (uintptr_t)extra[2] != 2 || extra[3] == NULL || (uintptr_t)extra[4] != 3) {
    log_line("{\"call\":\"hipModuleLaunchKernel\",\"status\":%d,\"reason\":\"bad extra array\"}",
             hipErrorInvalidValue);
    return hipErrorInvalidValue;
  }
  size_t size = *(size_t *)extra[3];
  char *args = hex((const unsigned char *)extra[1], size);
  log_line("{\"call\":\"hipModuleLaunchKernel\",\"status\":0,\"name\":\"%s\",\"device\":%d,"
           "\"module_device\":%d,\"grid\":[%u,%u,%u],\"block\":[%u,%u,%u],\"shared\":%u,"
           "\"stream\":%llu,\"args_size\":%zu,\"args\":\"%s\"}",
           f->name, current_device, f->module->device, gx, gy, gz, bx, by, bz, shared,
           (unsigned long long)(uintptr_t)stream, size, args ? args : "");
  free(args);
  return hipSuccess;
}

/* Entry points that a driver might resolve but this fake does not model. */
hipError_t hipModuleLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz,
                                            unsigned bx, unsigned by, unsigned bz,
                                            unsigned shared, void *stream, void **params) {
  (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared;
  (void)stream, (void)params;
  return hipErrorNotSupported;
}

hipError_t hipDeviceGetAttribute(int *value, int attr, int device) {
  (void)value, (void)attr, (void)device;
  return hipErrorNotSupported;
}
