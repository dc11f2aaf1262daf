// train_gpt end to end: bad input gets one error line and exit status 1;
// good input trains, logs JSONL, saves, resumes and samples.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <weft/device.h>
#include <weft/cpu_kernels.h>
#include <weft/ops.h>
#include <weft/bpe.h>
#include <weft/data.h>
#include <weft/safetensors.h>
#include <weft/units.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <xxhash.h>
#include <sstream>

#include "test_util.h"

namespace weft {
namespace {

using testing::read_file;
using testing::source_path;
using testing::write_file;

struct Result {
  int code = -1;
  std::string out, err;
};

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::temp_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::string text;
    for (int i = 0; i < 100; ++i) text += "To be, or not to be, that is the question.\n";
    write_file(dir_ + "/text.txt", text);
    // A token file whose ids fit the fixture's vocabulary of 64.
    std::vector<uint16_t> tokens(400);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 7) % 64);
    write_bin(dir_ + "/tokens.bin", 20240520, 1, static_cast<int32_t>(tokens.size()), tokens);
  }

  static void write_bin(const std::string& path, int32_t magic, int32_t version, int32_t count,
                        const std::vector<uint16_t>& tokens) {
    std::vector<int32_t> header(256, 0);
    header[0] = magic, header[1] = version, header[2] = count;
    std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
    bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
    write_file(path, bytes);
  }

  // Runs train_gpt on the CPU unless `args` names a device: the suite means
  // the same thing on a machine with a GPU.
  Result run(const std::string& args) {
    const char* exe = std::getenv("WEFT_TRAIN_GPT");
    EXPECT_NE(exe, nullptr) << "WEFT_TRAIN_GPT is set by meson test";
    const std::string device = testing::contains(args, "--device") ? "" : " --device cpu";
    std::string cmd = std::string(exe ? exe : "train_gpt") + " " + args + device + " >" + dir_ +
                      "/out.txt 2>" + dir_ + "/err.txt";
    int status = std::system(cmd.c_str());
    Result r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_file(dir_ + "/out.txt");
    r.err = read_file(dir_ + "/err.txt");
    return r;
  }

  // Runs and expects one error line containing every fragment.
  void expect_error(const std::string& args, std::initializer_list<std::string> fragments) {
    Result r = run(args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    for (const auto& f : fragments) EXPECT_NE(r.err.find(f), std::string::npos) << "missing '" << f << "' in: " << r.err;
  }

  // The fixture model's shape, reading the token file.
  std::string tiny(const std::string& extra) {
    return "--vocab-size 64 --max-position-embeddings 16 --num-layers 2 --hidden-size 32 "
           "--num-attention-heads 4 --seq-length 12 --micro-batch-size 2 --train-iters 1 "
           "--data-path " + dir_ + "/tokens.bin " + extra;
  }

  std::string toy(const std::string& extra) {
    return "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
           "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --data-path " + dir_ +
           "/text.txt " + extra;
  }

  // Writes the fixture's init tensors, edited, to a new safetensors file.
  std::string edited_init(const std::string& name,
                          const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
    auto f = safetensors::File::open(source_path("tests/reference/fixtures/gpt_tiny_init.safetensors"));
    std::vector<std::pair<std::string, Tensor>> t;
    for (const auto& info : f.tensors()) t.emplace_back(info.name, f.get(info.name).clone());
    edit(t);
    const std::string path = dir_ + "/" + name;
    safetensors::save(path, t);
    return path;
  }

  std::string dir_;
};

// Device and precision flags that cannot be honoured: one line each.
TEST_F(Cli, DeviceAndPrecisionFlags) {
  expect_error(toy("--bf16 --fp16"), {"--bf16 and --fp16 are mutually exclusive"});
  expect_error(toy("--device tpu"),
               {"--device 'tpu' must be cpu, cuda, cuda:N (N a GPU index) or auto"});
  expect_error(toy("--device cuda:first"),
               {"--device 'cuda:first' must be cpu, cuda, cuda:N (N a GPU index) or auto"});
  // NCCL without a GPU: auto is the CPU, which NCCL cannot carry.
  expect_error(toy("--device auto --comm-backend nccl"),
               {cuda_device_count() > 0
                    ? "--comm-backend nccl chooses how ranks talk, but the job is one process"
                    : "--comm-backend nccl carries GPU tensors: it needs --device cuda"});
  expect_error(toy("--device cpu --tf32"), {"--tf32 needs --device cuda"});
  // The CUDA profiler's range needs both ends, the end past the start.
  expect_error(toy("--profile-step-start 2"),
               {"--profile-step-start (2) and --profile-step-end (-1) go together"});
  expect_error(toy("--profile-step-start 3 --profile-step-end 3"),
               {"--profile-step-end (3) must be past --profile-step-start (3)"});
  expect_error(toy("--device cuda --tf32 --bf16"), {"--tf32 changes nothing with --bf16"});
  expect_error(toy("--comm-backend gloo"), {"--comm-backend 'gloo' must be auto, mpi or nccl"});
  expect_error(toy("--device cpu --comm-backend nccl"),
               {"--comm-backend nccl carries GPU tensors: it needs --device cuda"});
  expect_error(toy("--device cpu --comm-backend mpi"),
               {"--comm-backend mpi chooses how ranks talk, but the job is one process"});
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible: --device cuda can run here";
  expect_error(toy("--device cuda"), {cuda_built() ? "--device cuda: no CUDA device is visible"
                                                   : "--device cuda: weft was built without CUDA"});
  expect_error(toy("--device cuda:1"), {cuda_built() ? "--device cuda:1: no CUDA device is visible"
                                                     : "--device cuda: weft was built without CUDA"});
  // auto falls back to the CPU without a GPU, and says where it runs.
  Result r = run(toy("--device auto --train-iters 1"));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "| threads ")) << r.out;
}

// --bf16 and --fp16 on the CPU: emulated, and the log says so; fp16's loss
// scale is logged per step, and its flags are refused without --fp16 or with
// values that break Megatron's rules.
TEST_F(Cli, MixedPrecisionFlags) {
  for (const char* flag : {"--loss-scale 1024", "--initial-loss-scale 65536",
                           "--min-loss-scale 2", "--loss-scale-window 10", "--hysteresis 1"})
    expect_error(toy(flag), {"set fp16's loss scaling: they need --fp16"});
  expect_error(toy("--bf16 --loss-scale 8"), {"they need --fp16"});
  expect_error(toy("--fp16 --loss-scale 0"), {"--loss-scale (0) must be a positive number"});
  expect_error(toy("--fp16 --loss-scale -4"), {"--loss-scale (-4) must be a positive number"});
  expect_error(toy("--fp16 --loss-scale 8 --hysteresis 3"),
               {"shape the dynamic loss scale, which --loss-scale 8 replaces by a fixed one"});
  expect_error(toy("--fp16 --initial-loss-scale 0"),
               {"--initial-loss-scale (0) must be a positive number"});
  expect_error(toy("--fp16 --min-loss-scale 0"), {"--min-loss-scale (0) must be positive"});
  expect_error(toy("--fp16 --initial-loss-scale 4 --min-loss-scale 8"),
               {"--min-loss-scale (8) must be positive and at most --initial-loss-scale (4)"});
  expect_error(toy("--fp16 --loss-scale-window 0"),
               {"--loss-scale-window (0) must be at least 1"});
  expect_error(toy("--fp16 --hysteresis 0"), {"--hysteresis (0) must be at least 1"});
  expect_error(toy("--fp16 --local-steps 2 --train-iters 2"),
               {"--fp16 skips a step when the all-reduced gradients overflow",
                "--local-steps 2"});

  Result r = run(toy("--bf16 --train-iters 2"));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, cpu::bf16_gemm() == cpu::Bf16Gemm::OneDnn
                                           ? "bf16 (bf16 GEMMs on oneDNN ("
                                           : "bf16 (emulated on the CPU"))
      << r.out;
  // The default scale, 2^32, overflows fp16 at once: the first step is
  // skipped and logged so.
  const std::string jsonl = dir_ + "/fp16.jsonl";
  r = run(toy("--fp16 --train-iters 3 --log-interval 1 --log-jsonl " + jsonl));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "fp16 (emulated on the CPU")) << r.out;
  EXPECT_TRUE(testing::contains(r.out, "skipped: gradients overflowed")) << r.out;
  std::istringstream lines(read_file(jsonl));
  std::string line;
  std::getline(lines, line);  // the header
  ASSERT_TRUE(std::getline(lines, line));
  const nlohmann::json first = nlohmann::json::parse(line);
  EXPECT_EQ(first.value("loss_scale", 0.0), 4294967296.0) << line;
  EXPECT_EQ(first.value("skipped", false), true) << line;

  // A resume that names no precision takes the checkpoint's, with its loss
  // scale: two overflows (the first kept by the hysteresis) leave 2^31.
  const std::string ckpt = dir_ + "/ckpt", resumed = dir_ + "/resumed.jsonl";
  r = run(toy("--fp16 --train-iters 2 --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(toy("--train-iters 3 --save " + ckpt + " --log-jsonl " + resumed));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "from the checkpoint") &&
              testing::contains(r.out, "--fp16") &&
              testing::contains(r.out, "fp16 (emulated on the CPU"))
      << r.out;
  const std::vector<nlohmann::json> steps = testing::jsonl_steps(resumed);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].value("step", 0), 3);
  EXPECT_EQ(steps[0].value("loss_scale", 0.0), 2147483648.0) << steps[0].dump();
}

