#include <weft/data.h>
#include <weft/error.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <set>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using testing::contains;
using testing::error_message;

using testing::temp_dir;
using testing::write_file;


void put_i32(std::string& b, size_t at, int32_t v) {
  auto u = static_cast<uint32_t>(v);
  for (size_t i = 0; i < 4; ++i) b[at + i] = static_cast<char>(u >> (8 * i));
}

// An llm.c token file: 1024-byte header, then uint16 little-endian tokens.
std::string llmc_file(int32_t magic, int32_t version, int32_t count,
                      const std::vector<uint16_t>& tokens) {
  std::string b(1024, '\0');
  put_i32(b, 0, magic);
  put_i32(b, 4, version);
  put_i32(b, 8, count);
  for (uint16_t t : tokens) {
    b.push_back(static_cast<char>(t & 0xff));
    b.push_back(static_cast<char>(t >> 8));
  }
  return b;
}

// 100, 101, ..., 100 + n - 1
TokenData ramp(int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), 100);
  return TokenData::from_tokens(t, 0);
}

TEST(TokenData, TextFileTokensAreBytes) {
  std::string path = temp_dir("data-text") + "/corpus.txt";
  write_file(path, std::string("Hi\0\xff!", 5));
  TokenData d = TokenData::load(path);
  EXPECT_TRUE(d.is_text());
  EXPECT_EQ(d.path(), path);
  EXPECT_EQ(d.tokens(), (std::vector<int32_t>{72, 105, 0, 255, 33}));
  EXPECT_EQ(d.size(), 5);
  EXPECT_EQ(d.max_token(), 256);

  write_file(path, "abca");
  EXPECT_EQ(TokenData::load(path).max_token(), 'c' + 1);
}

TEST(TokenData, ExplicitTextFormatReadsBinAsBytes) {
  std::string path = temp_dir("data-forcetext") + "/bytes.bin";
  write_file(path, "xyz");
  TokenData d = TokenData::load(path, TokenFormat::Text);
  EXPECT_TRUE(d.is_text());
  EXPECT_EQ(d.tokens(), (std::vector<int32_t>{'x', 'y', 'z'}));
}

TEST(TokenData, WindowsCountFullWindowsWithShiftedTarget) {
  EXPECT_EQ(ramp(11).windows(3), 3);  // (11 - 1) / 3
  EXPECT_EQ(ramp(10).windows(3), 3);
  EXPECT_EQ(ramp(9).windows(3), 2);
  EXPECT_EQ(ramp(4).windows(3), 1);  // exactly T + 1 tokens
  EXPECT_EQ(ramp(11).windows(10), 1);
}

TEST(TokenData, WindowsThrowsWhenNoWindowFits) {
  std::string msg = error_message([] { ramp(3).windows(3); });
  EXPECT_TRUE(contains(msg, "3 tokens")) << msg;
  EXPECT_TRUE(contains(msg, "sequence length 3")) << msg;
  EXPECT_TRUE(contains(msg, "needs 4 tokens")) << msg;

  std::string path = temp_dir("data-short") + "/tiny.txt";
  write_file(path, "ab");
  msg = error_message([&] { TokenData::load(path).windows(8); });
  EXPECT_TRUE(contains(msg, path)) << msg;
  EXPECT_TRUE(contains(msg, "2 tokens")) << msg;
}

TEST(TokenData, FillReadsWindowsInOrder) {
  TokenData d = ramp(11);  // tokens 100..110, T = 3: windows start at 100, 103, 106
  std::vector<int32_t> in(9, -1), tg(9, -1);
  d.fill(0, 3, 3, in.data(), tg.data());
  EXPECT_EQ(in, (std::vector<int32_t>{100, 101, 102, 103, 104, 105, 106, 107, 108}));
  EXPECT_EQ(tg, (std::vector<int32_t>{101, 102, 103, 104, 105, 106, 107, 108, 109}));

  std::vector<int32_t> in1(3), tg1(3);
  d.fill(1, 1, 3, in1.data(), tg1.data());
  EXPECT_EQ(in1, (std::vector<int32_t>{103, 104, 105}));
  EXPECT_EQ(tg1, (std::vector<int32_t>{104, 105, 106}));
}

