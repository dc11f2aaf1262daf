// Shape, Tensor, Arena and the deterministic parameter initialisation.
#include <gtest/gtest.h>
#include <weft/arena.h>
#include <weft/device.h>
#include <weft/param.h>
#include <weft/tensor.h>
#include <weft/units.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using testing::contains;
using testing::error_message;



// --- Shape ---

TEST(Shape, NumelRowsLastAndStr) {
  Shape s{4, 12, 64};
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.numel(), 4 * 12 * 64);
  EXPECT_EQ(s.rows(), 4 * 12);
  EXPECT_EQ(s.last(), 64);
  EXPECT_EQ(s[1], 12);
  EXPECT_EQ(s.str(), "[4, 12, 64]");

  Shape v{7};
  EXPECT_EQ(v.numel(), 7);
  EXPECT_EQ(v.rows(), 1);
  EXPECT_EQ(v.str(), "[7]");

  // A scalar: the empty product is 1 element, one row of one column.
  Shape scalar;
  EXPECT_EQ(scalar.rank, 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.rows(), 1);
  EXPECT_EQ(scalar.last(), 1);
  EXPECT_EQ(scalar.str(), "[]");

  Shape zero{3, 0, 5};
  EXPECT_EQ(zero.numel(), 0);
  EXPECT_EQ(zero.str(), "[3, 0, 5]");
}

TEST(Shape, OfSpanMatchesInitializerList) {
  std::vector<int64_t> d = {2, 3, 5, 7};
  Shape s = Shape::of(d);
  EXPECT_EQ(s, (Shape{2, 3, 5, 7}));
  EXPECT_EQ(s.numel(), 210);
}

TEST(Shape, Equality) {
  EXPECT_EQ((Shape{2, 3}), (Shape{2, 3}));
  EXPECT_NE((Shape{2, 3}), (Shape{3, 2}));
  // Same element count, different rank: not the same shape.
  EXPECT_NE((Shape{6}), (Shape{2, 3}));
  EXPECT_NE((Shape{2, 3}), (Shape{2, 3, 1}));
  EXPECT_FALSE((Shape{2, 3}) != (Shape{2, 3}));
  // Slots beyond the rank must not take part in the comparison.
  Shape a{2, 3};
  Shape b{2, 3, 9};
  b.rank = 2;
  EXPECT_EQ(a, b);
  EXPECT_EQ(Shape(), Shape());
}

TEST(Shape, RankAboveFourThrows) {
  EXPECT_NO_THROW((Shape{1, 2, 3, 4}));
  EXPECT_THROW((Shape{1, 2, 3, 4, 5}), Error);
  std::vector<int64_t> five = {1, 2, 3, 4, 5};
  EXPECT_THROW(Shape::of(five), Error);
  // The message names the offending rank.
  EXPECT_PRED2(contains, error_message([] { Shape s{1, 2, 3, 4, 5}; }), "rank 5");
}

// --- Tensor ---

// A host allocation larger than the memory left is refused with both sizes,
// not left to the kernel's OOM killer.
TEST(HostMemory, AnAllocationBeyondWhatIsAvailableIsRefused) {
  const size_t avail = host_memory_available();
  ASSERT_GT(avail, size_t{0});
  if (avail > (size_t{1} << 50)) GTEST_SKIP() << "no memory figure on this machine";
  const std::string msg =
      testing::error_message([&] { (void)device_alloc(avail + (size_t{1} << 30), Device::cpu()); });
  EXPECT_TRUE(testing::contains(msg, "out of host memory: an allocation needs")) << msg;
  EXPECT_TRUE(testing::contains(msg, "GiB are available")) << msg;
  EXPECT_EQ(format_bytes(1.5 * double(1 << 30)), "1.5 GiB");
  EXPECT_EQ(format_bytes(640.0 * double(1 << 20)), "640.0 MiB");
  EXPECT_EQ(format_bytes(512), "512 B");
}

TEST(Tensor, DefaultIsUndefined) {
  Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.raw(), nullptr);
}