// --attention-backend: Megatron's flag; 'fused' is cuDNN's fused attention,
// and the choice exists only on a GPU of a build that has it.
TEST_F(Cli, AttentionBackend) {
  expect_error(toy("--attention-backend flash"),
               {"--attention-backend flash: weft has no such kernel; 'fused' is cuDNN's"});
  expect_error(toy("--attention-backend local"), {"--attention-backend local: weft has no such"});
  expect_error(toy("--attention-backend sdpa"),
               {"--attention-backend 'sdpa' must be auto, fused or unfused"});
  expect_error(toy("--device cpu --attention-backend fused"),
               {"--attention-backend fused chooses the attention kernel on a GPU: the CPU "
                "computes attention unfused"});
  expect_error(toy("--device cpu --attention-backend unfused"),
               {"--attention-backend unfused chooses the attention kernel on a GPU"});
  if (!ops::fused_attention_built())
    expect_error(toy("--device cuda --attention-backend fused"),
                 {"--attention-backend fused: weft was built without cuDNN's fused attention"});
}

// --cpu-gemm: the CPU's GEMM library, named in the log header. Both train the
// same model: the first step's loss (a forward pass, before any update)
// differs only by the GEMMs' summation order. Each output of a GEMM with
// reduction length k <= 256 is off by at most (k + 2) 2^-24 of its magnitudes'
// sum (about 1.5e-5 relative); through 2 blocks and the head that is well
// under 1e-4 of a loss near ln(256) = 5.5.
TEST_F(Cli, CpuGemmLibrary) {
  expect_error(toy("--cpu-gemm mkl"), {"--cpu-gemm 'mkl' must be auto, openblas or onednn"});
  expect_error(toy("--device cuda --cpu-gemm openblas"),
               {"--cpu-gemm openblas chooses the CPU's GEMM library, but --device cuda runs "
                "GEMMs on cuBLAS"});
  if (!cpu::onednn_built()) {
    expect_error(toy("--cpu-gemm onednn"), {"--cpu-gemm onednn: weft was built without oneDNN"});
  }
  // The environment's choices, checked as flags are: one line, rc 1.
  // (Each variable is put back as it was: CI runs this suite under them.)
  struct ScopedEnv {
    std::string name, saved;
    bool had;
    ScopedEnv(const char* n, const char* value) : name(n), had(std::getenv(n) != nullptr) {
      if (had) saved = std::getenv(n);
      setenv(n, value, 1);
    }
    ~ScopedEnv() { had ? setenv(name.c_str(), saved.c_str(), 1) : unsetenv(name.c_str()); }
  };
  {
    ScopedEnv env("WEFT_CPU_GEMM", "mkl");
    expect_error(toy("--train-iters 2"), {"WEFT_CPU_GEMM 'mkl' must be auto, openblas or onednn"});
  }
  {
    ScopedEnv env("WEFT_CPU_BF16_GEMM", "amx");
    expect_error(toy("--bf16 --train-iters 2"),
                 {"WEFT_CPU_BF16_GEMM 'amx' must be emulated or onednn"});
  }
  std::vector<double> first;
  for (const std::string library : {"openblas", "onednn"}) {
    if (library == "onednn" && !cpu::onednn_built()) continue;
    const std::string log = dir_ + "/" + library + ".jsonl";
    const Result r = run(toy("--train-iters 2 --cpu-gemm " + library + " --log-jsonl " + log));
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_TRUE(
        testing::contains(r.out, library == "onednn" ? "| GEMM oneDNN " : "| GEMM OpenBLAS "))
        << r.out;
    first.push_back(testing::jsonl_steps(log).at(0)["loss"].get<double>());
  }
  if (first.size() == 2) {
    EXPECT_NEAR(first[0], first[1], 1e-4);
  }
}

// Token data samples decode through an llm.c tokenizer file; without one the
// ids are printed and a prompt (which nothing could encode) is refused.
TEST_F(Cli, SamplesOfTokenDataDecodeThroughATokenizer) {
  auto tokenizer = [&](const std::string& name, uint32_t magic, uint32_t vocab) {
    std::vector<uint32_t> header(256, 0);
    header[0] = magic, header[1] = 2, header[2] = vocab, header[3] = 0;
    std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
    for (uint32_t i = 0; i < vocab; ++i) {  // token i is the two bytes "<letter>|"
      bytes.push_back(2);
      bytes.push_back(static_cast<char>('a' + i % 26));
      bytes.push_back('|');
    }
    write_file(dir_ + "/" + name, bytes);
    return dir_ + "/" + name;
  };
  Result r = run(tiny("--sample 12 --tokenizer " + tokenizer("tok.bin", 20240328, 64)));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string text = r.out.substr(r.out.find('\n', r.out.find("--- sample")) + 1);
  EXPECT_EQ(std::count(text.begin(), text.end(), '|'), 12) << text;  // 12 decoded tokens
  r = run(tiny("--sample 4"));
  EXPECT_TRUE(testing::contains(r.out, "give --tokenizer-type or --tokenizer to decode them"))
      << r.out;
  expect_error(tiny("--sample 4 --sample-prompt Hello"), {"--sample-prompt needs text data"});
  expect_error(tiny("--sample 4 --tokenizer " + tokenizer("bad.bin", 123, 64)),
               {"bad.bin", "magic 123", "20240328"});
  expect_error(tiny("--sample 4 --tokenizer " + tokenizer("small.bin", 20240328, 10)),
               {"small.bin has 10 tokens", "token id 63"});
}

// --split, --eval-interval and --eval-iters (Megatron's) put a validation
// loss in the log and the JSONL; --loss-plot draws both curves.
TEST_F(Cli, ValidationLossAndLossPlot) {
  Result r = run(toy("--train-iters 6 --split 90,10,0 --eval-interval 3 --eval-iters 2 "
                     "--log-jsonl " + dir_ + "/v.jsonl --loss-plot " + dir_ + "/loss.svg"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "validation loss")) << r.out;
  EXPECT_TRUE(testing::contains(r.out, "| elapsed ")) << r.out;
  EXPECT_TRUE(testing::contains(r.out, "| eta ")) << r.out;
  std::vector<int> evaluated;
  for (const auto& j : testing::jsonl_steps(dir_ + "/v.jsonl"))
    if (j.contains("val_loss")) evaluated.push_back(j["step"].get<int>());
  EXPECT_EQ(evaluated, (std::vector<int>{3, 6}));
  const std::string svg = read_file(dir_ + "/loss.svg");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u) << svg.substr(0, 80);
  EXPECT_EQ(testing::count(svg, "<polyline"), 2) << "train and validation curves";
  expect_error(toy("--eval-interval 3"), {"--eval-interval 3 needs validation data"});
  expect_error(toy("--split 90,x"), {"--split '90,x': 'x' is not a non-negative number"});
  expect_error(toy("--split 0,1,0"), {"--split '0,1,0' leaves no window for training"});
  expect_error(toy("--split 9,1 --eval-interval 2 --eval-iters 0"),
               {"--eval-iters (0) must be positive"});
}

// --arch and Megatron's family flags: consistent ones run, contradicting
// ones are one line each. Without --arch, the flags choose the family: all
// of Llama's parts give Llama (which samples); parts of no family are refused.
TEST_F(Cli, ModelFamilyFlags) {
  const std::string llama_parts =
      "--normalization RMSNorm --swiglu --position-embedding-type rope "
      "--untie-embeddings-and-output-weights --disable-bias-linear";
  Result r = run(toy("--arch llama " + llama_parts + " --train-iters 2"));
  EXPECT_EQ(r.code, 0) << r.err;
  r = run(toy(llama_parts + " --train-iters 2 --sample 8"));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "--- sample (8 tokens")) << r.out;
  // Llama's count: tables 2 x 256 x 32; per layer two norms (64), qkv 32 x
  // 96, o 32 x 32, SwiGLU (width 8 x 32 / 3 rounded up to 64: 128) 32 x 256
  // and 128 x 32; the final norm 32. 16384 + 2 x 16448 + 32.
  EXPECT_TRUE(testing::contains(r.out, "params 49312")) << r.out;
  expect_error(toy("--arch bert"), {"--arch 'bert' must be gpt2 or llama"});
  expect_error(toy("--swiglu"),
               {"--swiglu describes no model family (flags left out are Megatron's defaults: "
                "LayerNorm, learned_absolute positions, GELU MLP, tied head, biases)",
                "llama (RMSNorm, rope positions, SwiGLU MLP, untied head, no biases)"});
  expect_error(toy("--normalization RMSNorm --swiglu"),
               {"--normalization RMSNorm --swiglu describe no model family"});
  expect_error(toy("--arch gpt2 --swiglu"),
               {"--swiglu describes the llama family, but --arch is gpt2"});
  expect_error(toy("--arch llama --normalization LayerNorm"),
               {"--normalization LayerNorm describes the gpt2 family, but --arch is llama"});
  r = run(toy("--arch llama --group-query-attention --num-query-groups 2 --train-iters 2"));
  EXPECT_EQ(r.code, 0) << r.err;
  expect_error(toy("--arch llama --num-query-groups 2"),
               {"--num-query-groups 2 needs --group-query-attention"});
  expect_error(toy("--group-query-attention"),
               {"--group-query-attention is not a flag of the gpt2 family (llama reads it)"});
  expect_error(toy("--arch llama --group-query-attention --num-query-groups 3"),
               {"--num-query-groups (3) must divide --num-attention-heads (4)"});
  expect_error(toy("--arch llama --group-query-attention --num-query-groups 0"),
               {"--num-query-groups (0) must be >= 1"});
  expect_error(toy("--ffn-hidden-size 64"),
               {"--ffn-hidden-size is not a flag of the gpt2 family (llama reads it)"});
  expect_error(toy("--arch llama --hidden-size 36 --num-attention-heads 4"),
               {"head size 9", "must be even for rotary embedding"});
}

