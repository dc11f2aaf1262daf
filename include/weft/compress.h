// weft/compress.h — gradient compression for the data-parallel reduction.
//
// PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): each gradient
// matrix is sent as two thin factors of rank r, found by one step of power
// iteration that starts from the previous step's factor (warm start), and
// what the approximation drops is added to the next step's gradient (error
// feedback), so nothing is lost for good, only delayed. For one replica's
// matrix G (n x m) and the dp replicas' sum over w:
//
//   M_w = G_w + E_w             the gradient plus last step's residual
//   P   = sum_w M_w Q           (n x r), all-reduced; Q (m x r) is the warm start
//   P^  = P with orthonormal columns (Gram-Schmidt, the same on every replica)
//   Q   = sum_w M_w^T P^        (m x r), all-reduced; kept as the next warm start
//   U   = P^ Q^T = P^ P^^T sum_w M_w      the update every replica applies
//   E_w = M_w - U / dp          kept by replica w; sum_w E_w = sum_w M_w - U
//
// A replica sends (n + m) r numbers instead of n m. The sum of the updates
// applied so far plus the replicas' residuals is exactly the sum of the true
// gradients so far. As PyTorch's PowerSGD hook does, only matrices are
// compressed, and only where the factors are less than half the matrix
// ((n + m) r < n m / 2, PyTorch's default); vectors (biases, LayerNorm) and small matrices
// travel uncompressed in the first all-reduce.
//
//   PowerSgd c(pieces, /*rank=*/4);
//   comm.all_reduce(c.compress(grad), ReduceOp::Sum);
//   comm.all_reduce(c.project(grad), ReduceOp::Sum);
//   c.decompress(grad, comm.size());   // grad now holds U (and the summed vectors)
#pragma once

#include <weft/tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weft {

// --grad-compression
enum class GradCompression : uint8_t { None, PowerSgd };
const char* grad_compression_name(GradCompression c);  // "none", "powersgd"
// Throws Error naming the value and the choices.
GradCompression parse_grad_compression(const std::string& name);

// Orthonormalises the r columns of the row-major (n, r) matrix p in place by
// modified Gram-Schmidt (twice, in double precision). A column that is zero,
// or (to ~1e-6 of its length) in the span of the columns before it, becomes
// zero: it carries nothing rather than noise.
void orthonormalize_columns(float* p, int64_t n, int64_t r);

class PowerSgd {
 public:
  // One tensor of the flat gradient buffer: elements [offset, offset + numel).
  struct Piece {
    std::string name;  // seeds the warm start: every replica starts alike
    int64_t offset = 0;
    Shape shape;
  };
  // Whether a tensor of this shape is compressed at this rank: 2 or more
  // dimensions, seen as (rows, last), with (rows + last) * rank less than
  // half of rows * last.
  static bool compressible(const Shape& shape, int rank);

  // `pieces` of a flat fp32 buffer, compressed at rank `rank` (>= 1).
  PowerSgd(const std::vector<Piece>& pieces, int rank, uint64_t seed = 0);

  // Adds the residuals to the matrices of `grad` and returns what to
  // all-reduce (sum): each matrix's P = M Q, then the uncompressed pieces.
  Tensor compress(float* grad);
  // After that all-reduce: orthonormalises each P and returns what to
  // all-reduce next (sum): each matrix's Q = M^T P^. `grad` is as compress left it.
  Tensor project(const float* grad);
  // After the second all-reduce: writes each matrix's update P^ Q^T and the
  // reduced uncompressed pieces into `grad`, and keeps each residual
  // M - update / replicas for the next step.
  void decompress(float* grad, int replicas);

  int rank() const { return rank_; }
  int64_t matrices() const { return static_cast<int64_t>(mats_.size()); }
  // Elements all-reduced per step: both rounds together.
  int64_t sent_elements() const { return first_.numel() + second_.numel(); }
  // This replica's residual of piece `i` (a matrix: compressible(shape) holds).
  Tensor residual(size_t i) const;
  // Every residual back to zero and every warm start back to its seed.
  void reset();

 private:
  struct Matrix {
    size_t piece = 0;
    int64_t offset = 0, rows = 0, cols = 0;
    int64_t p_at = 0, q_at = 0, e_at = 0;  // offsets in first_, second_, error_
    std::string name;
  };
  struct Plain {
    int64_t offset = 0, numel = 0, at = 0;  // in the gradient, in first_
  };
  void seed_column(const Matrix& m, int64_t col, int64_t generation);

  int rank_;
  uint64_t seed_;
  std::vector<Matrix> mats_;
  std::vector<Plain> plain_;
  std::vector<int> piece_matrix_;  // piece -> index in mats_, or -1
  Tensor first_;   // [P of every matrix | uncompressed pieces]
  Tensor second_;  // [Q of every matrix]: the warm start between steps
  Tensor error_;   // [E of every matrix]
  int64_t generation_ = 0;  // steps so far: reseeds a column that died
};

}  // namespace weft
