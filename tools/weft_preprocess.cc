// weft-preprocess — text to Megatron's indexed dataset, as Megatron-LM's
// tools/preprocess_data.py makes it; train_gpt --data-path reads the result.
//
//   weft-preprocess --input corpus.jsonl --output-prefix data/corpus
//       --tokenizer-type GPT2BPETokenizer --vocab-file gpt2/vocab.json
//       --merge-file gpt2/merges.txt --append-eod --workers 8
//   train_gpt --data-path data/corpus_text_document --vocab-size 50257 ...
//
// Input, file by file in the order given (--input-format; auto takes a name
// ending in .jsonl or .json for JSONL, anything else for text):
//   jsonl  one JSON object a line, Megatron's input: each --json-keys key
//          (default: text) holds a string, one document of that key's
//          dataset. Blank lines are skipped.
//   text   a whole file is one document of the key "text"; with
//          --text-document-separator LINE, a line equal to LINE (a trailing
//          '\r' aside) ends a document and is dropped: '%' splits the fortune
//          files, '' splits at blank lines. What follows the last separator
//          is a document unless it is empty.
// Output: one dataset per key, PREFIX_KEY_document.bin and .idx (Megatron's
// names), its documents in input order. An empty document is skipped, as
// Megatron skips it, and counted in the summary.
//
// Tokenizers (--tokenizer-type):
//   GPT2BPETokenizer      GPT-2's --vocab-file vocab.json and --merge-file merges.txt
//   HuggingFaceTokenizer  --tokenizer-model tokenizer.json, of GPT-2's kind (weft/bpe.h)
//   ByteLevel             the UTF-8 bytes are the tokens, vocabulary 256: what
//                         train_gpt reads from a text file
// --append-eod ends each document with the vocabulary's <|endoftext|>; ByteLevel
// has none (its 256 ids are the bytes), so it refuses the flag.
//
// --workers N threads encode batches of documents, each with a tokenizer of
// its own (weft::BpeTokenizer caches, so it is one a thread); the main thread
// reads the input ahead of them and writes the batches in input order, so the
// files hold the same bytes at any N.
//
// Progress goes to stderr every --log-interval documents (documents, MB in,
// MB/s, tokens/s; MB = 10^6 bytes); a summary line to stdout at the end.
// Bad input gets one line naming the file (and line) and the rule broken,
// exit status 1, and no dataset: the writers write ".tmp" files and rename
// them only once everything is read, so a failure or an interrupt leaves the
// output prefix as it was.
#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <weft/bpe.h>
#include <weft/data.h>
#include <weft/error.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using weft::check;
using weft::Error;

enum class InputFormat { Auto, Jsonl, Text };
enum class TokenizerType { Gpt2Bpe, HuggingFace, ByteLevel };

struct Options {
  std::vector<std::string> inputs;
  InputFormat format = InputFormat::Auto;
  std::string separator;
  bool has_separator = false;
  std::vector<std::string> json_keys{"text"};
  std::string output_prefix;
  TokenizerType tokenizer = TokenizerType::ByteLevel;
  std::string vocab_file, merge_file, tokenizer_model;
  bool append_eod = false;
  int workers = 1;
  int64_t log_interval = 1000;
};

// A batch holds up to this many documents, or lines, or this many bytes.
constexpr size_t kBatchDocuments = 64;
constexpr size_t kBatchBytes = size_t{1} << 20;

std::atomic<int> g_signal{0};  // the signal that asked us to stop, 0 while none has
void on_signal(int sig) { g_signal.store(sig); }

InputFormat parse_input_format(const std::string& name) {
  if (name == "auto") return InputFormat::Auto;
  if (name == "jsonl") return InputFormat::Jsonl;
  if (name == "text") return InputFormat::Text;
  throw Error("--input-format {}: not one of jsonl, text, auto", name);
}

TokenizerType parse_tokenizer_type(const std::string& name) {
  if (name == "GPT2BPETokenizer") return TokenizerType::Gpt2Bpe;
  if (name == "HuggingFaceTokenizer") return TokenizerType::HuggingFace;
  if (name == "ByteLevel") return TokenizerType::ByteLevel;
  throw Error("--tokenizer-type {}: not one of GPT2BPETokenizer, HuggingFaceTokenizer, ByteLevel",
              name);
}

