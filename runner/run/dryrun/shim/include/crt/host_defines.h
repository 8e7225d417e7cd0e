/* Stand-in for CUDA's crt/host_defines.h, which the runtime wheel's driver_types.h includes but the wheel does not
 * ship: the qualifiers it defines, as a host-only C compiler needs them. */
#pragma once
#define __host__
#define __device__
#define __device_builtin__
#define __cudart_builtin__
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define CUDARTAPI
#define __location__(a)
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __constant__
#define __no_return__ __attribute__((noreturn))
