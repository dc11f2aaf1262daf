#include <weft/param.h>

#include <algorithm>
#include <cmath>

namespace weft {

Param* ParamStore::create(const std::string& name, Shape shape, Init init) {
  check(find(name) == nullptr, "parameter '{}' is defined twice", name);
  Param& p = params_.emplace_back();
  p.name = name;
  p.value = Tensor::zeros(shape);
  p.grad = Tensor::zeros(shape);
  p.init = init;
  p.shard.full = shape;
  return &p;
}

std::vector<int64_t> equal_blocks(int64_t extent, int count) {
  check(count > 0 && extent % count == 0, "a width of {} is not {} equal blocks", extent, count);
  return std::vector<int64_t>(static_cast<size_t>(count), extent / count);
}

std::vector<int64_t> Shard::block_widths() const {
  if (dim < 0) return {};
  if (blocks.empty()) return {full[dim]};
  return blocks;
}

Shape Shard::local() const {
  Shape s = full;
  if (dim >= 0) {
    check(dim < full.rank, "shard dimension {} is out of range for shape {}", dim, full.str());
    int64_t sum = 0;
    for (int64_t w : block_widths()) {
      check(w > 0 && w % parts == 0,
            "dimension {} of {}: a block of width {} must be divisible by {} parts", dim,
            full.str(), w, parts);
      sum += w;
    }
    check(sum == full[dim], "dimension {} of {} ({}) is not its blocks' total width {}", dim,
          full.str(), full[dim], sum);
    s[dim] = full[dim] / parts;
  }
  return s;
}

Param* ParamStore::create_shard(const std::string& name, Shard shard, Init init) {
  Param* p = create(name, shard.local(), init);
  p->shard = shard;
  return p;
}

Param* ParamStore::find(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

const Param* ParamStore::find(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

std::vector<Param*> ParamStore::all() {
  std::vector<Param*> v;
  for (auto& p : params_) v.push_back(&p);
  return v;
}

namespace {

// splitmix64: a counter-based generator, so element i needs no state but i.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

double unit(uint64_t bits) {  // (0, 1]
  return (static_cast<double>(bits >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

}  // namespace

void normal_fill(float* out, int64_t n, uint64_t seed, const std::string& name, float std) {
  uint64_t key = mix(seed ^ mix(fnv1a(name)));
  // Box-Muller on pairs: element 2k and 2k+1 come from counter k.
  for (int64_t i = 0; i < n; ++i) {
    uint64_t k = static_cast<uint64_t>(i / 2);
    double u1 = unit(mix(key ^ (2 * k)));
    double u2 = unit(mix(key ^ (2 * k + 1) ^ 0x5bd1e995ULL));
    double r = std::sqrt(-2.0 * std::log(u1));
    double a = 2.0 * M_PI * u2;
    double z = (i % 2 == 0) ? r * std::cos(a) : r * std::sin(a);
    out[i] = static_cast<float>(z * std);
  }
}

namespace {

// Visits the contiguous runs that make up a rank's part: the full tensor is
// (outer, dim extent, inner); the part keeps, of each outer row and each
// block, the run of (width / parts) x inner elements at piece `index`.
template <typename F>
void for_each_run(const Shard& s, F&& f) {
  if (s.dim < 0) {
    f(int64_t{0}, int64_t{0}, s.full.numel());
    return;
  }
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < s.dim; ++i) outer *= s.full[i];
  for (int i = s.dim + 1; i < s.full.rank; ++i) inner *= s.full[i];
  const int64_t extent = s.full[s.dim];
  const std::vector<int64_t> widths = s.block_widths();
  int64_t part_off = 0;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t start = 0;
    for (int64_t w : widths) {
      const int64_t piece = w / s.parts;
      f((o * extent + start + s.index * piece) * inner, part_off, piece * inner);
      part_off += piece * inner;
      start += w;
    }
  }
}

void check_shard_pair(const Tensor& full, const Shard& s, const Tensor& part) {
  check_shape(full, s.full, "full tensor of a shard");
  check_shape(part, s.local(), "part of a shard");
  check(full.dtype() == DType::F32 && part.dtype() == DType::F32, "shards are fp32 tensors");
}

// `t` where the host can read it: itself, or a host copy of a device
// tensor (whose memory the host must not touch: on a GPU a fault, and the
// device's queued work may not have written it yet).
Tensor on_host(const Tensor& t) {
  if (t.device().is_cpu()) return t;
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  h.copy_from(t);  // waits for the device's queued work
  return h;
}

}  // namespace

std::vector<ShardRun> shard_runs(const Shard& s) {
  std::vector<ShardRun> runs;
  for_each_run(s, [&](int64_t full, int64_t part, int64_t n) { runs.push_back({full, part, n}); });
  return runs;
}

void slice_shard(const Tensor& full, const Shard& s, const Tensor& part) {
  check_shard_pair(full, s, part);
  if (!part.device().is_cpu()) {
    Tensor h = Tensor::empty(part.shape(), part.dtype());
    slice_shard(on_host(full), s, h);
    part.copy_from(h);
    return;
  }
  const Tensor host = on_host(full);
  const float* src = host.data<float>();
  float* dst = part.data<float>();
  for_each_run(s, [&](int64_t full_off, int64_t part_off, int64_t n) {
    std::copy(src + full_off, src + full_off + n, dst + part_off);
  });
}

void place_shard(const Tensor& part, const Shard& s, const Tensor& full) {
  check_shard_pair(full, s, part);
  if (!full.device().is_cpu()) {
    const Tensor h = on_host(full);
    place_shard(part, s, h);
    full.copy_from(h);
    return;
  }
  const Tensor host = on_host(part);
  const float* src = host.data<float>();
  float* dst = full.data<float>();
  for_each_run(s, [&](int64_t full_off, int64_t part_off, int64_t n) {
    std::copy(src + part_off, src + part_off + n, dst + full_off);
  });
}

void place_params(const std::vector<Param*>& params, Device device) {
  for (Param* p : params) {
    if (p->value.device() == device) continue;
    Tensor value = Tensor::empty(p->value.shape(), p->value.dtype(), device);
    value.copy_from(p->value);
    p->value = value;
    p->grad = Tensor::zeros(p->value.shape(), DType::F32, device);
  }
}

int64_t real_rows(const Param& p) {
  if (p.true_rows == 0) return p.shard.full.rank == 0 ? 1 : p.shard.full[0];
  check(p.true_rows > 0 && p.shard.full.rank >= 1 && p.true_rows <= p.shard.full[0],
        "{}: {} true rows do not fit its full shape {}", p.name, p.true_rows, p.shard.full.str());
  return p.true_rows;
}

Shape file_shape(const Param& p) {
  if (p.true_rows == 0) return p.shard.full;
  Shape s = p.shard.full;
  s[0] = real_rows(p);
  return s;
}

Tensor pad_rows(const Param& p, const Tensor& real) {
  check_shape(real, file_shape(p), p.name + " without padding");
  if (p.true_rows == 0) return real;
  Tensor full = Tensor::zeros(p.shard.full, real.dtype(), real.device());
  full.slice0(0, p.true_rows).copy_from(real);
  return full;
}

Tensor unpad_rows(const Param& p, const Tensor& full) {
  check_shape(full, p.shard.full, p.name + " with padding");
  return p.true_rows == 0 ? full : full.slice0(0, p.true_rows);
}

void init_param(Param& p, uint64_t seed) {
  // The full tensor: this rank's value, or a scratch copy to slice a shard from.
  const bool piece = p.shard.split();
  const Tensor full = piece ? Tensor::empty(p.shard.full) : p.value;
  float* d = full.data<float>();
  const int64_t n = full.numel();
  const int64_t real = p.true_rows == 0 ? n : n / full.dim(0) * real_rows(p);
  if (p.init.kind == Init::Kind::Constant) {
    std::fill(d, d + real, p.init.value);
  } else {
    normal_fill(d, real, seed, p.name, p.init.value);
  }
  std::fill(d + real, d + n, 0.0f);
  if (piece) slice_shard(full, p.shard, p.value);
}

}  // namespace weft
