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
 *   FAKEHIP_VERSION   what hipDriverGetVersion/hipRuntimeGetVersion answer (default 70200000)
 *
 * Module images must be AMDGPU ELF code objects (what Triton writes as .hsaco): the image
 * size is taken from the ELF header (the section header table ends the file) and the
 * EF_AMDGPU_MACH byte of e_flags must name the device's gfx target, else
 * hipErrorNoBinaryForGpu, as a real runtime answers for an image of another arch.
 *
 * Like the real runtime, the fake reads each kernel's AMDGPU metadata (the msgpack note
 * NT_AMDGPU_METADATA: .args with .offset/.size/.value_kind, .kernarg_segment_size,
 * .max_flat_workgroup_size, .group_segment_fixed_size) and builds the kernarg segment a
 * launch would hand the GPU: explicit arguments copied from kernelParams[i] (Triton's
 * launcher) or read at their metadata offsets from the `extra` buffer (aotriton-rt), hidden
 * arguments (hidden_block_count_*, hidden_group_size_*, ...) filled from the launch. The
 * launch record's "kernarg" field holds those bytes, so two launchers of one kernel can be
 * compared byte for byte. Images without metadata (tests' minimal ELF files) still load; their
 * launches record the raw `extra` buffer only and refuse kernelParams.
 *
 * Triton's own HIP launcher dlopens this library, checks hipDriverGetVersion and resolves
 * every other entry point through hipGetProcAddress; both are provided.
 *
 * Build: gcc -shared -fPIC -O1 -I../helpers -Wl,-soname,libamdhip64.so -o libamdhip64.so fake_amdhip64.c
 */

#define FAKE_LOG_ENV "FAKEHIP_LOG"
#define FAKE_FAIL_ENV "FAKEHIP_FAIL"
#include "fake_driver.h" /* tests/helpers: env_int, env_str, injected_failure, log_line, hex, fnv1a64 */

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
#define PROP_REGS_PER_BLOCK 304
#define PROP_WARP_SIZE 308
#define PROP_MAX_THREADS_PER_BLOCK 320
#define PROP_CLOCK_RATE 348
#define PROP_MAJOR 360
#define PROP_MINOR 364
#define PROP_MULTIPROCESSOR_COUNT 388
#define PROP_MEMORY_CLOCK_RATE 608
#define PROP_MEMORY_BUS_WIDTH 612
#define PROP_MAX_THREADS_PER_MP 624
#define PROP_SHARED_PER_BLOCK_OPTIN 696
#define PROP_GCN_ARCH_NAME 1160

#define MODULE_MAGIC 0x4d4f44554c454148ull  /* "HAELUDOM" */
#define FUNCTION_MAGIC 0x46554e4354494f4eull

#define MAX_KERNELS 16
#define MAX_ARGS 128

typedef struct {
  uint32_t offset, size;
  char kind[40]; /* .value_kind: global_buffer, by_value, hidden_block_count_x, ... */
} KernelArg;

/* One kernel's AMDGPU metadata, as far as a launch needs it. */
typedef struct {
  char name[256];
  int nargs;
  KernelArg args[MAX_ARGS];
  uint32_t kernarg_size, max_flat_workgroup_size, group_fixed, private_fixed, vgprs;
} KernelInfo;

typedef struct {
  uint64_t magic;
  int device;
  size_t size;
  unsigned char *data;
  int nkernels; /* -1: the image has no readable AMDGPU metadata */
  KernelInfo kernels[MAX_KERNELS];
} FakeModule;

typedef struct {
  uint64_t magic;
  FakeModule *module;
  char name[256];
  int max_dynamic_shared;
  const KernelInfo *info; /* NULL when the module has no metadata for it */
} FakeFunction;

static __thread int current_device = 0;

/* ---------------------------------------------------------------- environment */

static int device_count(void) { return env_int("FAKEHIP_DEVICES", 1); }

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
  /* CDNA (gfx9) runs 64-wide wavefronts; RDNA (gfx10+) defaults to 32 in HIP. */
  const char *arch = env_str("FAKEHIP_ARCH", "gfx942:sramecc+:xnack-");
  /* gfxMMms: major MM (one or two digits), minor m, stepping s (a hex digit). */
  char version[16] = {0};
  size_t digits = strcspn(arch + 3, ":");
  if (digits >= 3 && digits < sizeof version) memcpy(version, arch + 3, digits - 2);
  int major = atoi(version);
  put_int(p, PROP_WARP_SIZE, major == 9 ? 64 : 32);
  put_int(p, PROP_MAX_THREADS_PER_BLOCK, 1024);
  put_int(p, PROP_MAJOR, major);
  put_int(p, PROP_MINOR, digits > 1 ? arch[3 + digits - 2] - '0' : 0);
  put_int(p, PROP_MULTIPROCESSOR_COUNT, 304);
  put_int(p, PROP_REGS_PER_BLOCK, 65536);
  put_int(p, PROP_CLOCK_RATE, 2100000);
  put_int(p, PROP_MEMORY_CLOCK_RATE, 1300000);
  put_int(p, PROP_MEMORY_BUS_WIDTH, 8192);
  put_int(p, PROP_MAX_THREADS_PER_MP, 2048);
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
  *version = env_int("FAKEHIP_VERSION", 70200000); /* major * 10^7 + minor * 10^5 + patch */
  return hipSuccess;
}

