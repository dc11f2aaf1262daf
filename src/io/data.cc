#include <weft/data.h>
#include <weft/error.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace weft {
namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

std::string read_all(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  check(f != nullptr, "{}: cannot open token file: {}", path, std::strerror(errno));
  std::string bytes;
  char buf[1 << 16];
  size_t got = 0;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.append(buf, got);
  bool failed = std::ferror(f) != 0;
  int err = errno;
  std::fclose(f);
  check(!failed, "{}: cannot read token file: {}", path, std::strerror(err));
  return bytes;
}

// The format is little-endian whatever the host is.
int32_t le_i32(const std::string& b, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return static_cast<int32_t>(v);
}

uint16_t le_u16(const std::string& b, size_t at) {
  return static_cast<uint16_t>(static_cast<unsigned char>(b[at]) |
                               (static_cast<unsigned char>(b[at + 1]) << 8));
}

std::vector<int32_t> parse_llmc(const std::string& path, const std::string& b) {
  check(b.size() >= kLlmcHeaderBytes,
        "{}: file is {} bytes, shorter than the {}-byte llm.c token header", path, b.size(),
        kLlmcHeaderBytes);
  int32_t magic = le_i32(b, 0), version = le_i32(b, 4), count = le_i32(b, 8);
  check(magic == kLlmcMagic, "{}: header magic is {}, expected {} (llm.c token file)", path, magic,
        kLlmcMagic);
  check(version == kLlmcVersion, "{}: header version is {}, expected {}", path, version,
        kLlmcVersion);
  check(count > 0, "{}: header token count is {}, must be > 0", path, count);
  size_t expected = kLlmcHeaderBytes + 2 * static_cast<size_t>(count);
  check(b.size() == expected,
        "{}: file is {} bytes, but a header token count of {} needs exactly {} bytes "
        "(1024 + 2 per token); {}",
        path, b.size(), count, expected,
        b.size() < expected ? "the token section is truncated" : "extra bytes follow the tokens");
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = le_u16(b, kLlmcHeaderBytes + 2 * i);
  return tokens;
}

int32_t max_plus_one(const std::vector<int32_t>& tokens) {
  return tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end()) + 1;
}

std::string describe(const std::string& path) { return path.empty() ? "token data" : path; }

}  // namespace

TokenData TokenData::load(const std::string& path, TokenFormat format) {
  if (format == TokenFormat::Auto)
    format = std::filesystem::path(path).extension() == ".bin" ? TokenFormat::LlmcBin
                                                               : TokenFormat::Text;
  std::string bytes = read_all(path);
  check(!bytes.empty(), "{}: token file is empty (0 bytes)", path);

  TokenData d;
  d.path_ = path;
  if (format == TokenFormat::LlmcBin) {
    d.tokens_ = parse_llmc(path, bytes);
    d.is_text_ = false;
  } else {
    d.tokens_.resize(bytes.size());
    for (size_t i = 0; i < bytes.size(); ++i)
      d.tokens_[i] = static_cast<unsigned char>(bytes[i]);
    d.is_text_ = true;
  }
  d.max_token_ = max_plus_one(d.tokens_);
  return d;
}

// vocab_hint > 0 bounds the ids; 256 marks byte tokens, which is what text is.
TokenData TokenData::from_tokens(std::vector<int32_t> tokens, int32_t vocab_hint) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    check(tokens[i] >= 0, "token {} at index {} is negative", tokens[i], i);
    check(vocab_hint <= 0 || tokens[i] < vocab_hint,
          "token {} at index {} is outside the vocabulary of {}", tokens[i], i, vocab_hint);
  }
  TokenData d;
  d.tokens_ = std::move(tokens);
  d.max_token_ = max_plus_one(d.tokens_);
  d.is_text_ = vocab_hint == 256;
  return d;
}

int64_t TokenData::windows(int64_t seq_len) const {
  check(seq_len > 0, "{}: sequence length {} must be > 0", describe(path_), seq_len);
  int64_t n = size() > 0 ? (size() - 1) / seq_len : 0;
  check(n > 0,
        "{}: {} tokens hold no window of sequence length {} (a window needs {} tokens: inputs "
        "plus the shifted target)",
        describe(path_), size(), seq_len, seq_len + 1);
  return n;
}

void TokenData::fill(int64_t first_sequence, int64_t count, int64_t seq_len, int32_t* inputs,
                     int32_t* targets, int64_t first_window, int64_t num_windows) const {
  const int64_t all = windows(seq_len);
  check(first_window >= 0 && num_windows >= 0 && first_window + num_windows <= all,
        "{}: windows [{}, +{}) are outside the data's {} windows", describe(path_), first_window,
        num_windows, all);
  const int64_t n = num_windows > 0 ? num_windows : all;
  check(first_sequence >= 0 && count >= 0, "{}: sequences [{}, +{}) must be non-negative",
        describe(path_), first_sequence, count);
  const size_t t = static_cast<size_t>(seq_len);
  for (int64_t i = 0; i < count; ++i) {
    int64_t w = first_window + (first_sequence + i) % n;
    const int32_t* src = tokens_.data() + static_cast<size_t>(w) * t;
    std::copy(src, src + t, inputs + static_cast<size_t>(i) * t);
    std::copy(src + 1, src + 1 + t, targets + static_cast<size_t>(i) * t);
  }
}

int64_t first_sequence(int64_t step, int64_t global_batch, int64_t micro_batch, int64_t micro,
                       int64_t dp, int64_t dp_rank) {
  check(step >= 0 && micro >= 0 && micro_batch > 0 && dp > 0 && dp_rank >= 0 && dp_rank < dp,
        "first_sequence: step {}, micro {}, micro_batch {}, dp_rank {} of dp {} must satisfy "
        "step, micro >= 0, micro_batch > 0, 0 <= dp_rank < dp",
        step, micro, micro_batch, dp_rank, dp);
  // Each step owns sequences [s*G, s*G + G); a micro-batch beyond that would
  // read the next step's data.
  check((micro + 1) * micro_batch * dp <= global_batch,
        "first_sequence: micro-batch {} of {} sequences x {} replicas ends past the global batch "
        "of {} sequences",
        micro, micro_batch, dp, global_batch);
  return step * global_batch + micro * micro_batch * dp + dp_rank * micro_batch;
}

}  // namespace weft
