#include <weft/safetensors.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>

#include "test_util.h"

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::source_path;
using testing::temp_dir;
using testing::write_file;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return s;
}

uint64_t read_le64(const std::string& b) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(b[static_cast<size_t>(i)]);
  return n;
}

// A safetensors file with this header text and `data_bytes` zero bytes of data.
std::string raw_file(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\0');
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// open() must fail, naming the file and the rule.
void expect_open_error(const std::string& path, const std::string& phrase) {
  try {
    safetensors::File::open(path);
    ADD_FAILURE() << "open(" << path << ") did not throw; expected '" << phrase << "'";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_TRUE(contains(msg, path)) << msg;
    EXPECT_TRUE(contains(msg, phrase)) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

class SafetensorsMalformed : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = temp_dir("st-bad"); }
  // Writes the raw bytes and checks that open() rejects them.
  void expect_rejected(const std::string& bytes, const std::string& phrase) {
    std::string path = dir_ + "/bad.safetensors";
    write_file(path, bytes);
    expect_open_error(path, phrase);
  }
  std::string dir_;
};

Tensor iota_f32(Shape shape, float base) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = base + 0.25f * static_cast<float>(i);
  return t;
}

Tensor iota_i32(Shape shape, int32_t base) {
  Tensor t = Tensor::empty(shape, DType::I32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = base - 3 * static_cast<int32_t>(i);
  return t;
}

std::vector<std::pair<std::string, Tensor>> sample_tensors() {
  Tensor bf = Tensor::empty({3, 2}, DType::BF16);
  for (int64_t i = 0; i < bf.numel(); ++i)
    bf.data<uint16_t>()[i] = static_cast<uint16_t>(0x3f80 + i);
  return {
      {"z.matrix", iota_f32({2, 3}, 1.0f)},
      {"a.vector", iota_f32({5}, -2.0f)},
      {"ids", iota_i32({2, 2, 3}, 100)},
      {"scalar", iota_f32(Shape{}, 7.5f)},
      {"rank4", iota_f32({1, 2, 3, 2}, 0.0f)},
      {"empty", Tensor::empty({4, 0})},
      {"half", bf},
  };
}

TEST(Safetensors, RoundTripKeepsOrderShapesBytesAndMetadata) {
  std::string dir = temp_dir("st-roundtrip");
  std::string path = dir + "/model.safetensors";
  auto tensors = sample_tensors();
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}};
  safetensors::save(path, tensors, meta);

  auto f = safetensors::File::open(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, want] = tensors[i];
    SCOPED_TRACE(name);
    EXPECT_EQ(f.tensors()[i].name, name);  // file order is save order
    ASSERT_NE(f.find(name), nullptr);
    Tensor got = f.get(name);
    EXPECT_EQ(got.dtype(), want.dtype());
    EXPECT_EQ(got.shape(), want.shape());
    EXPECT_TRUE(got.device().is_cpu());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got.raw()) % 4, 0u);
    ASSERT_EQ(got.nbytes(), want.nbytes());
    if (want.nbytes()) {
      EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0);
    }
  }
  // The first tensor starts the data section, which open() aligns to 64 bytes.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.get("z.matrix").raw()) % 64, 0u);
  EXPECT_EQ(f.get("ids").data<int32_t>()[11], 100 - 33);
}

TEST(Safetensors, FileLayoutIsPaddedHeaderThenPackedData) {
  std::string dir = temp_dir("st-layout");
  std::string path = dir + "/model.safetensors";
  auto tensors = sample_tensors();
  safetensors::save(path, tensors, {{"k", "v"}});

  std::string bytes = read_file(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = read_le64(bytes);
  EXPECT_EQ(n % 8, 0u);
  std::string expected_data;
  for (const auto& [name, t] : tensors)
    expected_data.append(static_cast<const char*>(t.raw()), t.nbytes());
  ASSERT_EQ(bytes.size(), 8 + n + expected_data.size());
  EXPECT_EQ(bytes.substr(8 + n), expected_data);

  // Any JSON reader can parse the header; offsets are contiguous in save order.
  auto header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  ASSERT_TRUE(header.is_object());
  EXPECT_EQ(header["__metadata__"]["k"], "v");
  size_t offset = 0;
  size_t i = 0;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") continue;
    const auto& [name, t] = tensors[i++];
    EXPECT_EQ(key, name);
    EXPECT_EQ(value["dtype"], dtype_name(t.dtype()));
    EXPECT_EQ(value["shape"].size(), static_cast<size_t>(t.rank()));
    EXPECT_EQ(value["data_offsets"][0].get<size_t>(), offset);
    offset += t.nbytes();
    EXPECT_EQ(value["data_offsets"][1].get<size_t>(), offset);
  }
  EXPECT_EQ(i, tensors.size());
}

