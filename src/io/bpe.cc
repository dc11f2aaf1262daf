#include <weft/bpe.h>
#include <weft/error.h>

#include "weft_config.h"

#if WEFT_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <bit>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <utility>
#endif

namespace weft {

#if WEFT_PCRE2

namespace {

using nlohmann::json;

// GPT-2's pre-tokenization pattern (OpenAI's encoder.py; tokenizers' ByteLevel).
constexpr char kPattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr char kEod[] = "<|endoftext|>";
// Pieces up to this long are cached, up to this many of them (then the cache
// starts again empty).
constexpr size_t kMaxCachedBytes = 256;
constexpr size_t kCacheEntries = size_t{1} << 16;

// GPT-2's byte-level alphabet (bytes_to_unicode): the printable bytes of
// Latin-1 stand for themselves; the other 68 (controls, space, DEL, NBSP, the
// soft hyphen) take the code points 256, 257, ... in byte order.
constexpr char32_t kSymbolLimit = 256 + 68;
std::array<char32_t, 256> byte_symbols() {
  std::array<char32_t, 256> cp{};
  char32_t extra = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    cp[static_cast<size_t>(b)] = printable ? static_cast<char32_t>(b) : extra++;
  }
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {  // cp < 0x800: the alphabet's range
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The bytes a token stands for: each code point of its string mapped back
// through the alphabet; a string with a code point outside the alphabet (an
// added token with a plain space, say) stands for its own UTF-8 bytes, as in
// tokenizers' ByteLevel decoder.
std::string token_bytes(const std::string& token, const std::array<int, kSymbolLimit>& byte_of) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    auto lead = static_cast<unsigned char>(token[i]);
    size_t n = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    if (n > 2 || i + n > token.size()) return token;  // beyond U+07FF: not a symbol
    char32_t cp = n == 1 ? lead : ((lead & 0x1Fu) << 6) | (token[i + 1] & 0x3Fu);
    if (cp >= kSymbolLimit || byte_of[cp] < 0) return token;
    out += static_cast<char>(byte_of[cp]);
    i += n;
  }
  return out;
}

// s as a JSON string, quoted and escaped, for messages (bytes that are not
// UTF-8, as a merges.txt line may hold, become U+FFFD).
std::string json_string(std::string_view s) {
  return json(std::string(s)).dump(-1, ' ', false, json::error_handler_t::replace);
}

// nlohmann's message without its "[json.exception.parse_error.101] " tag.
std::string parse_message(const json::exception& e) {
  std::string what = e.what();
  size_t tag = what.find("] ");
  return tag == std::string::npos ? what : what.substr(tag + 2);
}

json read_json(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  check(f.good(), "{}: cannot open", path);
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw Error("{}: not valid JSON: {}", path, parse_message(e));
  }
}

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buf{};
  int n = pcre2_get_error_message(code, buf.data(), buf.size());
  if (n < 0) return fmt::format("PCRE2 error {}", code);
  return std::string(reinterpret_cast<const char*>(buf.data()), static_cast<size_t>(n));
}