hipError_t hipDriverGetVersion(int *version) {
  int code = enter("hipDriverGetVersion");
  if (code) return code;
  if (!version) return hipErrorInvalidValue;
  *version = env_int("FAKEHIP_VERSION", 70200000);
  return hipSuccess;
}

hipError_t hipGetLastError(void) { return hipSuccess; }

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

hipError_t hipStreamGetCaptureInfo(void *stream, int *status, unsigned long long *id) {
  int code = hipStreamIsCapturing(stream, status);
  if (code) return code;
  if (id) *id = *status ? (unsigned long long)(uintptr_t)stream : 0;
  return hipSuccess;
}

/* Events: opaque counters; each call is logged with the event and the stream. */
static unsigned long long next_event = 0xe000;

hipError_t hipEventCreateWithFlags(void **event, unsigned flags) {
  int code = enter("hipEventCreateWithFlags");
  if (code) return code;
  if (!event) return hipErrorInvalidValue;
  *event = (void *)(uintptr_t)(++next_event);
  log_line("{\"call\":\"hipEventCreateWithFlags\",\"status\":0,\"device\":%d,\"event\":%llu,\"flags\":%u}",
           current_device, next_event, flags);
  return hipSuccess;
}

static hipError_t event_call(const char *name, void *event, void *stream) {
  int code = enter(name);
  if (code) return code;
  if (!event) return hipErrorInvalidValue;
  log_line("{\"call\":\"%s\",\"status\":0,\"event\":%llu,\"stream\":%llu}", name,
           (unsigned long long)(uintptr_t)event, (unsigned long long)(uintptr_t)stream);
  return hipSuccess;
}

hipError_t hipEventRecord(void *event, void *stream) { return event_call("hipEventRecord", event, stream); }
hipError_t hipStreamWaitEvent(void *stream, void *event, unsigned flags) {
  return flags ? hipErrorInvalidValue : event_call("hipStreamWaitEvent", event, stream);
}
hipError_t hipEventSynchronize(void *event) { return event_call("hipEventSynchronize", event, NULL); }
hipError_t hipEventDestroy(void *event) { return event_call("hipEventDestroy", event, NULL); }

/* ---------------------------------------------------------------- modules */

/* gfx name -> EF_AMDGPU_MACH value (the low byte of e_flags), for the targets the project
 * builds; values checked against code objects Triton writes for each target. */
