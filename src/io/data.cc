#include <weft/data.h>
#include <weft/error.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <filesystem>

namespace weft {
namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

// Megatron's indexed dataset: the index's magic, and its token types by code.
constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;
constexpr uint8_t kIndexUint8 = 1, kIndexInt32 = 4, kIndexUint16 = 8;

// A file mapped read-only for the life of the TokenData that reads it.
struct Mapping {
  void* addr = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (addr != nullptr) ::munmap(addr, bytes);
  }
};

std::shared_ptr<const Mapping> map_file(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  check(fd >= 0, "{}: cannot open {}: {}", path, what, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    throw Error("{}: cannot read {}: {}", path, what,
                S_ISDIR(st.st_mode) ? "it is a folder" : std::strerror(err));
  }
  auto m = std::make_shared<Mapping>();
  m->bytes = static_cast<size_t>(st.st_size);
  if (m->bytes > 0) {
    m->addr = ::mmap(nullptr, m->bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (m->addr == MAP_FAILED) {
      const int err = errno;
      m->addr = nullptr;
      ::close(fd);
      throw Error("{}: cannot map {}: {}", path, what, std::strerror(err));
    }
    // Windows are read in a shuffled order: no read-ahead past what is asked.
    ::madvise(m->addr, m->bytes, MADV_RANDOM);
  }
  ::close(fd);
  return m;
}

// The formats are little-endian whatever the host is.
uint64_t le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void put_le(std::vector<unsigned char>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<unsigned char>(v >> (8 * i)));
}

std::string describe(const std::string& path) { return path.empty() ? "token data" : path; }

bool is_file(const std::string& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec);
}

// PREFIX for PREFIX, PREFIX.bin or PREFIX.idx where both files exist; "" if not.
std::string indexed_prefix(const std::string& path) {
  const std::filesystem::path p(path);
  std::string prefix = path;
  if (p.extension() == ".bin" || p.extension() == ".idx")
    prefix = (p.parent_path() / p.stem()).string();
  return is_file(prefix + ".idx") && is_file(prefix + ".bin") ? prefix : "";
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

constexpr int64_t kBlock = 4096;  // sequences between the blend's stored counts

}  // namespace

TokenFormat parse_token_format(const std::string& name) {
  if (name == "auto") return TokenFormat::Auto;
  if (name == "text") return TokenFormat::Text;
  if (name == "llmc") return TokenFormat::LlmcBin;
  if (name == "uint16") return TokenFormat::Uint16;
  if (name == "indexed") return TokenFormat::Indexed;
  throw Error("--data-format '{}' is not one of auto, text, llmc, uint16, indexed", name);
}

const char* token_format_name(TokenFormat format) {
  switch (format) {
    case TokenFormat::Auto:
      return "auto";
    case TokenFormat::Text:
      return "text";
    case TokenFormat::LlmcBin:
      return "llmc";
    case TokenFormat::Uint16:
      return "uint16";
    case TokenFormat::Indexed:
      return "indexed";
  }
  return "?";
}

std::vector<std::string> token_files(const std::string& path, TokenFormat format) {
  if (format == TokenFormat::Auto || format == TokenFormat::Indexed) {
    const std::string prefix = indexed_prefix(path);
    if (!prefix.empty()) return {prefix + ".idx", prefix + ".bin"};
  }
  return {path};
}