TEST(Tensor, EmptyAndZeros) {
  Tensor e = Tensor::empty({3, 5});
  EXPECT_TRUE(e.defined());
  EXPECT_EQ(e.shape(), (Shape{3, 5}));
  EXPECT_EQ(e.dtype(), DType::F32);
  EXPECT_TRUE(e.device().is_cpu());
  EXPECT_EQ(e.numel(), 15);
  EXPECT_EQ(e.nbytes(), 60u);
  EXPECT_EQ(e.rank(), 2);
  EXPECT_EQ(e.dim(1), 5);

  Tensor i = Tensor::empty({4}, DType::I32);
  EXPECT_EQ(i.dtype(), DType::I32);
  EXPECT_EQ(i.nbytes(), 16u);
  EXPECT_EQ(Tensor::empty({4}, DType::BF16).nbytes(), 8u);

  Tensor z = Tensor::zeros({7, 9});
  for (int64_t k = 0; k < z.numel(); ++k) ASSERT_EQ(z.data<float>()[k], 0.0f) << k;

  EXPECT_THROW(Tensor::empty({3, -1}), Error);
}

TEST(Tensor, DtypeNamesAndSizes) {
  EXPECT_STREQ(dtype_name(DType::F32), "F32");
  EXPECT_STREQ(dtype_name(DType::I32), "I32");
  EXPECT_STREQ(dtype_name(DType::BF16), "BF16");
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
}

TEST(Tensor, ZeroFillsEverything) {
  Tensor t = testing::uniform_tensor({4, 6}, 3, 1.0f, 2.0f);
  t.zero_();
  for (int64_t k = 0; k < t.numel(); ++k) ASSERT_EQ(t.data<float>()[k], 0.0f) << k;
}

TEST(Tensor, ViewSharesBytes) {
  Tensor t = testing::uniform_tensor({2, 3, 4}, 1);
  Tensor v = t.view({6, 4});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_EQ(v.raw(), t.raw());
  v.data<float>()[5] = 42.0f;
  EXPECT_EQ(t.data<float>()[5], 42.0f);
  EXPECT_PRED2(contains, error_message([&] { t.view({5, 5}); }), "[2, 3, 4]");
  EXPECT_PRED2(contains, error_message([&] { t.view({5, 5}); }), "[5, 5]");
}

TEST(Tensor, ViewKeepsStorageAlive) {
  Tensor v;
  {
    Tensor t = Tensor::zeros({8});
    t.data<float>()[3] = 7.0f;
    v = t.view({2, 4});
  }
  // The owner is gone; the view's shared reference must keep the bytes valid.
  EXPECT_EQ(v.data<float>()[3], 7.0f);
}

TEST(Tensor, Slice0IsAViewOfRows) {
  Tensor t = testing::uniform_tensor({5, 3, 2}, 2);
  Tensor s = t.slice0(1, 4);
  EXPECT_EQ(s.shape(), (Shape{3, 3, 2}));
  EXPECT_EQ(s.data<float>(), t.data<float>() + 6);
  s.data<float>()[0] = -9.0f;
  EXPECT_EQ(t.data<float>()[6], -9.0f);

  EXPECT_EQ(t.slice0(2, 2).numel(), 0);
  EXPECT_EQ(t.slice0(0, 5).raw(), t.raw());
  EXPECT_THROW(t.slice0(3, 6), Error);
  EXPECT_THROW(t.slice0(-1, 2), Error);
  EXPECT_THROW(t.slice0(3, 2), Error);

  Tensor ints = Tensor::zeros({4, 3}, DType::I32);
  EXPECT_EQ(ints.slice0(2, 3).data<int32_t>(), ints.data<int32_t>() + 6);
}

TEST(Tensor, CloneIsAnIndependentCopy) {
  Tensor t = testing::uniform_tensor({3, 4}, 5);
  Tensor c = t.clone();
  EXPECT_NE(c.raw(), t.raw());
  EXPECT_EQ(c.shape(), t.shape());
  EXPECT_EQ(std::memcmp(c.raw(), t.raw(), t.nbytes()), 0);
  const float before = t.data<float>()[0];
  c.data<float>()[0] = before + 1.0f;
  EXPECT_EQ(t.data<float>()[0], before);
}

TEST(Tensor, CopyFrom) {
  Tensor src = testing::uniform_tensor({2, 5}, 6);
  Tensor dst = Tensor::zeros({2, 5});
  dst.copy_from(src);
  EXPECT_EQ(std::memcmp(dst.raw(), src.raw(), src.nbytes()), 0);

  Tensor wrong = Tensor::zeros({5, 2});
  std::string msg = error_message([&] { wrong.copy_from(src); });
  EXPECT_PRED2(contains, msg, "[2, 5]");
  EXPECT_PRED2(contains, msg, "[5, 2]");

  Tensor ints = Tensor::zeros({2, 5}, DType::I32);
  EXPECT_THROW(ints.copy_from(src), Error);
}

