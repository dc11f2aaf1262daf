// weft-preprocess as a user runs it: JSONL and text into Megatron's indexed
// datasets read back token for token, the same bytes at any --workers, one
// error line and no files for bad input, and train_gpt training on the result.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <weft/bpe.h>
#include <weft/data.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using testing::contains;
using testing::read_file;
using testing::source_path;
using testing::write_file;

struct Result {
  int code = -1;
  std::string out, err;
};

std::string fixture(const std::string& name) {
  return source_path("tests/reference/fixtures/" + name);
}

std::string bpe_flags() {
  return "--tokenizer-type GPT2BPETokenizer --vocab-file " + fixture("bpe_vocab.json") +
         " --merge-file " + fixture("bpe_merges.txt");
}

// A sentence of words drawn from `seed`: ASCII, accented letters, CJK, digits,
// quotes and newlines, so that JSON escapes and BPE's pieces are exercised.
std::string sentence(uint64_t seed) {
  static const char* words[] = {"the",     "weaver", "counts",   "picks", "per", "inch",   "café",
                                "日本語",  "1984",   "\"warp\"", "weft",  "\n",  "loom's", "  ",
                                "shuttle", "résumé", "\t",       "!?",    "a",   "Zebra"};
  std::string s;
  const int n = 1 + static_cast<int>(seed % 23);
  for (int i = 0; i < n; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    if (i > 0) s += ' ';
    s += words[(seed >> 33) % std::size(words)];
  }
  return s;
}

// The sizes of an indexed dataset's documents, from its .idx (Megatron's
// layout: magic 9, version 8, dtype 1, sequences 8, documents 8, then the
// sequences' int32 sizes).
std::vector<int32_t> idx_sizes(const std::string& prefix) {
  const std::string idx = read_file(prefix + ".idx");
  EXPECT_GE(idx.size(), 34u) << prefix;
  if (idx.size() < 34) return {};
  uint64_t sequences = 0;
  std::memcpy(&sequences, idx.data() + 18, 8);
  EXPECT_GE(idx.size(), 34 + 4 * sequences) << prefix;
  std::vector<int32_t> sizes(sequences);
  std::memcpy(sizes.data(), idx.data() + 34, 4 * sequences);
  return sizes;
}

