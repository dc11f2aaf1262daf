// weft/data.h — token data, read in place, and the order training reads it in.
//
// A dataset is one token stream, memory-mapped: a rank touches only the pages
// of the windows it trains on. Formats:
//   text     the file's bytes are the tokens (vocabulary 256)
//   llmc     llm.c's ".bin": 256 int32 of header (magic 20240520, version 1,
//            token count), then the tokens as uint16
//   uint16   nanoGPT's ".bin": uint16 tokens and nothing else (no header, so
//            it is never guessed: name it)
//   indexed  Megatron's indexed dataset: PREFIX.idx (documents and their
//            offsets) beside PREFIX.bin (the tokens, uint8, uint16 or int32);
//            its documents, in file order, are the stream
// A window is T + 1 consecutive tokens of the stream (inputs, and targets
// shifted by one): window w = tokens [w*T, w*T + T], windows = (tokens - 1)/T.
//
// WindowOrder says which window is the run's sequence k (k = step * G + i for
// a global batch of G sequences): a function of the datasets, their weights,
// the seed and k, never of the layout. Within step s, micro-batch j of
// data-parallel replica r (dp replicas, B sequences each) holds sequences
// s*G + j*B*dp + r*B + [0, B) (first_sequence below).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace weft {

enum class TokenFormat { Auto, Text, LlmcBin, Uint16, Indexed };

// "auto", "text", "llmc", "uint16", "indexed"; anything else is an Error
// naming the choices.
TokenFormat parse_token_format(const std::string& name);
const char* token_format_name(TokenFormat format);

// The files TokenData::load(path, format) reads (an indexed dataset's .idx
// and .bin), found without reading them.
std::vector<std::string> token_files(const std::string& path, TokenFormat format);

class TokenData {
 public:
  // Auto: PREFIX (or PREFIX.bin, or PREFIX.idx) with both PREFIX.idx and
  // PREFIX.bin present is an indexed dataset; another ".bin" is an llm.c
  // token file; anything else is text. Throws Error naming the file and what
  // is wrong: missing or unreadable, empty, a header field (its value and the
  // expected one), a token section of the wrong length, an index that points
  // past its data or disagrees with itself.
  static TokenData load(const std::string& path, TokenFormat format = TokenFormat::Auto);
  // Tokens held in memory; vocab_hint > 0 bounds the ids (256 marks bytes).
  static TokenData from_tokens(std::vector<int32_t> tokens, int32_t vocab_hint);

  int64_t size() const { return size_; }
  int32_t operator[](int64_t i) const;
  // Tokens [first, first + count) into out.
  void read(int64_t first, int64_t count, int32_t* out) const;
  // Every token, copied (small data and tests).
  std::vector<int32_t> tokens() const;
  // Largest token id + 1: reads every token.
  int32_t max_token() const;
  bool is_text() const { return format_ == TokenFormat::Text; }
  TokenFormat format() const { return format_; }
  // An indexed dataset's documents; 1 for a plain stream.
  int64_t documents() const { return documents_; }
  // What load() was given, and the files it reads (an indexed dataset's .idx
  // and .bin).
  const std::string& path() const { return path_; }
  const std::vector<std::string>& files() const { return files_; }

  // Number of windows of length seq_len (throws if there are none).
  int64_t windows(int64_t seq_len) const;
  // Fills inputs and targets (each count*seq_len) with windows
  // first_sequence .. first_sequence+count-1 (modulo windows(seq_len)).
  // With `num_windows` > 0, only windows [first_window, first_window +
  // num_windows) are read (a train or validation split), sequence k being
  // window first_window + k mod num_windows.
  void fill(int64_t first_sequence, int64_t count, int64_t seq_len, int32_t* inputs,
            int32_t* targets, int64_t first_window = 0, int64_t num_windows = 0) const;
  // Window w into inputs and targets (seq_len each).
  void fill_window(int64_t w, int64_t seq_len, int32_t* inputs, int32_t* targets) const;

