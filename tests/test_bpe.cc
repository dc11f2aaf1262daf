// GPT-2's byte-level BPE (weft/bpe.h) against Hugging Face's tokenizers: the
// fixtures of tests/reference/bpe_reference.py, a small trained vocabulary
// and the ids tokenizers gives for a corpus of awkward texts.
#include <gtest/gtest.h>
#include <weft/bpe.h>
#include <weft/error.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using nlohmann::json;
using testing::contains;
using testing::error_message;
using testing::read_file;
using testing::source_path;
using testing::temp_dir;
using testing::write_file;

const std::string kVocab = "tests/reference/fixtures/bpe_vocab.json";
const std::string kMerges = "tests/reference/fixtures/bpe_merges.txt";
const std::string kTokenizerJson = "tests/reference/fixtures/bpe_tokenizer.json";
const std::string kCases = "tests/reference/fixtures/bpe_cases.json";

#define SKIP_WITHOUT_PCRE2()                                                         \
  if (!BpeTokenizer::available()) {                                                  \
    GTEST_SKIP() << "weft was built without PCRE2 (libpcre2-dev): no BPE tokenizer"; \
  }

BpeTokenizer fixture_tokenizer() {
  return BpeTokenizer::load(source_path(kVocab), source_path(kMerges));
}

json cases() { return json::parse(read_file(source_path(kCases))); }

// Every case of the fixture: tokenizers' ids, token for token, and the text back from them.
void expect_fixture_ids(BpeTokenizer& bpe) {
  json all = cases();
  ASSERT_GE(all["cases"].size(), 40u);
  for (const json& c : all["cases"]) {
    std::string name = c["name"], text = c["text"];
    std::vector<int32_t> want = c["ids"];
    std::vector<int32_t> got = bpe.encode(text);
    EXPECT_EQ(got, want) << name;
    EXPECT_EQ(bpe.decode(got), text) << name;
  }
}

TEST(Bpe, BuiltWithPcre2OrSaysWhy) {
  std::string message = error_message([] { fixture_tokenizer(); });
  if (BpeTokenizer::available()) {
    EXPECT_EQ(message, "");
  } else {
    EXPECT_TRUE(contains(message, "built without PCRE2")) << message;
    EXPECT_TRUE(contains(message, "libpcre2-dev")) << message;
    EXPECT_TRUE(contains(message, "bpe_vocab.json")) << message;
  }
}

TEST(Bpe, MatchesTokenizersOnEveryCase) {
  SKIP_WITHOUT_PCRE2();
  BpeTokenizer bpe = fixture_tokenizer();
  expect_fixture_ids(bpe);
  // Again, now that every piece comes from the cache.
  expect_fixture_ids(bpe);
}

TEST(Bpe, TokenizerJsonGivesTheSameIds) {
  SKIP_WITHOUT_PCRE2();
  BpeTokenizer bpe = BpeTokenizer::load_json(source_path(kTokenizerJson));
  expect_fixture_ids(bpe);
}

// Older tokenizers save merges as "a b" strings, newer as ["a", "b"] pairs;
// GPT-2's own tokenizer.json has string merges and "" for the subword prefix
// and the word suffix it does not use.
TEST(Bpe, TokenizerJsonAsGpt2sOwn) {
  SKIP_WITHOUT_PCRE2();
  json j = json::parse(read_file(source_path(kTokenizerJson)));
  ASSERT_TRUE(j["model"]["merges"][0].is_array());
  for (json& merge : j["model"]["merges"]) {
    merge = merge[0].get<std::string>() + " " + merge[1].get<std::string>();
  }
  j["model"]["continuing_subword_prefix"] = "";
  j["model"]["end_of_word_suffix"] = "";
  std::string path = temp_dir("bpe_string_merges") + "/tokenizer.json";
  write_file(path, j.dump());
  BpeTokenizer bpe = BpeTokenizer::load_json(path);
  expect_fixture_ids(bpe);
}

TEST(Bpe, VocabularyFacts) {
  SKIP_WITHOUT_PCRE2();
  json vocab = json::parse(read_file(source_path(kVocab)));
  json all = cases();
  BpeTokenizer bpe = fixture_tokenizer();
  EXPECT_EQ(bpe.vocab_size(), static_cast<int64_t>(vocab.size()));
  EXPECT_EQ(bpe.vocab_size(), all["vocab_size"].get<int64_t>());
  EXPECT_EQ(bpe.eod(), all["eod"].get<int32_t>());
  EXPECT_EQ(bpe.eod(), vocab["<|endoftext|>"].get<int32_t>());
  EXPECT_EQ(bpe.token_id("<|endoftext|>"), bpe.eod());
  EXPECT_EQ(bpe.token_id("\xc4\xa0"), vocab["\xc4\xa0"].get<int32_t>());  // 'Ġ', the space
  EXPECT_EQ(bpe.token_id("not a token"), -1);
  // The special token decodes to its text; encoding that text does not give it back.
  int32_t eod = bpe.eod();
  EXPECT_EQ(bpe.decode(std::span(&eod, 1)), "<|endoftext|>");
  EXPECT_GT(bpe.encode("<|endoftext|>").size(), 1u);
  BpeTokenizer from_json = BpeTokenizer::load_json(source_path(kTokenizerJson));
  EXPECT_EQ(from_json.vocab_size(), bpe.vocab_size());
  EXPECT_EQ(from_json.eod(), bpe.eod());
}

