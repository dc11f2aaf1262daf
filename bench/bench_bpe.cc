// bench_bpe — weft's GPT-2 BPE (weft/bpe.h) encoding documents, one call per
// document as a data pipeline makes them, on one thread; bench/bpe_speed.sh
// runs it against Hugging Face's tokenizers (bench/bpe_tokenizers.py).
//
//   bench_bpe --vocab vocab.json --merges merges.txt --docs docs.jsonl [--ids ids.bin]
//
// docs.jsonl holds one JSON string a line. Prints one JSON line: documents,
// bytes, tokens, seconds (the encoding alone, after loading) and MB/s
// (10^6 bytes). --ids writes every id as int32, in document order.
#include <fmt/format.h>
#include <weft/bpe.h>
#include <weft/error.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  std::string vocab, merges, docs_path, ids_path;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        fmt::print(stderr, "bench_bpe: {} needs a value\n", a);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--vocab")
      vocab = next();
    else if (a == "--merges")
      merges = next();
    else if (a == "--docs")
      docs_path = next();
    else if (a == "--ids")
      ids_path = next();
    else {
      fmt::print(stderr, "usage: bench_bpe --vocab FILE --merges FILE --docs FILE [--ids FILE]\n");
      return 2;
    }
  }
  if (vocab.empty() || merges.empty() || docs_path.empty()) {
    fmt::print(stderr, "bench_bpe: --vocab, --merges and --docs are needed\n");
    return 2;
  }
  try {
    std::vector<std::string> docs;
    std::ifstream in(docs_path);
    weft::check(in.good(), "{}: cannot open", docs_path);
    size_t bytes = 0;
    for (std::string line; std::getline(in, line);) {
      docs.push_back(nlohmann::json::parse(line).get<std::string>());
      bytes += docs.back().size();
    }
    weft::BpeTokenizer bpe = weft::BpeTokenizer::load(vocab, merges);
    std::vector<int32_t> ids;
    ids.reserve(bytes / 2);
    auto start = std::chrono::steady_clock::now();
    for (const std::string& doc : docs) bpe.encode(doc, ids);
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!ids_path.empty()) {
      std::ofstream out(ids_path, std::ios::binary);
      out.write(reinterpret_cast<const char*>(ids.data()),
                static_cast<std::streamsize>(ids.size() * sizeof(int32_t)));
      weft::check(out.good(), "{}: cannot write", ids_path);
    }
    fmt::print(
        "{{\"side\": \"weft\", \"documents\": {}, \"bytes\": {}, \"tokens\": {}, \"seconds\": "
        "{:.4f}, "
        "\"mb_per_s\": {:.3f}}}\n",
        docs.size(), bytes, ids.size(), seconds, static_cast<double>(bytes) / seconds / 1e6);
  } catch (const weft::Error& e) {
    fmt::print(stderr, "bench_bpe: {}\n", e.what());
    return 1;
  }
  return 0;
}
