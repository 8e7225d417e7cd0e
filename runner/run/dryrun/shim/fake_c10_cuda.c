/* LD_PRELOAD shim for the CUDA rehearsal (mode=dryrun dryrun.device=cuda): a CUDA build of torch on a machine
 * with no GPU and no driver, running on fake tensors (runner/run/dryrun/fake_cuda.py loads and drives it).
 *
 * Written for torch 2.13.0 (+cu130). Each symbol is an exported C++ function that libtorch_cuda.so calls through
 * its PLT, so the preloaded definition wins:
 *  - c10::cuda::device_count(): 0 until fake_cuda_set_device_count(n). FakeTensorMode installs its no-op CUDA
 *    device guard only while the count is 0; afterwards the autograd engine's hasPrimaryContext(0) needs an index
 *    below the count (it then asks libcuda.so.1's cuDevicePrimaryCtxGetState: libcuda_stub.c).
 *  - c10::cuda::current_device(): 0.
 *  - at::cuda::getCurrentDeviceProperties() / getDeviceProperties(i): the rehearsed GPU, from the environment
 *    (FAKE_CUDA_CAPABILITY "9.0", FAKE_CUDA_MEMORY_GB 80, FAKE_CUDA_NAME), read at the first query. SDPA's kernel
 *    choice and the FP8 checks in C++ read these. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <driver_types.h> /* cudaDeviceProp, from the nvidia runtime wheel's headers */

static volatile int8_t g_count = 0;
int8_t _ZN3c104cuda12device_countEv(void) { return g_count; }
int8_t _ZN3c104cuda14current_deviceEv(void) { return 0; }
void fake_cuda_set_device_count(int n) { g_count = (int8_t)n; }
int fake_cuda_get_device_count(void) { return g_count; }

static struct cudaDeviceProp g_prop;
static int g_prop_init = 0;

static const char *env_or(const char *name, const char *fallback) {
  const char *v = getenv(name);
  return v && *v ? v : fallback;
}

static struct cudaDeviceProp *props(void) {
  if (g_prop_init) return &g_prop;
  memset(&g_prop, 0, sizeof(g_prop));
  strncpy(g_prop.name, env_or("FAKE_CUDA_NAME", "NVIDIA H100 80GB HBM3 (fake)"), sizeof(g_prop.name) - 1);
  const char *cap = env_or("FAKE_CUDA_CAPABILITY", "9.0");
  g_prop.major = atoi(cap);
  const char *dot = strchr(cap, '.');
  g_prop.minor = dot ? atoi(dot + 1) : 0;
  g_prop.totalGlobalMem = (size_t)(atof(env_or("FAKE_CUDA_MEMORY_GB", "80")) * 1e9);
  g_prop.multiProcessorCount = 132;
  g_prop.warpSize = 32;
  g_prop.sharedMemPerBlock = 48 << 10;
  g_prop.sharedMemPerBlockOptin = 227 << 10;
  g_prop.sharedMemPerMultiprocessor = 228 << 10;
  g_prop.regsPerBlock = 65536;
  g_prop.regsPerMultiprocessor = 65536;
  g_prop.maxThreadsPerBlock = 1024;
  g_prop.maxThreadsPerMultiProcessor = 2048;
  g_prop.maxThreadsDim[0] = 1024;
  g_prop.maxThreadsDim[1] = 1024;
  g_prop.maxThreadsDim[2] = 64;
  g_prop.maxGridSize[0] = 2147483647;
  g_prop.maxGridSize[1] = 65535;
  g_prop.maxGridSize[2] = 65535;
  g_prop.l2CacheSize = 50 << 20;
  g_prop.memoryBusWidth = 5120;
  g_prop_init = 1;
  return &g_prop;
}
struct cudaDeviceProp *_ZN2at4cuda26getCurrentDevicePropertiesEv(void) { return props(); }
struct cudaDeviceProp *_ZN2at4cuda19getDevicePropertiesEa(int8_t idx) {
  (void)idx;
  return props();
}
