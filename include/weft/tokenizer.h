// weft/tokenizer.h — decoding token ids to text, from llm.c's tokenizer file.
//
// The file (e.g. gpt2_tokenizer.bin, written by llm.c's train_gpt2.py) is a
// header of 256 uint32 (magic 20240328, version 1 or 2, vocabulary size, and
// for version 2 the end-of-text token), then each token's bytes as one length
// byte and that many bytes. It decodes only: it holds no merges, so it cannot
// encode a prompt.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft {

class Tokenizer {
 public:
  // Throws Error naming the file and what is wrong with it.
  static Tokenizer load(const std::string& path);
  int64_t vocab_size() const { return static_cast<int64_t>(pieces_.size()); }
  int32_t eot() const { return eot_; }  // -1 when the file does not say
  // The bytes of token `id`; throws Error for an id outside the vocabulary.
  const std::string& decode(int32_t id) const;

 private:
  std::vector<std::string> pieces_;
  int32_t eot_ = -1;
  std::string path_;
};

}  // namespace weft