// "a b": two tokens separated by one space, as tokenizers reads a merge.
std::optional<std::pair<std::string_view, std::string_view>> split_merge(std::string_view line) {
  size_t space = line.find(' ');
  if (space == std::string_view::npos || space == 0 || space + 1 == line.size() ||
      line.find(' ', space + 1) != std::string_view::npos) {
    return std::nullopt;
  }
  return std::pair{line.substr(0, space), line.substr(space + 1)};
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct Merge {
  int32_t rank = 0;
  int32_t id = 0;  // the merged token
};

// The merges by (left, right) pair, in open addressing: a lookup reads one
// slot, mostly one cache line, where std::unordered_map's read a bucket, a
// node and its chain. Encoding a piece not seen before is little but these
// lookups, and with std::unordered_map it took twice as long.
class MergeTable {
 public:
  // A pair set twice keeps the later merge.
  void set(int32_t left, int32_t right, Merge merge) {
    if (2 * (count_ + 1) > slots_.size()) grow();
    Slot& slot = slots_[probe(key(left, right))];
    if (slot.key == kEmpty) ++count_;
    slot = {key(left, right), merge};
  }
  const Merge* find(int32_t left, int32_t right) const {
    if (slots_.empty()) return nullptr;
    const Slot& slot = slots_[probe(key(left, right))];
    return slot.key == kEmpty ? nullptr : &slot.merge;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are below 2^31: no pair's key
  struct Slot {
    uint64_t key = kEmpty;
    Merge merge;
  };
  static uint64_t key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  // The slot holding `k`, or the empty one where it would go (linear probing
  // from a Fibonacci hash; the table is at most half full).
  size_t probe(uint64_t k) const {
    size_t mask = slots_.size() - 1;
    size_t i = static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_);
    while (slots_[i].key != k && slots_[i].key != kEmpty) i = (i + 1) & mask;
    return i;
  }
  void grow() {
    std::vector<Slot> old =
        std::exchange(slots_, std::vector<Slot>(std::max<size_t>(64, 2 * slots_.size())));
    shift_ = 64 - std::countr_zero(slots_.size());
    for (const Slot& slot : old) {
      if (slot.key != kEmpty) slots_[probe(slot.key)] = slot;
    }
  }
  std::vector<Slot> slots_;
  size_t count_ = 0;
  int shift_ = 64;
};

struct CodeFree {
  void operator()(pcre2_code* p) const { pcre2_code_free(p); }
};
struct MatchDataFree {
  void operator()(pcre2_match_data* p) const { pcre2_match_data_free(p); }
};

}  // namespace

struct BpeTokenizer::Impl {
  // A candidate merge of the symbol at `pos` with the one after it, valid
  // while those two are still `left` and `right`.
  struct Candidate {
    int32_t rank, pos, left, right, merged;
  };
  struct Symbol {
    int32_t id, prev, next;  // id -1: merged into the symbol before it
  };

  std::string source;                   // the file(s), for messages
  StringMap<int32_t> ids;               // token as the vocabulary spells it -> id
  std::vector<std::string> bytes;       // id -> the bytes it stands for
  std::array<int32_t, 256> byte_ids{};  // byte -> the id of its symbol
  int32_t eod = -1;
  MergeTable merges;

  std::unique_ptr<pcre2_code, CodeFree> code;
  std::unique_ptr<pcre2_match_data, MatchDataFree> match;

  StringMap<std::pair<uint32_t, uint32_t>> cache;  // piece -> [offset, count) in cached_ids
  std::vector<int32_t> cached_ids;
  std::vector<Symbol> symbols;  // scratch of merge()
  std::vector<Candidate> queue;

  void add_token(const std::string& token, const json& id, const std::string& where);
  void finish_vocabulary(const std::string& where);
  void add_merge(std::string_view left, std::string_view right, int32_t rank,
                 const std::function<std::string()>& where);
  void compile_pattern();
  void encode_piece(std::string_view piece, std::vector<int32_t>& out);
  void merge(std::string_view piece, std::vector<int32_t>& out);

  std::vector<std::pair<int32_t, std::string>> by_id;  // filled while loading
};

void BpeTokenizer::Impl::add_token(const std::string& token, const json& id,
                                   const std::string& where) {
  if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
      id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
    throw Error("{}: token {} has id {}: ids are integers in [0, 2^31)", where, json_string(token),
                id.dump());
  }
  auto value = id.get<int32_t>();
  auto [it, inserted] = ids.emplace(token, value);
  if (inserted) {
    by_id.emplace_back(value, token);
  } else if (it->second != value) {
    throw Error("{}: token {} has two ids, {} and {}", where, json_string(token), it->second,
                value);
  }
}