// Pipeline flags that would change nothing are refused (#16: every accepted
// flag changes something).
TEST_F(Cli, PipelineFlagsThatWouldDoNothingAreRefused) {
  expect_error(toy("--schedule zbh1"), {"--schedule 'zbh1' is not a schedule (one of: gpipe, 1f1b"});
  for (const char* flag :
       {"--schedule 1f1b", "--virtual-stages 2", "--partition time", "--memory-budget 1GiB"})
    expect_error(toy(flag), {"shapes the pipeline, and there is none: it needs --pp > 1"});
  expect_error(toy("--recompute"),
               {"--recompute recomputes whole pipeline stages, and at --pp 1 the one stage is the "
                "whole model",
                "--recompute-granularity full --recompute-method uniform"});
  expect_error(toy("--pp 2 --schedule 1f1b --virtual-stages 2"),
               {"--virtual-stages 2: 1f1b runs one chunk per rank; only interleaved-1f1b and zb-v "
                "run several"});
  expect_error(toy("--pp 2 --schedule 1f1b --num-layers-per-virtual-pipeline-stage 1"),
               {"--num-layers-per-virtual-pipeline-stage gives each rank several model chunks"});
  expect_error(toy("--pp 2 --schedule zb-v --virtual-stages 3"),
               {"--virtual-stages 3: zb-v runs exactly 2 chunks per rank"});
  expect_error(toy("--pp 2 --memory-budget 2XB"),
               {"--memory-budget '2XB' must be a positive size: bytes, or a number with KiB"});
  // Megatron's recompute flags: full with a method, nothing half-given.
  const std::string full = " --recompute-granularity full --recompute-method uniform";
  expect_error(toy("--recompute-granularity full"),
               {"--recompute-granularity full needs --recompute-method uniform or block"});
  expect_error(toy("--recompute-method block"),
               {"--recompute-method says which blocks --recompute-granularity full recomputes"});
  expect_error(toy("--recompute-num-layers 2"), {"--recompute-num-layers says which blocks"});
  expect_error(toy("--pp 2 --recompute" + full),
               {"--recompute (whole stages) and --recompute-granularity full both say"});
  expect_error(toy("--recompute-granularity selective --recompute-method block"),
               {"--recompute-method says which blocks --recompute-granularity full recomputes; "
                "selective recomputes every attention node"});
  expect_error(toy("--recompute-granularity some"),
               {"--recompute-granularity 'some' must be full or selective"});
  expect_error(toy("--recompute-granularity full --recompute-method layers"),
               {"--recompute-method 'layers' must be uniform or block"});
  expect_error(toy(full.substr(1) + " --recompute-num-layers 0"),
               {"--recompute-num-layers 0 must be at least 1"});
}

TEST_F(Cli, SequenceParallelNeedsTensorParallelism) {
  expect_error(toy("--sequence-parallel"),
               {"--sequence-parallel needs --tensor-model-parallel-size above 1 (got 1)"});
}

