// LayerNorm (scalar and 16-byte kernels, fused with the residual add), RMSNorm, and
// the column sums of their weight and bias gradients.
// Device code and its launchers (src/cuda/launch.h); the shared helpers are
// in common.cuh.
#include "src/cuda/kernels/common.cuh"

namespace weft::cuda::launch {

namespace {

// ---------------------------------------------------------------- LayerNorm

// One warp per row. x, y (N, C) of activations X, Y (float or bf16); mean, rstd (N)
template <class X, class Y>
__global__ void layernorm_forward_kernel(const X* x, const float* w, const float* b, Y* y,
                                         float* mean, float* rstd, int64_t n, int64_t c,
                                         float eps) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const X* xr = x + row * c;
  float s = 0;
  for (int64_t j = lane; j < c; j += kWarp) s += load(xr, j);
  const float m = warp_sum(s) / static_cast<float>(c);
  float var = 0;
  for (int64_t j = lane; j < c; j += kWarp) {
    const float d = load(xr, j) - m;
    var += d * d;
  }
  var = warp_sum(var) / static_cast<float>(c);
  const float r = 1.0f / sqrtf(var + eps);
  Y* yr = y + row * c;
  for (int64_t j = lane; j < c; j += kWarp) store(yr, j, (load(xr, j) - m) * r * w[j] + b[j]);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// One warp per row: dx += (dy w - mean(dy w) - xhat mean(dy w xhat)) rstd;
// x of activations X, dy and dx of their gradients' type G (float, or bf16
// with bf16 activations: dx read widened, the sum rounded once).
template <class X, class G>
__global__ void layernorm_backward_input_kernel(const G* dy, const X* x, const float* w,
                                                const float* mean, const float* rstd, G* dx,
                                                int64_t n, int64_t c) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const G* dyr = dy + row * c;
  const X* xr = x + row * c;
  const float m = mean[row], r = rstd[row];
  float dnorm_mean = 0, dnorm_xhat_mean = 0;
  for (int64_t j = lane; j < c; j += kWarp) {
    const float dnorm = load(dyr, j) * w[j];
    dnorm_mean += dnorm;
    dnorm_xhat_mean += dnorm * (load(xr, j) - m) * r;
  }
  dnorm_mean = warp_sum(dnorm_mean) / static_cast<float>(c);
  dnorm_xhat_mean = warp_sum(dnorm_xhat_mean) / static_cast<float>(c);
  G* dxr = dx + row * c;
  for (int64_t j = lane; j < c; j += kWarp) {
    const float xhat = (load(xr, j) - m) * r;
    store(dxr, j, load(dxr, j) + (load(dyr, j) * w[j] - dnorm_mean - xhat * dnorm_xhat_mean) * r);
  }
}

// ---------------------------------------------------------------- RMSNorm, SwiGLU, RoPE

// The Llama layers' kernels are templated on the activations' element type
// T (float, or bf16 under --bf16: x, y, dy and dx; the weight and rstd stay
// fp32), as LayerNorm's are: the bf16 instance loads widened, computes as
// the fp32 instance does, and rounds each store once.

// One warp per row. x, y (N, C); rstd (N)
template <class T>
__global__ void rmsnorm_forward_kernel(const T* x, const float* w, T* y, float* rstd, int64_t n,
                                       int64_t c, float eps) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const T* xr = x + row * c;
  float ss = 0;
  for (int64_t j = lane; j < c; j += kWarp) {
    const float xj = load(xr, j);
    ss += xj * xj;
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(c) + eps);
  T* yr = y + row * c;
  for (int64_t j = lane; j < c; j += kWarp) store(yr, j, load(xr, j) * r * w[j]);
  if (lane == 0) rstd[row] = r;
}

// One warp per row: dx += r w dy - x r^3 / C * sum_j w_j dy_j x_j
template <class T>
__global__ void rmsnorm_backward_input_kernel(const T* dy, const T* x, const float* w,
                                              const float* rstd, T* dx, int64_t n, int64_t c) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const T* dyr = dy + row * c;
  const T* xr = x + row * c;
  const float r = rstd[row];
  float dot = 0;
  for (int64_t j = lane; j < c; j += kWarp) dot += w[j] * load(dyr, j) * load(xr, j);
  const float k = r * r * r * warp_sum(dot) / static_cast<float>(c);
  T* dxr = dx + row * c;
  for (int64_t j = lane; j < c; j += kWarp)
    store(dxr, j, load(dxr, j) + (r * w[j] * load(dyr, j) - load(xr, j) * k));
}

