#include <weft/data.h>
#include <weft/error.h>

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using testing::contains;
using testing::error_message;

using testing::read_file;
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

// Megatron's index, laid out by hand from its format: magic, version, token
// type code, sequence and document counts, then lengths (int32), byte
// pointers (int64) and the document index (int64).
std::string megatron_index(uint8_t code, const std::vector<int32_t>& lengths,
                           const std::vector<int64_t>& pointers, const std::vector<int64_t>& docs) {
  std::string b("MMIDIDX\0\0", 9);
  auto put = [&](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) b.push_back(static_cast<char>(v >> (8 * i)));
  };
  put(1, 8);
  b.push_back(static_cast<char>(code));
  put(lengths.size(), 8);
  put(docs.size(), 8);
  for (int32_t l : lengths) put(static_cast<uint32_t>(l), 4);
  for (int64_t p : pointers) put(static_cast<uint64_t>(p), 8);
  for (int64_t d : docs) put(static_cast<uint64_t>(d), 8);
  return b;
}

std::string write_indexed(const std::string& prefix, int64_t vocab,
                          const std::vector<std::vector<int32_t>>& docs) {
  IndexedDatasetWriter w(prefix, vocab);
  for (const auto& d : docs) w.add_document(d);
  w.finish();
  return prefix;
}

TEST(IndexedDataset, TheWriterWritesMegatronsLayout) {
  const std::string prefix = temp_dir("indexed-layout") + "/corpus";
  write_indexed(prefix, 50257, {{7, 8, 9}, {50256, 1}});
  EXPECT_EQ(read_file(prefix + ".idx"), megatron_index(8, {3, 2}, {0, 6}, {0, 1, 2}));
  EXPECT_EQ(read_file(prefix + ".bin"), std::string("\x07\0\x08\0\x09\0\x50\xc4\x01\0", 10));
  // A vocabulary past uint16 is written as int32.
  write_indexed(prefix, 70000, {{69999}});
  EXPECT_EQ(read_file(prefix + ".idx"), megatron_index(4, {1}, {0}, {0, 1}));
  EXPECT_EQ(read_file(prefix + ".bin"), std::string("\x6f\x11\x01\0", 4));
  // Nothing is left in place of an unfinished dataset.
  const std::string other = temp_dir("indexed-layout") + "/unfinished";
  {
    IndexedDatasetWriter w(other, 10);
    w.add_document(std::vector<int32_t>{1, 2});
    EXPECT_TRUE(contains(error_message([&] { w.add_document(std::vector<int32_t>{10}); }),
                         "token 10 at 0 of document 1 is outside the vocabulary of 10"));
  }
  EXPECT_FALSE(std::ifstream(other + ".bin").good());
  EXPECT_FALSE(std::ifstream(other + ".bin.tmp").good());
}

TEST(IndexedDataset, ItsDocumentsInOrderAreTheStreamWhicheverNameIsGiven) {
  const std::string prefix = temp_dir("indexed-read") + "/corpus";
  for (int64_t vocab : {300, 70000}) {
    write_indexed(prefix, vocab, {{1, 2, 3}, {}, {299, 4}, {5}});
    for (const std::string& name : {prefix, prefix + ".bin", prefix + ".idx"}) {
      const TokenData d = TokenData::load(name);
      EXPECT_EQ(d.format(), TokenFormat::Indexed) << name;
      EXPECT_EQ(d.tokens(), (std::vector<int32_t>{1, 2, 3, 299, 4, 5})) << name;
      EXPECT_EQ(d.documents(), 4);
      EXPECT_EQ(d.files(), (std::vector<std::string>{prefix + ".idx", prefix + ".bin"}));
      EXPECT_EQ(d.windows(2), 2);
    }
    EXPECT_EQ(token_files(prefix, TokenFormat::Auto),
              (std::vector<std::string>{prefix + ".idx", prefix + ".bin"}));
  }
  // Named as indexed without its files: which ones are missing.
  std::string msg = error_message([&] { TokenData::load(prefix + "-none", TokenFormat::Indexed); });
  EXPECT_TRUE(contains(msg, "needs both")) << msg;
}