static int mach_of(const char *gfx) {
  static const struct {
    const char *gfx;
    int mach;
  } table[] = {{"gfx90a", 0x3f},  {"gfx942", 0x4c},  {"gfx950", 0x4f}, {"gfx1100", 0x41},
               {"gfx1151", 0x4a}, {"gfx1201", 0x4e}, {"gfx1250", 0x49}};
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

/* ------------------------------------------------ a msgpack reader for the AMDGPU metadata */

enum { MP_ERR, MP_INT, MP_STR, MP_ARRAY, MP_MAP, MP_SCALAR };

typedef struct {
  const unsigned char *p, *end;
} Mp;

typedef struct {
  int kind;
  int64_t value;          /* MP_INT */
  const char *str;        /* MP_STR, not NUL-terminated */
  uint32_t len;           /* MP_STR length; MP_ARRAY / MP_MAP element count */
} MpItem;

static int mp_take(Mp *m, size_t n, const unsigned char **at) {
  if ((size_t)(m->end - m->p) < n) return 0;
  *at = m->p;
  m->p += n;
  return 1;
}

static uint64_t mp_be(const unsigned char *at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v = (v << 8) | at[i];
  return v;
}

/* Read one item header; strings are taken whole, containers only announce their count. */
static MpItem mp_read(Mp *m) {
  MpItem it = {MP_ERR, 0, NULL, 0};
  const unsigned char *at;
  if (!mp_take(m, 1, &at)) return it;
  unsigned c = at[0];
  int n = 0;
  if (c <= 0x7f) { it.kind = MP_INT; it.value = c; return it; }
  if (c >= 0xe0) { it.kind = MP_INT; it.value = (int8_t)c; return it; }
  if ((c & 0xf0) == 0x80) { it.kind = MP_MAP; it.len = c & 15; return it; }
  if ((c & 0xf0) == 0x90) { it.kind = MP_ARRAY; it.len = c & 15; return it; }
  if ((c & 0xe0) == 0xa0) { it.len = c & 31; goto string; }
  switch (c) {
    case 0xc0: case 0xc2: case 0xc3: it.kind = MP_SCALAR; return it;
    case 0xc4: case 0xc5: case 0xc6: n = 1 << (c - 0xc4); goto blob;
    case 0xca: n = 4; goto scalar;
    case 0xcb: n = 8; goto scalar;
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
      n = 1 << (c - 0xcc);
      if (!mp_take(m, (size_t)n, &at)) return it;
      it.kind = MP_INT; it.value = (int64_t)mp_be(at, n); return it;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
      n = 1 << (c - 0xd0);
      if (!mp_take(m, (size_t)n, &at)) return it;
      uint64_t u = mp_be(at, n);
      int shift = 64 - 8 * n;
      it.kind = MP_INT; it.value = (int64_t)(u << shift) >> shift; return it;
    }
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:
      n = 1 + (1 << (c - 0xd4)); goto scalar;
    case 0xd9: case 0xda: case 0xdb:
      n = 1 << (c - 0xd9);
      if (!mp_take(m, (size_t)n, &at)) return it;
      it.len = (uint32_t)mp_be(at, n); goto string;
    case 0xdc: case 0xdd:
      n = 2 << (c - 0xdc);
      if (!mp_take(m, (size_t)n, &at)) return it;
      it.kind = MP_ARRAY; it.len = (uint32_t)mp_be(at, n); return it;
    case 0xde: case 0xdf:
      n = 2 << (c - 0xde);
      if (!mp_take(m, (size_t)n, &at)) return it;
      it.kind = MP_MAP; it.len = (uint32_t)mp_be(at, n); return it;
    default: return it; /* ext8/16/32 (0xc7-0xc9): never in AMDGPU metadata */
  }
blob:
  if (!mp_take(m, (size_t)n, &at)) return it;
  n = (int)mp_be(at, n);
scalar:
  if (!mp_take(m, (size_t)n, &at)) return it;
  it.kind = MP_SCALAR; return it;
string:
  if (!mp_take(m, it.len, &at)) return it;
  it.kind = MP_STR; it.str = (const char *)at; return it;
}

/* Skip one whole item (containers included); 0 on malformed input. */
static int mp_skip(Mp *m, int depth) {
  MpItem it = mp_read(m);
  if (it.kind == MP_ERR || depth > 32) return 0;
  uint64_t children = it.kind == MP_ARRAY ? it.len : it.kind == MP_MAP ? 2ull * it.len : 0;
  for (uint64_t i = 0; i < children; i++)
    if (!mp_skip(m, depth + 1)) return 0;
  return 1;
}