// Column sums over rows in two deterministic passes. Pass 1: block (32, 8)
// owns 32 columns and row slice blockIdx.y of `slices`; it writes one partial
// per column. Pass 2 adds the slices' partials in order into the output.
// With `norm`, it also sums dy * xhat (the LayerNorm weight gradient), x of
// activations X (float or bf16).
constexpr int kColTile = 32, kRowLanes = 8;

template <bool norm, class X, class G>
__global__ void column_partials_kernel(const G* dy, const X* x, const float* mean,
                                       const float* rstd, float* part_dw, float* part_db,
                                       int64_t n, int64_t c) {
  __shared__ float sw[kRowLanes][kColTile], sb[kRowLanes][kColTile];
  const int64_t col = int64_t{blockIdx.x} * kColTile + threadIdx.x;
  const int64_t slices = gridDim.y;
  float acc_w = 0, acc_b = 0;
  if (col < c) {
    for (int64_t i = int64_t{blockIdx.y} * kRowLanes + threadIdx.y; i < n;
         i += slices * kRowLanes) {
      const float g = load(dy, i * c + col);
      acc_b += g;
      if constexpr (norm) acc_w += g * (load(x, i * c + col) - mean[i]) * rstd[i];
    }
  }
  sw[threadIdx.y][threadIdx.x] = acc_w;
  sb[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    float tw = 0, tb = 0;
    for (int k = 0; k < kRowLanes; ++k) {
      tw += sw[k][threadIdx.x];
      tb += sb[k][threadIdx.x];
    }
    if constexpr (norm) part_dw[int64_t{blockIdx.y} * c + col] = tw;
    part_db[int64_t{blockIdx.y} * c + col] = tb;
  }
}

// One thread per column adds its up to 128 partials in order. They were just
// written, so they come from L2, but a few hundred threads (C 768: 3 blocks)
// waiting on one load after another would take a round trip per few slices:
// the loop is unrolled 16 deep so that 16 loads are in flight at once (the
// adds stay in order).
__global__ void column_finish_kernel(const float* part, float* out, int64_t slices, int64_t c) {
  for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < c;
       j += int64_t{gridDim.x} * blockDim.x) {
    float s = 0;
#pragma unroll 16
    for (int64_t k = 0; k < slices; ++k) s += part[k * c + j];
    out[j] += s;
  }
}

// ---------------------------------------------------------------- LayerNorm, 16-byte accesses

// The LayerNorm kernels of rows whose width is a multiple of 8, every array
// 16-byte aligned: one warp per row as above, but each lane owns whole groups
// of 8 elements (groups lane, lane + 32, ...) and moves each in 16-byte
// accesses (one uint4 of bf16, or two float4 of fp32). The lane keeps its
// groups in registers, so the forward reads x once (not three times) and the
// backward reads dy and x once each. kGroups is the most groups a lane owns;
// the launchers pick it from C alone. A lane sums its own elements in a fixed
// order (group by group, 8 in a row) before the warp's tree, and the fp32 and
// bf16 instances do the same arithmetic on the widened values, so a bf16
// output is still the fp32 instance's output rounded once. The order differs
// from the scalar kernels' (a lane's elements are no longer 32 apart), within
// fp32 rounding.

// The most groups of 8 a lane keeps in registers: rows of up to 32 * 8 * 8 =
// 2048 elements take the vector kernels, wider ones the scalar kernels.
constexpr int kMaxLaneGroups = 8;