bool is_jsonl(const std::string& path, InputFormat format) {
  if (format != InputFormat::Auto) return format == InputFormat::Jsonl;
  const std::string ext = std::filesystem::path(path).extension().string();
  return ext == ".jsonl" || ext == ".json";
}

// One thread's tokenizer: GPT-2's BPE, or the bytes themselves.
class Encoder {
 public:
  static Encoder load(const Options& o) {
    Encoder e;
    switch (o.tokenizer) {
      case TokenizerType::Gpt2Bpe:
        e.bpe_ = weft::BpeTokenizer::load(o.vocab_file, o.merge_file);
        break;
      case TokenizerType::HuggingFace:
        e.bpe_ = weft::BpeTokenizer::load_json(o.tokenizer_model);
        break;
      case TokenizerType::ByteLevel:
        break;
    }
    return e;
  }

  void encode(std::string_view text, std::vector<int32_t>& out) {
    if (bpe_) {
      bpe_->encode(text, out);
    } else {
      for (unsigned char c : text) out.push_back(c);
    }
  }
  int64_t vocab_size() const { return bpe_ ? bpe_->vocab_size() : 256; }
  int32_t eod() const { return bpe_ ? bpe_->eod() : -1; }

 private:
  std::optional<weft::BpeTokenizer> bpe_;  // none: ByteLevel
};

// Documents of one input file, encoded by a worker, written by the main thread.
struct Batch {
  size_t file = 0;
  bool jsonl = false;
  int64_t first_line = 1;          // JSONL: the line number of texts[0]
  std::vector<std::string> texts;  // JSONL lines, or text documents
  int64_t bytes = 0;               // of the input, newlines included

  // Filled by the worker. out[k]: the documents of key k, their tokens end to end.
  struct Key {
    std::vector<int32_t> tokens;
    std::vector<int64_t> lengths;
    int64_t empty = 0;
  };
  std::vector<Key> out;
  int64_t documents = 0;
  std::string error;  // the batch's first bad line, in input order
  bool done = false;  // under Workers::mu_
};

// What a worker needs to encode a batch: the same for every worker.
struct Settings {
  const std::vector<std::string>* inputs;
  const std::vector<std::string>* keys;
  int32_t eod = -1;  // appended to each non-empty document when >= 0
};

void add_document(Batch::Key& key, Encoder& encoder, std::string_view text, int32_t eod) {
  const size_t before = key.tokens.size();
  encoder.encode(text, key.tokens);
  if (key.tokens.size() == before) {
    ++key.empty;
    return;
  }
  if (eod >= 0) key.tokens.push_back(eod);
  key.lengths.push_back(static_cast<int64_t>(key.tokens.size() - before));
}

// "an array", "a number": nlohmann's type names read in a sentence.
std::string with_article(std::string_view name) {
  const bool vowel = !name.empty() && std::string_view("aeiou").find(name[0]) != name.npos;
  return fmt::format("{} {}", vowel ? "an" : "a", name);
}

bool blank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

// nlohmann's "[json.exception.parse_error.101] parse error at line 1, column 9: ..."
// without the bracket or the line, the parser having seen one line alone.
std::string json_reason(const nlohmann::json::exception& e) {
  std::string what = e.what();
  const size_t bracket = what.find("] ");
  if (bracket != std::string::npos) what.erase(0, bracket + 2);
  const size_t line = what.find("at line 1, ");
  if (line != std::string::npos) what.erase(line + 3, 8);
  return what;
}