// Bytes that are not UTF-8 match nothing of the pattern: each run of them is
// a piece of its own, and the text around them is encoded as without them.
TEST(Bpe, InvalidUtf8IsEncodedByteByByte) {
  SKIP_WITHOUT_PCRE2();
  BpeTokenizer bpe = fixture_tokenizer();
  const std::string bad[] = {"\xff",    "\xc3", "\x80\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80",
                             "\xc0\xaf"};
  for (const std::string& b : bad) {
    std::string text = "weave" + b + "the cloth " + b + b + " again" + b;
    std::vector<int32_t> ids = bpe.encode(text);
    EXPECT_EQ(bpe.decode(ids), text);
    std::vector<int32_t> want = bpe.encode("weave");
    for (const std::string& part :
         {b, std::string("the cloth "), b + b, std::string(" again"), b}) {
      std::vector<int32_t> p = bpe.encode(part);
      want.insert(want.end(), p.begin(), p.end());
    }
    EXPECT_EQ(ids, want) << json(std::vector<unsigned char>(b.begin(), b.end())).dump();
  }
  // Every byte value alone, and all 256 in a row, come back.
  std::string every;
  for (int i = 0; i < 256; ++i) {
    std::string one(1, static_cast<char>(i));
    EXPECT_EQ(bpe.decode(bpe.encode(one)), one) << i;
    every += one;
  }
  EXPECT_EQ(bpe.decode(bpe.encode(every)), every);
}

// \s+(?!\S) over a megabyte of spaces: one piece of all but the last space,
// which goes with the word after it; no stack limit of the regex is reached.
TEST(Bpe, LongPieces) {
  SKIP_WITHOUT_PCRE2();
  BpeTokenizer bpe = fixture_tokenizer();
  const size_t n = size_t{1} << 20;
  std::string spaces(n, ' ');
  std::vector<int32_t> ids = bpe.encode(spaces + "x");
  std::vector<int32_t> want = bpe.encode(spaces.substr(1));
  std::vector<int32_t> tail = bpe.encode(" x");
  want.insert(want.end(), tail.begin(), tail.end());
  EXPECT_EQ(ids, want);
  EXPECT_EQ(bpe.decode(ids), spaces + "x");
  std::string word(n, 'a');
  EXPECT_EQ(bpe.decode(bpe.encode(word)), word);
}

// More distinct pieces than the cache holds: it empties and fills again, and
// the ids are the same as a fresh tokenizer's, piece by piece.
TEST(Bpe, CacheRefillsWithTheSameIds) {
  SKIP_WITHOUT_PCRE2();
  BpeTokenizer bpe = fixture_tokenizer();
  BpeTokenizer fresh = fixture_tokenizer();
  std::string text;
  std::vector<int32_t> want;
  for (int i = 0; i < 150000; ++i) {
    std::string piece = fmt::format(" w{}", i * 7919);
    text += piece;
    std::vector<int32_t> p = fresh.encode(piece);
    want.insert(want.end(), p.begin(), p.end());
  }
  EXPECT_EQ(bpe.encode(text), want);
  EXPECT_EQ(bpe.encode(text), want);
}

TEST(Bpe, DecodeRefusesIdsOutsideTheVocabulary) {
  SKIP_WITHOUT_PCRE2();
  BpeTokenizer bpe = fixture_tokenizer();
  for (int32_t id : {-1, static_cast<int32_t>(bpe.vocab_size())}) {
    std::vector<int32_t> ids = {5, id};
    std::string message = error_message([&] { bpe.decode(ids); });
    EXPECT_TRUE(contains(message, fmt::format("token id {} is outside the vocabulary [0, {})", id,
                                              bpe.vocab_size())))
        << message;
    EXPECT_TRUE(contains(message, "bpe_vocab.json")) << message;
  }
}

// --- bad files: one line naming the file and the rule broken ---