// v as an array of T holds it: as it is, or rounded to bf16 (to nearest even).
__device__ __forceinline__ float as_stored(float v, const float*) { return v; }
__device__ __forceinline__ float as_stored(float v, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// kSum: the row normalised is the sum x + a of two rows, written to `sum`
// too (a residual add fused with the LayerNorm that reads it). Each element
// of the sum is rounded to X as the add's kernels round it and normalised
// as stored, so sum and y are the bits of the add followed by this kernel
// on its output, and x is read once more than it would be alone, not the
// sum written, then read back.
template <int kGroups, bool kSum, class X, class Y>
__global__ void layernorm_forward_vec_kernel(const X* x, const X* a, X* sum, const float* w,
                                             const float* b, Y* y, float* mean, float* rstd,
                                             int64_t n, int64_t c, float eps) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;  // the whole warp: every lane below reaches the shuffles
  const int64_t groups = c / kVec, first = row * groups;  // the row's first group
  float v[kGroups][kVec];
  float s = 0;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t g = lane + int64_t{k} * kWarp;
    if (g < groups) {
      load8(x, first + g, v[k]);
      if constexpr (kSum) {
        float u[kVec];
        load8(a, first + g, u);
        for (int e = 0; e < kVec; ++e) v[k][e] = v[k][e] + u[e];
        store8(sum, first + g, v[k]);
        for (int e = 0; e < kVec; ++e) v[k][e] = as_stored(v[k][e], sum);
      }
      for (int e = 0; e < kVec; ++e) s += v[k][e];
    }
  }
  const float m = warp_sum(s) / static_cast<float>(c);
  float var = 0;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    if (lane + int64_t{k} * kWarp < groups) {
      for (int e = 0; e < kVec; ++e) {
        const float d = v[k][e] - m;
        var += d * d;
      }
    }
  }
  var = warp_sum(var) / static_cast<float>(c);
  const float r = 1.0f / sqrtf(var + eps);
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t g = lane + int64_t{k} * kWarp;
    if (g < groups) {
      float wg[kVec], bg[kVec];
      load8(w, g, wg);
      load8(b, g, bg);
      for (int e = 0; e < kVec; ++e) v[k][e] = (v[k][e] - m) * r * wg[e] + bg[e];
      store8(y, first + g, v[k]);
    }
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dx += (dy w - mean(dy w) - xhat mean(dy w xhat)) rstd, as the scalar kernel;
// a lane keeps dy w and xhat of its groups, then reads and writes dx once.
// kCopy: the new dx is written to `copy` as well (the gradient of both
// inputs of a residual add fused with this LayerNorm).
template <int kGroups, bool kCopy, class X, class G>
__global__ void layernorm_backward_input_vec_kernel(const G* dy, const X* x, const float* w,
                                                    const float* mean, const float* rstd, G* dx,
                                                    G* copy, int64_t n, int64_t c) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;  // the whole warp
  const int64_t groups = c / kVec, first = row * groups;
  const float m = mean[row], r = rstd[row];
  float dnorm[kGroups][kVec], xhat[kGroups][kVec];
  float dnorm_mean = 0, dnorm_xhat_mean = 0;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t g = lane + int64_t{k} * kWarp;
    if (g < groups) {
      float wg[kVec];
      load8(dy, first + g, dnorm[k]);
      load8(x, first + g, xhat[k]);
      load8(w, g, wg);
      for (int e = 0; e < kVec; ++e) {
        dnorm[k][e] = dnorm[k][e] * wg[e];
        xhat[k][e] = (xhat[k][e] - m) * r;
        dnorm_mean += dnorm[k][e];
        dnorm_xhat_mean += dnorm[k][e] * xhat[k][e];
      }
    }
  }
  dnorm_mean = warp_sum(dnorm_mean) / static_cast<float>(c);
  dnorm_xhat_mean = warp_sum(dnorm_xhat_mean) / static_cast<float>(c);
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t g = lane + int64_t{k} * kWarp;
    if (g < groups) {
      float d[kVec];
      load8(dx, first + g, d);
      for (int e = 0; e < kVec; ++e)
        d[e] = d[e] + (dnorm[k][e] - dnorm_mean - xhat[k][e] * dnorm_xhat_mean) * r;
      store8(dx, first + g, d);
      if constexpr (kCopy) store8(copy, first + g, d);
    }
  }
}

// ---------------------------------------------------------------- column sums, 16-byte accesses

// column_partials_kernel for rows whose width is a multiple of 8, dy (and x)
// 16-byte aligned: block (32, 8) owns 256 columns, each thread 8 adjacent
// ones read in one 16-byte access (a warp reads 512 bytes of a bf16 row, not
// 64). Every column is summed exactly as column_partials_kernel sums it: the
// same rows for each threadIdx.y in the same order, then the 8 row lanes in
// order, so the partials do not depend on which kernel ran.
constexpr int kColVecTile = kWarp * kVec;