TEST(TokenData, FillWrapsModuloWindows) {
  TokenData d = ramp(11);  // 3 windows of T = 3
  std::vector<int32_t> in(12), tg(12);
  d.fill(2, 4, 3, in.data(), tg.data());  // windows 2, 0, 1, 2
  EXPECT_EQ(in, (std::vector<int32_t>{106, 107, 108, 100, 101, 102, 103, 104, 105, 106, 107, 108}));
  EXPECT_EQ(tg, (std::vector<int32_t>{107, 108, 109, 101, 102, 103, 104, 105, 106, 107, 108, 109}));

  std::vector<int32_t> in2(3), tg2(3);
  d.fill(3 * 5 + 1, 1, 3, in2.data(), tg2.data());  // sequence 16 is window 1
  EXPECT_EQ(in2, (std::vector<int32_t>{103, 104, 105}));
}

TEST(TokenData, FirstSequenceFormula) {
  // step*G + micro*B*dp + dp_rank*B
  EXPECT_EQ(first_sequence(0, 8, 8, 0, 1, 0), 0);
  EXPECT_EQ(first_sequence(5, 8, 8, 0, 1, 0), 40);
  EXPECT_EQ(first_sequence(3, 16, 2, 1, 4, 3), 48 + 8 + 6);
  EXPECT_EQ(first_sequence(2, 12, 2, 2, 2, 1), 24 + 8 + 2);
}

TEST(TokenData, FirstSequencePartitionsEachStep) {
  // Every (micro, rank) pair covers a disjoint block, and together they tile the step.
  const int64_t B = 3, dp = 2, accum = 4, G = B * dp * accum, step = 7;
  std::set<int64_t> seen;
  for (int64_t micro = 0; micro < accum; ++micro)
    for (int64_t r = 0; r < dp; ++r) {
      int64_t s0 = first_sequence(step, G, B, micro, dp, r);
      for (int64_t k = 0; k < B; ++k) EXPECT_TRUE(seen.insert(s0 + k).second) << s0 + k;
    }
  ASSERT_EQ(static_cast<int64_t>(seen.size()), G);
  EXPECT_EQ(*seen.begin(), step * G);
  EXPECT_EQ(*seen.rbegin(), step * G + G - 1);
}

TEST(TokenData, FirstSequenceRejectsBadLayout) {
  std::string msg = error_message([] { first_sequence(0, 8, 2, 0, 2, 2); });
  EXPECT_TRUE(contains(msg, "dp_rank 2 of dp 2")) << msg;
  msg = error_message([] { first_sequence(0, 8, 2, 2, 2, 0); });  // micro 2 needs 12 > 8
  EXPECT_TRUE(contains(msg, "global batch of 8")) << msg;
}

TEST(TokenData, LlmcBinRoundTrip) {
  std::string path = temp_dir("data-llmc") + "/train.bin";
  std::vector<uint16_t> toks = {50256, 0, 1, 65535, 7, 300};
  write_file(path, llmc_file(20240520, 1, 6, toks));
  TokenData d = TokenData::load(path);
  EXPECT_FALSE(d.is_text());
  EXPECT_EQ(d.path(), path);
  EXPECT_EQ(d.tokens(), (std::vector<int32_t>{50256, 0, 1, 65535, 7, 300}));
  EXPECT_EQ(d.max_token(), 65536);
  EXPECT_EQ(d.windows(2), 2);

  // Forcing the format works whatever the extension.
  std::string other = temp_dir("data-llmc2") + "/tokens.dat";
  write_file(other, llmc_file(20240520, 1, 2, {5, 9}));
  EXPECT_EQ(TokenData::load(other, TokenFormat::LlmcBin).tokens(), (std::vector<int32_t>{5, 9}));
  EXPECT_TRUE(TokenData::load(other).is_text());  // Auto: not ".bin"
}