TEST(IndexedDataset, ABadIndexIsNamedWithWhatIsWrong) {
  const std::string dir = temp_dir("indexed-bad");
  const std::string p = dir + "/d";
  auto expect = [&](const std::string& idx, const std::string& bin, const std::string& what) {
    write_file(p + ".idx", idx);
    write_file(p + ".bin", bin);
    const std::string msg = error_message([&] { TokenData::load(p); });
    EXPECT_TRUE(contains(msg, what)) << msg;
    EXPECT_TRUE(contains(msg, p)) << msg;
  };
  const std::string four(8, '\1');  // 4 uint16 tokens
  expect("NOTANIDX" + std::string(40, '\0'), four, "not a Megatron index");
  std::string v2 = megatron_index(8, {4}, {0}, {0, 1});
  v2[9] = 2;
  expect(v2, four, "index version is 2, expected 1");
  expect(megatron_index(5, {4}, {0}, {0, 1}), four, "token type code 5");
  std::string cut = megatron_index(8, {4}, {0}, {0, 1});
  cut.pop_back();
  expect(cut, four, "1 sequences and 2 document entries need 62 bytes, the index has 61");
  expect(megatron_index(8, {2, 2}, {0, 6}, {0, 2}), four,
         "sequence 1 starts at byte 6, where the sequences before it end at byte 4");
  expect(megatron_index(8, {2, 2}, {0, 4}, {0, 1}), four, "document index must run from 0 to");
  expect(megatron_index(8, {5}, {0}, {0, 1}), four, "the index points past the data");
  expect(megatron_index(8, {3}, {0}, {0, 1}), four, "extra bytes follow the indexed tokens");
  expect(megatron_index(8, {-1}, {0}, {0, 1}), four, "sequence 0 has length -1");
}

TEST(TokenData, Uint16IsNamedNeverGuessed) {
  const std::string path = temp_dir("data-u16") + "/train.bin";
  write_file(path, std::string("\x01\0\xff\xff\x02\x01", 6));
  const TokenData d = TokenData::load(path, TokenFormat::Uint16);
  EXPECT_EQ(d.tokens(), (std::vector<int32_t>{1, 65535, 258}));
  EXPECT_EQ(d.format(), TokenFormat::Uint16);
  // As ".bin" it is taken for llm.c's, whose error says how to read it.
  std::string msg = error_message([&] { TokenData::load(path); });
  EXPECT_TRUE(contains(msg, "--data-format uint16")) << msg;
  write_file(path, std::string("\x01\0\x02", 3));
  msg = error_message([&] { TokenData::load(path, TokenFormat::Uint16); });
  EXPECT_TRUE(contains(msg, "3 bytes is not a whole number of uint16 tokens")) << msg;
  EXPECT_EQ(parse_token_format("uint16"), TokenFormat::Uint16);
  msg = error_message([] { parse_token_format("npy"); });
  EXPECT_TRUE(contains(msg, "'npy' is not one of auto, text, llmc, uint16, indexed")) << msg;
}

TEST(Permute, TakesEveryValueOnceAndDependsOnTheKey) {
  for (uint64_t n : {1, 2, 3, 5, 16, 17, 100, 4097}) {
    for (uint64_t key : {0ULL, 1ULL, 0xdeadbeefULL}) {
      std::vector<uint64_t> seen(n, 0);
      for (uint64_t i = 0; i < n; ++i) ++seen[permute(i, n, key)];
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<std::ptrdiff_t>(n))
          << "n " << n << " key " << key;
    }
  }
  // Two keys give two orders; neither is the identity.
  int same = 0, fixed = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    same += permute(i, 1000, 1) == permute(i, 1000, 2);
    fixed += permute(i, 1000, 1) == i;
  }
  EXPECT_LT(same, 20);  // about 1 expected of a random pair
  EXPECT_LT(fixed, 20);
}

std::shared_ptr<const TokenData> shared(TokenData d) {
  return std::make_shared<const TokenData>(std::move(d));
}

TEST(WindowOrder, InFileOrderItIsTheOldOrder) {
  const auto d = shared(ramp(31));  // 10 windows of T = 3
  const WindowOrder order({{d, 1.0, 2, 5}}, 3, /*shuffle=*/false, 7);
  for (int64_t k = 0; k < 12; ++k) EXPECT_EQ(order.locate(k).window, 2 + k % 5);
  std::vector<int32_t> in(6), tg(6), in2(6), tg2(6);
  order.fill(4, 2, in.data(), tg.data());
  d->fill(4, 2, 3, in2.data(), tg2.data(), 2, 5);
  EXPECT_EQ(in, in2);
  EXPECT_EQ(tg, tg2);
  EXPECT_EQ(in, (std::vector<int32_t>{118, 119, 120, 106, 107, 108}));  // windows 6, 2
  EXPECT_EQ(tg, (std::vector<int32_t>{119, 120, 121, 107, 108, 109}));
}