TokenData TokenData::load(const std::string& path, TokenFormat format) {
  std::string prefix;
  if (format == TokenFormat::Auto || format == TokenFormat::Indexed) prefix = indexed_prefix(path);
  if (format == TokenFormat::Auto)
    format = !prefix.empty()                                     ? TokenFormat::Indexed
             : std::filesystem::path(path).extension() == ".bin" ? TokenFormat::LlmcBin
                                                                 : TokenFormat::Text;
  TokenData d;
  d.path_ = path;
  d.format_ = format;
  if (format == TokenFormat::Indexed) {
    check(!prefix.empty(), "{}: an indexed dataset needs both {}.idx and {}.bin", path, path, path);
    const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
    d.files_ = {idx_path, bin_path};
    const auto idx = map_file(idx_path, "index");
    const auto* p = static_cast<const unsigned char*>(idx->addr);
    const size_t n = idx->bytes;
    check(n >= kIndexHeaderBytes && std::memcmp(p, kIndexMagic, 9) == 0,
          "{}: not a Megatron index (it does not start with MMIDIDX)", idx_path);
    const uint64_t version = le(p + 9, 8);
    check(version == 1, "{}: index version is {}, expected 1", idx_path, version);
    const uint8_t code = p[17];
    check(code == kIndexUint8 || code == kIndexUint16 || code == kIndexInt32,
          "{}: token type code {} is not uint8 (1), uint16 (8) or int32 (4)", idx_path, code);
    d.elem_ = code == kIndexUint8 ? 1 : code == kIndexUint16 ? 2 : 4;
    const uint64_t sequences = le(p + 18, 8), doc_entries = le(p + 26, 8);
    check(sequences < (uint64_t{1} << 40) && doc_entries < (uint64_t{1} << 40) &&
              n == kIndexHeaderBytes + 12 * sequences + 8 * doc_entries,
          "{}: {} sequences and {} document entries need {} bytes, the index has {}", idx_path,
          sequences, doc_entries, kIndexHeaderBytes + 12 * sequences + 8 * doc_entries, n);
    const unsigned char* sizes = p + kIndexHeaderBytes;
    const unsigned char* pointers = sizes + 4 * sequences;
    const unsigned char* docs = pointers + 8 * sequences;
    // The stream is the documents in order: each sequence must start where
    // the one before it ended.
    uint64_t tokens = 0;
    for (uint64_t s = 0; s < sequences; ++s) {
      const uint64_t at = le(pointers + 8 * s, 8);
      const auto len = static_cast<int32_t>(le(sizes + 4 * s, 4));
      check(len >= 0, "{}: sequence {} has length {}", idx_path, s, len);
      check(at == tokens * static_cast<uint64_t>(d.elem_),
            "{}: sequence {} starts at byte {}, where the sequences before it end at byte {}: "
            "the index does not describe one stream of tokens",
            idx_path, s, at, tokens * static_cast<uint64_t>(d.elem_));
      tokens += static_cast<uint64_t>(len);
    }
    check(doc_entries >= 1 && le(docs, 8) == 0 && le(docs + 8 * (doc_entries - 1), 8) == sequences,
          "{}: the document index must run from 0 to the {} sequences", idx_path, sequences);
    for (uint64_t i = 1; i < doc_entries; ++i)
      check(le(docs + 8 * i, 8) >= le(docs + 8 * (i - 1), 8),
            "{}: document {} starts before document {}", idx_path, i, i - 1);
    d.documents_ = static_cast<int64_t>(doc_entries) - 1;
    const auto bin = map_file(bin_path, "token data");
    check(bin->bytes == tokens * static_cast<uint64_t>(d.elem_),
          "{}: {} holds {} tokens of {} bytes ({} bytes), but the file has {} bytes: {}", bin_path,
          idx_path, tokens, d.elem_, tokens * static_cast<uint64_t>(d.elem_), bin->bytes,
          bin->bytes < tokens * static_cast<uint64_t>(d.elem_)
              ? "the index points past the data"
              : "extra bytes follow the indexed tokens");
    check(tokens > 0, "{}: the dataset holds no tokens", path);
    d.base_ = static_cast<const unsigned char*>(bin->addr);
    d.size_ = static_cast<int64_t>(tokens);
    d.hold_ = bin;
    return d;
  }

  d.files_ = {path};
  const auto m = map_file(path, "token file");
  check(m->bytes > 0, "{}: token file is empty (0 bytes)", path);
  const auto* p = static_cast<const unsigned char*>(m->addr);
  d.hold_ = m;
  if (format == TokenFormat::LlmcBin) {
    const size_t b = m->bytes;
    check(b >= kLlmcHeaderBytes,
          "{}: file is {} bytes, shorter than the {}-byte llm.c token header (a header-less "
          "uint16 file, nanoGPT's, is read with --data-format uint16)",
          path, b, kLlmcHeaderBytes);
    const auto magic = static_cast<int32_t>(le(p, 4)), version = static_cast<int32_t>(le(p + 4, 4)),
               count = static_cast<int32_t>(le(p + 8, 4));
    check(magic == kLlmcMagic,
          "{}: header magic is {}, expected {} (llm.c token file; a header-less uint16 file, "
          "nanoGPT's, is read with --data-format uint16)",
          path, magic, kLlmcMagic);
    check(version == kLlmcVersion, "{}: header version is {}, expected {}", path, version,
          kLlmcVersion);
    check(count > 0, "{}: header token count is {}, must be > 0", path, count);
    const size_t expected = kLlmcHeaderBytes + 2 * static_cast<size_t>(count);
    check(b == expected,
          "{}: file is {} bytes, but a header token count of {} needs exactly {} bytes "
          "(1024 + 2 per token); {}",
          path, b, count, expected,
          b < expected ? "the token section is truncated" : "extra bytes follow the tokens");
    d.base_ = p + kLlmcHeaderBytes;
    d.elem_ = 2;
    d.size_ = count;
  } else if (format == TokenFormat::Uint16) {
    check(m->bytes % 2 == 0, "{}: {} bytes is not a whole number of uint16 tokens", path, m->bytes);
    d.base_ = p;
    d.elem_ = 2;
    d.size_ = static_cast<int64_t>(m->bytes / 2);
  } else {
    d.base_ = p;
    d.elem_ = 1;
    d.size_ = static_cast<int64_t>(m->bytes);
  }
  return d;
}