template <bool norm, class X, class G>
__global__ void column_partials_vec_kernel(const G* dy, const X* x, const float* mean,
                                           const float* rstd, float* part_dw, float* part_db,
                                           int64_t n, int64_t c) {
  __shared__ float sw[kRowLanes][kColVecTile], sb[kRowLanes][kColVecTile];
  const int64_t base = int64_t{blockIdx.x} * kColVecTile;  // the block's first column
  const int64_t col = base + threadIdx.x * kVec;            // the thread's first column
  const int64_t slices = gridDim.y, groups = c / kVec;
  float acc_w[kVec] = {}, acc_b[kVec] = {};
  if (col < c) {  // then so are col + 1 ... col + 7: c is a multiple of 8
#pragma unroll 4
    for (int64_t i = int64_t{blockIdx.y} * kRowLanes + threadIdx.y; i < n;
         i += slices * kRowLanes) {
      float g[kVec];
      load8(dy, i * groups + col / kVec, g);
      if constexpr (norm) {
        float xs[kVec];
        load8(x, i * groups + col / kVec, xs);
        const float m = mean[i], r = rstd[i];
        for (int e = 0; e < kVec; ++e) acc_w[e] += g[e] * (xs[e] - m) * r;
      }
      for (int e = 0; e < kVec; ++e) acc_b[e] += g[e];
    }
  }
  for (int e = 0; e < kVec; ++e) {
    sw[threadIdx.y][threadIdx.x * kVec + e] = acc_w[e];
    sb[threadIdx.y][threadIdx.x * kVec + e] = acc_b[e];
  }
  __syncthreads();
  // Each of the block's 256 threads finishes one column.
  const int t = threadIdx.y * kWarp + threadIdx.x;
  if (base + t < c) {
    float tw = 0, tb = 0;
    for (int k = 0; k < kRowLanes; ++k) {
      tw += sw[k][t];
      tb += sb[k][t];
    }
    if constexpr (norm) part_dw[int64_t{blockIdx.y} * c + base + t] = tw;
    part_db[int64_t{blockIdx.y} * c + base + t] = tb;
  }
}


// Groups of 8 a lane owns in the LayerNorm vector kernels, for rows of c: 0
// (the scalar kernels) unless c is a multiple of 8 and at most 32 * 8 *
// kMaxLaneGroups, and every array is 16-byte aligned (then so is every row:
// c / 8 whole 16-byte or 32-byte groups after the first). Rounded up to a
// count that is instantiated. It depends on c and the arrays' addresses only,
// not on their element types, so an fp32 and a bf16 call on arrays of one
// shape take the same kernel shape.
int layernorm_lane_groups(int64_t c, std::initializer_list<const void*> ps) {
  if (c <= 0 || c % kVec != 0 || !aligned16(ps)) return 0;
  const int64_t per_lane = (c / kVec + kWarp - 1) / kWarp;
  if (per_lane > kMaxLaneGroups) return 0;
  return per_lane <= 4 ? static_cast<int>(per_lane) : per_lane <= 6 ? 6 : 8;
}

// f(std::integral_constant<int, k>{}) for a count k of layernorm_lane_groups.
template <class F>
void with_lane_groups(int k, F f) {
  switch (k) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: f(std::integral_constant<int, kMaxLaneGroups>{}); break;
  }
}

// The LayerNorm launchers for either type of activations X, Y and gradients G.
template <class X, class Y>
void layernorm_forward_of(cudaStream_t s, const X* x, const float* w, const float* b, Y* y,
                          float* mean, float* rstd, int64_t n, int64_t c, float eps) {
  const int k = layernorm_lane_groups(c, {x, w, b, y});
  if (k == 0) {
    layernorm_forward_kernel<<<row_blocks(n), kThreads, 0, s>>>(x, w, b, y, mean, rstd, n, c, eps);
    return;
  }
  with_lane_groups(k, [&](auto groups) {
    layernorm_forward_vec_kernel<decltype(groups)::value, false>
        <<<row_blocks(n), kThreads, 0, s>>>(x, static_cast<const X*>(nullptr),
                                            static_cast<X*>(nullptr), w, b, y, mean, rstd, n, c,
                                            eps);
  });
}

// sum = x + a and y = LayerNorm(sum) in one kernel where the vector kernel
// takes rows of c; false, launching nothing, where it does not.
template <class X>
bool add_layernorm_forward_of(cudaStream_t s, const X* x, const X* a, X* sum, const float* w,
                              const float* b, X* y, float* mean, float* rstd, int64_t n,
                              int64_t c, float eps) {
  const int k = layernorm_lane_groups(c, {x, a, sum, w, b, y});
  if (k == 0) return false;
  with_lane_groups(k, [&](auto groups) {
    layernorm_forward_vec_kernel<decltype(groups)::value, true>
        <<<row_blocks(n), kThreads, 0, s>>>(x, a, sum, w, b, y, mean, rstd, n, c, eps);
  });
  return true;
}

