// weft/data.h — token data and the order in which training reads it.
//
// A text file is bytes (vocab 256). A ".bin" file is llm.c's token format:
// a header of 256 int32 (magic 20240520, version 1, token count), then the
// tokens as uint16. The order is fixed so that every parallel layout sees the
// same batches:
//   window w   = tokens [w*T, w*T + T]    (inputs w*T.., targets shifted by one)
//   windows    = (tokens - 1) / T
//   step s     = windows s*G .. s*G + G - 1, modulo the number of windows
// where G is the global batch in sequences. Within step s, micro-batch j of
// data-parallel replica r (dp replicas, B sequences each) holds sequences
// s*G + j*B*dp + r*B + [0, B).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft {

enum class TokenFormat { Auto, Text, LlmcBin };

class TokenData {
 public:
  // Auto: ".bin" files are llm.c token files, anything else is text bytes.
  // Throws Error for a missing/unreadable file, a bad header (naming the
  // field, its value and the expected one), or a truncated token section.
  static TokenData load(const std::string& path, TokenFormat format = TokenFormat::Auto);
  static TokenData from_tokens(std::vector<int32_t> tokens, int32_t vocab_hint);

  const std::vector<int32_t>& tokens() const { return tokens_; }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  // Largest token id + 1.
  int32_t max_token() const { return max_token_; }
  bool is_text() const { return is_text_; }
  const std::string& path() const { return path_; }

  // Number of windows of length seq_len (throws if there are none).
  int64_t windows(int64_t seq_len) const;
  // Fills inputs and targets (each count*seq_len) with windows
  // first_sequence .. first_sequence+count-1 (modulo windows(seq_len)).
  // With `num_windows` > 0, only windows [first_window, first_window +
  // num_windows) are read (a train or validation split), sequence k being
  // window first_window + k mod num_windows.
  void fill(int64_t first_sequence, int64_t count, int64_t seq_len, int32_t* inputs,
            int32_t* targets, int64_t first_window = 0, int64_t num_windows = 0) const;

 private:
  std::vector<int32_t> tokens_;
  int32_t max_token_ = 0;
  bool is_text_ = true;
  std::string path_;
};

// First sequence index of micro-batch `micro` of replica `dp_rank` at `step`.
int64_t first_sequence(int64_t step, int64_t global_batch, int64_t micro_batch, int64_t micro,
                       int64_t dp, int64_t dp_rank);

}  // namespace weft