// vocab_hint > 0 bounds the ids; 256 marks byte tokens, which is what text is.
TokenData TokenData::from_tokens(std::vector<int32_t> tokens, int32_t vocab_hint) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    check(tokens[i] >= 0, "token {} at index {} is negative", tokens[i], i);
    check(vocab_hint <= 0 || tokens[i] < vocab_hint,
          "token {} at index {} is outside the vocabulary of {}", tokens[i], i, vocab_hint);
  }
  auto held = std::make_shared<const std::vector<int32_t>>(std::move(tokens));
  TokenData d;
  d.base_ = reinterpret_cast<const unsigned char*>(held->data());
  d.size_ = static_cast<int64_t>(held->size());
  d.elem_ = 4;
  d.hold_ = held;
  d.format_ = vocab_hint == 256 ? TokenFormat::Text : TokenFormat::Auto;
  return d;
}

int32_t TokenData::operator[](int64_t i) const {
  const unsigned char* p = base_ + static_cast<size_t>(i) * static_cast<size_t>(elem_);
  if (elem_ == 1) return *p;
  if (elem_ == 2) return static_cast<int32_t>(le(p, 2));
  int32_t v;
  std::memcpy(&v, p, 4);  // held in memory (host order) or an indexed int32 file (little-endian)
  return v;
}

void TokenData::read(int64_t first, int64_t count, int32_t* out) const {
  check(first >= 0 && count >= 0 && first + count <= size_,
        "{}: tokens [{}, +{}) are outside its {} tokens", describe(path_), first, count, size_);
  const unsigned char* p = base_ + static_cast<size_t>(first) * static_cast<size_t>(elem_);
  const auto n = static_cast<size_t>(count);
  if (elem_ == 4) {
    std::memcpy(out, p, 4 * n);
  } else if (elem_ == 2) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(p[2 * i] | (p[2 * i + 1] << 8));
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = p[i];
  }
}

std::vector<int32_t> TokenData::tokens() const {
  std::vector<int32_t> all(static_cast<size_t>(size_));
  read(0, size_, all.data());
  return all;
}

