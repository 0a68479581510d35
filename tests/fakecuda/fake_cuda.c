/*
 * A recording fake libcuda.so.1 for CPU-only differential tests: Triton's own CUDA launcher
 * (triton/backends/nvidia/driver.py, linked against this library) and aotriton-rt's CUDA
 * driver both launch real cubins here, and every launch is logged with the parameter buffer
 * the GPU would see.
 *
 * Like the real driver, the fake reads each kernel's parameter layout from the cubin itself:
 * the .nv.info.<kernel> section's EIATTR_KPARAM_INFO records (ordinal, offset, size) and
 * EIATTR_CBANK_PARAM_SIZE, and the launch bound from EIATTR_MAX_THREADS / EIATTR_REQNTID.
 * kernelParams[i] is copied to parameter i's offset; an `extra` buffer
 * {CU_LAUNCH_PARAM_BUFFER_POINTER=1, buf, CU_LAUNCH_PARAM_BUFFER_SIZE=2, &size, END=0} is
 * read at the same offsets. The launch record's "params" field holds the resulting bytes.
 *
 * Environment (read at each call):
 *   FAKECUDA_LOG      path of the JSON-lines log (no log when unset)
 *   FAKECUDA_CC       compute capability of every device, e.g. 90 (default 90)
 *   FAKECUDA_DEVICES  number of devices (default 1)
 *   FAKECUDA_OPTIN    shared memory per block with opt-in, bytes (default 232448)
 *   FAKECUDA_CAPTURING  comma-separated stream handles that are capturing a graph; each
 *                       one's capture id and graph handle are the stream handle itself
 *
 * Graph user objects retained by a "captured" graph run their destructors when a test calls
 * fake_cuda_destroy_graph(graph), as the driver does once a graph and its executables are gone.
 *
 * Build: gcc -shared -fPIC -O1 -I../helpers -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_cuda.c
 */

#define FAKE_LOG_ENV "FAKECUDA_LOG"
#include "fake_driver.h" /* tests/helpers: env_int, log_line, hex, fnv1a64 */

typedef int CUresult;
typedef uint64_t CUdeviceptr;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};

#define MODULE_MAGIC 0x4d4f44554c45430aull
#define FUNCTION_MAGIC 0x46554e4354494f0aull
#define MAX_PARAMS 256

typedef struct {
  uint64_t magic;
  size_t size;
  unsigned char *data;
} FakeModule;

typedef struct {
  uint64_t magic;
  FakeModule *module;
  char name[256];
  int nparams;
  uint16_t offset[MAX_PARAMS], size[MAX_PARAMS];
  uint32_t param_size, max_threads, shared_static, max_dynamic_shared;
} FakeFunction;

static __thread void *current_context = NULL;
static char primary[16]; /* one byte per device: its primary context's address */

/* ---------------------------------------------------------------- environment */

static int devices(void) { return env_int("FAKECUDA_DEVICES", 1); }
static int capability(void) { return env_int("FAKECUDA_CC", 90); }

/* ---------------------------------------------------------------- errors, init, devices */

CUresult cuGetErrorString(CUresult code, const char **text) {
  if (!text) return CUDA_ERROR_INVALID_VALUE;
  *text = code == 0 ? "no error" : code == 1 ? "invalid argument" : "fake libcuda error";
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult code, const char **text) {
  if (!text) return CUDA_ERROR_INVALID_VALUE;
  *text = code == 0 ? "CUDA_SUCCESS" : code == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}

