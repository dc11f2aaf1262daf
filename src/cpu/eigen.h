// Eigen for the CPU kernels, included here only.
//
// GCC 12 built for AVX-512 (-march=x86-64-v4, or native on Zen 4) reports
// -Wmaybe-uninitialized on the deliberately undefined register that
// avx512fintrin.h's reduction and permute intrinsics start from (GCC bug
// 105593, fixed in GCC 13). It reaches us through Eigen's vectorised maxCoeff
// and tanh, inlined into our kernels. The warning sits in the system header's
// code, so it is ignored for the headers included below and nowhere else: a
// diagnostic's pragma state is the one at the line it points to, and those
// lines belong to these headers.
#pragma once

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <Eigen/Core>
#pragma GCC diagnostic pop