// A vocabulary of the 256 byte symbols (ids 0..255), as JSON, with `extra` added.
json byte_vocab(const json& extra = json::object()) {
  json v = json::parse(read_file(source_path(kVocab)));
  json out = json::object();
  for (const auto& [token, id] : v.items()) {
    if (id.get<int>() >= 1 && id.get<int>() <= 256) out[token] = id.get<int>() - 1;
  }
  EXPECT_EQ(out.size(), 256u);
  for (const auto& [token, id] : extra.items()) out[token] = id;
  return out;
}

struct Files {
  std::string vocab, merges;
};

Files write_pair(const std::string& tag, const std::string& vocab, const std::string& merges) {
  std::string dir = temp_dir(tag);
  Files f{dir + "/vocab.json", dir + "/merges.txt"};
  write_file(f.vocab, vocab);
  write_file(f.merges, merges);
  return f;
}

std::string load_error(const Files& f) {
  return error_message([&] { BpeTokenizer::load(f.vocab, f.merges); });
}

TEST(Bpe, SmallHandWrittenFilesLoad) {
  SKIP_WITHOUT_PCRE2();
  // ab and abc through two merges; blank lines and CRLF ends are allowed.
  Files f = write_pair("bpe_ok", byte_vocab({{"ab", 256}, {"abc", 257}}).dump(),
                       "#version: 0.2\r\na b\r\n\r\nab c\r\n");
  BpeTokenizer bpe = BpeTokenizer::load(f.vocab, f.merges);
  EXPECT_EQ(bpe.vocab_size(), 258);
  EXPECT_EQ(bpe.eod(), -1);
  int32_t space = bpe.token_id("\xc4\xa0");
  EXPECT_EQ(bpe.encode("abc ab abd"),
            (std::vector<int32_t>{257, space, 256, space, 256, 'd' - 33}));
}

// A pair listed twice keeps its later rank (tokenizers' rule): with b c ranked
// before a b, "abc" is a + bc, and a + bc is not a merge.
TEST(Bpe, ALaterDuplicateMergeTakesItsLaterRank) {
  SKIP_WITHOUT_PCRE2();
  json vocab = byte_vocab({{"ab", 256}, {"bc", 257}});
  Files once = write_pair("bpe_dup1", vocab.dump(), "a b\nb c\n");
  Files twice = write_pair("bpe_dup2", vocab.dump(), "a b\nb c\na b\n");
  EXPECT_EQ(BpeTokenizer::load(once.vocab, once.merges).encode("abc"),
            (std::vector<int32_t>{256, 'c' - 33}));
  EXPECT_EQ(BpeTokenizer::load(twice.vocab, twice.merges).encode("abc"),
            (std::vector<int32_t>{'a' - 33, 257}));
}

TEST(Bpe, FileThatCannotBeOpened) {
  SKIP_WITHOUT_PCRE2();
  std::string message =
      error_message([] { BpeTokenizer::load("/nonexistent/vocab.json", source_path(kMerges)); });
  EXPECT_EQ(message, "/nonexistent/vocab.json: cannot open");
  message =
      error_message([] { BpeTokenizer::load(source_path(kVocab), "/nonexistent/merges.txt"); });
  EXPECT_EQ(message, "/nonexistent/merges.txt: cannot open");
}

TEST(Bpe, VocabThatIsNotJson) {
  SKIP_WITHOUT_PCRE2();
  Files f = write_pair("bpe_notjson", "{\"a\": 0,", "");
  std::string message = load_error(f);
  EXPECT_TRUE(contains(message, f.vocab + ": not valid JSON: ")) << message;
  EXPECT_FALSE(contains(message, "\n")) << message;
}

TEST(Bpe, VocabThatIsNotAnObject) {
  SKIP_WITHOUT_PCRE2();
  Files f = write_pair("bpe_array", "[\"a\", \"b\"]", "");
  EXPECT_EQ(load_error(f),
            f.vocab + ": a vocabulary is a JSON object of token -> id, not an array");
}

TEST(Bpe, VocabIdsThatAreNotIntegers) {
  SKIP_WITHOUT_PCRE2();
  for (const char* bad : {"\"7\"", "2.5", "-1", "null", "4294967296"}) {
    json v = byte_vocab();
    v["zz"] = json::parse(bad);
    Files f = write_pair("bpe_badid", v.dump(), "");
    EXPECT_EQ(load_error(f),
              fmt::format("{}: token \"zz\" has id {}: ids are integers in [0, 2^31)", f.vocab,
                          json::parse(bad).dump()));
  }
}

TEST(Bpe, VocabWithDuplicateIds) {
  SKIP_WITHOUT_PCRE2();
  Files f = write_pair("bpe_dupid", byte_vocab({{"ab", 256}, {"zz", 256}}).dump(), "");
  EXPECT_EQ(load_error(f), f.vocab + ": tokens \"ab\" and \"zz\" both have id 256");
}