TEST(Safetensors, SaveReplacesExistingFileAndLeavesNoTemporary) {
  std::string dir = temp_dir("st-atomic");
  std::string path = dir + "/ckpt.safetensors";
  write_file(path, "old contents that are not safetensors");
  safetensors::save(path, {{"w", iota_f32({3}, 1.0f)}});

  EXPECT_FALSE(fs::exists(path + ".tmp"));
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    ++entries;
    EXPECT_EQ(e.path().filename().string(), "ckpt.safetensors");
  }
  EXPECT_EQ(entries, 1u);
  auto f = safetensors::File::open(path);
  ASSERT_EQ(f.tensors().size(), 1u);
  EXPECT_EQ(f.get("w").data<float>()[2], 1.5f);

  // Saving again over a valid file replaces it too.
  safetensors::save(path, {{"v", iota_i32({2}, 9)}});
  auto g = safetensors::File::open(path);
  ASSERT_EQ(g.tensors().size(), 1u);
  EXPECT_EQ(g.tensors()[0].name, "v");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// after_tensor(i) runs with tensors 0..i written to the temporary file and
// nothing renamed yet: where an interrupted save is simulated.
TEST(Safetensors, AfterTensorRunsWithTheFilePartlyWritten) {
  std::string path = temp_dir("st-after") + "/x.safetensors";
  const std::vector<std::pair<std::string, Tensor>> tensors = {{"a", iota_f32({3}, 1.0f)},
                                                               {"b", iota_f32({5}, 2.0f)}};
  std::vector<uintmax_t> sizes;
  safetensors::save(path, tensors, {}, [&](size_t i) {
    EXPECT_EQ(i, sizes.size());
    EXPECT_FALSE(fs::exists(path));
    sizes.push_back(fs::file_size(path + ".tmp"));
  });
  ASSERT_EQ(sizes.size(), 2u);
  const uintmax_t total = fs::file_size(path);
  EXPECT_EQ(sizes[1], total);
  EXPECT_EQ(sizes[0], total - 5 * sizeof(float));  // b is not written yet
}

TEST(Safetensors, SaveIntoMissingDirectoryNamesThePath) {
  std::string path = temp_dir("st-nodir") + "/no/such/dir/x.safetensors";
  try {
    safetensors::save(path, {{"w", iota_f32({3}, 1.0f)}});
    ADD_FAILURE() << "save did not throw";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), path)) << e.what();
    EXPECT_TRUE(contains(e.what(), "No such file or directory")) << e.what();
  }
}

TEST(Safetensors, SaveRejectsDuplicateNames) {
  std::string path = temp_dir("st-dup") + "/x.safetensors";
  try {
    safetensors::save(path, {{"w", iota_f32({3}, 1.0f)}, {"w", iota_f32({2}, 1.0f)}});
    ADD_FAILURE() << "save did not throw";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "'w' appears more than once")) << e.what();
  }
  EXPECT_FALSE(fs::exists(path));
}

TEST(Safetensors, GetOfAbsentNameThrowsNamingIt) {
  std::string path = temp_dir("st-absent") + "/m.safetensors";
  safetensors::save(path, {{"present", iota_f32({2}, 0.0f)}});
  auto f = safetensors::File::open(path);
  EXPECT_EQ(f.find("missing.weight"), nullptr);
  try {
    f.get("missing.weight");
    ADD_FAILURE() << "get did not throw";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "missing.weight")) << e.what();
    EXPECT_TRUE(contains(e.what(), path)) << e.what();
  }
}

TEST(Safetensors, OpenMissingFileNamesPath) {
  std::string path = temp_dir("st-missing") + "/absent.safetensors";
  expect_open_error(path, "No such file or directory");
}

TEST_F(SafetensorsMalformed, FileShorterThanEightBytes) {
  expect_rejected("abc", "shorter than the 8-byte header length");
}

TEST_F(SafetensorsMalformed, HeaderLengthPastEndOfFile) {
  expect_rejected(le64(100) + "{}", "header length 100 runs past the end of the file");
}

