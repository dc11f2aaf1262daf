// Helpers shared by weft's tests.
#pragma once

#include <weft/data.h>
#include <weft/tensor.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace weft::testing {

// Path of a file under the source tree (tests/reference/fixtures/...).
std::string source_path(const std::string& rel);
// A fresh empty directory under the build's temp area, removed at exit.
std::string temp_dir(const std::string& tag);
// A host copy of a tensor on any device.
Tensor to_host(const Tensor& t);

// Every sequence length the GPU's attention and classifier kernels are held
// to against the CPU: powers of two, their neighbours, and ragged values.
inline constexpr int64_t kSeqLengths[] = {1,   2,   3,   7,   31,  32,  33,  37,  63,   64,  65,
                                          127, 128, 129, 255, 256, 511, 512, 513, 1023, 1024};

// Deterministic uniform values in [lo, hi).
std::vector<float> uniform(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f);
Tensor uniform_tensor(Shape shape, uint64_t seed, float lo = -1.0f, float hi = 1.0f);
// ||a - b|| / max(||b||, tiny), in double.
double rel_error(const float* a, const float* b, int64_t n);
double rel_error(const Tensor& a, const Tensor& b);
// "It was the best of times, it was the worst of times. " `repeats` times:
// the text small tests train on, and as byte tokens (vocabulary 256).
std::string best_of_times(int repeats);
TokenData best_of_times_tokens(int repeats);
// Token data a BPE made with --append-eod: the fixture tokenizer's
// (tests/reference/fixtures/bpe_*) encoding of `documents` documents, line
// k % lines.size() each, each ended by its <|endoftext|>, as an indexed
// dataset at `prefix`. Returns train_gpt's flags for it: --data-path,
// --vocab-size and the tokenizer's. Needs BpeTokenizer::available().
std::string write_bpe_documents(const std::string& prefix, const std::vector<std::string>& lines,
                                int documents);
// Writes a file with these bytes.
void write_file(const std::string& path, const std::string& bytes);
std::string read_file(const std::string& path);
// The lines of a --log-jsonl file: its step records (the lines with a "step"),
// or its headers (one per start: "start_step" and the rank table "ranks").
std::vector<nlohmann::json> jsonl_steps(const std::string& path);
std::vector<nlohmann::json> jsonl_headers(const std::string& path);

// Runs train_gpt ($WEFT_TRAIN_GPT) with `args` plus --log-jsonl, under
// `$WEFT_MPIEXEC -n ranks` when ranks > 1, its output going to dir/out.txt.
struct TrainRun {
  bool ok = false;                      // exited with status 0
  std::string command, output;
  std::vector<nlohmann::json> records;  // one per step of the JSONL log
};
TrainRun run_train_gpt(int ranks, const std::string& args, const std::string& dir);
// The same for another program built on the training job (weft/job.h).
TrainRun run_job(const std::string& program, int ranks, const std::string& args,
                 const std::string& dir);

// How many times `part` occurs in `text`.
inline int count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// True when `text` contains `part`.
inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The message of the Error thrown by f, or "" when nothing was thrown.
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace weft::testing