// Megatron's recompute (of blocks, or of attention alone) through train_gpt
// at pp 1: the same bits as without it, in less activation memory (test_pipeline holds every
// schedule and pp). The executor runs pp 1 too, so --profile and --trace
// work there.
TEST_F(Cli, RecomputedBlocksTrainTheSameBitsInLessMemory) {
  const std::string base =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --train-iters 3 --data-path " +
      dir_ + "/text.txt";
  // The peak: "activation memory, peak per pipeline rank: [12.0 KiB] held".
  auto held = [](const std::string& out) {
    const std::string head = "activation memory, peak per pipeline rank: [";
    const size_t at = out.find(head);
    if (at == std::string::npos) return -1.0;
    const size_t begin = at + head.size();
    std::string first = out.substr(begin, out.find(']', begin) - begin);
    first.erase(std::remove(first.begin(), first.end(), ' '), first.end());
    return parse_bytes("held", first);
  };
  const std::string plain_log = dir_ + "/plain.jsonl", recompute_log = dir_ + "/recompute.jsonl";
  const Result plain = run(base + " --log-jsonl " + plain_log);
  ASSERT_EQ(plain.code, 0) << plain.out << plain.err;
  const Result recomputed =
      run(base +
          " --recompute-granularity full --recompute-method uniform "
          "--recompute-num-layers 1 --log-jsonl " +
          recompute_log + " --profile " + dir_ + "/costs.json --trace " + dir_ + "/trace.json");
  ASSERT_EQ(recomputed.code, 0) << recomputed.out << recomputed.err;
  const auto a = testing::jsonl_steps(plain_log), b = testing::jsonl_steps(recompute_log);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    for (const char* key : {"loss", "grad_norm"})
      EXPECT_EQ(a[i][key].get<double>(), b[i][key].get<double>()) << key << " step " << i;
  // Four blocks' activations held at once, against one block's replayed.
  EXPECT_GT(held(plain.out), 0) << plain.out;
  EXPECT_GT(held(recomputed.out), 0) << recomputed.out;
  EXPECT_LT(held(recomputed.out), held(plain.out)) << plain.out << recomputed.out;
  // Attention alone: the CPU's (B, H, T, T) probabilities are not held.
  const std::string selective_log = dir_ + "/selective.jsonl";
  const Result selective =
      run(base + " --recompute-granularity selective --log-jsonl " + selective_log);
  ASSERT_EQ(selective.code, 0) << selective.out << selective.err;
  const auto c = testing::jsonl_steps(selective_log);
  ASSERT_EQ(c.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    for (const char* key : {"loss", "grad_norm"})
      EXPECT_EQ(a[i][key].get<double>(), c[i][key].get<double>()) << key << " step " << i;
  EXPECT_GT(held(selective.out), 0) << selective.out;
  EXPECT_LT(held(selective.out), held(plain.out)) << plain.out << selective.out;
  std::ifstream costs(dir_ + "/costs.json");
  const nlohmann::json profile = nlohmann::json::parse(costs);
  ASSERT_EQ(profile["stages"].size(), 1u) << profile.dump();
  EXPECT_TRUE(profile["stages"][0].contains("memory")) << profile.dump();
  EXPECT_TRUE(std::ifstream(dir_ + "/trace.json").good()) << recomputed.out;
}

// --make-vocab-size-divisible-by (Megatron's, default 128): the fixture's 64
// tokens pad to 128 rows, train the unpadded model's losses and gradient norms
// (the error model of tests/test_vocab_padding.cc: 1e-5), and save 64 rows; the
// checkpoint resumes without padding.
TEST_F(Cli, VocabularyPaddingTrainsTheUnpaddedModel) {
  const std::string ckpt = dir_ + "/ckpt";
  const Result padded =
      run(tiny("--train-iters 3 --lr 1e-2 --log-jsonl " + dir_ + "/padded.jsonl --save " + ckpt));
  ASSERT_EQ(padded.code, 0) << padded.out << padded.err;
  EXPECT_TRUE(testing::contains(
      padded.out, "vocabulary 64 padded to 128 (--make-vocab-size-divisible-by 128 x tp 1)"))
      << padded.out;
  const Result plain = run(tiny("--train-iters 3 --lr 1e-2 --make-vocab-size-divisible-by 1 "
                                "--log-jsonl " + dir_ + "/plain.jsonl"));
  ASSERT_EQ(plain.code, 0) << plain.out << plain.err;
  EXPECT_FALSE(testing::contains(plain.out, "padded to")) << plain.out;
  const auto a = testing::jsonl_steps(dir_ + "/padded.jsonl"),
             b = testing::jsonl_steps(dir_ + "/plain.jsonl");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    for (const char* key : {"loss", "grad_norm"}) {
      const double want = b[i][key].get<double>();
      EXPECT_NEAR(a[i][key].get<double>(), want, 1e-5 * want) << key << " step " << i + 1;
    }
  auto model = safetensors::File::open(ckpt + "/iter_0000003/model-00001-of-00001.safetensors");
  EXPECT_EQ(model.find("wte.weight")->shape, (Shape{64, 32}));
  const Result resumed = run(tiny("--train-iters 4 --lr 1e-2 --make-vocab-size-divisible-by 1 "
                                  "--save " + ckpt));
  ASSERT_EQ(resumed.code, 0) << resumed.out << resumed.err;
  EXPECT_TRUE(testing::contains(resumed.out, "resumed from")) << resumed.out;
  EXPECT_FALSE(testing::contains(resumed.out, "padded to")) << resumed.out;
}

// --plan auto runs the planner's fastest layout; a layout flag given fixes
// its dimension (here the toy's --micro-batch-size 2 leaves one plan on one
// rank); its setup flags need it, and a layout flag no plan can honour is
// refused naming it.
TEST_F(Cli, PlanAutoRunsTheBestPlan) {
  nlohmann::json nodes = nlohmann::json::array();
  for (const char* name : {"embed", "h.0.a", "h.0.b", "h.1.a", "h.1.b", "lm_head"})
    nodes.push_back({{"name", name}, {"f", 1e-3}, {"i", 1e-3}, {"w", 1e-3},
                     {"param_bytes", 1e3}, {"activation_bytes", 1e3}, {"output_bytes", 1e3}});
  const std::string costs = dir_ + "/costs.json";
  write_file(costs, nlohmann::json{{"micro_batch_size", 2}, {"tp", 1}, {"nodes", nodes}}.dump());
  Result r = run(toy("--plan auto --plan-costs " + costs + " --train-iters 1"));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(testing::contains(r.out, "plan auto: (dp 1, pp 1, tp 1) mb 2, predicted step"))
      << r.out;
  EXPECT_TRUE(testing::contains(r.out, "the fastest of 1 plans")) << r.out;
  EXPECT_TRUE(testing::contains(r.out, "micro-batch 2 x 2 = global 4")) << r.out;
  // A sharding strategy given is fixed, as a layout flag is: the plan keeps
  // it (at dp 1 it shards nothing, as train_gpt runs it).
  r = run(toy("--plan auto --plan-costs " + costs +
              " --train-iters 1 --data-parallel-sharding-strategy optim_grads"));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(testing::contains(r.out, "plan auto: (dp 1, pp 1, tp 1) mb 2 zero-2, predicted step"))
      << r.out;
  r = run(toy("--plan auto --plan-costs " + costs +
              " --train-iters 1 --data-parallel-sharding-strategy optim_grads_params"));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(testing::contains(r.out, "plan auto: (dp 1, pp 1, tp 1) mb 2 zero-3, predicted step"))
      << r.out;
  // What ran is what the state line says: at dp 1 nothing was sharded.
  EXPECT_TRUE(testing::contains(r.out, "training state on rank 0 (nothing sharded: dp is 1)"))
      << r.out;
  expect_error(toy("--plan-costs " + costs), {"--plan-costs sets up the planner: it needs --plan auto"});
  expect_error(toy("--plan-wake 1e-3"), {"--plan-wake sets up the planner: it needs --plan auto"});
  expect_error(toy("--plan auto --plan-wake -1 --plan-costs " + costs),
               {"--plan-wake (-1) must be seconds >= 0"});
  // Without --plan-costs the run profiles the model itself, plans, runs
  // the plan and sets its prediction beside the first steps.
  r = run(toy("--plan auto --train-iters 3"));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  for (const char* line : {"plan auto: profiled on rank 0 at micro-batch 2 on cpu",
                           "one rank, no links", "plan auto: (dp 1, pp 1, tp 1) mb ",
                           "plan auto: predicted ", " ms a step; steps 2-3 took "})
    EXPECT_TRUE(testing::contains(r.out, line)) << line << "\n" << r.out;
  // The profile runs in the run's precision: --bf16's activations are half
  // the bytes (the attention's probabilities stay fp32), so the plan holds less.
  auto per_rank = [](const std::string& out) {
    const size_t at = out.find(" per rank (the fastest");
    EXPECT_NE(at, std::string::npos) << out;
    if (at == std::string::npos) return 0.0;
    const size_t unit = out.rfind(' ', at - 1), number = out.rfind(' ', unit - 1);
    const std::string u = out.substr(unit + 1, at - unit - 1);
    const double scale = u == "B" ? 1 : u == "KiB" ? 1024 : u == "MiB" ? 1024 * 1024 : 0;
    EXPECT_GT(scale, 0) << u;
    return std::stod(out.substr(number + 1, unit - number - 1)) * scale;
  };
  const Result fp32 = run(toy("--plan auto --train-iters 1"));
  const Result bf16 = run(toy("--plan auto --train-iters 1 --bf16"));
  ASSERT_EQ(fp32.code, 0) << fp32.err;
  ASSERT_EQ(bf16.code, 0) << bf16.err;
  EXPECT_LT(per_rank(bf16.out), 0.95 * per_rank(fp32.out)) << fp32.out << bf16.out;
  expect_error(toy("--plan auto --pp 2"), {"--plan auto: no layout of 1 ranks runs with --pp 2"});
  expect_error(toy("--plan auto --pp 2 --profile " + dir_ + "/p.json"),
               {"--profile with --plan auto and no --plan-costs"});
  expect_error(toy("--plan best --plan-costs " + costs), {"--plan 'best' must be auto"});
  expect_error(toy("--plan auto --pp 2 --plan-costs " + costs),
               {"--plan auto: no layout of 1 ranks runs with --pp 2"});
  expect_error(toy("--plan auto --num-layers-per-virtual-pipeline-stage 1 --plan-costs " + costs),
               {"--num-layers-per-virtual-pipeline-stage contradicts --plan auto"});
  expect_error(toy("--plan auto --plan-costs " + dir_ + "/none.json"),
               {"--plan-costs " + dir_ + "/none.json: cannot open the file"});
}

// Numeric flags out of range are refused, one line each, never run with.
TEST_F(Cli, NumericFlagsOutOfRange) {
  const std::pair<const char*, const char*> cases[] = {
      {"--global-batch-size -8", "--global-batch-size (-8) must be positive"},
      {"--lr-warmup-iters -3", "--lr-warmup-iters (-3) must not be negative"},
      {"--threads -2", "--threads (-2) must be in [0, 4096]"},
      {"--seed -1", "--seed (-1) must not be negative"},
      {"--comm-timeout 0", "--comm-timeout (0) must be a number of seconds"},
      {"--comm-timeout -1", "--comm-timeout (-1) must be a number of seconds"},
      {"--comm-timeout nan", "--comm-timeout (nan) must be a number of seconds"},
      {"--sample-temperature nan", "--sample-temperature (nan) must be a number >= 0"},
      {"--weight-decay -0.1", "--weight-decay (-0.1) must be a number >= 0"},
      {"--tp 0", "--tp (0) and --pp (1) must be positive"},
      {"--make-vocab-size-divisible-by 0",
       "--make-vocab-size-divisible-by (0) must be between 1 (no padding) and 2^20"},
      {"--make-vocab-size-divisible-by -128",
       "--make-vocab-size-divisible-by (-128) must be between 1 (no padding) and 2^20"},
  };
  for (const auto& [flags, want] : cases) expect_error(toy(flags), {want});
  // A micro-batch whose activations alone need terabytes: refused before the
  // first step, with what it needs (in weft::format_bytes's largest unit) and
  // what there is.
  expect_error(toy("--micro-batch-size 100000000 --global-batch-size 100000000"),
               {"out of host memory: this run needs at least", "TiB of activations per micro-batch",
                "were available as it started: use a smaller --micro-batch-size"});
}

// --load takes a checkpoint directory or one iter_N in it. An edited
// meta.json no longer matches the manifest; a folder without one loads only
// with --load-unverified, and then a meta.json that lies or is malformed is
// named with its file and field.
TEST_F(Cli, LoadChecksTheCheckpointItOpens) {
  const std::string ckpt = dir_ + "/ckpt";
  Result r = run(toy("--train-iters 4 --save-interval 2 --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  // Saved at steps 2 and 4; the final step, just saved by the interval, not again.
  EXPECT_EQ(testing::count(r.out, "saved checkpoint at step"), 2) << r.out;
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/iter_0000002/meta.json"));
  r = run(toy("--train-iters 5 --load " + ckpt + "/iter_0000002"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "resumed from " + ckpt + "/iter_0000002 at step 2")) << r.out;

  const std::string folder = ckpt + "/iter_0000004", meta = folder + "/meta.json";
  const std::string good = read_file(meta);
  auto with_step = [&](const std::string& value) {
    std::string text = good;
    const size_t at = text.find("\"step\": 4");
    EXPECT_NE(at, std::string::npos) << text;
    text.replace(at, std::string("\"step\": 4").size(), "\"step\": " + value);
    write_file(meta, text);
  };
  with_step("5");  // as long as the original: only the checksum tells
  expect_error(toy("--train-iters 6 --load " + folder),
               {"--load " + folder + ": " + meta + ": checksum mismatch (stored "});
  std::filesystem::remove(folder + "/manifest.json");
  expect_error(toy("--train-iters 6 --load " + folder),
               {folder + "/manifest.json is missing", "--load-unverified"});
  const std::string unverified = " --load-unverified --load " + folder;
  with_step("\"four\"");
  expect_error(toy("--train-iters 6" + unverified), {meta, "'step' must be a non-negative integer"});
  with_step("999999");
  expect_error(toy("--train-iters 6" + unverified),
               {meta, "says step 999999, but its folder is iter_0000004"});
  write_file(meta, "{ not json");
  expect_error(toy("--train-iters 6" + unverified), {meta, "is not valid JSON"});
}

// --keep-last-checkpoints rotates; what an interrupted save left is removed
// at start, and said.
TEST_F(Cli, CheckpointRotationAndStaleTemporaries) {
  namespace fs = std::filesystem;
  const std::string ckpt = dir_ + "/ckpt";
  fs::create_directories(ckpt + "/iter_0000009.tmp");
  write_file(ckpt + "/iter_0000009.tmp/model.safetensors", "half a file");
  Result r = run(toy("--train-iters 4 --save-interval 1 --keep-last-checkpoints 2 --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "iter_0000009.tmp, left by an interrupted save")) << r.out;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(ckpt)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"iter_0000003", "iter_0000004",
                                            "latest_checkpointed_iteration.txt", "weft.lock"}));
  expect_error(toy("--keep-last-checkpoints -1 --save " + ckpt),
               {"--keep-last-checkpoints (-1) must not be negative"});
  // Flags that would change nothing are refused.
  expect_error(toy("--keep-last-checkpoints 2"), {"--keep-last-checkpoints 2 needs --save"});
  expect_error(toy("--overwrite-checkpoints --save " + ckpt), {"only matters with --no-load"});
  expect_error(toy("--eval-iters 3"), {"--eval-iters sets the batches", "needs --eval-interval"});
  expect_error(tiny("--tokenizer " + dir_ + "/t.bin"),
               {"--tokenizer decodes samples and names the end-of-document token: it needs "
                "--sample N or a document flag"});
}

// SIGTERM mid-run: the job finishes its step, saves, exits 0; run again with
// --load, it ends with the uninterrupted run's losses bit for bit.
TEST_F(Cli, SigtermSavesAndTheResumedRunMatchesTheUninterruptedOne) {
  const char* exe = std::getenv("WEFT_TRAIN_GPT");
  ASSERT_NE(exe, nullptr);
  const std::string flags = toy("--device cpu --threads 1 --lr-decay-style constant ");
  const std::string ckpt = dir_ + "/ckpt", jsonl = dir_ + "/stopped.jsonl";
  // Signal once three steps are logged; the job may be anywhere in a step.
  const std::string cmd = "( " + std::string(exe) + " " + flags + "--train-iters 1000000 --save " +
                          ckpt + " --log-jsonl " + jsonl + " >" + dir_ + "/stopped.out 2>&1 & "
                          "pid=$!; while [ \"$(cat " + jsonl + " 2>/dev/null | grep -c step)\" -lt 3 ]; "
                          "do sleep 0.05; done; kill -TERM $pid; wait $pid )";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(dir_ + "/stopped.out");
  const std::string out = read_file(dir_ + "/stopped.out");
  EXPECT_TRUE(testing::contains(out, "stopping on SIGTERM after step")) << out;
  const int stopped = std::stoi(read_file(ckpt + "/latest_checkpointed_iteration.txt"));
  ASSERT_GE(stopped, 3);
  const int total = stopped + 4;
  Result resumed = run(flags + "--train-iters " + std::to_string(total) + " --load " + ckpt +
                       " --log-jsonl " + dir_ + "/resumed.jsonl");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  Result full = run(flags + "--train-iters " + std::to_string(total) + " --log-jsonl " + dir_ +
                    "/full.jsonl");
  ASSERT_EQ(full.code, 0) << full.err;
  const auto a = testing::jsonl_steps(dir_ + "/resumed.jsonl"),
             b = testing::jsonl_steps(dir_ + "/full.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), static_cast<size_t>(total));
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[static_cast<size_t>(stopped) + i]["step"]);
    EXPECT_EQ(a[i]["loss"].get<double>(), b[static_cast<size_t>(stopped) + i]["loss"].get<double>());
    EXPECT_EQ(a[i]["grad_norm"].get<double>(),
              b[static_cast<size_t>(stopped) + i]["grad_norm"].get<double>());
  }
}

// --async-save: each rank writes its slices of each checkpoint on a thread
// while training goes on. Completing the folder is made slow (300 ms a save), so the steps
// after a save run during its writing; the files are the synchronous run's
// byte for byte, and the first save's stall is the host copies alone (the next
// one, two fast steps later, waits for the first to be written). A
// writer killed mid-save (kill -9 inside the thread) leaves the newest
// complete checkpoint, which resumes with the uninterrupted losses.
TEST_F(Cli, AsyncSaveWritesTheSameCheckpointsWhileTrainingGoesOn) {
  const std::string flags = toy("--threads 1 --train-iters 6 --save-interval 2 ");
  Result sync = run(flags + "--save " + dir_ + "/sync --log-jsonl " + dir_ + "/sync.jsonl");
  ASSERT_EQ(sync.code, 0) << sync.err;
  ::setenv("WEFT_FAULT_INJECT", "slow-save:300", 1);
  Result async =
      run(flags + "--async-save --save " + dir_ + "/async --log-jsonl " + dir_ + "/async.jsonl");
  ::unsetenv("WEFT_FAULT_INJECT");
  ASSERT_EQ(async.code, 0) << async.err;
  for (int step : {2, 4}) {
    const std::string line = fmt::format(
        "saving checkpoint at step {} to {}/async in the "
        "background: training stalled ",
        step, dir_);
    const size_t at = async.out.find(line);
    ASSERT_NE(at, std::string::npos) << async.out;
    // Step 4's save comes before step 2's is written: it waits for that one first.
    if (step == 2) {
      EXPECT_LT(std::stod(async.out.substr(at + line.size())), 300.0) << async.out;
    }
  }
  EXPECT_TRUE(testing::contains(async.out, "saved checkpoint at step 6 to " + dir_ + "/async"))
      << async.out;
  for (const char* iter : {"/iter_0000004/", "/iter_0000006/"})
    for (const char* file :
         {"model-00001-of-00001.safetensors", "optimizer-00001-of-00001.safetensors"})
      EXPECT_EQ(read_file(dir_ + "/async" + iter + file), read_file(dir_ + "/sync" + iter + file))
          << iter << file;
  const auto a = testing::jsonl_steps(dir_ + "/async.jsonl"),
             b = testing::jsonl_steps(dir_ + "/sync.jsonl");
  ASSERT_EQ(a.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << i;

  const std::string killed = dir_ + "/killed";
  ::setenv("WEFT_FAULT_INJECT", "writing-tensors@4", 1);
  Result k = run(flags + "--async-save --save " + killed);
  ::unsetenv("WEFT_FAULT_INJECT");
  EXPECT_NE(k.code, 0) << k.out;
  EXPECT_EQ(read_file(killed + "/latest_checkpointed_iteration.txt"), "2\n");
  Result resumed =
      run(flags + "--async-save --save " + killed + " --log-jsonl " + dir_ + "/resumed.jsonl");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_TRUE(testing::contains(resumed.out, "at step 2")) << resumed.out;
  const auto c = testing::jsonl_steps(dir_ + "/resumed.jsonl");
  ASSERT_EQ(c.size(), 4u);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i]["loss"], b[i + 2]["loss"]) << i;
}