TEST_F(SafetensorsMalformed, AbsurdHeaderLength) {
  // A sparse file big enough that the length fits, but over the sanity limit.
  std::string path = dir_ + "/huge.safetensors";
  uint64_t n = 200ull << 20;
  write_file(path, le64(n));
  fs::resize_file(path, n + 8);
  expect_open_error(path, "exceeds the limit");
}

TEST_F(SafetensorsMalformed, HeaderNotJson) {
  expect_rejected(raw_file("{\"a\": ", 0), "header is not valid JSON");
}

TEST_F(SafetensorsMalformed, HeaderJsonNotObject) {
  expect_rejected(raw_file("[1, 2, 3]", 0), "header JSON is array, not an object");
}

TEST_F(SafetensorsMalformed, EntryNotObject) {
  expect_rejected(raw_file(R"({"w": 5})", 0), "tensor 'w' header entry is number");
}

TEST_F(SafetensorsMalformed, EntryMissingDtype) {
  expect_rejected(raw_file(R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", 8),
                  "tensor 'w' is missing \"dtype\"");
}

TEST_F(SafetensorsMalformed, EntryMissingShape) {
  expect_rejected(raw_file(R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", 8),
                  "tensor 'w' is missing \"shape\"");
}

TEST_F(SafetensorsMalformed, EntryMissingDataOffsets) {
  expect_rejected(raw_file(R"({"w": {"dtype": "F32", "shape": [2]}})", 8),
                  "tensor 'w' is missing \"data_offsets\"");
}

TEST_F(SafetensorsMalformed, UnsupportedDtype) {
  expect_rejected(raw_file(R"({"w": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})", 16),
                  "tensor 'w' has unsupported dtype \"F64\"");
  expect_rejected(raw_file(R"({"u": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", 2),
                  "tensor 'u' has unsupported dtype \"U8\"");
}

TEST_F(SafetensorsMalformed, NegativeDimension) {
  expect_rejected(raw_file(R"({"w": {"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 8]}})",
                           8),
                  "dimension 1 must be a non-negative integer");
}

TEST_F(SafetensorsMalformed, RankAboveMaximum) {
  expect_rejected(
      raw_file(R"({"w": {"dtype": "F32", "shape": [1, 1, 1, 1, 1], "data_offsets": [0, 4]}})", 4),
      "has rank 5, more than the maximum of 4");
}

TEST_F(SafetensorsMalformed, OffsetsPastEndOfData) {
  expect_rejected(raw_file(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8),
                  "tensor 'w' data_offsets [0, 16] run past the end of the data section (8 bytes)");
}

TEST_F(SafetensorsMalformed, OffsetsSpanDoesNotMatchNumel) {
  expect_rejected(
      raw_file(R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})", 16),
      "data_offsets [0, 12] span 12 bytes, but F32 [2, 2] needs 4 x 4 bytes");
}

TEST_F(SafetensorsMalformed, OffsetsBeginAfterEnd) {
  expect_rejected(raw_file(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8),
                  "data_offsets [8, 4] have begin after end");
}

TEST_F(SafetensorsMalformed, OffsetsNotAPair) {
  expect_rejected(raw_file(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4),
                  "must be [begin, end]");
}

TEST_F(SafetensorsMalformed, HugeShapeDoesNotWrap) {
  // 2^32 * 2^32 wraps to 0 in 64 bits, which would match empty offsets.
  expect_rejected(
      raw_file(
          R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
          0),
      "too many elements");
}

TEST_F(SafetensorsMalformed, MetadataValueNotString) {
  expect_rejected(raw_file(R"({"__metadata__": {"step": 3}})", 0),
                  "__metadata__ value for 'step' is 3, not a string");
}

TEST(Safetensors, CommittedFixtureLoads) {
  std::string path = source_path("tests/reference/fixtures/gpt_tiny_init.safetensors");
  if (!fs::exists(path)) GTEST_SKIP() << path << " is not present";
  auto f = safetensors::File::open(path);
  const auto* info = f.find("wte.weight");
  ASSERT_NE(info, nullptr);
  Tensor wte = f.get("wte.weight");
  EXPECT_EQ(wte.dtype(), DType::F32);
  EXPECT_EQ(wte.shape(), Shape({64, 32}));
}

}  // namespace
}  // namespace weft
