#include <weft/error.h>
#include <weft/tokenizer.h>

#include <array>
#include <fstream>

namespace weft {

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  check(f.good(), "tokenizer {}: cannot open", path);
  std::array<uint32_t, 256> header{};
  f.read(reinterpret_cast<char*>(header.data()), sizeof header);
  check(f.gcount() == static_cast<std::streamsize>(sizeof header),
        "tokenizer {}: {} bytes, shorter than its 1024-byte header", path, f.gcount());
  check(header[0] == 20240328, "tokenizer {}: magic {} is not llm.c's tokenizer magic 20240328",
        path, header[0]);
  check(header[1] == 1 || header[1] == 2, "tokenizer {}: version {} is not 1 or 2", path,
        header[1]);
  check(header[2] > 0 && header[2] <= (1u << 24), "tokenizer {}: vocabulary size {} is not in "
        "[1, 2^24]", path, header[2]);
  Tokenizer t;
  t.path_ = path;
  if (header[1] == 2) t.eot_ = static_cast<int32_t>(header[3]);
  t.pieces_.resize(header[2]);
  for (size_t i = 0; i < t.pieces_.size(); ++i) {
    unsigned char len = 0;
    f.read(reinterpret_cast<char*>(&len), 1);
    check(f.good(), "tokenizer {}: ends at token {} of {}", path, i, header[2]);
    t.pieces_[i].resize(len);
    f.read(t.pieces_[i].data(), len);
    check(f.gcount() == len, "tokenizer {}: token {} is cut short", path, i);
  }
  return t;
}

const std::string& Tokenizer::decode(int32_t id) const {
  check(id >= 0 && id < vocab_size(), "token {} is outside the tokenizer's vocabulary [0, {}) ({})",
        id, vocab_size(), path_);
  return pieces_[static_cast<size_t>(id)];
}

}  // namespace weft