// A second signal (a launcher and a terminal both passing one on) is held
// and the save still happens; a third ends the run at once and says it did
// not save. The save is made slow (2 s), so that the later signals arrive
// during it, each 0.3 s after the one before (sent back to back, signals of
// one kind merge before the handler runs).
TEST_F(Cli, ASecondSignalIsHeldAndTheSaveHappens) {
  const char* exe = std::getenv("WEFT_TRAIN_GPT");
  ASSERT_NE(exe, nullptr);
  const std::string flags = toy("--device cpu --threads 1 ");
  for (int signals : {2, 3}) {
    const std::string ckpt = dir_ + "/ckpt" + std::to_string(signals),
                      jsonl = dir_ + "/sig.jsonl", out = dir_ + "/sig.out";
    std::filesystem::remove(jsonl);
    std::string kills;
    for (int i = 0; i < signals; ++i) kills += "kill -TERM $pid; sleep 0.3; ";
    const std::string cmd =
        "( WEFT_FAULT_INJECT=slow-save:2000 " + std::string(exe) + " " + flags + "--train-iters 1000000 --save " + ckpt +
        " --log-jsonl " + jsonl + " >" + out + " 2>&1 & pid=$!; while [ \"$(cat " + jsonl +
        " 2>/dev/null | grep -c step)\" -lt 2 ]; do sleep 0.05; done; " + kills + "wait $pid )";
    const int status = std::system(cmd.c_str());
    const std::string text = read_file(out);
    if (signals == 2) {
      ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << text;
      EXPECT_TRUE(testing::contains(text, "a second signal: held")) << text;
      EXPECT_TRUE(testing::contains(text, "stopping on SIGTERM after step")) << text;
      EXPECT_TRUE(std::filesystem::exists(ckpt + "/latest_checkpointed_iteration.txt")) << text;
    } else {
      EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << text;
      EXPECT_TRUE(testing::contains(text, "a third signal: ending at once, without saving"))
          << text;
    }
  }
}

// A resume compares what would silently change the run: the learning-rate
// schedule (left out, it is the checkpoint's, decaying over the steps it was
// given; a flag that differs is refused unless --override-opt_param-scheduler,
// and then said), the validation split, and the data file's bytes (its size
// and a checksum of its first and last MiB).
TEST_F(Cli, AResumeRefusesAnotherScheduleSplitOrDataFile) {
  const std::string ckpt = dir_ + "/sched";
  Result r = run(toy("--threads 1 --train-iters 3 --lr-decay-style cosine --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  expect_error(toy("--train-iters 5 --lr 5e-3 --save " + ckpt),
               {"--lr 0.004999999888241291 contradicts the checkpoint's lr"});
  expect_error(toy("--train-iters 5 --lr-decay-style constant --save " + ckpt),
               {"--lr-decay-style \"constant\" contradicts the checkpoint's lr_decay_style "
                "\"cosine\""});
  expect_error(toy("--train-iters 5 --lr-decay-iters 9 --save " + ckpt),
               {"--lr-decay-iters 9 contradicts the checkpoint's lr_decay_iters 3"});
  expect_error(toy("--train-iters 5 --split 90,10 --save " + ckpt),
               {"--split \"90,10\" contradicts the checkpoint's split"});
  r = run(toy("--train-iters 4 --lr 5e-3 --override-opt_param-scheduler --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "note: --lr 0.004999999888241291 differs from the "
                                       "checkpoint's 0.009999999776482582: the flag's is used"))
      << r.out;
  // Left out, the schedule is the checkpoint's: --lr-decay-style cosine.
  r = run("--threads 1 --train-iters 5 --save " + ckpt);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "--lr-decay-style cosine")) << r.out;

  // The data file rewritten in place: refused, unless told to go on.
  std::string text = read_file(dir_ + "/text.txt");
  text[text.size() / 2] = text[text.size() / 2] == 'a' ? 'b' : 'a';
  write_file(dir_ + "/text.txt", text);
  expect_error("--threads 1 --train-iters 6 --save " + ckpt,
               {"--data-path " + dir_ + "/text.txt has changed since the checkpoint was saved",
                "--override-checkpoint-args"});
  r = run("--threads 1 --train-iters 6 --override-checkpoint-args --save " + ckpt);
  EXPECT_EQ(r.code, 0) << r.err;
}

