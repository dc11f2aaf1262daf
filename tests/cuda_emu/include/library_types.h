// GPU emulator (tests/cuda_emu): the data-type names of CUDA's library_types.h
// that weft uses, with CUDA's values. Written for weft; not NVIDIA's header.
#pragma once

typedef enum cudaDataType_t {
  CUDA_R_16F = 2,
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16BF = 14,
  CUDA_R_32I = 10,
} cudaDataType_t;
typedef cudaDataType_t cudaDataType;