TEST(Tensor, CheckShapeNamesWhatAndBothShapes) {
  Tensor t = Tensor::zeros({2, 3});
  EXPECT_NO_THROW(check_shape(t, {2, 3}, "x"));
  std::string msg = error_message([&] { check_shape(t, {3, 2}, "the thing"); });
  EXPECT_PRED2(contains, msg, "the thing");
  EXPECT_PRED2(contains, msg, "[3, 2]");
  EXPECT_PRED2(contains, msg, "[2, 3]");
}

// --- Arena ---

TEST(Arena, AllocationsAre64ByteAlignedAndDisjoint) {
  Arena arena;
  std::vector<Tensor> ts;
  const int64_t sizes[] = {1, 3, 17, 64, 5, 100, 2};
  for (int64_t n : sizes) ts.push_back(arena.alloc({n}));
  ts.push_back(arena.alloc({3}, DType::BF16));
  ts.push_back(arena.alloc({5}, DType::I32));
  for (const Tensor& t : ts) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
    EXPECT_TRUE(t.defined());
  }
  for (size_t a = 0; a < ts.size(); ++a)
    for (size_t b = a + 1; b < ts.size(); ++b) {
      auto pa = reinterpret_cast<uintptr_t>(ts[a].raw());
      auto pb = reinterpret_cast<uintptr_t>(ts[b].raw());
      EXPECT_TRUE(pa + ts[a].nbytes() <= pb || pb + ts[b].nbytes() <= pa) << a << " " << b;
    }
  EXPECT_EQ(ts.back().dtype(), DType::I32);
  EXPECT_GE(arena.used(), 7 * 64u);
  EXPECT_EQ(arena.high_water(), arena.used());
}

TEST(Arena, ZerosReallyZeroesReusedMemory) {
  Arena arena;
  Tensor a = arena.alloc({100});
  for (int64_t k = 0; k < 100; ++k) a.data<float>()[k] = 1.0f;
  arena.reset();
  Tensor z = arena.zeros({100});
  EXPECT_EQ(z.raw(), a.raw());
  for (int64_t k = 0; k < 100; ++k) ASSERT_EQ(z.data<float>()[k], 0.0f);
}

TEST(Arena, ResetReusesTheSameMemory) {
  Arena arena;
  Tensor a = arena.alloc({1000});
  Tensor b = arena.alloc({10});
  const size_t allocs = arena.system_allocations();
  EXPECT_EQ(allocs, 1u);
  const size_t used = arena.used();
  arena.reset();
  EXPECT_EQ(arena.used(), 0u);
  EXPECT_EQ(arena.high_water(), used);
  Tensor a2 = arena.alloc({1000});
  Tensor b2 = arena.alloc({10});
  EXPECT_EQ(a2.raw(), a.raw());
  EXPECT_EQ(b2.raw(), b.raw());
  EXPECT_EQ(arena.system_allocations(), allocs);
}

TEST(Arena, ResetCoalescesBlocksSoTheNextPassDoesNotAllocate) {
  // About 4.3 MB in pieces that leave the growing blocks partly unused: more than the
  // largest block the first pass creates, so later passes only fit in a planned block.
  const std::vector<int64_t> pass = {175000, 180000, 7, 175000, 190000, 64, 175000, 180000};
  Arena arena;
  auto run = [&](bool planned) {
    std::vector<Tensor> ts;
    for (int64_t n : pass) {
      Tensor t = arena.alloc({n});
      // Touch first and last element: every handed-out byte must be real memory.
      t.data<float>()[0] = 1.0f;
      t.data<float>()[n - 1] = 2.0f;
      ts.push_back(t);
    }
    for (size_t a = 0; a < ts.size(); ++a)
      for (size_t b = a + 1; b < ts.size(); ++b) {
        auto pa = reinterpret_cast<uintptr_t>(ts[a].raw());
        auto pb = reinterpret_cast<uintptr_t>(ts[b].raw());
        EXPECT_TRUE(pa + ts[a].nbytes() <= pb || pb + ts[b].nbytes() <= pa);
      }
    // Served from one block: each tensor follows the previous one (rounded to 64 bytes).
    for (size_t a = 1; planned && a < ts.size(); ++a) {
      EXPECT_EQ(static_cast<char*>(ts[a].raw()),
                static_cast<char*>(ts[a - 1].raw()) + (ts[a - 1].nbytes() + 63) / 64 * 64)
          << a;
    }
  };
  run(false);
  const size_t first = arena.system_allocations();
  ASSERT_GT(first, 1u) << "the first pass should have needed several blocks";
  const size_t hw = arena.high_water();
  arena.reset();
  EXPECT_GE(arena.capacity(), hw);
  const size_t planned = arena.system_allocations();
  for (int k = 0; k < 3; ++k) {
    run(true);
    EXPECT_EQ(arena.system_allocations(), planned) << "pass " << k + 2;
    EXPECT_EQ(arena.high_water(), hw);
    arena.reset();
    EXPECT_EQ(arena.system_allocations(), planned) << "reset after pass " << k + 2;
    EXPECT_GE(arena.capacity(), arena.high_water());
  }
}