template <class X, class G>
void layernorm_backward_input_of(cudaStream_t s, const G* dy, const X* x, const float* w,
                                 const float* mean, const float* rstd, G* dx, int64_t n,
                                 int64_t c) {
  const int k = layernorm_lane_groups(c, {dy, x, w, dx});
  if (k == 0) {
    layernorm_backward_input_kernel<<<row_blocks(n), kThreads, 0, s>>>(dy, x, w, mean, rstd, dx,
                                                                       n, c);
    return;
  }
  with_lane_groups(k, [&](auto groups) {
    layernorm_backward_input_vec_kernel<decltype(groups)::value, false>
        <<<row_blocks(n), kThreads, 0, s>>>(dy, x, w, mean, rstd, dx, static_cast<G*>(nullptr),
                                            n, c);
  });
}

// dx += d/dx and copy = dx in one kernel where the vector kernel takes rows
// of c; false, launching nothing, where it does not.
template <class X, class G>
bool layernorm_backward_input_copy_of(cudaStream_t s, const G* dy, const X* x, const float* w,
                                      const float* mean, const float* rstd, G* dx, G* copy,
                                      int64_t n, int64_t c) {
  const int k = layernorm_lane_groups(c, {dy, x, w, dx, copy});
  if (k == 0) return false;
  with_lane_groups(k, [&](auto groups) {
    layernorm_backward_input_vec_kernel<decltype(groups)::value, true>
        <<<row_blocks(n), kThreads, 0, s>>>(dy, x, w, mean, rstd, dx, copy, n, c);
  });
  return true;
}

// column_sums for either type of x and dy. The 16-byte kernel when c is a
// multiple of 8 and dy (and x, when read) are 16-byte aligned; it gives the
// same partials as the scalar one.
template <class X, class G>
void column_sums_of(cudaStream_t s, const G* dy, const X* x, const float* mean,
                    const float* rstd, float* dw, float* db, float* partials, int64_t n,
                    int64_t c) {
  const int64_t slices = column_slices(n);
  const bool norm = dw != nullptr;
  const bool vec = c % kVec == 0 && (norm ? aligned16({dy, x}) : aligned16({dy}));
  const int64_t tile = vec ? kColVecTile : kColTile;
  const dim3 grid(static_cast<unsigned>((c + tile - 1) / tile), static_cast<unsigned>(slices));
  const dim3 block(kWarp, kRowLanes);
  static_assert(kColTile == kWarp, "a block's threadIdx.x spans its tile's columns");
  float* part_db = partials;
  float* part_dw = norm ? partials + slices * c : nullptr;
  if (norm && vec)
    column_partials_vec_kernel<true, X, G><<<grid, block, 0, s>>>(dy, x, mean, rstd, part_dw,
                                                                  part_db, n, c);
  else if (norm)
    column_partials_kernel<true, X, G><<<grid, block, 0, s>>>(dy, x, mean, rstd, part_dw, part_db,
                                                              n, c);
  else if (vec)
    column_partials_vec_kernel<false, X, G><<<grid, block, 0, s>>>(dy, x, mean, rstd, nullptr,
                                                                   part_db, n, c);
  else
    column_partials_kernel<false, X, G><<<grid, block, 0, s>>>(dy, x, mean, rstd, nullptr, part_db,
                                                               n, c);
  if (norm) column_finish_kernel<<<blocks_for(c), kThreads, 0, s>>>(part_dw, dw, slices, c);
  column_finish_kernel<<<blocks_for(c), kThreads, 0, s>>>(part_db, db, slices, c);
}

}  // namespace

void layernorm_forward(cudaStream_t s, const float* x, const float* w, const float* b, float* y,
                       float* mean, float* rstd, int64_t n, int64_t c, float eps) {
  layernorm_forward_of(s, x, w, b, y, mean, rstd, n, c, eps);
}

void layernorm_forward(cudaStream_t s, const uint16_t* x, const float* w, const float* b,
                       uint16_t* y, float* mean, float* rstd, int64_t n, int64_t c, float eps) {
  layernorm_forward_of(s, bf(x), w, b, bf(y), mean, rstd, n, c, eps);
}

void layernorm_backward_input(cudaStream_t s, const float* dy, const float* x, const float* w,
                              const float* mean, const float* rstd, float* dx, int64_t n,
                              int64_t c) {
  layernorm_backward_input_of(s, dy, x, w, mean, rstd, dx, n, c);
}