TEST(Bpe, VocabWithAGapInItsIds) {
  SKIP_WITHOUT_PCRE2();
  Files f = write_pair("bpe_gap", byte_vocab({{"ab", 256}, {"zz", 300}}).dump(), "");
  EXPECT_EQ(load_error(f), f.vocab +
                               ": ids must run from 0 to N - 1 for N = 258 tokens, but no "
                               "token has id 257 (token \"zz\" has id 300)");
}

TEST(Bpe, VocabWithoutEveryByteSymbol) {
  SKIP_WITHOUT_PCRE2();
  json v = byte_vocab();
  int space = v["\xc4\xa0"];  // 'Ġ', the space's symbol
  v.erase("\xc4\xa0");
  v["zz"] = space;
  Files f = write_pair("bpe_nospace", v.dump(), "");
  EXPECT_EQ(load_error(f), f.vocab +
                               ": byte 0x20's symbol \"\xc4\xa0\" is not in the vocabulary: "
                               "a byte-level BPE vocabulary (GPT-2's) holds all 256");
}

TEST(Bpe, MergeLinesThatAreNotTwoTokens) {
  SKIP_WITHOUT_PCRE2();
  std::string vocab = byte_vocab({{"ab", 256}}).dump();
  for (const char* line : {"ab", "a b c", "a  b", " a", "a "}) {
    Files f = write_pair("bpe_badline", vocab, std::string("#version: 0.2\na b\n") + line + "\n");
    EXPECT_EQ(load_error(f), fmt::format("{}:3: a merge is two tokens separated by one space, "
                                         "not {}",
                                         f.merges, json(line).dump()));
  }
  // A line that is not UTF-8 is named with U+FFFD in place of its bad bytes.
  Files f = write_pair("bpe_badutf8", vocab, "a b\n\xff\n");
  EXPECT_EQ(load_error(f), f.merges +
                               ":2: a merge is two tokens separated by one space, not "
                               "\"\xef\xbf\xbd\"");
}

TEST(Bpe, MergeOfTokensNotInTheVocabulary) {
  SKIP_WITHOUT_PCRE2();
  std::string vocab = byte_vocab({{"ab", 256}}).dump();
  Files f = write_pair("bpe_oov", vocab, "a b\nab zz\n");
  EXPECT_EQ(load_error(f), f.merges + ":2: merge \"ab\" \"zz\": \"zz\" is not in the vocabulary");
  f = write_pair("bpe_oov_result", vocab, "a b\nab c\n");
  EXPECT_EQ(load_error(f),
            f.merges + ":2: merge \"ab\" \"c\": the merged token \"abc\" is not in the vocabulary");
}

std::string json_error(const std::string& tag, const json& j) {
  std::string path = temp_dir(tag) + "/tokenizer.json";
  write_file(path, j.dump());
  return error_message([&] { BpeTokenizer::load_json(path); });
}

TEST(Bpe, TokenizerJsonOfAnotherKind) {
  SKIP_WITHOUT_PCRE2();
  json good = json::parse(read_file(source_path(kTokenizerJson)));
  json j = good;
  j["model"]["type"] = "WordPiece";
  EXPECT_TRUE(contains(json_error("bpe_wp", j), "model.type is \"WordPiece\", not \"BPE\""));
  j = good;
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  EXPECT_TRUE(contains(json_error("bpe_ws", j),
                       "pre_tokenizer is {\"type\":\"Whitespace\"}: weft's BPE is GPT-2's"));
  j = good;
  j["pre_tokenizer"]["add_prefix_space"] = true;
  EXPECT_TRUE(contains(json_error("bpe_prefix", j), "no prefix space"));
  j = good;
  j["normalizer"] = {{"type", "NFC"}};
  EXPECT_TRUE(contains(json_error("bpe_nfc", j), "normalizer is {\"type\":\"NFC\"}"));
  j = good;
  j["model"]["continuing_subword_prefix"] = "##";
  EXPECT_TRUE(contains(json_error("bpe_subword", j), "model.continuing_subword_prefix is \"##\""));
  j = good;
  j["model"]["merges"][3] = {"a"};
  EXPECT_TRUE(contains(json_error("bpe_merge3", j),
                       "model.merges[3]: a merge is \"a b\" or [\"a\", \"b\"], not [\"a\"]"));
  j = good;
  j["model"]["merges"][4] = {"a", "zz"};
  EXPECT_TRUE(contains(json_error("bpe_merge4", j),
                       "model.merges[4]: merge \"a\" \"zz\": \"zz\" is not in the vocabulary"));
  j = good;
  j["added_tokens"][0]["id"] = 5;
  EXPECT_TRUE(contains(json_error("bpe_added", j),
                       ": added_tokens: token \"<|endoftext|>\" has two ids, 0 and 5"));
}

}  // namespace
}  // namespace weft