// While a pass grows the arena, tensors of kOwnBlock bytes or more get
// blocks of exactly their size and smaller ones share blocks of at most
// kOwnBlock: what the first pass holds exceeds what it uses by less than
// one shared block (doubling every block could leave most of the last one
// empty: here 18 MiB tensors would grow 1, 2, ..., 64 MiB blocks). Then
// reset() plans one block and the next pass fits it exactly.
TEST(Arena, LargeTensorsGetBlocksOfTheirOwnSize) {
  const int64_t big = (int64_t{18} << 20) / 4, small = 3000;  // 18 MiB, 12 KB of floats
  const std::vector<int64_t> pass = {small, big, small, small, big, 7, big, small, big, big};
  Arena arena;
  for (int k = 0; k < 2; ++k) {
    for (int64_t n : pass) {
      Tensor t = arena.alloc({n});
      t.data<float>()[0] = 1.0f;
      t.data<float>()[n - 1] = 2.0f;
    }
    EXPECT_LT(arena.capacity() - arena.used(), Arena::kOwnBlock) << "pass " << k + 1;
    if (k == 0) {
      EXPECT_EQ(arena.capacity() - arena.used(), (size_t{1} << 20) - Arena::bytes_for({small}) * 4 -
                                                     Arena::bytes_for({7}))
          << "the five big tensors' blocks are full; the small ones share one 1 MiB block";
    } else {
      EXPECT_EQ(arena.capacity(), arena.used()) << "the planned block is exactly the high water";
    }
    arena.reset();
  }
}

TEST(Arena, MoveTransfersBlocks) {
  Arena a;
  Tensor t = a.alloc({16});
  t.data<float>()[0] = 3.0f;
  Arena b(std::move(a));
  EXPECT_EQ(b.system_allocations(), 1u);
  EXPECT_GE(b.capacity(), 64u);
  b.reset();
  EXPECT_EQ(b.alloc({16}).raw(), t.raw());
}

// --- Parameters and their initialisation ---

