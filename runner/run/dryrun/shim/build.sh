#!/usr/bin/env bash
# Build the CUDA rehearsal's shim into VENV/fake_cuda/ (scripts/setup.sh --cuda-rehearsal calls it): the LD_PRELOAD
# library and the libcuda.so.1 stand-in, from the C sources beside this script, with the CUDA headers of the venv's
# nvidia runtime wheel. runner.run.dryrun.fake_cuda finds them there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=$(cd "${1:?usage: build.sh VENV}" && pwd)
inc=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu*/include 2>/dev/null | head -1)
[ -n "$inc" ] && [ -f "$inc/driver_types.h" ] || { echo "build.sh: no CUDA runtime headers (driver_types.h) under $venv" >&2; exit 1; }
command -v gcc >/dev/null || { echo "build.sh: gcc is needed to build the CUDA rehearsal's shim (apt-get install gcc)" >&2; exit 1; }
out=$venv/fake_cuda
mkdir -p "$out/libcuda"
gcc -O2 -shared -fPIC -D__CUDA_INCLUDE_COMPILER_INTERNAL_HEADERS__ -I "$here/include" -I "$inc" -o "$out/libfake_c10_cuda.so" "$here/fake_c10_cuda.c"
gcc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$out/libcuda/libcuda.so.1" "$here/libcuda_stub.c"
echo "built $out/libfake_c10_cuda.so and $out/libcuda/libcuda.so.1"