void encode_jsonl(Batch& b, Encoder& encoder, const Settings& s) {
  const std::string& path = (*s.inputs)[b.file];
  const std::vector<std::string>& keys = *s.keys;
  for (size_t i = 0; i < b.texts.size(); ++i) {
    const std::string& line = b.texts[i];
    if (blank(line)) continue;
    const int64_t line_no = b.first_line + static_cast<int64_t>(i);
    nlohmann::json doc;
    try {
      doc = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      b.error = fmt::format("{}:{}: not valid JSON: {}", path, line_no, json_reason(e));
      return;
    }
    if (!doc.is_object()) {
      b.error = fmt::format("{}:{}: a JSON {}, not an object holding the --json-keys", path,
                            line_no, doc.type_name());
      return;
    }
    for (size_t k = 0; k < keys.size(); ++k) {
      const auto it = doc.find(keys[k]);
      if (it == doc.end()) {
        b.error = fmt::format("{}:{}: no key \"{}\" (--json-keys)", path, line_no, keys[k]);
        return;
      }
      if (!it->is_string()) {
        b.error = fmt::format("{}:{}: key \"{}\" holds {}, not a string", path, line_no, keys[k],
                              with_article(it->type_name()));
        return;
      }
      try {
        add_document(b.out[k], encoder, it->get_ref<const std::string&>(), s.eod);
      } catch (const std::exception& e) {
        b.error = fmt::format("{}:{}: key \"{}\": {}", path, line_no, keys[k], e.what());
        return;
      }
    }
    ++b.documents;
  }
}

void encode_batch(Batch& b, Encoder& encoder, const Settings& s) {
  b.out.assign(s.keys->size(), {});
  if (b.jsonl) return encode_jsonl(b, encoder, s);
  for (const std::string& text : b.texts) {  // text input: the key "text", the only one
    try {
      add_document(b.out[0], encoder, text, s.eod);
    } catch (const std::exception& e) {
      b.error = fmt::format("{}: {}", (*s.inputs)[b.file], e.what());
      return;
    }
    ++b.documents;
  }
}

// N threads encoding batches, each with its own Encoder. A batch goes in with
// submit() and is waited for with wait(); the destructor drops the batches
// not yet started and joins the threads (a batch in flight is finished first,
// so a caller may free its batches once the Workers are gone).
class Workers {
 public:
  // `first` serves worker 0; `load` makes the others' tokenizers, on their own threads.
  Workers(int n, Encoder first, std::function<Encoder()> load, Settings settings)
      : settings_(settings) {
    threads_.emplace_back([this, e = std::move(first)]() mutable { run(e); });
    for (int i = 1; i < n; ++i) {
      threads_.emplace_back([this, load] {
        std::optional<Encoder> e;
        try {
          e = load();
        } catch (const std::exception& ex) {
          std::lock_guard<std::mutex> lock(mu_);
          if (error_.empty()) error_ = ex.what();
          done_cv_.notify_all();
          return;
        }
        run(*e);
      });
    }
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      todo_.clear();
    }
    work_cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  void submit(Batch* b) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      todo_.push_back(b);
    }
    work_cv_.notify_one();
  }

  // Waits until `b` is encoded; throws a worker's failure to load its tokenizer,
  // or an interrupt.
  void wait(const Batch& b) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!b.done) {
      check(error_.empty(), "{}", error_);
      check(g_signal.load() == 0, "interrupted by signal {}: nothing written", g_signal.load());
      done_cv_.wait_for(lock, std::chrono::milliseconds(100));
    }
  }

 private:
  void run(Encoder& encoder) {
    for (;;) {
      Batch* b = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return closed_ || !todo_.empty(); });
        if (todo_.empty()) return;
        b = todo_.front();
        todo_.pop_front();
      }
      try {
        encode_batch(*b, encoder, settings_);
      } catch (const std::exception& e) {  // out of memory, say: the batch's first error stands
        if (b->error.empty()) b->error = e.what();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        b->done = true;
      }
      done_cv_.notify_all();
    }
  }

  Settings settings_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Batch*> todo_;
  bool closed_ = false;
  std::string error_;  // a worker's tokenizer did not load
  std::vector<std::thread> threads_;
};

struct Totals {
  int64_t documents = 0, empty = 0, tokens = 0, bytes = 0;
};

// Reads the inputs into batches, has them encoded, writes them in order.
class Preprocess {
 public:
  Preprocess(const Options& o, std::vector<std::unique_ptr<weft::IndexedDatasetWriter>>& writers)
      : o_(o), writers_(writers), start_(std::chrono::steady_clock::now()) {}