TEST(NormalFill, SameSeedAndNameGiveSameNumbers) {
  std::vector<float> a(1001), b(1001);
  normal_fill(a.data(), 1001, 7, "h.0.attn.c_attn.weight", 1.0f);
  normal_fill(b.data(), 1001, 7, "h.0.attn.c_attn.weight", 1.0f);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

TEST(NormalFill, DifferentNamesOrSeedsDiffer) {
  const int64_t n = 256;
  std::vector<float> a(n), b(n), c(n);
  normal_fill(a.data(), n, 7, "wte", 1.0f);
  normal_fill(b.data(), n, 7, "wpe", 1.0f);
  normal_fill(c.data(), n, 8, "wte", 1.0f);
  int same_ab = 0, same_ac = 0;
  for (int64_t i = 0; i < n; ++i) {
    same_ab += a[static_cast<size_t>(i)] == b[static_cast<size_t>(i)];
    same_ac += a[static_cast<size_t>(i)] == c[static_cast<size_t>(i)];
  }
  EXPECT_EQ(same_ab, 0);
  EXPECT_EQ(same_ac, 0);
}

TEST(NormalFill, PrefixIsIndependentOfLengthAndStdScales) {
  // Element i depends on (seed, name, i) only: a shorter fill is a prefix of a longer one,
  // including an odd length that splits a Box-Muller pair.
  std::vector<float> full(100), part(37), scaled(100);
  normal_fill(full.data(), 100, 3, "x", 1.0f);
  normal_fill(part.data(), 37, 3, "x", 1.0f);
  normal_fill(scaled.data(), 100, 3, "x", 0.02f);
  for (size_t i = 0; i < part.size(); ++i) EXPECT_EQ(part[i], full[i]) << i;
  for (size_t i = 0; i < full.size(); ++i)
    EXPECT_NEAR(scaled[i], 0.02f * full[i], 1e-7f + 1e-6f * std::abs(full[i])) << i;
}

TEST(NormalFill, StatisticsOfManySamples) {
  const int64_t n = 100000;
  std::vector<float> x(n);
  normal_fill(x.data(), n, 1234, "stats", 1.0f);
  double s = 0, s2 = 0, s4 = 0;
  int64_t beyond3 = 0;
  for (float v : x) {
    ASSERT_TRUE(std::isfinite(v));
    s += v;
    s2 += static_cast<double>(v) * v;
    s4 += static_cast<double>(v) * v * v * v;
    beyond3 += std::abs(v) > 3.0f;
  }
  const double mean = s / n;
  const double var = s2 / n - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(std::sqrt(var), 1.0, 0.02);
  // A normal's kurtosis is 3 and 0.27% of it lies beyond 3 sigma: rules out uniform-like output.
  EXPECT_NEAR(s4 / n / (var * var), 3.0, 0.1);
  EXPECT_NEAR(static_cast<double>(beyond3) / n, 0.0027, 0.001);
}

TEST(Param, InitConstantAndNormal) {
  ParamStore store;
  Param* c = store.create("ln_f.weight", {10}, Init::constant(1.0f));
  Param* w = store.create("wte", {4, 6}, Init::normal(0.02f));
  Param* w2 = store.create("wpe", {4, 6}, Init::normal(0.02f));
  init_param(*c, 42);
  init_param(*w, 42);
  init_param(*w2, 42);
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(c->value.data<float>()[i], 1.0f);

  std::vector<float> expect(24);
  normal_fill(expect.data(), 24, 42, "wte", 0.02f);
  EXPECT_EQ(std::memcmp(expect.data(), w->value.raw(), 24 * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(w2->value.raw(), w->value.raw(), 24 * sizeof(float)), 0);
  double s2 = 0;
  for (int64_t i = 0; i < 24; ++i) s2 += std::pow(w->value.data<float>()[i], 2);
  EXPECT_GT(s2, 0.0);
  EXPECT_LT(std::sqrt(s2 / 24), 0.1);  // scaled by std = 0.02, not unit

  // Initialisation depends on (seed, name) only, not on creation order or the store.
  ParamStore other;
  Param* w_again = other.create("wte", {4, 6}, Init::normal(0.02f));
  init_param(*w_again, 42);
  EXPECT_EQ(std::memcmp(w_again->value.raw(), w->value.raw(), 24 * sizeof(float)), 0);
  init_param(*w_again, 43);
  EXPECT_NE(std::memcmp(w_again->value.raw(), w->value.raw(), 24 * sizeof(float)), 0);
}

TEST(ParamStore, CreateFindAndDuplicates) {
  ParamStore store;
  Param* a = store.create("a.weight", {3, 2}, Init::normal(0.02f));
  Param* b = store.create("a.bias", {2}, Init::constant(0.0f));
  EXPECT_EQ(store.size(), 2u);
  EXPECT_EQ(store.find("a.weight"), a);
  EXPECT_EQ(store.find("a.bias"), b);
  EXPECT_EQ(store.find("nope"), nullptr);
  EXPECT_EQ(a->value.shape(), (Shape{3, 2}));
  EXPECT_EQ(a->grad.shape(), (Shape{3, 2}));
  EXPECT_NE(a->grad.raw(), a->value.raw());
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(a->grad.data<float>()[i], 0.0f);
  EXPECT_TRUE(a->weight_decay());
  EXPECT_FALSE(b->weight_decay());
  EXPECT_PRED2(contains, error_message([&] { store.create("a.bias", {2}, Init::constant(0.0f)); }),
               "a.bias");
  // Addresses stay stable as the store grows: layers keep Param*.
  for (int i = 0; i < 100; ++i) store.create(fmt::format("p{}", i), {1}, Init::constant(0));
  EXPECT_EQ(store.find("a.weight"), a);
  EXPECT_EQ(store.all().size(), 102u);
  EXPECT_EQ(store.all()[0], a);
}

}  // namespace
}  // namespace weft