// A run whose --save holds a checkpoint resumes from it; starting over
// (--no-load) never replaces checkpoints unless told to.
TEST_F(Cli, AutomaticResumeAndNoSilentOverwrite) {
  const std::string ckpt = dir_ + "/ckpt";
  Result r = run(toy("--train-iters 3 --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(toy("--train-iters 5 --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "resumed from " + ckpt + " at step 3 (automatic")) << r.out;
  EXPECT_EQ(read_file(ckpt + "/latest_checkpointed_iteration.txt"), "5\n");
  expect_error(toy("--train-iters 2 --no-load --save " + ckpt),
               {"already holds checkpoints (the newest is step 5)", "--overwrite-checkpoints"});
  r = run(toy("--train-iters 2 --no-load --overwrite-checkpoints --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(testing::contains(r.out, "resumed")) << r.out;
  EXPECT_EQ(read_file(ckpt + "/latest_checkpointed_iteration.txt"), "2\n");
  expect_error(toy("--no-load --load " + ckpt), {"--no-load and --load", "contradict"});
}

// Megatron's --exit-interval and --exit-duration-in-mins: the run saves (with
// --save), says why it stopped and exits 0; running the same command again
// continues with the uninterrupted run's losses, bit for bit.
TEST_F(Cli, ExitIntervalAndDurationStopCleanly) {
  const std::string flags = toy("--threads 1 --train-iters 6 ");
  const std::string ckpt = dir_ + "/ckpt";
  const std::string job = flags + "--exit-interval 4 --save " + ckpt + " --log-jsonl " + dir_;
  Result r = run(job + "/first.jsonl");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(
      r.out, "stopping at --exit-interval 4 after step 4; run again with --load " + ckpt))
      << r.out;
  EXPECT_EQ(read_file(ckpt + "/latest_checkpointed_iteration.txt"), "4\n");
  r = run(job + "/second.jsonl");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(testing::contains(r.out, "stopping")) << r.out;
  r = run(flags + "--log-jsonl " + dir_ + "/full.jsonl");
  ASSERT_EQ(r.code, 0) << r.err;
  auto records = [&](const std::string& name) { return testing::jsonl_steps(dir_ + "/" + name); };
  const auto first = records("first.jsonl"), second = records("second.jsonl"),
             full = records("full.jsonl");
  ASSERT_EQ(first.size(), 4u);
  ASSERT_EQ(second.size(), 2u);
  ASSERT_EQ(full.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    const nlohmann::json& got = i < 4 ? first[i] : second[i - 4];
    EXPECT_EQ(got["step"], full[i]["step"]);
    EXPECT_EQ(got["loss"].get<double>(), full[i]["loss"].get<double>()) << "step " << i + 1;
  }

  // A time limit already passed stops after the first step; without --save,
  // it says that nothing was saved.
  r = run(toy("--train-iters 50 --exit-duration-in-mins 1e-9"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "stopping after 1e-09 minutes (--exit-duration-in-mins) "
                                       "after step 1; nothing was saved (no --save)"))
      << r.out;
  expect_error(toy("--exit-interval -2"), {"--exit-interval (-2) must be >= 0"});
  expect_error(toy("--exit-duration-in-mins nan"),
               {"--exit-duration-in-mins (nan) must be a number of minutes >= 0"});
}

// Megatron's --use-checkpoint-args, always on: a resumed run takes the
// flags it leaves out from the checkpoint's meta.json; a flag that
// contradicts it is refused naming both values, unless
// --override-checkpoint-args or --finetune says otherwise.
TEST_F(Cli, FlagsLeftOutComeFromTheCheckpointAndContradictionsAreRefused) {
  const std::string ckpt = dir_ + "/ckpt";
  Result r = run(toy("--threads 1 --train-iters 3 --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  // Only what changes: no shape, no data path, no batch.
  r = run("--threads 1 --lr 1e-2 --train-iters 5 --save " + ckpt + " --log-jsonl " + dir_ +
          "/resumed.jsonl");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "from the checkpoint (" + ckpt + "/iter_0000003/meta.json): ") &&
              testing::contains(r.out, "--num-layers 2 --hidden-size 32") &&
              testing::contains(r.out, "--global-batch-size 4"))
      << r.out;
  Result full = run(toy("--threads 1 --train-iters 5 --log-jsonl " + dir_ + "/full.jsonl"));
  ASSERT_EQ(full.code, 0) << full.err;
  const auto resumed = testing::jsonl_steps(dir_ + "/resumed.jsonl"),
             whole = testing::jsonl_steps(dir_ + "/full.jsonl");
  ASSERT_EQ(resumed.size(), 2u);
  ASSERT_EQ(whole.size(), 5u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_EQ(resumed[i]["loss"].get<double>(), whole[i + 3]["loss"].get<double>());

  expect_error(toy("--train-iters 6 --num-layers 3 --save " + ckpt),
               {"--num-layers 3 contradicts the checkpoint's num_layers 2",
                ckpt + "/iter_0000005/meta.json", "--override-checkpoint-args"});
  expect_error(toy("--train-iters 6 --global-batch-size 8 --save " + ckpt),
               {"--global-batch-size 8 contradicts the checkpoint's global_batch_size 4"});
  expect_error(toy("--train-iters 6 --seed 9 --save " + ckpt),
               {"--seed 9 contradicts the checkpoint's seed 1234"});
  // The same file under another name agrees.
  r = run(toy("--train-iters 6 --save " + ckpt + " --data-path " + dir_ + "/../" +
              std::filesystem::path(dir_).filename().string() + "/text.txt"));
  EXPECT_EQ(r.code, 0) << r.err;
  r = run(toy("--train-iters 7 --global-batch-size 8 --override-checkpoint-args --save " + ckpt));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "resumed from " + ckpt + " at step 6")) << r.out;

  // --finetune: the weights only, from step 0, with other data settings allowed.
  Result fresh = run(toy("--train-iters 1 --seed 9 --log-jsonl " + dir_ + "/fresh.jsonl"));
  ASSERT_EQ(fresh.code, 0) << fresh.err;
  r = run(toy("--train-iters 1 --seed 9 --finetune --load " + ckpt + " --save " + dir_ +
              "/ft --log-jsonl " + dir_ + "/ft.jsonl"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "fine-tuning from the weights of " + ckpt)) << r.out;
  const auto ft = testing::jsonl_steps(dir_ + "/ft.jsonl");
  ASSERT_EQ(ft.size(), 1u);
  EXPECT_EQ(ft[0]["step"], 1);
  // Seven steps on this repetitive text have lowered the loss well below a fresh model's.
  EXPECT_LT(ft[0]["loss"].get<double>(),
            0.8 * testing::jsonl_steps(dir_ + "/fresh.jsonl").at(0)["loss"].get<double>());
  expect_error(toy("--finetune"), {"--finetune starts from the weights of --load DIR"});
}

// --check-for-spiky-loss: the batch of step 13 is random bytes (read in file
// order), which the model, trained on one repeated line, predicts badly; its
// update is skipped and logged, and the run goes on.
TEST_F(Cli, SpikyLossIsSkippedAndLogged) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "To be, or not to be, that is the question.\n";
  uint32_t x = 7;
  for (size_t i = 12 * 64; i <= 13 * 64; ++i) text[i] = static_cast<char>((x = x * 1664525u + 1013904223u) >> 24);
  write_file(dir_ + "/spiky.txt", text);
  const std::string flags =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --train-iters 16 "
      "--log-interval 100 --data-order file --data-path " +
      dir_ + "/spiky.txt ";
  Result r = run(flags + "--check-for-spiky-loss --spiky-loss-factor 1.5 --log-jsonl " + dir_ +
                 "/s.jsonl");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "step    13/16") &&
              testing::contains(r.out, "| skipped: a loss spike (recent mean"))
      << r.out;
  std::vector<int> skipped;
  for (const auto& j : testing::jsonl_steps(dir_ + "/s.jsonl"))
    if (j.value("skipped", false)) skipped.push_back(j["step"].get<int>());
  EXPECT_EQ(skipped, (std::vector<int>{13}));
  expect_error(flags + "--check-for-spiky-loss --spiky-loss-factor 1.5 --max-skipped-steps 0",
               {"step 13: loss", "more than --max-skipped-steps 0: training stopped"});
  expect_error(flags + "--spiky-loss-factor 3",
               {"--spiky-loss-factor and --max-skipped-steps set the loss-spike check"});
  expect_error(flags + "--check-for-spiky-loss --spiky-loss-factor 0.5",
               {"--spiky-loss-factor (0.5) must be a number > 1"});
}

// Local SGD / DiLoCo flags that cannot work are refused, one line each.
TEST_F(Cli, ParameterServerFlagsAreChecked) {
  expect_error(toy("--ps-ranks 1"), {"--ps-ranks 1 must be below the world size 1"});
  expect_error(toy("--ps-ranks -1"), {"--ps-ranks (-1) must not be negative"});
  expect_error(toy("--max-staleness -1"), {"--max-staleness (-1) must be >= 0"});
  expect_error(toy("--max-staleness 2"), {"--max-staleness shapes the parameter servers: it needs --ps-ranks"});
  expect_error(toy("--slow-rank 0 --slow-factor 2"), {"--slow-rank shapes the parameter servers: it needs --ps-ranks"});
}

TEST_F(Cli, LocalSgdFlagsAreChecked) {
  expect_error(toy("--sgd-momentum 0.9"), {"--sgd-momentum sets SGD's momentum: it needs --optimizer sgd"});
  expect_error(toy("--optimizer sgd --sgd-momentum 1"), {"--sgd-momentum (1) must be in [0, 1)"});
  expect_error(toy("--local-steps -1"), {"--local-steps (-1) must be >= 0"});
  // Compression needs a data-parallel reduction to compress.
  expect_error(toy("--grad-reduce-dtype bf16"),
               {"--grad-reduce-dtype bf16 compresses the data-parallel reduction, and there is "
                "none: dp is 1"});
  expect_error(toy("--local-steps 2 --train-iters 4 --grad-compression powersgd"),
               {"--grad-compression powersgd compresses the data-parallel reduction, and there is "
                "none: dp is 1"});
  expect_error(toy("--outer-optimizer nesterov"), {"--outer-optimizer steps the average of local SGD: it needs --local-steps"});
  expect_error(toy("--local-steps 2 --outer-lr 0.5"), {"--outer-lr and --outer-momentum set DiLoCo's outer step"});
  expect_error(toy("--local-steps 4 --train-iters 6"),
               {"--train-iters (6) must be a multiple of --local-steps (4)"});
  expect_error(toy("--local-steps 2 --train-iters 4 --use-distributed-optimizer"),
               {"cannot be combined with --use-distributed-optimizer"});
  expect_error(toy("--optimizer adagrad"), {"--optimizer 'adagrad' must be adam, sgd or lion"});
  expect_error(toy("--lion-beta1 0.8"),
               {"--lion-beta1 and --lion-beta2 set Lion's interpolation and momentum: they need "
                "--optimizer lion"});
  expect_error(toy("--optimizer lion --lion-beta2 1"), {"--lion-beta2 (1) must be in [0, 1)"});
  // A checkpoint records its optimizer: resuming with the other one is refused.
  Result r = run(toy("--optimizer sgd --train-iters 2 --save " + dir_ + "/sgd"));
  ASSERT_EQ(r.code, 0) << r.err;
  expect_error(toy("--optimizer adam --train-iters 3 --save " + dir_ + "/sgd"),
               {"--optimizer \"adamw\" contradicts the checkpoint's optimizer \"sgd\""});
  r = run(toy("--train-iters 3 --save " + dir_ + "/sgd"));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "--optimizer sgd")) << r.out;
  // Lion's too: its momentum is in the checkpoint, and a resume takes Lion.
  r = run(toy("--optimizer lion --lr 1e-3 --train-iters 2 --save " + dir_ + "/lion"));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(toy("--lr 1e-3 --train-iters 3 --save " + dir_ + "/lion"));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "--optimizer lion")) << r.out;
}