static int mp_is(const MpItem *it, const char *key) {
  return it->kind == MP_STR && it->len == strlen(key) && memcmp(it->str, key, it->len) == 0;
}

static void mp_copy(const MpItem *it, char *out, size_t cap) {
  size_t n = it->kind == MP_STR ? (it->len < cap - 1 ? it->len : cap - 1) : 0;
  if (n) memcpy(out, it->str, n);
  out[n] = 0;
}

static int mp_uint32(Mp *m, uint32_t *out) {
  MpItem it = mp_read(m);
  if (it.kind != MP_INT || it.value < 0 || it.value > 0xffffffffll) return 0;
  *out = (uint32_t)it.value;
  return 1;
}

static int parse_arg(Mp *m, KernelArg *arg) {
  MpItem map = mp_read(m);
  if (map.kind != MP_MAP) return 0;
  for (uint32_t i = 0; i < map.len; i++) {
    MpItem key = mp_read(m);
    if (mp_is(&key, ".offset")) {
      if (!mp_uint32(m, &arg->offset)) return 0;
    } else if (mp_is(&key, ".size")) {
      if (!mp_uint32(m, &arg->size)) return 0;
    } else if (mp_is(&key, ".value_kind")) {
      MpItem v = mp_read(m);
      if (v.kind != MP_STR) return 0;
      mp_copy(&v, arg->kind, sizeof arg->kind);
    } else if (key.kind == MP_ERR || !mp_skip(m, 1)) {
      return 0;
    }
  }
  return 1;
}

static int parse_kernel(Mp *m, KernelInfo *k) {
  MpItem map = mp_read(m);
  if (map.kind != MP_MAP) return 0;
  k->max_flat_workgroup_size = 1024;
  for (uint32_t i = 0; i < map.len; i++) {
    MpItem key = mp_read(m);
    if (mp_is(&key, ".name")) {
      MpItem v = mp_read(m);
      if (v.kind != MP_STR) return 0;
      mp_copy(&v, k->name, sizeof k->name);
    } else if (mp_is(&key, ".args")) {
      MpItem arr = mp_read(m);
      if (arr.kind != MP_ARRAY || arr.len > MAX_ARGS) return 0;
      k->nargs = (int)arr.len;
      for (uint32_t j = 0; j < arr.len; j++)
        if (!parse_arg(m, &k->args[j])) return 0;
    } else if (mp_is(&key, ".kernarg_segment_size")) {
      if (!mp_uint32(m, &k->kernarg_size)) return 0;
    } else if (mp_is(&key, ".max_flat_workgroup_size")) {
      if (!mp_uint32(m, &k->max_flat_workgroup_size)) return 0;
    } else if (mp_is(&key, ".group_segment_fixed_size")) {
      if (!mp_uint32(m, &k->group_fixed)) return 0;
    } else if (mp_is(&key, ".private_segment_fixed_size")) {
      if (!mp_uint32(m, &k->private_fixed)) return 0;
    } else if (mp_is(&key, ".vgpr_count")) {
      if (!mp_uint32(m, &k->vgprs)) return 0;
    } else if (key.kind == MP_ERR || !mp_skip(m, 1)) {
      return 0;
    }
  }
  for (int j = 0; j < k->nargs; j++)
    if ((uint64_t)k->args[j].offset + k->args[j].size > k->kernarg_size) return 0;
  return 1;
}

/* The kernels of one metadata blob; -1 when it is not AMDGPU metadata this reader knows. */
static int parse_metadata(const unsigned char *blob, size_t size, KernelInfo *kernels) {
  Mp m = {blob, blob + size};
  MpItem top = mp_read(&m);
  if (top.kind != MP_MAP) return -1;
  int count = -1;
  for (uint32_t i = 0; i < top.len; i++) {
    MpItem key = mp_read(&m);
    if (mp_is(&key, "amdhsa.kernels")) {
      MpItem arr = mp_read(&m);
      if (arr.kind != MP_ARRAY || arr.len > MAX_KERNELS) return -1;
      for (uint32_t j = 0; j < arr.len; j++)
        if (!parse_kernel(&m, &kernels[j])) return -1;
      count = (int)arr.len;
    } else if (key.kind == MP_ERR || !mp_skip(&m, 1)) {
      return -1;
    }
  }
  return count;
}