CUresult cuInit(unsigned flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult cuDriverGetVersion(int *version) {
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = 13000;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  *count = devices();
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(int *device, int ordinal) {
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, int device) {
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (device < 0 || device >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  snprintf(name, (size_t)len, "Fake NVIDIA sm%d", capability());
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  if (device < 0 || device >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  switch (attribute) {
    case 1: *value = 1024; break;                                /* MAX_THREADS_PER_BLOCK */
    case 8: *value = 49152; break;                               /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 10: *value = 32; break;                                 /* WARP_SIZE */
    case 12: *value = 65536; break;                              /* MAX_REGISTERS_PER_BLOCK */
    case 13: *value = 1980000; break;                            /* CLOCK_RATE */
    case 16: *value = 132; break;                                /* MULTIPROCESSOR_COUNT */
    case 36: *value = 2619000; break;                            /* MEMORY_CLOCK_RATE */
    case 37: *value = 5120; break;                               /* GLOBAL_MEMORY_BUS_WIDTH */
    case 75: *value = capability() / 10; break;                  /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = capability() % 10; break;                  /* COMPUTE_CAPABILITY_MINOR */
    case 81: *value = env_int("FAKECUDA_OPTIN", 232448) + 1024; break; /* ..._PER_MULTIPROCESSOR */
    case 97: *value = env_int("FAKECUDA_OPTIN", 232448); break;  /* MAX_SHARED_..._OPTIN */
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- contexts */

CUresult cuDevicePrimaryCtxRetain(void **context, int device) {
  if (!context) return CUDA_ERROR_INVALID_VALUE;
  if (device < 0 || device >= devices() || device >= (int)sizeof primary)
    return CUDA_ERROR_INVALID_DEVICE;
  *context = &primary[device];
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(void **context) {
  if (!context) return CUDA_ERROR_INVALID_VALUE;
  *context = current_context;
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(void *context) {
  current_context = context;
  return CUDA_SUCCESS;
}

/* A small per-process stack is enough here: the differential launches from one thread. */
static void *pushed[16];
static int npushed;

CUresult cuCtxPushCurrent_v2(void *context) {
  if (!context) return CUDA_ERROR_INVALID_VALUE;
  if (npushed == (int)(sizeof pushed / sizeof pushed[0])) return CUDA_ERROR_INVALID_VALUE;
  pushed[npushed++] = current_context;
  current_context = context;
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(void **context) {
  if (npushed == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (context) *context = current_context;
  current_context = pushed[--npushed];
  return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(int *device) {
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  if (!current_context) return CUDA_ERROR_INVALID_CONTEXT;
  *device = (int)((char *)current_context - primary);
  return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) { return current_context ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }

CUresult cuCtxGetLimit(size_t *value, int limit) {
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  *value = limit == 1 /* PRINTF_FIFO_SIZE */ ? 1 << 20 : 0;
  return CUDA_SUCCESS;
}

CUresult cuCtxSetLimit(int limit, size_t value) {
  (void)limit, (void)value;
  return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- memory, pointers, streams */

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
  if (!ptr) return CUDA_ERROR_INVALID_VALUE;
  void *p = NULL;
  if (posix_memalign(&p, 256, size ? size : 1) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = (CUdeviceptr)(uintptr_t)p;
  log_line("{\"call\":\"cuMemAlloc_v2\",\"status\":0,\"size\":%zu}", size);
  return CUDA_SUCCESS;
}

/* Every address is device memory that maps to itself (CU_POINTER_ATTRIBUTE_DEVICE_POINTER). */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  if (attribute != 3) return CUDA_ERROR_NOT_SUPPORTED;
  memcpy(data, &ptr, sizeof ptr);
  return CUDA_SUCCESS;
}

CUresult cuPointerGetAttributes(unsigned n, int *attributes, void **data, CUdeviceptr ptr) {
  (void)n, (void)attributes, (void)data, (void)ptr;
  return CUDA_ERROR_NOT_SUPPORTED;
}

static int capturing(void *stream);

CUresult cuStreamIsCapturing(void *stream, int *status) {
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  *status = capturing(stream);
  return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- events, captures, graphs */

static int capturing(void *stream) {
  const char *list = getenv("FAKECUDA_CAPTURING");
  if (!list || !*list) return 0;
  char *copy = strdup(list), *save = NULL;
  int found = 0;
  for (char *tok = strtok_r(copy, ",", &save); tok && !found; tok = strtok_r(NULL, ",", &save))
    found = strtoull(tok, NULL, 0) == (unsigned long long)(uintptr_t)stream;
  free(copy);
  return found;
}

CUresult cuStreamGetCaptureInfo_v2(void *stream, int *status, uint64_t *id, void **graph,
                                   const void **deps, size_t *ndeps) {
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  int on = capturing(stream);
  *status = on;
  if (id) *id = on ? (uint64_t)(uintptr_t)stream : 0;
  if (graph) *graph = on ? stream : NULL;
  if (deps) *deps = NULL;
  if (ndeps) *ndeps = 0;
  log_line("{\"call\":\"cuStreamGetCaptureInfo\",\"status\":0,\"stream\":%llu,\"capturing\":%d}",
           (unsigned long long)(uintptr_t)stream, on);
  return CUDA_SUCCESS;
}

static unsigned long long next_event = 0xe000;

CUresult cuEventCreate(void **event, unsigned flags) {
  if (!event) return CUDA_ERROR_INVALID_VALUE;
  if (!current_context) return CUDA_ERROR_INVALID_CONTEXT;
  *event = (void *)(uintptr_t)(++next_event);
  log_line("{\"call\":\"cuEventCreate\",\"status\":0,\"event\":%llu,\"flags\":%u}", next_event, flags);
  return CUDA_SUCCESS;
}

CUresult cuEventRecord(void *event, void *stream) {
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  log_line("{\"call\":\"cuEventRecord\",\"status\":0,\"event\":%llu,\"stream\":%llu}",
           (unsigned long long)(uintptr_t)event, (unsigned long long)(uintptr_t)stream);
  return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  log_line("{\"call\":\"cuStreamWaitEvent\",\"status\":0,\"stream\":%llu,\"event\":%llu,\"flags\":%u}",
           (unsigned long long)(uintptr_t)stream, (unsigned long long)(uintptr_t)event, flags);
  return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(void *event) {
  log_line("{\"call\":\"cuEventSynchronize\",\"status\":0,\"event\":%llu}", (unsigned long long)(uintptr_t)event);
  return event ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuEventDestroy_v2(void *event) { return event ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }

CUresult cuMemFree_v2(CUdeviceptr ptr) {
  log_line("{\"call\":\"cuMemFree_v2\",\"status\":0,\"ptr\":%llu}", (unsigned long long)ptr);
  free((void *)(uintptr_t)ptr);
  return CUDA_SUCCESS;
}

static __thread int capture_mode = 0;

CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
  if (!mode) return CUDA_ERROR_INVALID_VALUE;
  int old = capture_mode;
  capture_mode = *mode;
  *mode = old;
  return CUDA_SUCCESS;
}

typedef struct {
  void *data;
  void (*destroy)(void *);
  void *graph;
} UserObject;

static UserObject user_objects[1024];
static int n_user_objects = 0;

CUresult cuUserObjectCreate(void **obj, void *data, void (*destroy)(void *), unsigned refs, unsigned flags) {
  if (!obj || !destroy || refs != 1 || flags != 1) return CUDA_ERROR_INVALID_VALUE;
  if (n_user_objects >= 1024) return CUDA_ERROR_OUT_OF_MEMORY;
  user_objects[n_user_objects] = (UserObject){data, destroy, NULL};
  *obj = &user_objects[n_user_objects++];
  return CUDA_SUCCESS;
}

CUresult cuGraphRetainUserObject(void *graph, void *obj, unsigned count, unsigned flags) {
  if (!graph || !obj || count != 1 || flags != 1) return CUDA_ERROR_INVALID_VALUE;
  ((UserObject *)obj)->graph = graph;
  log_line("{\"call\":\"cuGraphRetainUserObject\",\"status\":0,\"graph\":%llu}",
           (unsigned long long)(uintptr_t)graph);
  return CUDA_SUCCESS;
}

/* Test hook: the graph and its executables are gone; run its user objects' destructors. */
int fake_cuda_destroy_graph(uint64_t graph) {
  int n = 0;
  for (int i = 0; i < n_user_objects; i++)
    if (user_objects[i].graph == (void *)(uintptr_t)graph && user_objects[i].destroy) {
      user_objects[i].destroy(user_objects[i].data);
      user_objects[i].destroy = NULL;
      n++;
    }
  return n;
}

/* ---------------------------------------------------------------- cubins */

/* The section named `name` of an ELF64 image, or NULL. */
static const unsigned char *section(const unsigned char *elf, size_t size, const char *name,
                                    uint64_t *length) {
  uint64_t shoff;
  uint16_t shentsize, shnum, shstrndx;
  memcpy(&shoff, elf + 40, 8);
  memcpy(&shentsize, elf + 58, 2);
  memcpy(&shnum, elf + 60, 2);
  memcpy(&shstrndx, elf + 62, 2);
  if (shentsize < 64 || shstrndx >= shnum || shoff > size ||
      (uint64_t)shentsize * shnum > size - shoff)
    return NULL;
  uint64_t stroff, strsize;
  memcpy(&stroff, elf + shoff + (uint64_t)shstrndx * shentsize + 24, 8);
  memcpy(&strsize, elf + shoff + (uint64_t)shstrndx * shentsize + 32, 8);
  if (stroff > size || strsize > size - stroff) return NULL;
  for (unsigned i = 0; i < shnum; i++) {
    const unsigned char *sh = elf + shoff + (uint64_t)i * shentsize;
    uint32_t name_at;
    uint64_t off, len;
    memcpy(&name_at, sh, 4);
    memcpy(&off, sh + 24, 8);
    memcpy(&len, sh + 32, 8);
    if (name_at >= strsize || off > size || len > size - off) continue;
    const char *sname = (const char *)elf + stroff + name_at;
    if (strnlen(sname, strsize - name_at) < strsize - name_at && strcmp(sname, name) == 0) {
      *length = len;
      return elf + off;
    }
  }
  return NULL;
}

/* Fill f's parameter layout and launch bound from its .nv.info section; 0 when malformed. */
static int read_info(FakeFunction *f) {
  char name[300];
  uint64_t len = 0;
  snprintf(name, sizeof name, ".nv.info.%s", f->name);
  const unsigned char *p = section(f->module->data, f->module->size, name, &len);
  if (!p) return 0;
  int have_size = 0;
  f->max_threads = 1024;
  for (uint64_t at = 0; at + 4 <= len;) {
    uint8_t format = p[at], attr = p[at + 1];
    uint16_t value;
    memcpy(&value, p + at + 2, 2);
    if (format != 4 /* EIFMT_SVAL */) {
      if (attr == 0x19 /* EIATTR_CBANK_PARAM_SIZE */) f->param_size = value, have_size = 1;
      at += 4;
      continue;
    }
    const unsigned char *payload = p + at + 4;
    if (at + 4 + value > len) return 0;
    if (attr == 0x17 /* EIATTR_KPARAM_INFO */ && value >= 12) {
      uint16_t ordinal, offset;
      uint32_t word;
      memcpy(&ordinal, payload + 4, 2);
      memcpy(&offset, payload + 6, 2);
      memcpy(&word, payload + 8, 4);
      if (ordinal >= MAX_PARAMS) return 0;
      f->offset[ordinal] = offset;
      f->size[ordinal] = (uint16_t)(word >> 18);
      if (ordinal + 1 > f->nparams) f->nparams = ordinal + 1;
    } else if ((attr == 0x05 /* MAX_THREADS */ || attr == 0x10 /* REQNTID */) && value >= 12) {
      uint32_t xyz[3];
      memcpy(xyz, payload, 12);
      f->max_threads = xyz[0] * xyz[1] * xyz[2];
    }
    at += 4 + value;
  }
  for (int i = 0; i < f->nparams; i++)
    if ((uint32_t)f->offset[i] + f->size[i] > f->param_size) return 0;
  return have_size;
}

CUresult cuModuleLoadData(void **module, const void *image) {
  if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
  if (!current_context) return CUDA_ERROR_INVALID_CONTEXT;
  const unsigned char *bytes = image;
  uint16_t machine;
  uint32_t flags;
  memcpy(&machine, bytes + 18, 2);
  memcpy(&flags, bytes + 48, 4);
  if (memcmp(bytes, "\177ELF", 4) != 0 || bytes[4] != 2 || machine != 190 /* EM_CUDA */) {
    log_line("{\"call\":\"cuModuleLoadData\",\"status\":%d}", CUDA_ERROR_INVALID_IMAGE);
    return CUDA_ERROR_INVALID_IMAGE;
  }
  /* The SM number: bits 16..23 (ELF ABI v7), or bits 8..15 of newer ABI versions. */
  int sm = (int)((flags >> 16) & 0xff) ? (int)((flags >> 16) & 0xff) : (int)((flags >> 8) & 0xff);
  if (sm / 10 != capability() / 10 || sm > capability()) {
    log_line("{\"call\":\"cuModuleLoadData\",\"status\":%d,\"sm\":%d}", CUDA_ERROR_NO_BINARY_FOR_GPU, sm);
    return CUDA_ERROR_NO_BINARY_FOR_GPU;
  }
  uint64_t shoff;
  uint16_t shentsize, shnum;
  memcpy(&shoff, bytes + 40, 8);
  memcpy(&shentsize, bytes + 58, 2);
  memcpy(&shnum, bytes + 60, 2);
  size_t size = (size_t)(shoff + (uint64_t)shentsize * shnum);
  FakeModule *m = calloc(1, sizeof *m);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  m->magic = MODULE_MAGIC;
  m->size = size;
  m->data = malloc(size);
  memcpy(m->data, bytes, size);
  log_line("{\"call\":\"cuModuleLoadData\",\"status\":0,\"size\":%zu,\"fnv1a64\":\"%016llx\","
           "\"module\":%llu}",
           size, (unsigned long long)fnv1a64(bytes, size), (unsigned long long)(uintptr_t)m);
  *module = m;
  return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
  FakeModule *m = module;
  if (!function || !name || strlen(name) >= 256) return CUDA_ERROR_INVALID_VALUE;
  if (!m || m->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  char text[300];
  uint64_t len;
  snprintf(text, sizeof text, ".text.%s", name);
  if (!section(m->data, m->size, text, &len)) return CUDA_ERROR_NOT_FOUND;
  FakeFunction *f = calloc(1, sizeof *f);
  if (!f) return CUDA_ERROR_OUT_OF_MEMORY;
  f->magic = FUNCTION_MAGIC;
  f->module = m;
  strcpy(f->name, name);
  f->max_dynamic_shared = 49152;
  snprintf(text, sizeof text, ".nv.shared.%s", name);
  if (section(m->data, m->size, text, &len)) f->shared_static = (uint32_t)len;
  if (!read_info(f)) {
    free(f);
    return CUDA_ERROR_INVALID_IMAGE;
  }
  log_line("{\"call\":\"cuModuleGetFunction\",\"status\":0,\"name\":\"%s\",\"module\":%llu,"
           "\"function\":%llu}",
           name, (unsigned long long)(uintptr_t)m, (unsigned long long)(uintptr_t)f);
  *function = f;
  return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int *value, int attribute, void *function) {
  FakeFunction *f = function;
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  if (!f || f->magic != FUNCTION_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  switch (attribute) {
    case 0: *value = (int)f->max_threads; break;        /* MAX_THREADS_PER_BLOCK */
    case 1: *value = (int)f->shared_static; break;      /* SHARED_SIZE_BYTES */
    case 3: *value = 0; break;                          /* LOCAL_SIZE_BYTES */
    case 4: *value = 64; break;                         /* NUM_REGS */
    case 8: *value = (int)f->max_dynamic_shared; break; /* MAX_DYNAMIC_SHARED_SIZE_BYTES */
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(void *function, int attribute, int value) {
  FakeFunction *f = function;
  if (!f || f->magic != FUNCTION_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  if (attribute == 8) {
    if (value < 0 || (uint64_t)value + f->shared_static > (uint64_t)env_int("FAKECUDA_OPTIN", 232448))
      return CUDA_ERROR_INVALID_VALUE;
    f->max_dynamic_shared = (uint32_t)value;
  }
  return CUDA_SUCCESS;
}

CUresult cuFuncSetCacheConfig(void *function, int config) {
  (void)config;
  FakeFunction *f = function;
  return f && f->magic == FUNCTION_MAGIC ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuOccupancyMaxActiveClusters(int *clusters, void *function, const void *config) {
  (void)function, (void)config;
  if (!clusters) return CUDA_ERROR_INVALID_VALUE;
  *clusters = 1;
  return CUDA_SUCCESS;
}

CUresult cuTensorMapEncodeTiled(void) { return CUDA_ERROR_NOT_SUPPORTED; }

/* ---------------------------------------------------------------- launches */

typedef struct {
  unsigned grid[3], block[3], shared;
  void *stream;
  const uint32_t *attr_ids; /* id of each attribute; stride `attr_stride` bytes */
  size_t attr_stride;
  unsigned nattrs;
} Launch;

static CUresult launch(const char *call, void *function, const Launch *l, void **params,
                       void **extra) {
  FakeFunction *f = function;
  if (!f || f->magic != FUNCTION_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  if (!current_context) return CUDA_ERROR_INVALID_CONTEXT;
  unsigned long long threads = (unsigned long long)l->block[0] * l->block[1] * l->block[2];
  if (!l->grid[0] || !l->grid[1] || !l->grid[2] || !threads || threads > f->max_threads) {
    log_line("{\"call\":\"%s\",\"status\":%d,\"reason\":\"bad launch shape\"}", call,
             CUDA_ERROR_INVALID_VALUE);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (l->shared > f->max_dynamic_shared) {
    log_line("{\"call\":\"%s\",\"status\":%d,\"reason\":\"shared %u over %u\"}", call,
             CUDA_ERROR_INVALID_VALUE, l->shared, f->max_dynamic_shared);
    return CUDA_ERROR_INVALID_VALUE;
  }
  const unsigned char *buffer = NULL;
  size_t size = 0;
  if (params == NULL) {
    if (!extra || (uintptr_t)extra[0] != 1 || !extra[1] || (uintptr_t)extra[2] != 2 || !extra[3] ||
        (uintptr_t)extra[4] != 0) {
      log_line("{\"call\":\"%s\",\"status\":%d,\"reason\":\"bad extra array\"}", call,
               CUDA_ERROR_INVALID_VALUE);
      return CUDA_ERROR_INVALID_VALUE;
    }
    buffer = extra[1];
    size = *(size_t *)extra[3];
  } else if (extra) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  unsigned char *bank = calloc(1, f->param_size ? f->param_size : 1);
  if (!bank) return CUDA_ERROR_OUT_OF_MEMORY;
  for (int i = 0; i < f->nparams; i++) {
    if (params) {
      if (!params[i]) {
        free(bank);
        return CUDA_ERROR_INVALID_VALUE;
      }
      memcpy(bank + f->offset[i], params[i], f->size[i]);
    } else {
      if ((size_t)f->offset[i] + f->size[i] > size) {
        free(bank);
        return CUDA_ERROR_INVALID_VALUE;
      }
      memcpy(bank + f->offset[i], buffer + f->offset[i], f->size[i]);
    }
  }
  char attrs[256] = "";
  for (unsigned i = 0, n = 0; i < l->nattrs && n + 12 < sizeof attrs; i++) {
    uint32_t id;
    memcpy(&id, (const char *)l->attr_ids + i * l->attr_stride, 4);
    n += (unsigned)snprintf(attrs + n, sizeof attrs - n, "%s%u", i ? "," : "", id);
  }
  char *bytes = hex(bank, f->param_size);
  log_line("{\"call\":\"%s\",\"status\":0,\"name\":\"%s\",\"function\":%llu,\"grid\":[%u,%u,%u],"
           "\"block\":[%u,%u,%u],\"shared\":%u,\"stream\":%llu,\"attrs\":[%s],\"via\":\"%s\","
           "\"params\":\"%s\"}",
           call, f->name, (unsigned long long)(uintptr_t)f, l->grid[0], l->grid[1], l->grid[2],
           l->block[0], l->block[1], l->block[2], l->shared,
           (unsigned long long)(uintptr_t)l->stream, attrs, params ? "kernelParams" : "extra",
           bytes ? bytes : "");
  free(bytes);
  free(bank);
  return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void *stream, void **params,
                        void **extra) {
  Launch l = {{gx, gy, gz}, {bx, by, bz}, shared, stream, NULL, 0, 0};
  return launch("cuLaunchKernel", function, &l, params, extra);
}

/* CUlaunchConfig (cuda.h): grid, block, shared, stream, attrs, numAttrs; each CUlaunchAttribute
 * is an id (4 bytes, padded to 8) and a 64-byte value union. */
typedef struct {
  unsigned gx, gy, gz, bx, by, bz, shared;
  void *stream;
  const void *attrs;
  unsigned nattrs;
} LaunchConfig;

CUresult cuLaunchKernelEx(const LaunchConfig *c, void *function, void **params, void **extra) {
  if (!c) return CUDA_ERROR_INVALID_VALUE;
  Launch l = {{c->gx, c->gy, c->gz}, {c->bx, c->by, c->bz}, c->shared, c->stream, c->attrs, 72,
              c->nattrs};
  return launch("cuLaunchKernelEx", function, &l, params, extra);
}
