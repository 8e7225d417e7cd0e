/* A stand-in libcuda.so.1 for the CUDA rehearsal (written for torch 2.13.0): the one driver call the autograd engine
 * makes on fake CUDA tensors (CUDAHooks::hasPrimaryContext while stashing the current streams). "A context exists",
 * so the engine stashes the no-op guard's default stream. Nothing else of the driver is provided. */
typedef int CUresult;
typedef int CUdevice;
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
  (void)dev;
  if (flags) *flags = 0;
  if (active) *active = 1;
  return 0; /* CUDA_SUCCESS */
}