// Every id from 0 to N - 1 names one token; the byte table, the bytes of each
// token and eod follow.
void BpeTokenizer::Impl::finish_vocabulary(const std::string& where) {
  std::sort(by_id.begin(), by_id.end());
  for (size_t i = 0; i < by_id.size(); ++i) {
    if (i > 0 && by_id[i].first == by_id[i - 1].first) {
      throw Error("{}: tokens {} and {} both have id {}", where, json_string(by_id[i - 1].second),
                  json_string(by_id[i].second), by_id[i].first);
    }
    if (static_cast<size_t>(by_id[i].first) != i) {
      throw Error(
          "{}: ids must run from 0 to N - 1 for N = {} tokens, but no token has id {} (token {} "
          "has id {})",
          where, by_id.size(), i, json_string(by_id[i].second), by_id[i].first);
    }
  }
  std::array<char32_t, 256> symbol = byte_symbols();
  std::array<int, kSymbolLimit> byte_of{};
  byte_of.fill(-1);
  for (int b = 0; b < 256; ++b) {
    byte_of[symbol[static_cast<size_t>(b)]] = b;
    std::string s;
    append_utf8(s, symbol[static_cast<size_t>(b)]);
    auto it = ids.find(s);
    check(it != ids.end(),
          "{}: byte 0x{:02x}'s symbol {} is not in the vocabulary: a byte-level BPE vocabulary "
          "(GPT-2's) holds all 256",
          where, b, json_string(s));
    byte_ids[static_cast<size_t>(b)] = it->second;
  }
  bytes.reserve(by_id.size());
  for (const auto& [id, token] : by_id) bytes.push_back(token_bytes(token, byte_of));
  by_id = {};
  auto it = ids.find(std::string_view(kEod));
  eod = it == ids.end() ? -1 : it->second;
}

// tokenizers' rule: the two tokens and their concatenation are in the
// vocabulary. A pair listed twice keeps its later rank, as in tokenizers and
// GPT-2's encoder.py.
void BpeTokenizer::Impl::add_merge(std::string_view left, std::string_view right, int32_t rank,
                                   const std::function<std::string()>& where) {
  std::string merged = std::string(left) + std::string(right);
  std::array<int32_t, 3> id{};
  std::array<std::string_view, 3> parts = {left, right, merged};
  for (size_t k = 0; k < 3; ++k) {
    auto it = ids.find(parts[k]);
    if (it == ids.end()) {
      throw Error("{}: merge {} {}: {}{} is not in the vocabulary", where(), json_string(left),
                  json_string(right), k == 2 ? "the merged token " : "", json_string(parts[k]));
    }
    id[k] = it->second;
  }
  merges.set(id[0], id[1], {rank, id[2]});
}

void BpeTokenizer::Impl::compile_pattern() {
  int err = 0;
  PCRE2_SIZE offset = 0;
  // MATCH_INVALID_UTF: bytes that are not UTF-8 match nothing (and are no error).
  code.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                           PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &offset,
                           nullptr));
  check(code != nullptr, "PCRE2 cannot compile GPT-2's pattern (at offset {}): {}", offset,
        pcre2_message(err));
  // Where this PCRE2 has no JIT, the interpreter finds the same matches.
  (void)pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE);
  match.reset(pcre2_match_data_create_from_pattern(code.get(), nullptr));
  check(match != nullptr, "PCRE2: out of memory for match data");
}

void BpeTokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) {
  if (piece.size() == 1) {
    out.push_back(byte_ids[static_cast<unsigned char>(piece[0])]);
    return;
  }
  bool cacheable = piece.size() <= kMaxCachedBytes;
  if (cacheable) {
    auto it = cache.find(piece);
    if (it != cache.end()) {
      auto first = cached_ids.begin() + it->second.first;
      out.insert(out.end(), first, first + it->second.second);
      return;
    }
  }
  size_t begin = out.size();
  merge(piece, out);
  if (cacheable) {
    if (cache.size() >= kCacheEntries) {
      cache.clear();
      cached_ids.clear();
    }
    cache.emplace(piece, std::pair{static_cast<uint32_t>(cached_ids.size()),
                                   static_cast<uint32_t>(out.size() - begin)});
    cached_ids.insert(cached_ids.end(), out.begin() + static_cast<ptrdiff_t>(begin), out.end());
  }
}