/* Find the NT_AMDGPU_METADATA (32) note named "AMDGPU" in the SHT_NOTE sections. */
static int read_kernels(const unsigned char *image, size_t size, KernelInfo *kernels) {
  uint64_t shoff;
  uint16_t shentsize, shnum;
  memcpy(&shoff, image + 40, 8);
  memcpy(&shentsize, image + 58, 2);
  memcpy(&shnum, image + 60, 2);
  if (shentsize < 64 || shoff > size || (uint64_t)shentsize * shnum > size - shoff) return -1;
  for (unsigned s = 0; s < shnum; s++) {
    const unsigned char *sh = image + shoff + (uint64_t)s * shentsize;
    uint32_t type;
    uint64_t off, len;
    memcpy(&type, sh + 4, 4);
    memcpy(&off, sh + 24, 8);
    memcpy(&len, sh + 32, 8);
    if (type != 7 /* SHT_NOTE */ || off > size || len > size - off) continue;
    uint64_t at = off, end = off + len;
    while (at + 12 <= end) {
      uint32_t namesz, descsz, ntype;
      memcpy(&namesz, image + at, 4);
      memcpy(&descsz, image + at + 4, 4);
      memcpy(&ntype, image + at + 8, 4);
      uint64_t name = at + 12, desc = name + ((namesz + 3ull) & ~3ull);
      uint64_t next = desc + ((descsz + 3ull) & ~3ull);
      if (desc + descsz > end) break;
      if (ntype == 32 && namesz == 7 && memcmp(image + name, "AMDGPU", 7) == 0)
        return parse_metadata(image + desc, descsz, kernels);
      at = next;
    }
  }
  return -1;
}

