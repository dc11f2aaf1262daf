#include "test_util.h"

#include <weft/bpe.h>
#include <weft/data.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

#include <sys/wait.h>

namespace weft::testing {

std::string best_of_times(int repeats) {
  std::string text;
  for (int i = 0; i < repeats; ++i) text += "It was the best of times, it was the worst of times. ";
  return text;
}

TokenData best_of_times_tokens(int repeats) {
  const std::string text = best_of_times(repeats);
  return TokenData::from_tokens(std::vector<int32_t>(text.begin(), text.end()), 256);
}

std::string write_bpe_documents(const std::string& prefix, const std::vector<std::string>& lines,
                                int documents) {
  const std::string vocab = source_path("tests/reference/fixtures/bpe_vocab.json"),
                    merges = source_path("tests/reference/fixtures/bpe_merges.txt");
  BpeTokenizer bpe = BpeTokenizer::load(vocab, merges);
  IndexedDatasetWriter w(prefix, bpe.vocab_size());
  for (int d = 0; d < documents; ++d) {
    std::vector<int32_t> ids = bpe.encode(lines[static_cast<size_t>(d) % lines.size()]);
    ids.push_back(bpe.eod());
    w.add_document(ids);
  }
  w.finish();
  return "--data-path " + prefix + " --vocab-size " + std::to_string(bpe.vocab_size()) +
         " --tokenizer-type GPT2BPETokenizer --vocab-file " + vocab + " --merge-file " + merges;
}

std::string source_path(const std::string& rel) {
  const char* env = std::getenv("WEFT_SOURCE_DIR");
  std::string root = env ? env : WEFT_SOURCE_DIR;
  return root + "/" + rel;
}

std::string temp_dir(const std::string& tag) {
  auto base = std::filesystem::temp_directory_path() /
              ("weft-test-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base);
  return base.string();
}

std::vector<float> uniform(int64_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) {
    double u = static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
    x = lo + static_cast<float>(u) * (hi - lo);
  }
  return v;
}

Tensor uniform_tensor(Shape shape, uint64_t seed, float lo, float hi) {
  Tensor t = Tensor::empty(shape);
  auto v = uniform(t.numel(), seed, lo, hi);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

Tensor to_host(const Tensor& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
  h.copy_from(t);
  return h;
}

double rel_error(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

double rel_error(const Tensor& a, const Tensor& b) {
  check_shape(a, b.shape(), "rel_error operand");
  return rel_error(a.data<float>(), b.data<float>(), a.numel());
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

namespace {
// A variable meson sets for the tests (tests/meson.build's test_env_vars).
std::string required_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0')
    throw std::runtime_error(std::string(name) +
                             " is not set: run the test through `meson test`, which sets it, or "
                             "set it to the program's path");
  return v;
}
}  // namespace

TrainRun run_train_gpt(int ranks, const std::string& args, const std::string& dir) {
  return run_job(required_env("WEFT_TRAIN_GPT"), ranks, args, dir);
}

TrainRun run_job(const std::string& program, int ranks, const std::string& args,
                 const std::string& dir) {
  const std::string jsonl = dir + "/run.jsonl", out = dir + "/out.txt";
  std::remove(jsonl.c_str());
  TrainRun r;
  // On the CPU unless the test names a device: the same meaning on a GPU machine.
  const std::string device = contains(args, "--device") ? "" : " --device cpu";
  r.command = program + " " + args + device + " --log-jsonl " +
              jsonl;
  if (ranks > 1)
    r.command =
        required_env("WEFT_MPIEXEC") + " -n " + std::to_string(ranks) + " " + r.command;
  const int status = std::system((r.command + " >" + out + " 2>&1").c_str());
  r.ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  r.output = read_file(out);
  r.records = jsonl_steps(jsonl);
  return r;
}

namespace {
std::vector<nlohmann::json> jsonl_lines(const std::string& path, bool steps) {
  std::vector<nlohmann::json> v;
  std::istringstream lines(read_file(path));
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("step") == steps) v.push_back(std::move(j));
  }
  return v;
}
}  // namespace

std::vector<nlohmann::json> jsonl_steps(const std::string& path) { return jsonl_lines(path, true); }
std::vector<nlohmann::json> jsonl_headers(const std::string& path) {
  return jsonl_lines(path, false);
}

}  // namespace weft::testing