int32_t TokenData::max_token() const {
  int32_t top = -1;
  std::vector<int32_t> chunk(1 << 16);
  for (int64_t at = 0; at < size_; at += static_cast<int64_t>(chunk.size())) {
    const int64_t n = std::min<int64_t>(size_ - at, static_cast<int64_t>(chunk.size()));
    read(at, n, chunk.data());
    top = std::max(top, *std::max_element(chunk.begin(), chunk.begin() + n));
  }
  return top + 1;
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

void TokenData::fill_window(int64_t w, int64_t seq_len, int32_t* inputs, int32_t* targets) const {
  read(w * seq_len, seq_len, inputs);
  std::copy(inputs + 1, inputs + seq_len, targets);
  targets[seq_len - 1] = (*this)[w * seq_len + seq_len];
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
  for (int64_t i = 0; i < count; ++i)
    fill_window(first_window + (first_sequence + i) % n, seq_len, inputs + i * seq_len,
                targets + i * seq_len);
}

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, int64_t vocab_size)
    : prefix_(prefix), vocab_(vocab_size), elem_(vocab_size <= 65536 ? 2 : 4) {
  check(vocab_size > 0 && vocab_size <= (int64_t{1} << 31),
        "{}: vocabulary {} must be between 1 and 2^31", prefix, vocab_size);
  const std::string tmp = prefix + ".bin.tmp";
  bin_ = std::fopen(tmp.c_str(), "wb");
  check(bin_ != nullptr, "{}: cannot write: {}", tmp, std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_ == nullptr) return;
  std::fclose(bin_);
  std::remove((prefix_ + ".bin.tmp").c_str());
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  check(bin_ != nullptr, "{}: the dataset is finished", prefix_);
  check(tokens.size() < (size_t{1} << 31),
        "{}: a document of {} tokens is past the index's "
        "int32 lengths",
        prefix_, tokens.size());
  buf_.clear();
  for (size_t i = 0; i < tokens.size(); ++i) {
    check(tokens[i] >= 0 && tokens[i] < vocab_,
          "{}: token {} at {} of document {} is outside the vocabulary of {}", prefix_, tokens[i],
          i, lengths_.size(), vocab_);
    put_le(buf_, static_cast<uint32_t>(tokens[i]), elem_);
  }
  check(std::fwrite(buf_.data(), 1, buf_.size(), bin_) == buf_.size(),
        "{}.bin.tmp: cannot "
        "write: {}",
        prefix_, std::strerror(errno));
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetWriter::finish() {
  check(bin_ != nullptr, "{}: the dataset is finished", prefix_);
  const bool flushed = std::fflush(bin_) == 0 && ::fsync(::fileno(bin_)) == 0;
  const int err = errno;
  std::fclose(bin_);
  bin_ = nullptr;
  check(flushed, "{}.bin.tmp: cannot write: {}", prefix_, std::strerror(err));
  std::vector<unsigned char> idx(kIndexMagic, kIndexMagic + 9);
  put_le(idx, 1, 8);
  idx.push_back(elem_ == 2 ? kIndexUint16 : kIndexInt32);
  const uint64_t sequences = lengths_.size();
  put_le(idx, sequences, 8);
  put_le(idx, sequences + 1, 8);  // one document per sequence, and the end
  for (int32_t len : lengths_) put_le(idx, static_cast<uint32_t>(len), 4);
  uint64_t at = 0;
  for (int32_t len : lengths_) {
    put_le(idx, at, 8);
    at += static_cast<uint64_t>(len) * static_cast<uint64_t>(elem_);
  }
  for (uint64_t i = 0; i <= sequences; ++i) put_le(idx, i, 8);
  const std::string tmp = prefix_ + ".idx.tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  check(f != nullptr, "{}: cannot write: {}", tmp, std::strerror(errno));
  const bool wrote = std::fwrite(idx.data(), 1, idx.size(), f) == idx.size() &&
                     std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int werr = errno;
  std::fclose(f);
  check(wrote, "{}: cannot write: {}", tmp, std::strerror(werr));
  // The data first: an index found beside its data always describes it.
  check(std::rename((prefix_ + ".bin.tmp").c_str(), (prefix_ + ".bin").c_str()) == 0 &&
            std::rename(tmp.c_str(), (prefix_ + ".idx").c_str()) == 0,
        "{}: cannot rename the finished dataset into place: {}", prefix_, std::strerror(errno));
}

uint64_t permute(uint64_t i, uint64_t n, uint64_t key) {
  check(i < n, "permute: {} is outside [0, {})", i, n);
  int half = 1;
  while ((uint64_t{1} << (2 * half)) < n) ++half;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t x = i;
  do {  // cycle-walking: at most a few rounds, the domain being under 4n
    uint64_t l = x >> half, r = x & mask;
    for (uint64_t round = 0; round < 6; ++round) {
      const uint64_t f = splitmix64(r ^ splitmix64(key + round)) & mask;
      const uint64_t next = l ^ f;
      l = r;
      r = next;
    }
    x = (l << half) | r;
  } while (x >= n);
  return x;
}

WindowOrder::WindowOrder(std::vector<BlendPart> parts, int64_t seq_len, bool shuffle, uint64_t seed)
    : parts_(std::move(parts)), seq_len_(seq_len), shuffle_(shuffle), seed_(seed) {
  check(!parts_.empty(), "a blend needs at least one dataset");
  double total = 0;
  for (const BlendPart& p : parts_) {
    check(p.data != nullptr, "a blend's dataset is missing");
    check(std::isfinite(p.weight) && p.weight > 0, "{}: blend weight {} must be positive",
          describe(p.data->path()), p.weight);
    total += p.weight;
    const int64_t all = p.data->windows(seq_len);
    check(p.first_window >= 0 && p.num_windows >= 0 && p.first_window + p.num_windows <= all,
          "{}: windows [{}, +{}) are outside the data's {} windows", describe(p.data->path()),
          p.first_window, p.num_windows, all);
    n_.push_back(p.num_windows > 0 ? p.num_windows : all - p.first_window);
    check(n_.back() > 0, "{}: no window from {} on", describe(p.data->path()), p.first_window);
  }
  for (const BlendPart& p : parts_) share_.push_back(p.weight / total);
  counts_.assign(parts_.size(), 0);  // block 0: nothing yet
  cur_.assign(parts_.size(), 0);
}

// The part that sequence `sequence` comes from, and how many of the part's
// sequences precede it.
int64_t WindowOrder::part_sequence(int64_t sequence, int* part) const {
  const size_t p = parts_.size();
  if (p == 1) {
    *part = 0;
    return sequence;
  }
  std::lock_guard lock(mu_);
  // The part furthest below its share, given cur_'s counts of the first k.
  auto next = [&](int64_t k) {
    size_t best = 0;
    double gap = -1e300;
    for (size_t j = 0; j < p; ++j) {
      const double g = share_[j] * static_cast<double>(k + 1) - static_cast<double>(cur_[j]);
      if (g > gap) {
        gap = g;
        best = j;
      }
    }
    return best;
  };
  // Training asks in order, so the cursor usually walks a few sequences on;
  // behind it, or far ahead, it starts again from the last stored block.
  const int64_t stored = static_cast<int64_t>(counts_.size() / p);
  const int64_t from = std::min(sequence / kBlock, stored - 1);
  if (at_ > sequence || at_ < from * kBlock) {
    std::copy_n(counts_.begin() + static_cast<std::ptrdiff_t>(from * static_cast<int64_t>(p)), p,
                cur_.begin());
    at_ = from * kBlock;
  }
  for (; at_ < sequence; ++at_) {
    ++cur_[next(at_)];
    if ((at_ + 1) % kBlock == 0 && (at_ + 1) / kBlock == static_cast<int64_t>(counts_.size() / p))
      counts_.insert(counts_.end(), cur_.begin(), cur_.end());
  }
  const size_t j = next(sequence);
  *part = static_cast<int>(j);
  return cur_[j];
}

WindowOrder::Where WindowOrder::locate(int64_t sequence) const {
  check(sequence >= 0, "sequence {} must be non-negative", sequence);
  int part = 0;
  const int64_t c = part_sequence(sequence, &part);
  const auto j = static_cast<size_t>(part);
  const int64_t n = n_[j], epoch = c / n, at = c % n;
  const uint64_t key = splitmix64(
      seed_ ^ splitmix64((static_cast<uint64_t>(j) << 40) ^ static_cast<uint64_t>(epoch)));
  const int64_t w =
      shuffle_
          ? static_cast<int64_t>(permute(static_cast<uint64_t>(at), static_cast<uint64_t>(n), key))
          : at;
  return {part, parts_[j].first_window + w};
}

void WindowOrder::fill(int64_t first_sequence, int64_t count, int32_t* inputs, int32_t* targets,
                       int64_t vocab) const {
  check(first_sequence >= 0 && count >= 0, "sequences [{}, +{}) must be non-negative",
        first_sequence, count);
  const int64_t t = seq_len_;
  for (int64_t i = 0; i < count; ++i) {
    const Where at = locate(first_sequence + i);
    const TokenData& data = *parts_[static_cast<size_t>(at.part)].data;
    int32_t* in = inputs + i * t;
    int32_t* tg = targets + i * t;
    data.fill_window(at.window, t, in, tg);
    if (vocab <= 0) continue;
    for (int64_t k = 0; k <= t; ++k) {
      const int32_t v = k < t ? in[k] : tg[t - 1];
      check(v >= 0 && v < vocab,
            "{}: token {} (token {} of the stream, in window {}) is outside the vocabulary of "
            "{}: the data was made with another tokenizer, or --vocab-size is too small",
            describe(data.path()), v, at.window * t + k, at.window, vocab);
    }
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
