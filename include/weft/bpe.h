// weft/bpe.h — GPT-2's byte-level BPE tokenizer (Megatron's GPT2BPETokenizer):
// text to token ids and back.
//
//   auto bpe = weft::BpeTokenizer::load("gpt2/vocab.json", "gpt2/merges.txt");
//   std::vector<int32_t> ids = bpe.encode("Hello world");  // {15496, 995} with GPT-2's files
//   std::string text = bpe.decode(ids);                    // "Hello world"
//
// encode() splits UTF-8 text with GPT-2's pre-tokenization regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// maps each piece's bytes to GPT-2's byte-level alphabet (every byte a
// printable code point: ' ' is 'Ġ', '\n' is 'Ċ') and merges adjacent symbols
// by the merges' ranks, lowest first, as Hugging Face's tokenizers does. The
// ids are tokenizers' (tests/test_bpe.cc holds weft to them token for token).
// Special tokens such as <|endoftext|> are vocabulary entries only: encode()
// never parses them out of the text (as Megatron's tokenizer, which appends
// eod() between documents itself), so "<|endoftext|>" in a text is encoded as
// its characters. Bytes that are not valid UTF-8 are pieces of their own,
// encoded byte by byte through the merges, so decode(encode(s)) == s for any
// bytes s.
//
// Built only with PCRE2 (libpcre2-dev), the regex engine: without it the
// loaders throw Error saying so, and available() is false.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace weft {

class BpeTokenizer {
 public:
  // GPT-2's files, as Megatron's --vocab-file and --merge-file take them:
  // vocab.json, a JSON object of byte-level token -> id, ids 0..N-1, holding
  // all 256 byte symbols; merges.txt, an optional "#version" line, then one
  // merge "a b" a line, ranked by order, each of a, b and ab in the vocabulary.
  // Throws Error naming the file (and line) and the rule broken.
  static BpeTokenizer load(const std::string& vocab_path, const std::string& merges_path);
  // A Hugging Face tokenizer.json of the same kind: model BPE (merges as
  // "a b" strings or ["a", "b"] pairs), pre-tokenizer ByteLevel without a
  // prefix space, no normalizer. Its added tokens join the vocabulary for
  // decode(), token_id() and eod(); like the vocabulary's, they are never
  // parsed out of the text, and no post-processor adds any.
  static BpeTokenizer load_json(const std::string& tokenizer_json_path);
  // Whether this build has the tokenizer (weft found PCRE2 when it was set up).
  static bool available();

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  // Not const: encoding keeps a cache of pieces seen before. One tokenizer
  // must not encode on two threads at once; load one per thread.
  std::vector<int32_t> encode(std::string_view text);
  void encode(std::string_view text, std::vector<int32_t>& out);  // appends to out
  // The bytes of the tokens, concatenated (not necessarily valid UTF-8 when
  // the ids split a character). Throws Error for an id outside [0, vocab_size()).
  std::string decode(std::span<const int32_t> ids) const;

  int64_t vocab_size() const;  // N: the vocabulary's tokens, ids 0..N-1
  int32_t eod() const;         // the id of <|endoftext|>; -1 when the vocabulary has none
  // The id of a token as the vocabulary spells it ("<|endoftext|>", "Ġthe"); -1 when absent.
  int32_t token_id(std::string_view token) const;

 private:
  struct Impl;
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weft
