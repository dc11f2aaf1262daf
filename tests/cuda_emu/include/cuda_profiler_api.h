// GPU emulator (tests/cuda_emu): profiler ranges do nothing.
#pragma once

#include <cuda_runtime.h>

cudaError_t cudaProfilerStart();
cudaError_t cudaProfilerStop();