TEST(WindowOrder, ShuffledEachEpochReadsEveryWindowOnceInAnotherOrder) {
  const auto d = shared(ramp(301));  // 100 windows of T = 3
  const WindowOrder order({{d, 1.0, 0, 0}}, 3, /*shuffle=*/true, 1234);
  std::vector<int64_t> e0, e1;
  for (int64_t k = 0; k < 100; ++k) e0.push_back(order.locate(k).window);
  for (int64_t k = 100; k < 200; ++k) e1.push_back(order.locate(k).window);
  EXPECT_NE(e0, e1);
  std::vector<int64_t> all(100);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_NE(e0, all);
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e0, all);
  EXPECT_EQ(e1, all);
  // The seed alone decides: the same seed gives the same order, another another.
  const WindowOrder again({{d, 1.0, 0, 0}}, 3, true, 1234), other({{d, 1.0, 0, 0}}, 3, true, 99);
  int differ = 0;
  for (int64_t k = 0; k < 100; ++k) {
    EXPECT_EQ(again.locate(k).window, order.locate(k).window);
    differ += other.locate(k).window != order.locate(k).window;
  }
  EXPECT_GT(differ, 80);
}

TEST(WindowOrder, ABlendHoldsEachWeightWithinOneSequenceWhereverItIsAsked) {
  const auto a = shared(ramp(31)), b = shared(ramp(61)), c = shared(ramp(13));
  const std::vector<BlendPart> parts{{a, 0.5, 0, 0}, {b, 0.3, 0, 0}, {c, 0.2, 0, 0}};
  const WindowOrder order(parts, 3, true, 5);
  // Sequence by sequence from the start...
  std::vector<int64_t> count(3, 0);
  std::vector<WindowOrder::Where> seq;
  for (int64_t k = 0; k < 10000; ++k) {
    seq.push_back(order.locate(k));
    ++count[static_cast<size_t>(seq.back().part)];
    for (size_t j = 0; j < 3; ++j)
      ASSERT_LE(std::abs(static_cast<double>(count[j]) - parts[j].weight * (k + 1)), 1.0)
          << "part " << j << " after " << k + 1;
  }
  // ...and asked out of order, as a resume or another replica asks: the same.
  const WindowOrder fresh(parts, 3, true, 5);
  for (int64_t k : {9999, 17, 4096, 4095, 8191, 0, 5000}) {
    EXPECT_EQ(fresh.locate(k).part, seq[static_cast<size_t>(k)].part) << k;
    EXPECT_EQ(fresh.locate(k).window, seq[static_cast<size_t>(k)].window) << k;
  }
  // Each part's own sequences go through its windows, each once per epoch.
  std::map<int64_t, int> c_windows;
  int taken = 0;
  for (const auto& w : seq)
    if (w.part == 2 && taken++ < 4 * 4) ++c_windows[w.window];  // 4 epochs of c's 4 windows
  EXPECT_EQ(c_windows.size(), 4u);
  for (const auto& [w, n] : c_windows) EXPECT_EQ(n, 4) << "window " << w;
}

TEST(WindowOrder, BadWeightsAndTokensPastTheVocabularyAreNamed) {
  const auto d = shared(ramp(31));
  std::string msg = error_message([&] { WindowOrder({{d, 0.0, 0, 0}}, 3, false, 0); });
  EXPECT_TRUE(contains(msg, "blend weight 0 must be positive")) << msg;
  const WindowOrder order({{d, 1.0, 0, 0}}, 3, false, 0);
  std::vector<int32_t> in(3), tg(3);
  order.fill(0, 1, in.data(), tg.data(), 200);
  msg = error_message([&] { order.fill(1, 1, in.data(), tg.data(), 105); });
  EXPECT_TRUE(contains(msg,
                       "token 105 (token 5 of the stream, in window 1) is outside the "
                       "vocabulary of 105"))
      << msg;
}

// Resident memory of this process, in bytes.
int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// A dataset far larger than what a rank may hold (4 GiB of tokens: 8 GiB as
// int32) is read in place: training on shuffled windows of it adds a few
// pages per window to the process, not the dataset.
TEST(IndexedDataset, ARankHoldsOnlyTheWindowsItReads) {
  const std::string prefix = temp_dir("indexed-large") + "/big";
  const int32_t half = int32_t{1} << 30;  // two documents of 2^30 uint16 tokens
  write_file(prefix + ".idx", megatron_index(8, {half, half}, {0, int64_t{2} * half}, {0, 1, 2}));
  const int fd = ::open((prefix + ".bin").c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, int64_t{4} * half), 0);  // sparse: token 0 throughout
  ::close(fd);
  const int64_t before = resident_bytes();
  auto d = shared(TokenData::load(prefix));
  EXPECT_EQ(d->size(), int64_t{2} * half);
  const int64_t t = 1024;
  const WindowOrder order({{d, 1.0, 0, 0}}, t, true, 1);
  std::vector<int32_t> in(64 * t), tg(64 * t);
  for (int step = 0; step < 4; ++step) order.fill(step * 64, 64, in.data(), tg.data(), 50257);
  const int64_t grown = resident_bytes() - before;
  EXPECT_LT(grown, int64_t{64} << 20) << "resident memory grew by " << grown << " bytes";
  d.reset();
  std::remove((prefix + ".bin").c_str());
}

}  // namespace
}  // namespace weft