static hipError_t load_module(const char *call, void **module, const void *image) {
  int code = enter(call);
  if (code) return code;
  if (!module || !image) return hipErrorInvalidValue;
  const unsigned char *bytes = image;
  if (memcmp(bytes, "\177ELF", 4) != 0 || bytes[4] != 2 /* ELFCLASS64 */) {
    log_line("{\"call\":\"%s\",\"status\":%d,\"reason\":\"not an ELF64 image\"}", call,
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
    log_line("{\"call\":\"%s\",\"status\":%d,\"size\":%zu,\"mach\":%u}", call,
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
  m->nkernels = read_kernels(m->data, size, m->kernels);
  char *head = hex(bytes, size < 16 ? size : 16);
  log_line("{\"call\":\"%s\",\"status\":0,\"device\":%d,\"size\":%zu,"
           "\"fnv1a64\":\"%016llx\",\"head\":\"%s\",\"module\":%llu,\"kernels\":%d}",
           call, m->device, size, (unsigned long long)fnv1a64(bytes, size), head ? head : "",
           (unsigned long long)(uintptr_t)m, m->nkernels);
  free(head);
  *module = m;
  return hipSuccess;
}

hipError_t hipModuleLoadData(void **module, const void *image) {
  return load_module("hipModuleLoadData", module, image);
}

/* Triton's loader passes JIT options (log buffers); code objects need none of them. */
hipError_t hipModuleLoadDataEx(void **module, const void *image, unsigned n, void *options,
                               void **values) {
  (void)options, (void)values;
  if (n > 0 && (!options || !values)) return hipErrorInvalidValue;
  return load_module("hipModuleLoadDataEx", module, image);
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
  const KernelInfo *info = NULL;
  for (int i = 0; i < m->nkernels; i++)
    if (strcmp(m->kernels[i].name, name) == 0) info = &m->kernels[i];
  /* With metadata, a kernel is what the metadata lists; without, any symbol name. */
  int found = m->nkernels >= 0 ? info != NULL : has_symbol(m, name);
  if (strlen(name) >= sizeof(((FakeFunction *)0)->name) || !found) {
    log_line("{\"call\":\"hipModuleGetFunction\",\"status\":%d,\"name\":\"%.200s\"}",
             hipErrorNotFound, name);
    return hipErrorNotFound;
  }
  FakeFunction *f = calloc(1, sizeof *f);
  if (!f) return hipErrorOutOfMemory;
  f->magic = FUNCTION_MAGIC;
  f->module = m;
  f->info = info;
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

/* hipFunction_attribute values Triton asks for after loading (hip_runtime_api.h). */
enum {
  HIP_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
  HIP_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
  HIP_FUNC_ATTRIBUTE_NUM_REGS = 4,
};

hipError_t hipFuncGetAttribute(int *value, int attr, void *function) {
  int code = enter("hipFuncGetAttribute");
  if (code) return code;
  FakeFunction *f = function;
  if (!value) return hipErrorInvalidValue;
  if (!f || f->magic != FUNCTION_MAGIC) return hipErrorInvalidHandle;
  /* A function runs on the device its module was loaded on: that device must be current. */
  if (f->module->device != current_device) return hipErrorInvalidDevice;
  const KernelInfo *k = f->info;
  switch (attr) {
    case HIP_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
      *value = k ? (int)k->max_flat_workgroup_size : 1024;
      break;
    case HIP_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES:
      *value = k ? (int)k->private_fixed : 0;
      break;
    case HIP_FUNC_ATTRIBUTE_NUM_REGS:
      *value = k ? (int)k->vgprs : 0;
      break;
    default:
      return hipErrorNotSupported;
  }
  return hipSuccess;
}

/* ---------------------------------------------------------------- pointers */

/* hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_DEVICE_POINTER): every address is taken to be
 * device memory and maps to itself, so a launcher that asks gets the address it passed. */
hipError_t hipPointerGetAttribute(void *data, int attribute, void *ptr) {
  int code = enter("hipPointerGetAttribute");
  if (code) return code;
  if (!data) return hipErrorInvalidValue;
  if (attribute != 3 /* HIP_POINTER_ATTRIBUTE_DEVICE_POINTER */) return hipErrorNotSupported;
  uint64_t address = (uint64_t)(uintptr_t)ptr;
  memcpy(data, &address, sizeof address);
  log_line("{\"call\":\"hipPointerGetAttribute\",\"status\":0,\"attribute\":%d,\"ptr\":%llu}",
           attribute, (unsigned long long)address);
  return hipSuccess;
}

/* ---------------------------------------------------------------- launches */

static void put_hidden(unsigned char *seg, const KernelArg *a, uint64_t value) {
  size_t n = a->size < 8 ? a->size : 8;
  memcpy(seg + a->offset, &value, n); /* little endian, like the GPU */
}

/* Fill a hidden argument the way the runtime does for a grid of g blocks of b threads. */
static void fill_hidden(unsigned char *seg, const KernelArg *a, const unsigned g[3],
                        const unsigned b[3], unsigned shared) {
  static const char *dims = "xyz";
  for (int d = 0; d < 3; d++) {
    char name[40];
    snprintf(name, sizeof name, "hidden_block_count_%c", dims[d]);
    if (strcmp(a->kind, name) == 0) return put_hidden(seg, a, g[d]);
    snprintf(name, sizeof name, "hidden_group_size_%c", dims[d]);
    if (strcmp(a->kind, name) == 0) return put_hidden(seg, a, b[d]);
  }
  if (strcmp(a->kind, "hidden_grid_dims") == 0)
    return put_hidden(seg, a, g[2] * b[2] > 1 ? 3 : g[1] * b[1] > 1 ? 2 : 1);
  if (strcmp(a->kind, "hidden_dynamic_lds_size") == 0) return put_hidden(seg, a, shared);
  /* Remainders (the grid is whole blocks), global offsets, queue and heap pointers: zero. */
}

static int launch(const char *call, void *function, const unsigned g[3], const unsigned b[3],
                  unsigned shared, void *stream, void **kernel_params, void **extra) {
  int code = enter(call);
  if (code) return code;
  FakeFunction *f = function;
  if (!f || f->magic != FUNCTION_MAGIC) return hipErrorInvalidHandle;
  /* A function runs on the device its module was loaded on: that device must be current. */
  if (f->module->device != current_device) return hipErrorInvalidDevice;
  const KernelInfo *k = f->info;
  unsigned long long threads = (unsigned long long)b[0] * b[1] * b[2];
  if (g[0] == 0 || g[1] == 0 || g[2] == 0 || threads == 0 || threads > 1024 ||
      (k && threads > k->max_flat_workgroup_size)) {
    log_line("{\"call\":\"%s\",\"status\":%d,\"reason\":\"bad launch shape\",\"block\":[%u,%u,%u]}",
             call, hipErrorInvalidConfiguration, b[0], b[1], b[2]);
    return hipErrorInvalidConfiguration;
  }
  unsigned long long lds = (unsigned long long)shared + (k ? k->group_fixed : 0);
  if (lds > (unsigned long long)env_int("FAKEHIP_LDS", 65536)) return hipErrorInvalidValue;
  /* Exactly one way to pass arguments: kernelParams, or `extra` the HIP way:
   * {BUFFER_POINTER=1, buf, BUFFER_SIZE=2, &size, END=3}. CUDA ends with 0 instead of 3:
   * reject that mix-up loudly. */
  const unsigned char *buffer = NULL;
  size_t size = 0;
  if (kernel_params == NULL) {
    if (extra == NULL || (uintptr_t)extra[0] != 1 || extra[1] == NULL ||
        (uintptr_t)extra[2] != 2 || extra[3] == NULL || (uintptr_t)extra[4] != 3) {
      log_line("{\"call\":\"%s\",\"status\":%d,\"reason\":\"bad extra array\"}", call,
               hipErrorInvalidValue);
      return hipErrorInvalidValue;
    }
    buffer = extra[1];
    size = *(size_t *)extra[3];
  } else if (extra != NULL || k == NULL) {
    log_line("{\"call\":\"%s\",\"status\":%d,\"reason\":\"%s\"}", call, hipErrorInvalidValue,
             extra ? "both kernelParams and extra" : "kernelParams without kernel metadata");
    return hipErrorInvalidValue;
  }
  /* The kernarg segment the GPU would see: explicit arguments at their metadata offsets. */
  char *kernarg_hex = NULL;
  if (k) {
    unsigned char *seg = calloc(1, k->kernarg_size ? k->kernarg_size : 1);
    if (!seg) return hipErrorOutOfMemory;
    int explicit_index = 0;
    for (int i = 0; i < k->nargs; i++) {
      const KernelArg *a = &k->args[i];
      if (strncmp(a->kind, "hidden_", 7) == 0) {
        fill_hidden(seg, a, g, b, shared);
        continue;
      }
      if (kernel_params) {
        if (!kernel_params[explicit_index]) {
          free(seg);
          return hipErrorInvalidValue;
        }
        memcpy(seg + a->offset, kernel_params[explicit_index], a->size);
      } else {
        if ((uint64_t)a->offset + a->size > size) {
          log_line("{\"call\":\"%s\",\"status\":%d,\"reason\":\"extra buffer of %zu bytes ends "
                   "before argument %d (offset %u, size %u)\"}",
                   call, hipErrorInvalidValue, size, explicit_index, a->offset, a->size);
          free(seg);
          return hipErrorInvalidValue;
        }
        memcpy(seg + a->offset, buffer + a->offset, a->size);
      }
      explicit_index++;
    }
    kernarg_hex = hex(seg, k->kernarg_size);
    free(seg);
  }
  char *args = buffer ? hex(buffer, size) : NULL;
  log_line("{\"call\":\"%s\",\"status\":0,\"name\":\"%s\",\"function\":%llu,\"device\":%d,"
           "\"module_device\":%d,\"grid\":[%u,%u,%u],\"block\":[%u,%u,%u],\"shared\":%u,"
           "\"stream\":%llu,\"via\":\"%s\",\"args_size\":%zu,\"args\":\"%s\",\"kernarg\":\"%s\"}",
           call, f->name, (unsigned long long)(uintptr_t)f, current_device, f->module->device, g[0], g[1], g[2], b[0], b[1], b[2],
           shared, (unsigned long long)(uintptr_t)stream, buffer ? "extra" : "kernelParams", size,
           args ? args : "", kernarg_hex ? kernarg_hex : "");
  free(args);
  free(kernarg_hex);
  return hipSuccess;
}

hipError_t hipModuleLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz,
                                 unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                 void *stream, void **kernel_params, void **extra) {
  const unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
  return launch("hipModuleLaunchKernel", function, g, b, shared, stream, kernel_params, extra);
}

hipError_t hipModuleLaunchCooperativeKernel(void *function, unsigned gx, unsigned gy,
                                            unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                            unsigned shared, void *stream, void **params,
                                            void **extra) {
  const unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
  return launch("hipModuleLaunchCooperativeKernel", function, g, b, shared, stream, params,
                extra);
}

/* Cluster launches (Triton uses them only for num_ctas > 1): not modelled. */
hipError_t hipDrvLaunchKernelEx(const void *config, void *function, void **params, void **extra) {
  (void)config, (void)function, (void)params, (void)extra;
  log_line("{\"call\":\"hipDrvLaunchKernelEx\",\"status\":%d}", hipErrorNotSupported);
  return hipErrorNotSupported;
}

hipError_t hipDeviceGetAttribute(int *value, int attr, int device) {
  (void)value, (void)attr, (void)device;
  return hipErrorNotSupported;
}

/* ---------------------------------------------------------------- hipGetProcAddress */

/* What Triton's launchers resolve. Names are looked up in this table, never with dlsym, so a
 * real runtime loaded into the same process can never answer for the fake. ROCm 6+ maps
 * hipGetDeviceProperties to the R0600 entry point for callers built against 6.0+ headers. */
static const struct {
  const char *name;
  void *fn;
} procs[] = {
    {"hipGetErrorName", (void *)hipGetErrorName},
    {"hipGetErrorString", (void *)hipGetErrorString},
    {"hipGetLastError", (void *)hipGetLastError},
    {"hipInit", (void *)hipInit},
    {"hipDriverGetVersion", (void *)hipDriverGetVersion},
    {"hipRuntimeGetVersion", (void *)hipRuntimeGetVersion},
    {"hipGetDeviceCount", (void *)hipGetDeviceCount},
    {"hipGetDevice", (void *)hipGetDevice},
    {"hipSetDevice", (void *)hipSetDevice},
    {"hipGetDeviceProperties", (void *)hipGetDevicePropertiesR0600},
    {"hipGetDevicePropertiesR0600", (void *)hipGetDevicePropertiesR0600},
    {"hipModuleLoadData", (void *)hipModuleLoadData},
    {"hipModuleLoadDataEx", (void *)hipModuleLoadDataEx},
    {"hipModuleUnload", (void *)hipModuleUnload},
    {"hipModuleGetFunction", (void *)hipModuleGetFunction},
    {"hipFuncGetAttribute", (void *)hipFuncGetAttribute},
    {"hipFuncSetAttribute", (void *)hipFuncSetAttribute},
    {"hipModuleLaunchKernel", (void *)hipModuleLaunchKernel},
    {"hipModuleLaunchCooperativeKernel", (void *)hipModuleLaunchCooperativeKernel},
    {"hipDrvLaunchKernelEx", (void *)hipDrvLaunchKernelEx},
    {"hipPointerGetAttribute", (void *)hipPointerGetAttribute},
};

hipError_t hipGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags,
                             int *status) {
  int code = enter("hipGetProcAddress");
  if (code) return code;
  if (!symbol || !pfn) return hipErrorInvalidValue;
  for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
    if (strcmp(procs[i].name, symbol) == 0) {
      *pfn = procs[i].fn;
      if (status) *status = 0; /* HIP_GET_PROC_ADDRESS_SUCCESS */
      log_line("{\"call\":\"hipGetProcAddress\",\"status\":0,\"symbol\":\"%.100s\","
               "\"version\":%d,\"flags\":%llu}",
               symbol, version, (unsigned long long)flags);
      return hipSuccess;
    }
  }
  *pfn = NULL;
  if (status) *status = 1; /* HIP_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  log_line("{\"call\":\"hipGetProcAddress\",\"status\":%d,\"symbol\":\"%.100s\"}",
           hipErrorNotFound, symbol);
  return hipErrorNotFound;
}