TEST(TokenData, LlmcBadMagic) {
  std::string path = temp_dir("data-magic") + "/m.bin";
  write_file(path, llmc_file(12345, 1, 2, {1, 2}));
  std::string msg = error_message([&] { TokenData::load(path); });
  EXPECT_TRUE(contains(msg, path)) << msg;
  EXPECT_TRUE(contains(msg, "magic is 12345")) << msg;
  EXPECT_TRUE(contains(msg, "20240520")) << msg;
}

TEST(TokenData, LlmcBadVersion) {
  std::string path = temp_dir("data-version") + "/v.bin";
  write_file(path, llmc_file(20240520, 2, 2, {1, 2}));
  std::string msg = error_message([&] { TokenData::load(path); });
  EXPECT_TRUE(contains(msg, path)) << msg;
  EXPECT_TRUE(contains(msg, "version is 2, expected 1")) << msg;
}

TEST(TokenData, LlmcZeroCount) {
  std::string path = temp_dir("data-count") + "/c.bin";
  write_file(path, llmc_file(20240520, 1, 0, {}));
  std::string msg = error_message([&] { TokenData::load(path); });
  EXPECT_TRUE(contains(msg, path)) << msg;
  EXPECT_TRUE(contains(msg, "token count is 0")) << msg;
}

TEST(TokenData, LlmcTruncatedOrTooLong) {
  std::string path = temp_dir("data-trunc") + "/t.bin";
  write_file(path, llmc_file(20240520, 1, 5, {1, 2, 3, 4}));
  std::string msg = error_message([&] { TokenData::load(path); });
  EXPECT_TRUE(contains(msg, path)) << msg;
  EXPECT_TRUE(contains(msg, "1032 bytes")) << msg;  // found
  EXPECT_TRUE(contains(msg, "1034 bytes")) << msg;  // needed
  EXPECT_TRUE(contains(msg, "truncated")) << msg;

  write_file(path, llmc_file(20240520, 1, 3, {1, 2, 3, 4}));
  msg = error_message([&] { TokenData::load(path); });
  EXPECT_TRUE(contains(msg, "1032 bytes")) << msg;
  EXPECT_TRUE(contains(msg, "1030 bytes")) << msg;

  write_file(path, std::string(100, '\x01'));  // not even a header
  msg = error_message([&] { TokenData::load(path); });
  EXPECT_TRUE(contains(msg, "100 bytes")) << msg;
  EXPECT_TRUE(contains(msg, "1024-byte")) << msg;
}

TEST(TokenData, MissingFileNamesPath) {
  std::string path = temp_dir("data-missing") + "/nope.txt";
  std::string msg = error_message([&] { TokenData::load(path); });
  EXPECT_TRUE(contains(msg, path)) << msg;
  EXPECT_TRUE(contains(msg, "No such file or directory")) << msg;
}

TEST(TokenData, EmptyFileIsRejected) {
  std::string dir = temp_dir("data-empty");
  for (const char* name : {"/empty.txt", "/empty.bin"}) {
    std::string path = dir + name;
    write_file(path, "");
    std::string msg = error_message([&] { TokenData::load(path); });
    EXPECT_TRUE(contains(msg, path)) << msg;
    EXPECT_TRUE(contains(msg, "empty")) << msg;
  }
}

TEST(TokenData, FromTokensValidatesIds) {
  TokenData d = TokenData::from_tokens({3, 1, 4, 1, 5}, 10);
  EXPECT_EQ(d.max_token(), 6);
  EXPECT_EQ(d.size(), 5);
  std::string msg = error_message([] { TokenData::from_tokens({1, -2}, 0); });
  EXPECT_TRUE(contains(msg, "-2")) << msg;
  msg = error_message([] { TokenData::from_tokens({1, 10}, 10); });
  EXPECT_TRUE(contains(msg, "token 10 at index 1")) << msg;
}

}  // namespace
}  // namespace weft