// Every file in dir whose name is not one of `keep`.
std::vector<std::string> other_files(const std::string& dir, const std::vector<std::string>& keep) {
  std::vector<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (std::find(keep.begin(), keep.end(), name) == keep.end()) found.push_back(name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

class Preprocess : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::temp_dir(std::string("preprocess-") +
                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  Result run(const std::string& args) {
    const char* exe = std::getenv("WEFT_PREPROCESS");
    EXPECT_NE(exe, nullptr) << "WEFT_PREPROCESS is set by meson test";
    const std::string cmd = fmt::format("cd {} && {} {} >{}/out.txt 2>{}/err.txt", dir_,
                                        exe ? exe : "weft-preprocess", args, dir_, dir_);
    const int status = std::system(cmd.c_str());
    Result r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_file(path("out.txt"));
    r.err = read_file(path("err.txt"));
    std::filesystem::remove(path("out.txt"));
    std::filesystem::remove(path("err.txt"));
    return r;
  }

  // JSONL of `lines` objects with keys "text" and "title"; every 17th title is
  // empty. Returns the texts of each key in order.
  std::pair<std::vector<std::string>, std::vector<std::string>> write_jsonl(const std::string& name,
                                                                            int lines) {
    std::vector<std::string> texts, titles;
    std::string jsonl;
    for (int i = 0; i < lines; ++i) {
      texts.push_back(sentence(2 * i + 1));
      titles.push_back(i % 17 == 5 ? "" : sentence(2 * i + 2));
      jsonl += nlohmann::json{{"title", titles.back()}, {"id", i}, {"text", texts.back()}}.dump();
      jsonl += i % 50 == 7 ? "\n\n" : "\n";  // a blank line now and then: skipped
    }
    write_file(path(name), jsonl);
    return {texts, titles};
  }

  std::string dir_;
};

// Each document of the dataset is encode(text) + eod, in input order; empty
// texts are skipped.
void expect_documents(const std::string& prefix, const std::vector<std::string>& texts,
                      BpeTokenizer& bpe) {
  std::vector<int32_t> expected;
  std::vector<int32_t> sizes;
  for (const std::string& text : texts) {
    if (text.empty()) continue;
    std::vector<int32_t> ids = bpe.encode(text);
    ids.push_back(bpe.eod());
    expected.insert(expected.end(), ids.begin(), ids.end());
    sizes.push_back(static_cast<int32_t>(ids.size()));
  }
  const TokenData data = TokenData::load(prefix, TokenFormat::Indexed);
  EXPECT_EQ(data.documents(), static_cast<int64_t>(sizes.size())) << prefix;
  EXPECT_EQ(data.tokens(), expected) << prefix;
  EXPECT_EQ(idx_sizes(prefix), sizes) << prefix;
}

TEST_F(Preprocess, JsonlKeysThroughGpt2BpeWithEod) {
  if (!BpeTokenizer::available()) GTEST_SKIP() << "weft was built without PCRE2";
  const auto [texts, titles] = write_jsonl("in.jsonl", 300);
  const Result r =
      run("--input in.jsonl --json-keys text title --output-prefix out "
          "--append-eod --workers 2 " +
          bpe_flags());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_TRUE(contains(r.out, "300 documents (18 empty, skipped)")) << r.out;
  EXPECT_TRUE(contains(r.out,
                       "out_text_document.bin, out_text_document.idx, "
                       "out_title_document.bin, out_title_document.idx"))
      << r.out;
  auto bpe = BpeTokenizer::load(fixture("bpe_vocab.json"), fixture("bpe_merges.txt"));
  ASSERT_GE(bpe.eod(), 0);
  expect_documents(path("out_text_document"), texts, bpe);
  expect_documents(path("out_title_document"), titles, bpe);
  EXPECT_EQ(other_files(dir_, {"in.jsonl"}),
            (std::vector<std::string>{"out_text_document.bin", "out_text_document.idx",
                                      "out_title_document.bin", "out_title_document.idx"}));

  // Hugging Face's tokenizer.json of the same vocabulary writes the same files.
  const Result hf =
      run("--input in.jsonl --json-keys text title --output-prefix hf --append-eod "
          "--tokenizer-type HuggingFaceTokenizer --tokenizer-model " +
          fixture("bpe_tokenizer.json"));
  ASSERT_EQ(hf.code, 0) << hf.err;
  for (const char* file : {"_text_document.bin", "_text_document.idx", "_title_document.bin"})
    EXPECT_EQ(read_file(path(std::string("hf") + file)), read_file(path(std::string("out") + file)))
        << file;
}

// The files are the same bytes at any --workers: documents go out in input order.
TEST_F(Preprocess, WorkersWriteTheSameBytes) {
  write_jsonl("in.jsonl", 1000);  // 16 batches of 64 lines, handed round the workers
  std::vector<std::string> tokenizers = {"--tokenizer-type ByteLevel"};
  if (BpeTokenizer::available()) tokenizers.push_back(bpe_flags() + " --append-eod");
  for (const std::string& tokenizer : tokenizers) {
    for (int workers : {1, 3}) {
      const Result r =
          run(fmt::format("--input in.jsonl --json-keys text title --output-prefix "
                          "w{} --workers {} --log-interval 250 {}",
                          workers, workers, tokenizer));
      ASSERT_EQ(r.code, 0) << tokenizer << "\n" << r.err;
      // A progress line at each 250th document.
      EXPECT_EQ(testing::count(r.err, "\n"), 4) << r.err;
      EXPECT_EQ(testing::count(r.err, " MB/s, "), 4) << r.err;
      EXPECT_TRUE(contains(r.err, "weft-preprocess: 1000 documents, ")) << r.err;
    }
    for (const char* file : {"_text_document.bin", "_text_document.idx", "_title_document.bin",
                             "_title_document.idx"}) {
      const std::string one = read_file(path(std::string("w1") + file));
      EXPECT_GT(one.size(), 0u);
      EXPECT_EQ(one, read_file(path(std::string("w3") + file))) << tokenizer << " " << file;
    }
  }
}

// Text with ByteLevel: the tokens are the bytes; a whole file is a document, or
// documents end at a separator line.
TEST_F(Preprocess, TextThroughByteLevelGivesTheBytes) {
  const std::string whole = "It was the best of times,\nit was the worst of times. é 日本\n";
  write_file(path("whole.txt"), whole);
  write_file(path("fortunes"), "first fortune\n%\n%\nsecond\r\n  fortune\n%\nthird, no newline");
  write_file(path("empty.txt"), "");
  const Result r =
      run("--input whole.txt fortunes empty.txt --input-format text "
          "--text-document-separator % --output-prefix t --tokenizer-type ByteLevel");
  ASSERT_EQ(r.code, 0) << r.err;
  // whole.txt holds no separator: one document; fortunes three and an empty
  // one; empty.txt none (what follows the last separator counts unless empty).
  EXPECT_TRUE(contains(r.out, "5 documents (1 empty, skipped)")) << r.out;
  const std::vector<std::string> docs = {whole, "first fortune\n", "second\r\n  fortune\n",
                                         "third, no newline"};
  std::vector<int32_t> bytes;
  std::vector<int32_t> sizes;
  for (const std::string& d : docs) {
    for (unsigned char c : d) bytes.push_back(c);
    sizes.push_back(static_cast<int32_t>(d.size()));
  }
  const TokenData data = TokenData::load(path("t_text_document"));
  EXPECT_EQ(data.format(), TokenFormat::Indexed);
  EXPECT_EQ(data.documents(), 4);
  EXPECT_EQ(data.tokens(), bytes);
  EXPECT_EQ(idx_sizes(path("t_text_document")), sizes);

  // Without a separator every file is one document.
  const Result w =
      run("--input whole.txt fortunes --input-format text --output-prefix w "
          "--tokenizer-type ByteLevel");
  ASSERT_EQ(w.code, 0) << w.err;
  EXPECT_EQ(idx_sizes(path("w_text_document")),
            (std::vector<int32_t>{static_cast<int32_t>(whole.size()),
                                  static_cast<int32_t>(read_file(path("fortunes")).size())}));
}

// Bad input: exit 1, one line naming the file:line or the value and the rule,
// and no file written (the dataset's .tmp files removed too).
TEST_F(Preprocess, BadInputGetsOneLineAndNoFiles) {
  std::string good;
  for (int i = 0; i < 500; ++i) good += nlohmann::json{{"text", sentence(i)}}.dump() + "\n";
  // The bad lines come after several batches were written to the .tmp files.
  write_file(path("bad_json.jsonl"), good + "{\"text\": \"unterminated}\n");
  write_file(path("no_key.jsonl"), good + "{\"body\": \"x\"}\n");
  write_file(path("not_string.jsonl"), good + "{\"text\": [\"a\", \"b\"]}\n");
  write_file(path("not_object.jsonl"), "[1, 2]\n");
  write_file(path("good.jsonl"), good);
  write_file(path("blank.jsonl"), "\n  \n");
  const std::vector<std::string> inputs = {"bad_json.jsonl",   "no_key.jsonl", "not_string.jsonl",
                                           "not_object.jsonl", "good.jsonl",   "blank.jsonl"};
  const std::string bytes = "--tokenizer-type ByteLevel --output-prefix out";
  struct Case {
    std::string args;
    std::vector<std::string> fragments;
  };
  std::vector<Case> cases = {
      {"--input bad_json.jsonl " + bytes, {"bad_json.jsonl:501: not valid JSON"}},
      {"--input good.jsonl no_key.jsonl " + bytes, {"no_key.jsonl:501: no key \"text\""}},
      {"--input not_string.jsonl " + bytes,
       {"not_string.jsonl:501: key \"text\" holds an array, not a string"}},
      {"--input not_object.jsonl " + bytes, {"not_object.jsonl:1: a JSON array, not an object"}},
      {"--input good.jsonl --json-keys text title " + bytes,
       {"good.jsonl:1: no key \"title\" (--json-keys)"}},
      {"--input good.jsonl --output-prefix out --tokenizer-type SentencePiece",
       {"--tokenizer-type SentencePiece: not one of GPT2BPETokenizer"}},
      {"--input good.jsonl --output-prefix out --tokenizer-type GPT2BPETokenizer",
       {"needs --vocab-file and --merge-file"}},
      {"--input good.jsonl --output-prefix nowhere/out --tokenizer-type ByteLevel",
       {"--output-prefix nowhere/out: the folder nowhere does not exist"}},
      {"--input good.jsonl missing.jsonl " + bytes, {"--input missing.jsonl: no such file"}},
      {"--input good.jsonl --append-eod " + bytes,
       {"--append-eod: ByteLevel has no end-of-document token"}},
      {"--input good.jsonl --workers 0 " + bytes, {"--workers 0"}},
      {"--input blank.jsonl " + bytes, {"out_text_document: no documents to write"}},
  };
  if (BpeTokenizer::available())  // without PCRE2 the loader says so instead
    cases.push_back(
        {"--input good.jsonl --output-prefix out --tokenizer-type GPT2BPETokenizer "
         "--vocab-file missing.json --merge-file " +
             fixture("bpe_merges.txt"),
         {"missing.json: cannot open"}});
  for (const Case& c : cases) {
    const Result r = run(c.args);
    EXPECT_EQ(r.code, 1) << c.args << "\n" << r.out << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.args << "\n" << r.err;
    for (const std::string& f : c.fragments)
      EXPECT_TRUE(contains(r.err, f)) << "missing '" << f << "' in: " << r.err;
    EXPECT_EQ(r.out, "") << c.args;
    EXPECT_EQ(other_files(dir_, inputs), std::vector<std::string>{}) << c.args;
  }
  // The good lines alone go through.
  ASSERT_EQ(run("--input good.jsonl " + bytes).code, 0);
  EXPECT_EQ(TokenData::load(path("out_text_document")).documents(), 500);
}

// The three commands: text in, an indexed dataset out, train_gpt reading it.
TEST_F(Preprocess, TrainGptTrainsOnTheDataset) {
  const char* train_gpt = std::getenv("WEFT_TRAIN_GPT");
  ASSERT_NE(train_gpt, nullptr) << "WEFT_TRAIN_GPT is set by meson test";
  std::string corpus;
  for (int i = 0; i < 60; ++i) {  // paragraphs of one line each, a blank line between
    std::string line = sentence(i);
    std::replace(line.begin(), line.end(), '\n', ' ');
    corpus += line + "\n\n";
  }
  write_file(path("corpus.txt"), corpus);
  std::vector<std::pair<std::string, int>> tokenizers = {{"--tokenizer-type ByteLevel", 256}};
  if (BpeTokenizer::available()) tokenizers.push_back({bpe_flags() + " --append-eod", 640});
  for (const auto& [tokenizer, vocab] : tokenizers) {
    const Result pre =
        run("--input corpus.txt --text-document-separator '' --output-prefix c " + tokenizer);
    ASSERT_EQ(pre.code, 0) << pre.err;
    EXPECT_TRUE(contains(pre.out, "60 documents")) << pre.out;
    EXPECT_TRUE(contains(pre.out, fmt::format("(vocabulary {})", vocab))) << pre.out;
    const std::string cmd = fmt::format(
        "{} --data-path {} --vocab-size {} --num-layers 2 --hidden-size 32 "
        "--num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --train-iters 3 "
        "--threads 1 --device cpu >{}/train.txt 2>&1",
        train_gpt, path("c_text_document"), vocab, dir_);
    const int status = std::system(cmd.c_str());
    const std::string out = read_file(path("train.txt"));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd << "\n" << out;
    EXPECT_TRUE(contains(out, "indexed, 60 documents")) << out;
    for (int step = 1; step <= 3; ++step)
      EXPECT_TRUE(contains(out, fmt::format("step {:>5}/3 | loss", step))) << out;
  }
}

}  // namespace
}  // namespace weft