 private:
  std::shared_ptr<const void> hold_;  // the mapping, or the vector, the tokens live in
  const unsigned char* base_ = nullptr;
  int elem_ = 4;  // bytes per token: 1 (uint8), 2 (uint16 little-endian) or 4 (int32)
  int64_t size_ = 0;
  int64_t documents_ = 1;
  TokenFormat format_ = TokenFormat::Text;
  std::string path_;
  std::vector<std::string> files_;
};

// Writes Megatron's indexed dataset, one document at a time: tokens go to
// PREFIX.bin as uint16 when the vocabulary fits (ids < 65536), else int32;
// finish() writes PREFIX.idx. Both are written beside as ".tmp" files and
// renamed by finish(), so a dataset that was not finished is never found.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, int64_t vocab_size);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Throws for a token outside [0, vocab_size).
  void add_document(std::span<const int32_t> tokens);
  void finish();
  int64_t documents() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t tokens() const { return tokens_; }

 private:
  std::string prefix_;
  int64_t vocab_;
  int elem_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  int64_t tokens_ = 0;
  std::vector<unsigned char> buf_;
};

// One dataset of a blend: windows [first_window, first_window + num_windows)
// of `data` (num_windows 0: all of them), drawn with `weight` (> 0; the
// weights need not sum to 1).
struct BlendPart {
  std::shared_ptr<const TokenData> data;
  double weight = 1;
  int64_t first_window = 0, num_windows = 0;
};

// Which window is sequence k. The parts are interleaved so that after any
// k sequences each part's share is within one sequence of its weight's
// (the part furthest below its share comes next; ties go to the first). A
// part's c-th sequence is its window c mod n (n windows), in order, or, when
// shuffled, through a permutation of its n windows drawn from the seed, the
// part and the epoch c / n: every window once per epoch, in another order
// each epoch. Memory is O(parts) plus O(parts) per 4096 sequences of the
// furthest sequence asked for; sequences asked in order cost O(parts) each.
class WindowOrder {
 public:
  WindowOrder(std::vector<BlendPart> parts, int64_t seq_len, bool shuffle, uint64_t seed);

  struct Where {
    int part;
    int64_t window;  // within the part's data
  };
  Where locate(int64_t sequence) const;
  // Sequences [first_sequence, first_sequence + count) into inputs and
  // targets (count * seq_len each). With vocab > 0, a token outside
  // [0, vocab) is an Error naming the file, the token's place and value.
  void fill(int64_t first_sequence, int64_t count, int32_t* inputs, int32_t* targets,
            int64_t vocab = 0) const;

  int64_t seq_len() const { return seq_len_; }
  bool shuffled() const { return shuffle_; }
  const std::vector<BlendPart>& parts() const { return parts_; }
  // Every part's windows: an epoch of the blend read once at its weights'
  // proportions would take about this many sequences per part.
  int64_t windows(int part) const { return n_[static_cast<size_t>(part)]; }

 private:
  int64_t part_sequence(int64_t sequence, int* part) const;

  std::vector<BlendPart> parts_;
  std::vector<double> share_;  // weights / their sum
  std::vector<int64_t> n_;     // windows per part
  int64_t seq_len_;
  bool shuffle_;
  uint64_t seed_;
  mutable std::mutex mu_;
  // counts_[b * parts + j]: how many of the first b * kBlock sequences part j holds.
  mutable std::vector<int64_t> counts_;
  // A cursor: cur_[j] is how many of the first at_ sequences part j holds.
  mutable std::vector<int64_t> cur_;
  mutable int64_t at_ = 0;
};

// A permutation of [0, n) drawn from key: permute(i, n, key) for i in [0, n)
// takes every value in [0, n) once. O(1) memory (a Feistel network over the
// next power of 4, walked until it lands in range).
uint64_t permute(uint64_t i, uint64_t n, uint64_t key);

// First sequence index of micro-batch `micro` of replica `dp_rank` at `step`.
int64_t first_sequence(int64_t step, int64_t global_batch, int64_t micro_batch, int64_t micro,
                       int64_t dp, int64_t dp_rank);

}  // namespace weft