void layernorm_backward_input(cudaStream_t s, const uint16_t* dy, const uint16_t* x,
                              const float* w, const float* mean, const float* rstd, uint16_t* dx,
                              int64_t n, int64_t c) {
  layernorm_backward_input_of(s, bf(dy), bf(x), w, mean, rstd, bf(dx), n, c);
}

bool add_layernorm_forward(cudaStream_t s, const float* x, const float* a, float* sum,
                           const float* w, const float* b, float* y, float* mean, float* rstd,
                           int64_t n, int64_t c, float eps) {
  return add_layernorm_forward_of(s, x, a, sum, w, b, y, mean, rstd, n, c, eps);
}

bool add_layernorm_forward(cudaStream_t s, const uint16_t* x, const uint16_t* a, uint16_t* sum,
                           const float* w, const float* b, uint16_t* y, float* mean, float* rstd,
                           int64_t n, int64_t c, float eps) {
  return add_layernorm_forward_of(s, bf(x), bf(a), bf(sum), w, b, bf(y), mean, rstd, n, c, eps);
}

bool layernorm_backward_input_copy(cudaStream_t s, const float* dy, const float* x,
                                   const float* w, const float* mean, const float* rstd,
                                   float* dx, float* copy, int64_t n, int64_t c) {
  return layernorm_backward_input_copy_of(s, dy, x, w, mean, rstd, dx, copy, n, c);
}

bool layernorm_backward_input_copy(cudaStream_t s, const uint16_t* dy, const uint16_t* x,
                                   const float* w, const float* mean, const float* rstd,
                                   uint16_t* dx, uint16_t* copy, int64_t n, int64_t c) {
  return layernorm_backward_input_copy_of(s, bf(dy), bf(x), w, mean, rstd, bf(dx), bf(copy), n,
                                          c);
}

// About 16 rows per thread of the first pass, at most 128 slices.
int64_t column_slices(int64_t n) {
  return std::clamp<int64_t>((n + kRowLanes * 16 - 1) / (kRowLanes * 16), 1, 128);
}

void column_sums(cudaStream_t s, const float* dy, const float* x, const float* mean,
                 const float* rstd, float* dw, float* db, float* partials, int64_t n, int64_t c) {
  column_sums_of(s, dy, x, mean, rstd, dw, db, partials, n, c);
}

void column_sums(cudaStream_t s, const uint16_t* dy, const uint16_t* x, const float* mean,
                 const float* rstd, float* dw, float* db, float* partials, int64_t n, int64_t c) {
  column_sums_of(s, bf(dy), bf(x), mean, rstd, dw, db, partials, n, c);
}

template <class T>
void rmsnorm_forward_of(cudaStream_t s, const T* x, const float* w, T* y, float* rstd, int64_t n,
                        int64_t c, float eps) {
  rmsnorm_forward_kernel<<<row_blocks(n), kThreads, 0, s>>>(x, w, y, rstd, n, c, eps);
}

template <class T>
void rmsnorm_backward_input_of(cudaStream_t s, const T* dy, const T* x, const float* w,
                               const float* rstd, T* dx, int64_t n, int64_t c) {
  rmsnorm_backward_input_kernel<<<row_blocks(n), kThreads, 0, s>>>(dy, x, w, rstd, dx, n, c);
}


void rmsnorm_forward(cudaStream_t s, const float* x, const float* w, float* y, float* rstd,
                     int64_t n, int64_t c, float eps) {
  rmsnorm_forward_of(s, x, w, y, rstd, n, c, eps);
}

void rmsnorm_forward(cudaStream_t s, const uint16_t* x, const float* w, uint16_t* y, float* rstd,
                     int64_t n, int64_t c, float eps) {
  rmsnorm_forward_of(s, bf(x), w, bf(y), rstd, n, c, eps);
}

void rmsnorm_backward_input(cudaStream_t s, const float* dy, const float* x, const float* w,
                            const float* rstd, float* dx, int64_t n, int64_t c) {
  rmsnorm_backward_input_of(s, dy, x, w, rstd, dx, n, c);
}

void rmsnorm_backward_input(cudaStream_t s, const uint16_t* dy, const uint16_t* x, const float* w,
                            const float* rstd, uint16_t* dx, int64_t n, int64_t c) {
  rmsnorm_backward_input_of(s, bf(dy), bf(x), w, rstd, bf(dx), n, c);
}


}  // namespace weft::cuda::launch
