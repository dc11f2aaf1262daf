#include <weft/compress.h>
#include <weft/cpu_kernels.h>
#include <weft/param.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace weft {

const char* grad_compression_name(GradCompression c) {
  switch (c) {
    case GradCompression::None: return "none";
    case GradCompression::PowerSgd: return "powersgd";
  }
  return "?";
}

GradCompression parse_grad_compression(const std::string& name) {
  for (GradCompression c : {GradCompression::None, GradCompression::PowerSgd})
    if (name == grad_compression_name(c)) return c;
  throw Error("--grad-compression '{}' must be none or powersgd", name);
}

void orthonormalize_columns(float* p, int64_t n, int64_t r) {
  for (int64_t j = 0; j < r; ++j) {
    float* col = p + j;  // stride r
    auto norm = [&] {
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(col[i * r]) * col[i * r];
      return std::sqrt(s);
    };
    const double before = norm();
    // Twice is enough (Giraud et al.): the second pass removes what rounding
    // left of the earlier columns after the first.
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t k = 0; k < j; ++k) {
        const float* u = p + k;
        double dot = 0;
        for (int64_t i = 0; i < n; ++i) dot += static_cast<double>(col[i * r]) * u[i * r];
        const auto d = static_cast<float>(dot);
        for (int64_t i = 0; i < n; ++i) col[i * r] -= d * u[i * r];
      }
    const double after = norm();
    const bool dependent = !(after > 1e-6 * before) || !std::isfinite(after);
    const auto scale = dependent ? 0.0f : static_cast<float>(1.0 / after);
    for (int64_t i = 0; i < n; ++i) col[i * r] *= scale;
  }
}

bool PowerSgd::compressible(const Shape& shape, int rank) {
  if (shape.rank < 2) return false;
  const int64_t rows = shape.rows(), cols = shape.last();
  return 2 * (rows + cols) * rank < rows * cols;
}

PowerSgd::PowerSgd(const std::vector<Piece>& pieces, int rank, uint64_t seed)
    : rank_(rank), seed_(seed) {
  check(rank >= 1, "--powersgd-rank ({}) must be at least 1", rank);
  int64_t p_total = 0, q_total = 0, e_total = 0;
  std::vector<int64_t> plain_at;
  piece_matrix_.assign(pieces.size(), -1);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& piece = pieces[i];
    if (!compressible(piece.shape, rank)) continue;
    Matrix m;
    m.piece = i;
    m.offset = piece.offset;
    m.rows = piece.shape.rows();
    m.cols = piece.shape.last();
    m.p_at = p_total;
    m.q_at = q_total;
    m.e_at = e_total;
    m.name = piece.name;
    p_total += m.rows * rank;
    q_total += m.cols * rank;
    e_total += m.rows * m.cols;
    piece_matrix_[i] = static_cast<int>(mats_.size());
    mats_.push_back(std::move(m));
  }
  int64_t at = p_total;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (piece_matrix_[i] >= 0) continue;
    const int64_t n = pieces[i].shape.numel();
    plain_.push_back({pieces[i].offset, n, at});
    at += n;
  }
  first_ = Tensor::zeros({at});
  second_ = Tensor::zeros({q_total});
  error_ = Tensor::zeros({e_total});
  reset();
}

void PowerSgd::reset() {
  error_.zero_();
  generation_ = 0;
  // Q (cols, r) from (seed, name): the same on every replica, like the parameters.
  for (const Matrix& m : mats_)
    normal_fill(second_.data<float>() + m.q_at, m.cols * rank_, seed_, m.name + ".powersgd_q",
                1.0f);
}

// A Q column that is all zero (its P column was dependent or the gradient
// was zero) would stay zero for good; it restarts from fresh normals. Q is
// the all-reduced one, the same on every replica, so all of them restart it.
void PowerSgd::seed_column(const Matrix& m, int64_t col, int64_t generation) {
  Tensor fresh = Tensor::empty({m.cols * rank_});
  normal_fill(fresh.data<float>(), fresh.numel(), seed_,
              fmt::format("{}.powersgd_q#{}", m.name, generation), 1.0f);
  float* q = second_.data<float>() + m.q_at;
  for (int64_t i = 0; i < m.cols; ++i) q[i * rank_ + col] = fresh.data<float>()[i * rank_ + col];
}

Tensor PowerSgd::compress(float* grad) {
  const int64_t r = rank_;
  float* p = first_.data<float>();
  float* q = second_.data<float>();
  float* e = error_.data<float>();
  for (const Matrix& m : mats_) {
    float* g = grad + m.offset;
    float* err = e + m.e_at;
    const int64_t n = m.rows * m.cols;
    // M = G + E, kept in err until decompress turns it into the new residual.
    for (int64_t i = 0; i < n; ++i) err[i] = g[i] += err[i];
    for (int64_t c = 0; c < r; ++c) {
      bool zero = true;
      for (int64_t i = 0; i < m.cols && zero; ++i) zero = q[m.q_at + i * r + c] == 0.0f;
      if (zero) seed_column(m, c, generation_);
    }
    // P (rows, r) = M (rows, cols) Q (cols, r)
    cpu::gemm(false, false, m.rows, r, m.cols, 1.0f, g, m.cols, q + m.q_at, r, 0.0f, p + m.p_at,
              r);
  }
  for (const Plain& s : plain_)
    std::memcpy(p + s.at, grad + s.offset, static_cast<size_t>(s.numel) * sizeof(float));
  ++generation_;
  return first_;
}

Tensor PowerSgd::project(const float* grad) {
  const int64_t r = rank_;
  float* p = first_.data<float>();
  float* q = second_.data<float>();
  for (const Matrix& m : mats_) {
    orthonormalize_columns(p + m.p_at, m.rows, r);
    // Q (cols, r) = M^T (cols, rows) P^ (rows, r)
    cpu::gemm(true, false, m.cols, r, m.rows, 1.0f, grad + m.offset, m.cols, p + m.p_at, r, 0.0f,
              q + m.q_at, r);
  }
  return second_;
}

void PowerSgd::decompress(float* grad, int replicas) {
  const int64_t r = rank_;
  const float* p = first_.data<float>();
  const float* q = second_.data<float>();
  float* e = error_.data<float>();
  const float share = 1.0f / static_cast<float>(replicas);
  for (const Matrix& m : mats_) {
    float* g = grad + m.offset;
    // U (rows, cols) = P^ (rows, r) Q^T (r, cols)
    cpu::gemm(false, true, m.rows, m.cols, r, 1.0f, p + m.p_at, r, q + m.q_at, r, 0.0f, g, m.cols);
    float* err = e + m.e_at;
    const int64_t n = m.rows * m.cols;
    for (int64_t i = 0; i < n; ++i) err[i] -= share * g[i];
  }
  for (const Plain& s : plain_)
    std::memcpy(grad + s.offset, p + s.at, static_cast<size_t>(s.numel) * sizeof(float));
}

Tensor PowerSgd::residual(size_t i) const {
  check(i < piece_matrix_.size() && piece_matrix_[i] >= 0,
        "PowerSgd::residual: piece {} of {} is not a compressed matrix", i, piece_matrix_.size());
  const Matrix& m = mats_[static_cast<size_t>(piece_matrix_[i])];
  return Tensor(error_.data<float>() + m.e_at, {m.rows, m.cols}, DType::F32);
}

}  // namespace weft
