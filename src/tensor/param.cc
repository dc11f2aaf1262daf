#include <weft/param.h>

#include <cmath>

namespace weft {

Param* ParamStore::create(const std::string& name, Shape shape, Init init) {
  check(find(name) == nullptr, "parameter '{}' is defined twice", name);
  Param& p = params_.emplace_back();
  p.name = name;
  p.value = Tensor::zeros(shape);
  p.grad = Tensor::zeros(shape);
  p.init = init;
  return &p;
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

void init_param(Param& p, uint64_t seed) {
  float* d = p.value.data<float>();
  int64_t n = p.value.numel();
  if (p.init.kind == Init::Kind::Constant) {
    for (int64_t i = 0; i < n; ++i) d[i] = p.init.value;
  } else {
    normal_fill(d, n, seed, p.name, p.init.value);
  }
}

}  // namespace weft