  Totals run(Workers& workers) {
    workers_ = &workers;
    for (size_t f = 0; f < o_.inputs.size(); ++f) {
      if (is_jsonl(o_.inputs[f], o_.format)) {
        read_lines(f);
      } else if (o_.has_separator) {
        read_separated(f);
      } else {
        read_whole(f);
      }
    }
    while (!pending_.empty()) write_front();
    return totals_;
  }

  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::unique_ptr<Batch> new_batch(size_t file, bool jsonl, int64_t first_line) {
    auto b = std::make_unique<Batch>();
    b->file = file;
    b->jsonl = jsonl;
    b->first_line = first_line;
    return b;
  }

  void submit(std::unique_ptr<Batch> b) {
    check(g_signal.load() == 0, "interrupted by signal {}: nothing written", g_signal.load());
    // Read ahead of the writer by a few batches a worker, no more.
    while (pending_.size() >= 4 * static_cast<size_t>(o_.workers)) write_front();
    workers_->submit(b.get());
    pending_.push_back(std::move(b));
  }

  std::ifstream open(size_t file) {
    std::ifstream in(o_.inputs[file], std::ios::binary);
    check(in.is_open(), "{}: cannot open", o_.inputs[file]);
    return in;
  }

  void read_lines(size_t file) {
    std::ifstream in = open(file);
    auto b = new_batch(file, true, 1);
    std::string line;
    int64_t line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      b->bytes += static_cast<int64_t>(line.size()) + (in.eof() ? 0 : 1);
      b->texts.push_back(std::move(line));
      if (b->texts.size() >= kBatchDocuments || b->bytes >= static_cast<int64_t>(kBatchBytes)) {
        submit(std::move(b));
        b = new_batch(file, true, line_no + 1);
      }
    }
    check(!in.bad(), "{}:{}: read error", o_.inputs[file], line_no + 1);
    if (!b->texts.empty()) submit(std::move(b));
  }

  void read_separated(size_t file) {
    std::ifstream in = open(file);
    auto b = new_batch(file, false, 1);
    std::string line, doc;
    int64_t line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      const bool newline = !in.eof();
      b->bytes += static_cast<int64_t>(line.size()) + (newline ? 1 : 0);
      std::string_view bare = line;
      if (!bare.empty() && bare.back() == '\r') bare.remove_suffix(1);
      if (bare != o_.separator) {
        doc += line;
        if (newline) doc += '\n';
        continue;
      }
      b->texts.push_back(std::move(doc));
      doc.clear();
      if (b->texts.size() >= kBatchDocuments || b->bytes >= static_cast<int64_t>(kBatchBytes)) {
        submit(std::move(b));
        b = new_batch(file, false, line_no + 1);
      }
    }
    check(!in.bad(), "{}:{}: read error", o_.inputs[file], line_no + 1);
    if (!doc.empty()) b->texts.push_back(std::move(doc));
    if (!b->texts.empty() || b->bytes > 0) submit(std::move(b));
  }

  void read_whole(size_t file) {
    std::ifstream in = open(file);
    auto b = new_batch(file, false, 1);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    check(!in.bad(), "{}: read error", o_.inputs[file]);
    b->bytes = static_cast<int64_t>(text.size());
    b->texts.push_back(std::move(text));
    submit(std::move(b));
  }

  void write_front() {
    Batch& b = *pending_.front();
    workers_->wait(b);
    check(b.error.empty(), "{}", b.error);
    for (size_t k = 0; k < b.out.size(); ++k) {
      const Batch::Key& key = b.out[k];
      size_t at = 0;
      for (int64_t len : key.lengths) {
        writers_[k]->add_document(
            std::span<const int32_t>(key.tokens.data() + at, static_cast<size_t>(len)));
        at += static_cast<size_t>(len);
      }
      totals_.tokens += static_cast<int64_t>(key.tokens.size());
      totals_.empty += key.empty;
    }
    const int64_t before = totals_.documents;
    totals_.documents += b.documents;
    totals_.bytes += b.bytes;
    pending_.pop_front();
    if (o_.log_interval > 0 && totals_.documents / o_.log_interval > before / o_.log_interval) {
      const double s = seconds();
      fmt::print(stderr, "weft-preprocess: {} documents, {:.1f} MB, {:.2f} MB/s, {:.0f} tokens/s\n",
                 totals_.documents, totals_.bytes / 1e6, totals_.bytes / 1e6 / s,
                 totals_.tokens / s);
    }
  }

  const Options& o_;
  std::vector<std::unique_ptr<weft::IndexedDatasetWriter>>& writers_;
  std::chrono::steady_clock::time_point start_;
  Workers* workers_ = nullptr;
  std::deque<std::unique_ptr<Batch>> pending_;
  Totals totals_;
};