TEST_F(Cli, MissingDataFile) {
  expect_error(toy("--data-path /nonexistent/corpus.txt"), {"/nonexistent/corpus.txt"});
}

// Megatron's dataset lists: an indexed dataset and a text file blended by
// weight, each dataset's share printed; the roles' own paths; a resume of a
// checkpoint from before shuffling keeps its file order; and every list or
// data flag that cannot be read is one line before training.
TEST_F(Cli, DatasetListsBlendSplitAndAreChecked) {
  const std::string text = dir_ + "/text.txt", prefix = dir_ + "/indexed";
  {
    IndexedDatasetWriter w(prefix, 256);
    const std::string doc = "Whether 'tis nobler in the mind to suffer the slings and arrows. ";
    for (int d = 0; d < 40; ++d) {
      std::vector<int32_t> ids(doc.begin(), doc.end());
      w.add_document(ids);
    }
    w.finish();
  }
  Result r = run(toy("--data-path 0.7 " + prefix + " 0.3 " + text +
                     " --split 90,10,0 --eval-interval 2 --eval-iters 1 --train-iters 2"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "data " + prefix +
                                           " | indexed, 40 documents | 2600 tokens "
                                           "| 70% of the sequences | windows [0, 145) train, "
                                           "[145, 161) validate"))
      << r.out;
  EXPECT_TRUE(testing::contains(r.out, "| 30% of the sequences")) << r.out;
  EXPECT_TRUE(testing::contains(r.out, "data order: shuffled by --seed 1234")) << r.out;
  EXPECT_TRUE(testing::contains(r.out, "validation loss")) << r.out;
  // Without weights, each dataset in proportion to its windows.
  r = run(toy("--data-path " + prefix + " " + text + " --train-iters 1"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "| 37.7% of the sequences")) << r.out;  // 162 of 430
  const std::string model =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 "
      "--seq-length 16 --micro-batch-size 2 ";
  r = run(model + "--train-data-path " + prefix + " --valid-data-path " + text +
          " --eval-interval 1 --eval-iters 1 --train-iters 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "validation data " + text)) << r.out;

  // A checkpoint from before shuffling names no order: its run read the file in order.
  const std::string ckpt = dir_ + "/ckpt";
  r = run(toy("--train-iters 2 --save " + ckpt));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string meta_path = ckpt + "/iter_0000002/meta.json";
  nlohmann::json meta = nlohmann::json::parse(read_file(meta_path));
  EXPECT_EQ(meta["config"]["data_order"], "shuffled");
  meta["config"].erase("data_order");
  meta["config"].erase("data_format");
  write_file(meta_path, meta.dump());
  // The manifest made to list the edited meta.json, as an old checkpoint's would.
  const std::string manifest_path = ckpt + "/iter_0000002/manifest.json";
  nlohmann::json manifest = nlohmann::json::parse(read_file(manifest_path));
  const std::string edited = read_file(meta_path);
  for (auto& f : manifest["files"])
    if (f["name"] == "meta.json") {
      f["size"] = edited.size();
      f["xxh3_64"] = fmt::format("{:016x}", XXH3_64bits(edited.data(), edited.size()));
    }
  write_file(manifest_path, manifest.dump());
  r = run(toy("--train-iters 3 --load " + ckpt + "/iter_0000002"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "--data-order file")) << r.out;
  EXPECT_TRUE(testing::contains(r.out, "data order: file order")) << r.out;

  expect_error(toy("--data-path 0.7 " + prefix + " 0.3"), {"--data-path takes WEIGHT PATH pairs"});
  expect_error(toy("--data-path 0 " + prefix + " 0 " + text), {"the weights sum to 0"});
  expect_error(toy("--data-path " + prefix + " 0.5 " + text),
               {"'0.5': a list that starts with a path takes no weights"});
  expect_error(toy("--data-path -1 " + prefix + " 2 " + text),
               {"weight '-1'", "not a number >= 0"});
  expect_error(toy("--train-data-path " + text), {"--data-path and --train-data-path both"});
  expect_error(model + "--valid-data-path " + text, {"--valid-data-path needs --train-data-path"});
  expect_error(model + "--train-data-path " + prefix + " --valid-data-path " + text,
               {"--valid-data-path is read by validations: it needs --eval-interval N"});
  expect_error(toy("--async-save"), {"--async-save writes checkpoints in the background: it "
                                     "needs --save"});
  expect_error(model + "--train-data-path " + text + " --split 9,1,0",
               {"--split '9,1,0' splits --data-path"});
  expect_error(toy("--data-order random"), {"--data-order 'random' is not shuffled or file"});
  expect_error(toy("--data-format npy"), {"'npy' is not one of auto, text, llmc, uint16, indexed"});
  expect_error(toy("--data-path " + prefix + " --vocab-size 100"),
               {prefix, "holds token id 119, outside --vocab-size (100)"});
  expect_error(toy("--data-path " + prefix + ".idx --data-format text --vocab-size 100"),
               {prefix + ".idx", "outside --vocab-size (100)"});
  expect_error(toy("--tokenizer-type SentencePiece --sample 2"),
               {"--tokenizer-type 'SentencePiece' is not GPT2BPETokenizer"});
  expect_error(toy("--vocab-file v.json --sample 2"),
               {"--tokenizer-type GPT2BPETokenizer takes --vocab-file and --merge-file"});
  expect_error(toy("--tokenizer-type HuggingFaceTokenizer"),
               {"--tokenizer-type HuggingFaceTokenizer takes --tokenizer-model"});
}

// Token data made with a byte-level BPE trains, and the sample continues a
// prompt the same tokenizer encodes, decoded back to text.
TEST_F(Cli, ABpeTokenizerEncodesThePromptAndDecodesTheSample) {
  if (!BpeTokenizer::available()) GTEST_SKIP() << "weft was built without PCRE2";
  const std::string vocab = source_path("tests/reference/fixtures/bpe_vocab.json"),
                    merges = source_path("tests/reference/fixtures/bpe_merges.txt");
  BpeTokenizer bpe = BpeTokenizer::load(vocab, merges);
  const std::string prefix = dir_ + "/bpe";
  {
    IndexedDatasetWriter w(prefix, bpe.vocab_size());
    for (int d = 0; d < 30; ++d) {
      std::vector<int32_t> ids = bpe.encode("The quick brown fox jumps over the lazy dog. ");
      ids.push_back(bpe.eod());
      w.add_document(ids);
    }
    w.finish();
  }
  const std::string model =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 "
      "--seq-length 16 --micro-batch-size 2 --lr 1e-2 --train-iters 2 "
      "--vocab-size " +
      std::to_string(bpe.vocab_size()) + " --data-path " + prefix + " --sample 4 ";
  Result r = run(model + "--tokenizer-type GPT2BPETokenizer --vocab-file " + vocab +
                 " --merge-file " + merges + " --sample-prompt 'The quick'");
  ASSERT_EQ(r.code, 0) << r.err;
  const size_t at = r.out.find("--- sample (4 tokens");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(r.out.substr(r.out.find('\n', at) + 1, 9), "The quick") << r.out;
  r = run(model + "--tokenizer-type HuggingFaceTokenizer --tokenizer-model " +
          source_path("tests/reference/fixtures/bpe_tokenizer.json"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(testing::contains(r.out, "(token ids:")) << r.out;
  expect_error(model + "--sample-prompt 'The quick'",
               {"--sample-prompt needs text data, or a tokenizer that encodes"});
}

// Megatron's document flags on token data a BPE made with --append-eod: the
// tokenizer's <|endoftext|> ends each document. All three at once train,
// on one process and as a sample; without documents they are refused.
TEST_F(Cli, DocumentFlagsTrainOnDocumentsAndNeedAnEndOfDocumentToken) {
  if (!BpeTokenizer::available()) GTEST_SKIP() << "weft was built without PCRE2";
  const std::string model =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --train-iters 3 " +
      testing::write_bpe_documents(
          dir_ + "/docs", {"The quick brown fox. ", "Jumps over ", "the lazy dog, who sleeps. "},
          40) +
      " ";
  const std::string docs = "--eod-mask-loss --reset-position-ids --reset-attention-mask ";
  Result r = run(model + docs + "--sample 4 --sample-prompt 'The quick'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(testing::contains(r.out, "--- sample (4 tokens")) << r.out;
  r = run(model + docs + "--arch llama --sample 2");
  ASSERT_EQ(r.code, 0) << r.err;
  // Text has no end-of-document token, and GPT-2's is past a small vocabulary.
  expect_error(toy("--eod-mask-loss"),
               {"--eod-mask-loss needs documents", "text.txt", "weft-preprocess --append-eod"});
  expect_error(tiny("--reset-attention-mask"),
               {"--reset-attention-mask", "end-of-document token 50256", "--vocab-size (64)"});
}

TEST_F(Cli, DataPathIsADirectory) { expect_error(toy("--data-path " + dir_), {dir_}); }

TEST_F(Cli, BadTokenFileMagic) {
  write_bin(dir_ + "/bad.bin", 12345, 1, 4, {1, 2, 3, 4});
  expect_error(tiny("--data-path " + dir_ + "/bad.bin"), {"bad.bin", "12345", "20240520"});
}

TEST_F(Cli, TruncatedTokenFile) {
  write_bin(dir_ + "/short.bin", 20240520, 1, 100, {1, 2, 3});
  expect_error(tiny("--data-path " + dir_ + "/short.bin"), {"short.bin", "truncated"});
}

TEST_F(Cli, TokensOutsideTheVocabulary) {
  expect_error(toy("--vocab-size 64"), {"--vocab-size (64)", "text.txt"});
}

TEST_F(Cli, ImpossibleShapes) {
  expect_error(toy("--num-layers 0"), {"--num-layers (0)"});
  expect_error(toy("--num-attention-heads 5"), {"--num-attention-heads (5)", "--hidden-size (32)"});
  expect_error(toy("--seq-length 32 --max-position-embeddings 16"),
               {"--seq-length (32)", "--max-position-embeddings (16)"});
  expect_error(toy("--global-batch-size 3"), {"--global-batch-size (3)", "--micro-batch-size (2)"});
  expect_error(toy("--model huge"), {"'huge'", "toy"});
  expect_error(toy("--lr-decay-style linear"), {"'linear'"});
  expect_error(toy("--lr=-1"), {"--lr (-1)"});
  expect_error(toy("--seq-length 5000 --train-iters 1"), {"text.txt", "5000"});
}

TEST_F(Cli, InitFromMissingFile) {
  expect_error(tiny("--init-from " + dir_ + "/none.safetensors"), {"none.safetensors"});
}

TEST_F(Cli, InitFromMalformedHeaders) {
  std::string good = read_file(source_path("tests/reference/fixtures/gpt_tiny_init.safetensors"));
  std::string huge = good;
  uint64_t n = 1ull << 40;
  std::memcpy(huge.data(), &n, 8);
  write_file(dir_ + "/huge.st", huge);
  expect_error(tiny("--init-from " + dir_ + "/huge.st"), {"huge.st", "header"});

  std::string bad_json = good;
  bad_json[8] = '[';
  bad_json[9] = '[';
  write_file(dir_ + "/json.st", bad_json);
  expect_error(tiny("--init-from " + dir_ + "/json.st"), {"json.st", "JSON"});

  write_file(dir_ + "/cut.st", good.substr(0, good.size() - 100));
  expect_error(tiny("--init-from " + dir_ + "/cut.st"), {"cut.st", "past the end"});

  write_file(dir_ + "/tiny.st", "abc");
  expect_error(tiny("--init-from " + dir_ + "/tiny.st"), {"tiny.st"});
}

TEST_F(Cli, InitFromWrongTensors) {
  auto missing = edited_init("missing.st", [](auto& t) {
    std::erase_if(t, [](auto& p) { return p.first == "ln_f.bias"; });
  });
  expect_error(tiny("--init-from " + missing), {"missing.st", "lacks", "'ln_f.bias'"});

  auto extra = edited_init("extra.st", [](auto& t) { t.emplace_back("h.9.mlp.c_fc.weight", Tensor::zeros({2, 2})); });
  expect_error(tiny("--init-from " + extra), {"extra.st", "'h.9.mlp.c_fc.weight'"});

  auto shape = edited_init("shape.st", [](auto& t) {
    for (auto& p : t)
      if (p.first == "wpe.weight") p.second = Tensor::zeros({8, 32});
  });
  expect_error(tiny("--init-from " + shape), {"shape.st", "'wpe.weight'", "[8, 32]", "[16, 32]"});

  auto dtype = edited_init("dtype.st", [](auto& t) {
    for (auto& p : t)
      if (p.first == "ln_f.weight") p.second = Tensor::zeros({32}, DType::I32);
  });
  expect_error(tiny("--init-from " + dtype), {"dtype.st", "'ln_f.weight'", "I32", "F32"});

  // Hugging Face's prefix and mask buffers are accepted.
  auto hf = edited_init("hf.st", [](auto& t) {
    for (auto& p : t) p.first = "transformer." + p.first;
    t.emplace_back("transformer.h.0.attn.bias", Tensor::zeros({1, 1, 16, 16}));
  });
  Result r = run(tiny("--init-from " + hf));
  EXPECT_EQ(r.code, 0) << r.err;
}

TEST_F(Cli, TrainsLogsJsonlResumesAndSamples) {
  Result a = run(toy("--train-iters 4 --log-jsonl " + dir_ + "/a.jsonl"));
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_NE(a.out.find("step     4/4"), std::string::npos) << a.out;
  const std::vector<nlohmann::json> full = testing::jsonl_steps(dir_ + "/a.jsonl");
  ASSERT_EQ(full.size(), 4u);
  // The header: where the run started and which process is which rank.
  const auto headers = testing::jsonl_headers(dir_ + "/a.jsonl");
  ASSERT_EQ(headers.size(), 1u);
  EXPECT_EQ(headers[0]["start_step"], 0);
  ASSERT_EQ(headers[0]["ranks"].size(), 1u);
  const auto& rank = headers[0]["ranks"][0];
  EXPECT_EQ(rank["rank"], 0);
  EXPECT_GT(rank["pid"].get<int>(), 0);
  EXPECT_FALSE(rank["host"].get<std::string>().empty());
  EXPECT_EQ(rank["device"], "cpu");
  EXPECT_TRUE(testing::contains(
      a.out, fmt::format("rank 0 | host {} | pid {} | cpu", rank["host"].get<std::string>(),
                         rank["pid"].get<int>())))
      << a.out;
  for (size_t i = 0; i < full.size(); ++i) {
    EXPECT_EQ(full[i]["step"].get<int>(), static_cast<int>(i) + 1);  // as the console counts
    for (const char* key : {"loss", "lr", "grad_norm", "step_ms", "tokens_per_s"})
      EXPECT_TRUE(full[i].contains(key)) << key;
  }
  EXPECT_LT(full[3]["loss"].get<double>(), full[0]["loss"].get<double>());

  Result b = run(toy("--train-iters 2 --save " + dir_ + "/ckpt"));
  ASSERT_EQ(b.code, 0) << b.err;
  Result c = run(toy("--train-iters 4 --load " + dir_ + "/ckpt --log-jsonl " + dir_ +
                     "/c.jsonl --sample 40 --sample-prompt To"));
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.out.find("resumed from"), std::string::npos);
  const std::vector<nlohmann::json> tail = testing::jsonl_steps(dir_ + "/c.jsonl");
  ASSERT_EQ(tail.size(), 2u);
  EXPECT_EQ(testing::jsonl_headers(dir_ + "/c.jsonl").at(0)["start_step"], 2);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(tail[i]["step"], full[i + 2]["step"]);
    EXPECT_EQ(tail[i]["loss"].get<double>(), full[i + 2]["loss"].get<double>());
    EXPECT_EQ(tail[i]["grad_norm"].get<double>(), full[i + 2]["grad_norm"].get<double>());
  }
  auto pos = c.out.find("--- sample");
  ASSERT_NE(pos, std::string::npos) << c.out;
  std::string sample = c.out.substr(c.out.find('\n', pos) + 1);
  EXPECT_EQ(sample.rfind("To", 0), 0u);
  EXPECT_GE(sample.size(), 42u);
}

TEST_F(Cli, NonFiniteLossNamesTheStep) {
  expect_error(toy("--train-iters 3 --lr 1e30 --clip-grad 0"), {"step", "diverged"});
}

// A loss past a bound known before training stops the run from step 1 on,
// with or without the spike check (which needs a window of history): by
// default 4 x ln(vocabulary 256) = 22.18, four times a uniform guess's loss.
// --lr 10 sends step 2's loss past a thousand. --max-loss 0 turns it off.
TEST_F(Cli, ALossPastTheBoundStopsTheRunFromTheStart) {
  for (const char* spike : {"", " --check-for-spiky-loss"})
    expect_error(toy(std::string("--train-iters 4 --lr 10") + spike),
                 {"step 2: loss ", "is past --max-loss 22.1807; training diverged"});
  Result r = run(toy("--train-iters 2 --lr 10 --max-loss 0"));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  expect_error(toy("--train-iters 2 --max-loss -3"), {"--max-loss (-3) must be >= 0"});
  expect_error(toy("--train-iters 2 --save-timeout -1"),
               {"--save-timeout (-1) must be a number of seconds in [0, 604800]"});
}

// Integer flags past their range, or whose sizes would overflow, are refused
// in one line: no flag value reaches a crash or is quietly changed.
TEST_F(Cli, IntegerFlagsOutOfRangeAreRefused) {
  Result r = run(toy("--train-iters 2 --seed 99999999999999999999"));
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(testing::contains(r.err, "--seed: the value 99999999999999999999 is past the range of a "
                              "64-bit integer"))
      << r.err;
  expect_error(toy("--train-iters 2 --max-position-embeddings -1"),
               {"--max-position-embeddings (-1) must be positive"});
  expect_error(toy("--train-iters 2 --threads 100000"), {"--threads (100000) must be in [0, 4096]"});
  for (const char* huge : {"1152921504606846976", "4611686018427387904"})
    expect_error(std::string("--num-layers 2 --hidden-size 32 --num-attention-heads 4 "
                             "--seq-length 16 --train-iters 2 --micro-batch-size ") +
                     huge + " --data-path " + dir_ + "/text.txt",
                 {"has more elements than a 64-bit count holds"});
}

// Paths that meta.json and the metrics file record must be UTF-8: refused
// before training, not when the first save writes them.
TEST_F(Cli, ANonUtf8PathIsRefusedBeforeTraining) {
  const std::string odd = dir_ + "/caf\xe9.txt";
  std::filesystem::copy_file(dir_ + "/text.txt", odd,
                             std::filesystem::copy_options::overwrite_existing);
  expect_error("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
               "--micro-batch-size 2 --train-iters 2 --data-path " + odd,
               {"--data-path is not valid UTF-8"});
}

}  // namespace
}  // namespace weft