// BPE over one piece, as tokenizers runs it: the adjacent pair of lowest rank
// (leftmost among equals) merges first, and the pairs it makes with its
// neighbours join the queue; a queued pair that a merge has since changed is
// dropped when it comes up.
void BpeTokenizer::Impl::merge(std::string_view piece, std::vector<int32_t>& out) {
  check(piece.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
        "BPE encode ({}): a piece of {} bytes, more than 2^31 - 1", source, piece.size());
  auto n = static_cast<int32_t>(piece.size());
  symbols.resize(piece.size());
  for (int32_t i = 0; i < n; ++i) {
    symbols[static_cast<size_t>(i)] = {byte_ids[static_cast<unsigned char>(piece[i])], i - 1,
                                       i + 1 < n ? i + 1 : -1};
  }
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  auto candidate = [&](int32_t pos) {
    const Symbol& s = symbols[static_cast<size_t>(pos)];
    if (s.next < 0) return false;
    int32_t right = symbols[static_cast<size_t>(s.next)].id;
    const Merge* m = merges.find(s.id, right);
    if (m == nullptr) return false;
    queue.push_back({m->rank, pos, s.id, right, m->id});
    return true;
  };
  queue.clear();
  for (int32_t i = 0; i + 1 < n; ++i) candidate(i);
  std::make_heap(queue.begin(), queue.end(), later);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), later);
    Candidate c = queue.back();
    queue.pop_back();
    Symbol& s = symbols[static_cast<size_t>(c.pos)];
    if (s.id != c.left || s.next < 0 || symbols[static_cast<size_t>(s.next)].id != c.right) {
      continue;
    }
    Symbol& gone = symbols[static_cast<size_t>(s.next)];
    s.id = c.merged;
    s.next = gone.next;
    if (s.next >= 0) symbols[static_cast<size_t>(s.next)].prev = c.pos;
    gone.id = -1;
    if (s.prev >= 0 && candidate(s.prev)) std::push_heap(queue.begin(), queue.end(), later);
    if (candidate(c.pos)) std::push_heap(queue.begin(), queue.end(), later);
  }
  for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) {
    out.push_back(symbols[static_cast<size_t>(i)].id);
  }
}

BpeTokenizer BpeTokenizer::load(const std::string& vocab_path, const std::string& merges_path) {
  auto m = std::make_unique<Impl>();
  m->source = vocab_path + " and " + merges_path;
  json vocab = read_json(vocab_path);
  check(vocab.is_object(), "{}: a vocabulary is a JSON object of token -> id, not a{} {}",
        vocab_path, vocab.is_array() ? "n" : "", vocab.type_name());
  for (const auto& [token, id] : vocab.items()) m->add_token(token, id, vocab_path);
  m->finish_vocabulary(vocab_path);

  std::ifstream f(merges_path, std::ios::binary);
  check(f.good(), "{}: cannot open", merges_path);
  std::string line;
  int32_t rank = 0;
  for (int64_t number = 1; std::getline(f, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.starts_with("#version")) continue;
    auto pair = split_merge(line);
    if (!pair) {
      throw Error("{}:{}: a merge is two tokens separated by one space, not {}", merges_path,
                  number, json_string(line));
    }
    m->add_merge(pair->first, pair->second, rank++,
                 [&] { return fmt::format("{}:{}", merges_path, number); });
  }
  m->compile_pattern();
  return BpeTokenizer(std::move(m));
}