std::string dataset_prefix(const Options& o, const std::string& key) {
  return o.output_prefix + "_" + key + "_document";
}

// Every check that needs no reading of the input: bad flags fail before a file is written.
void check_options(const Options& o) {
  check(o.workers >= 1 && o.workers <= 1024, "--workers {}: must be between 1 and 1024", o.workers);
  check(o.log_interval >= 0, "--log-interval {}: must be 0 (no progress) or more", o.log_interval);
  for (size_t i = 0; i < o.json_keys.size(); ++i) {
    check(!o.json_keys[i].empty(), "--json-keys: a key is empty");
    for (size_t j = 0; j < i; ++j)
      check(o.json_keys[i] != o.json_keys[j], "--json-keys: {} is given twice", o.json_keys[i]);
  }
  bool any_text = false;
  for (const std::string& path : o.inputs) {
    std::error_code ec;
    const auto st = std::filesystem::status(path, ec);
    check(std::filesystem::exists(st), "--input {}: no such file", path);
    check(!std::filesystem::is_directory(st), "--input {}: a folder, not a file", path);
    std::ifstream probe(path, std::ios::binary);
    check(probe.is_open(), "--input {}: cannot open", path);
    if (!is_jsonl(path, o.format)) {
      any_text = true;
      check(o.json_keys.size() == 1 && o.json_keys[0] == "text",
            "--input {} is text, whose one key is text: --json-keys {} would find nothing", path,
            fmt::join(o.json_keys, " "));
    }
  }
  check(any_text || !o.has_separator,
        "--text-document-separator does nothing: every --input is JSONL");
  const std::filesystem::path folder = std::filesystem::path(o.output_prefix).parent_path();
  check(!std::filesystem::path(o.output_prefix).filename().empty(),
        "--output-prefix {}: names a folder, not a file prefix", o.output_prefix);
  check(folder.empty() || std::filesystem::is_directory(folder),
        "--output-prefix {}: the folder {} does not exist", o.output_prefix, folder.string());
  switch (o.tokenizer) {
    case TokenizerType::Gpt2Bpe:
      check(!o.vocab_file.empty() && !o.merge_file.empty(),
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file");
      check(o.tokenizer_model.empty(),
            "--tokenizer-model does nothing with --tokenizer-type GPT2BPETokenizer");
      break;
    case TokenizerType::HuggingFace:
      check(!o.tokenizer_model.empty(),
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model tokenizer.json");
      check(o.vocab_file.empty() && o.merge_file.empty(),
            "--vocab-file and --merge-file do nothing with --tokenizer-type HuggingFaceTokenizer");
      break;
    case TokenizerType::ByteLevel:
      check(o.vocab_file.empty() && o.merge_file.empty() && o.tokenizer_model.empty(),
            "--tokenizer-type ByteLevel reads no files: --vocab-file, --merge-file and "
            "--tokenizer-model do nothing with it");
      check(!o.append_eod,
            "--append-eod: ByteLevel has no end-of-document token (its 256 ids are the bytes)");
      break;
  }
}

int run(const Options& o) {
  check_options(o);
  Encoder first = Encoder::load(o);
  const int64_t vocab = first.vocab_size();
  const int32_t eod = o.append_eod ? first.eod() : -1;
  check(!o.append_eod || eod >= 0, "--append-eod: the vocabulary ({}) has no <|endoftext|>",
        o.tokenizer_model.empty() ? o.vocab_file : o.tokenizer_model);

  std::vector<std::unique_ptr<weft::IndexedDatasetWriter>> writers;
  for (const std::string& key : o.json_keys)
    writers.push_back(std::make_unique<weft::IndexedDatasetWriter>(dataset_prefix(o, key), vocab));

  Preprocess pre(o, writers);
  Totals totals;
  {
    Workers workers(
        o.workers, std::move(first), [&o] { return Encoder::load(o); },
        Settings{&o.inputs, &o.json_keys, eod});
    totals = pre.run(workers);
  }
  for (size_t k = 0; k < writers.size(); ++k)
    check(writers[k]->documents() > 0, "{}: no documents to write (none, or only empty ones)",
          dataset_prefix(o, o.json_keys[k]));
  // A dataset is renamed into place by finish(); should a later one fail, the
  // earlier ones go too, so that the prefix holds all of the run or none of it.
  std::vector<std::string> files;
  try {
    for (size_t k = 0; k < writers.size(); ++k) {
      const std::string prefix = dataset_prefix(o, o.json_keys[k]);
      writers[k]->finish();
      files.push_back(prefix + ".bin");
      files.push_back(prefix + ".idx");
    }
  } catch (...) {
    std::error_code ec;
    for (const std::string& f : files) std::filesystem::remove(f, ec);
    throw;
  }
  const double s = pre.seconds();
  fmt::print(
      "weft-preprocess: {} documents ({} empty, skipped), {} tokens (vocabulary {}), "
      "{:.2f} MB in {:.2f} s, {:.2f} MB/s; wrote {}\n",
      totals.documents, totals.empty, totals.tokens, vocab, totals.bytes / 1e6, s,
      totals.bytes / 1e6 / s, fmt::join(files, ", "));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "weft-preprocess: JSONL or text to Megatron's indexed dataset (PREFIX_KEY_document.bin "
      "and .idx), as Megatron-LM's tools/preprocess_data.py"};
  Options o;
  std::string input_format = "auto", tokenizer_type;
  app.add_option("--input", o.inputs, "JSONL or text files, read in this order")->required();
  app.add_option("--input-format", input_format,
                 "jsonl, text, or auto (.jsonl and .json are JSONL, the rest text)")
      ->capture_default_str();
  CLI::Option* separator = app.add_option(
      "--text-document-separator", o.separator,
      "text input: a line equal to this ends a document ('' = a blank line); without it a "
      "file is one document");
  app.add_option("--json-keys", o.json_keys, "JSONL keys, one dataset each")->capture_default_str();
  app.add_option("--output-prefix", o.output_prefix, "writes PREFIX_KEY_document.bin and .idx")
      ->required();
  app.add_option("--tokenizer-type", tokenizer_type,
                 "GPT2BPETokenizer, HuggingFaceTokenizer or ByteLevel")
      ->required();
  app.add_option("--vocab-file", o.vocab_file, "GPT2BPETokenizer: GPT-2's vocab.json");
  app.add_option("--merge-file", o.merge_file, "GPT2BPETokenizer: GPT-2's merges.txt");
  app.add_option("--tokenizer-model", o.tokenizer_model,
                 "HuggingFaceTokenizer: a tokenizer.json of GPT-2's kind");
  app.add_flag("--append-eod", o.append_eod, "end each document with <|endoftext|>");
  app.add_option("--workers", o.workers, "encoding threads, each with its own tokenizer")
      ->capture_default_str();
  app.add_option("--log-interval", o.log_interval,
                 "a progress line to stderr every this many documents (0: none)")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    fmt::print(stderr, "weft-preprocess: {}\n", e.what());
    return 1;
  }
  o.has_separator = separator->count() > 0;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  try {
    o.format = parse_input_format(input_format);
    o.tokenizer = parse_tokenizer_type(tokenizer_type);
    return run(o);
  } catch (const std::exception& e) {  // weft::Error, and the standard library's own
    fmt::print(stderr, "weft-preprocess: {}\n", e.what());
    return 1;
  }
}