BpeTokenizer BpeTokenizer::load_json(const std::string& path) {
  json j = read_json(path);
  check(j.is_object(), "{}: a tokenizer.json is a JSON object, not {}", path, j.type_name());
  auto field = [&](const json& parent, const char* key) -> const json& {
    static const json null;
    auto it = parent.find(key);
    return it == parent.end() ? null : *it;
  };
  const json& model = field(j, "model");
  check(model.is_object() && field(model, "type") == "BPE", "{}: model.type is {}, not \"BPE\"",
        path, field(model, "type").dump());
  // GPT-2's own tokenizer.json spells an absent prefix and suffix "".
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    const json& value = field(model, key);
    check(value.is_null() || value == "", "{}: model.{} is {}: weft's BPE has no such option", path,
          key, value.dump());
  }
  for (const char* key : {"byte_fallback", "ignore_merges"}) {
    check(field(model, key) != true, "{}: model.{} is true: weft's BPE has no such option", path,
          key);
  }
  check(field(j, "normalizer").is_null(), "{}: normalizer is {}: weft's BPE takes none", path,
        field(j, "normalizer").dump());
  const json& pre = field(j, "pre_tokenizer");
  check(pre.is_object() && field(pre, "type") == "ByteLevel" &&
            field(pre, "add_prefix_space") != true && field(pre, "use_regex") != false,
        "{}: pre_tokenizer is {}: weft's BPE is GPT-2's, a ByteLevel pre-tokenizer with its "
        "regex and no prefix space",
        path, pre.dump());

  auto m = std::make_unique<Impl>();
  m->source = path;
  const json& vocab = field(model, "vocab");
  check(vocab.is_object(), "{}: model.vocab is a JSON object of token -> id, not {}", path,
        vocab.type_name());
  for (const auto& [token, id] : vocab.items()) m->add_token(token, id, path + ": model.vocab");
  const json& added = field(j, "added_tokens");
  check(added.is_null() || added.is_array(), "{}: added_tokens is not a list", path);
  for (size_t i = 0; i < (added.is_array() ? added.size() : 0); ++i) {
    const json& t = added[i];
    check(t.is_object() && field(t, "content").is_string(),
          "{}: added token {} has no \"content\" string", path, t.dump());
    m->add_token(field(t, "content").get<std::string>(), field(t, "id"), path + ": added_tokens");
  }
  m->finish_vocabulary(path);

  const json& merges = field(model, "merges");
  check(merges.is_array(), "{}: model.merges is a list of merges, not {}", path,
        merges.type_name());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& e = merges[i];
    auto where = [&] { return fmt::format("{}: model.merges[{}]", path, i); };
    std::optional<std::pair<std::string_view, std::string_view>> pair;
    if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      pair.emplace(e[0].get_ref<const std::string&>(), e[1].get_ref<const std::string&>());
    } else if (e.is_string()) {
      pair = split_merge(e.get_ref<const std::string&>());
    }
    if (!pair) throw Error("{}: a merge is \"a b\" or [\"a\", \"b\"], not {}", where(), e.dump());
    m->add_merge(pair->first, pair->second, static_cast<int32_t>(i), where);
  }
  m->compile_pattern();
  return BpeTokenizer(std::move(m));
}

bool BpeTokenizer::available() { return true; }

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>& out) {
  Impl& m = *impl_;
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t at = 0;
  while (at < text.size()) {
    int rc = pcre2_match(m.code.get(), subject, text.size(), at, 0, m.match.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc <= 0) {
      throw Error("BPE encode ({}): PCRE2 failed at byte {}: {}", m.source, at, pcre2_message(rc));
    }
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(m.match.get());
    check(span[1] > span[0], "BPE encode ({}): an empty match at byte {}", m.source, span[0]);
    // Bytes the pattern skipped are not UTF-8: a piece of their own.
    if (span[0] > at) m.encode_piece(text.substr(at, span[0] - at), out);
    m.encode_piece(text.substr(span[0], span[1] - span[0]), out);
    at = span[1];
  }
  if (at < text.size()) m.encode_piece(text.substr(at), out);
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    check(id >= 0 && static_cast<size_t>(id) < impl_->bytes.size(),
          "token id {} is outside the vocabulary [0, {}) of {}", id, impl_->bytes.size(),
          impl_->source);
    out += impl_->bytes[static_cast<size_t>(id)];
  }
  return out;
}

int64_t BpeTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->bytes.size()); }
int32_t BpeTokenizer::eod() const { return impl_->eod; }
int32_t BpeTokenizer::token_id(std::string_view token) const {
  auto it = impl_->ids.find(token);
  return it == impl_->ids.end() ? -1 : it->second;
}

#else  // built without PCRE2

struct BpeTokenizer::Impl {};

namespace {
[[noreturn]] void unavailable(const std::string& path) {
  throw Error(
      "{}: weft was built without PCRE2, which the BPE tokenizer's pre-tokenization regex needs: "
      "install libpcre2-dev (Debian/Ubuntu) and set the build up again",
      path);
}
}  // namespace

BpeTokenizer BpeTokenizer::load(const std::string& vocab_path, const std::string&) {
  unavailable(vocab_path);
}
BpeTokenizer BpeTokenizer::load_json(const std::string& path) { unavailable(path); }
bool BpeTokenizer::available() { return false; }
void BpeTokenizer::encode(std::string_view, std::vector<int32_t>&) { unavailable("BPE"); }
std::string BpeTokenizer::decode(std::span<const int32_t>) const { unavailable("BPE"); }
int64_t BpeTokenizer::vocab_size() const { return 0; }
int32_t BpeTokenizer::eod() const { return -1; }
int32_t BpeTokenizer::token_id(std::string_view) const { return -1; }

#endif

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  encode(text, out);
  return out;
}

}  // namespace weft
