// weft-hf ($WEFT_HF): train_gpt's checkpoints through export and import unchanged; transformers'
// own GPT-2 and Llama (tests/reference/hf_reference.py; fixtures committed, so no transformers
// here) through import to the logits transformers computes, and back through export to the
// bytes transformers saved; one line for each model weft cannot hold.
#include <weft/checkpoint.h>
#include <weft/hf.h>
#include <weft/runner.h>
#include <weft/safetensors.h>

#include <gtest/gtest.h>
#include <sys/wait.h>

#include "layers/lm_head.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "test_util.h"

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::read_file;
using testing::source_path;
using testing::write_file;

struct Result {
  int code = -1;
  std::string out, err;
};

// weft-hf with `args`, in `dir`.
Result weft_hf(const std::string& args, const std::string& dir) {
  const char* exe = std::getenv("WEFT_HF");
  EXPECT_NE(exe, nullptr) << "WEFT_HF is set by meson test";
  const std::string out = dir + "/hf_out.txt", err = dir + "/hf_err.txt";
  const std::string cmd =
      fmt::format("cd {} && {} {} >{} 2>{}", dir, exe ? exe : "weft-hf", args, out, err);
  const int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

std::string fixture(const std::string& rel) {
  return source_path("tests/reference/fixtures/hf/" + rel);
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_file(path)); }

// A tensor's values as fp32 bit patterns (BF16 widened, exactly).
std::vector<uint32_t> f32_bits(const Tensor& t) {
  std::vector<uint32_t> v(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::BF16) {
    const uint16_t* h = t.data<uint16_t>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint32_t>(h[i]) << 16;
  } else {
    EXPECT_EQ(t.dtype(), DType::F32);
    std::memcpy(v.data(), t.raw(), t.nbytes());
  }
  return v;
}

// `got` holds the tensors of `want`, none other, each with its shape and its
// fp32 values bit for bit.
void expect_same_tensors(const safetensors::File& got, const safetensors::File& want) {
  EXPECT_EQ(got.tensors().size(), want.tensors().size()) << got.path() << " vs " << want.path();
  for (const auto& info : want.tensors()) {
    const safetensors::TensorInfo* g = got.find(info.name);
    ASSERT_NE(g, nullptr) << got.path() << " lacks " << info.name;
    EXPECT_EQ(g->shape, info.shape) << info.name;
    EXPECT_TRUE(f32_bits(got.get(info.name)) == f32_bits(want.get(info.name))) << info.name;
  }
}

// The train_gpt flags weft-hf import printed: its line "train_gpt --init-from FILE FLAGS".
std::string printed_flags(const std::string& out, const std::string& file) {
  const std::string lead = "train_gpt --init-from " + file + " ";
  const size_t at = out.find(lead);
  if (at == std::string::npos) return "";
  const size_t end = out.find('\n', at);
  return out.substr(at + lead.size(), end - at - lead.size());
}

// --- a train_gpt checkpoint, out and back in ---

struct TrainCase {
  std::string name, flags;
};

void PrintTo(const TrainCase& c, std::ostream* os) { *os << c.name; }

class HfRoundTrip : public ::testing::TestWithParam<TrainCase> {};

// One step of train_gpt saved; exported; imported: the checkpoint's tensors bit for bit. The
// flags the import prints make train_gpt build the same model: its first step from the import
// has the loss and gradient norm of a --finetune from the checkpoint.
TEST_P(HfRoundTrip, ATrainGptCheckpointComesBackBitForBit) {
  const TrainCase& c = GetParam();
  const std::string dir = testing::temp_dir("hf-roundtrip-" + c.name);
  write_file(dir + "/text.txt", testing::best_of_times(40));
  // --make-vocab-size-divisible-by 7: the table is padded to 259 rows in memory, 256 on disk.
  const std::string data = fmt::format(
      " --seq-length 16 --micro-batch-size 2 --train-iters 1 --data-path {}/text.txt", dir);
  testing::TrainRun first = testing::run_train_gpt(
      1, c.flags + data + " --make-vocab-size-divisible-by 7 --save " + dir + "/ckpt", dir);
  ASSERT_TRUE(first.ok) << first.output;

  Result exported = weft_hf("export --load ckpt --output hf", dir);
  ASSERT_EQ(exported.code, 0) << exported.err;
  EXPECT_TRUE(contains(exported.out, "the " + c.name + " of ckpt/iter_0000001 (step 1)"))
      << exported.out;
  const nlohmann::json config = read_json(dir + "/hf/config.json");
  EXPECT_EQ(config["model_type"], c.name);
  EXPECT_EQ(config["vocab_size"], 256);
  safetensors::File hf = safetensors::File::open(dir + "/hf/model.safetensors");
  safetensors::File ckpt =
      safetensors::File::open(dir + "/ckpt/iter_0000001/model-00001-of-00001.safetensors");
  if (c.name == "llama") {
    EXPECT_EQ(config["num_key_value_heads"], 2);
    EXPECT_EQ(config["rope_theta"], 500.0);
    // transformers' k_proj (G D, C) is the k columns of weft's qkv (C, C + 2 G D), transposed:
    // k_proj[r][j] = qkv[j][C + r].
    const Tensor qkv = ckpt.get("h.1.attn.qkv.weight"),
                 k = hf.get("model.layers.1.self_attn.k_proj.weight");
    ASSERT_EQ(k.shape(), (Shape{16, 32}));
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t j = 0; j < 32; ++j)
        ASSERT_EQ(k.data<float>()[r * 32 + j], qkv.data<float>()[j * 64 + 32 + r]) << r << "," << j;
  } else {
    EXPECT_EQ(config["n_embd"], 32);
    EXPECT_EQ(hf.find("lm_head.weight"), nullptr) << "GPT-2's head is tied";
    EXPECT_NE(hf.find("transformer.h.1.mlp.c_proj.weight"), nullptr);
  }

  Result imported = weft_hf("import --input hf --output weft.safetensors", dir);
  ASSERT_EQ(imported.code, 0) << imported.err;
  expect_same_tensors(safetensors::File::open(dir + "/weft.safetensors"), ckpt);

  const std::string flags = printed_flags(imported.out, "weft.safetensors");
  ASSERT_FALSE(flags.empty()) << imported.out;
  // The table padded in memory as the checkpoint's run padded it (the file
  // holds the 256 real rows either way): the head's GEMMs over 259 rows and
  // over 256 add in other orders on some BLAS kernels (AVX-512's), and the
  // comparison is of the weights, bit for bit.
  testing::TrainRun from_import = testing::run_train_gpt(
      1,
      fmt::format("--init-from {}/weft.safetensors {}{} --make-vocab-size-divisible-by 7", dir,
                  flags, data),
      dir);
  ASSERT_TRUE(from_import.ok) << from_import.output;
  testing::TrainRun finetune =
      testing::run_train_gpt(1, fmt::format("--load {}/ckpt --finetune --train-iters 1", dir), dir);
  ASSERT_TRUE(finetune.ok) << finetune.output;
  ASSERT_EQ(from_import.records.size(), 1u);
  ASSERT_EQ(finetune.records.size(), 1u);
  EXPECT_EQ(from_import.records[0]["loss"], finetune.records[0]["loss"]);
  EXPECT_EQ(from_import.records[0]["grad_norm"], finetune.records[0]["grad_norm"]);
}

INSTANTIATE_TEST_SUITE_P(
    Families, HfRoundTrip,
    ::testing::Values(TrainCase{"gpt2",
                                "--num-layers 2 --hidden-size 32 --num-attention-heads 4 "
                                "--max-position-embeddings 24"},
                      TrainCase{"llama",
                                "--arch llama --num-layers 2 --hidden-size 32 "
                                "--num-attention-heads 4 --group-query-attention "
                                "--num-query-groups 2 --ffn-hidden-size 48 "
                                "--rotary-base 500"}),
    [](const auto& p) { return p.param.name; });

// --- transformers' own models ---

struct HfCase {
  std::string name, flags;
};

void PrintTo(const HfCase& c, std::ostream* os) { *os << c.name; }

class HfTransformers : public ::testing::TestWithParam<HfCase> {};

// weft's logits for `tokens` (B, T) with the weights of `file`.
template <typename Model>
Tensor logits(Model& m, const std::string& file, const Tensor& tokens) {
  load_weights(file, m.graph.params());
  m.head->set_keep_logits(true);
  MicroBatch mb(m.graph);
  mb.input(m.tokens).copy_from(tokens);
  mb.input(m.targets).copy_from(tokens);  // any ids: the loss is not looked at
  const int n = static_cast<int>(m.graph.nodes().size());
  forward(m.graph, mb, 0, n);
  return TiedLmHeadLoss::logits(mb.ctx(n - 1)).clone();
}

// The error model of the logits. Both sides compute in fp32 (unit roundoff u = 2^-24) from the
// same weights, in other orders. A sum of n products carries at most about n u of relative
// error (of the sum of the magnitudes; sqrt(n) u as a rule); normalisations and softmax add a
// few u, and what a block gets wrong its residual carries on. Summing the reduction lengths
// along one token's path gives N: per block, GPT-2's c_attn (C), scores (D), probabilities
// times values (T), c_proj (C), c_fc (C), the MLP's c_proj (4C) and two LayerNorms (C each);
// Llama's qkv, o and gate_up (C each), scores (D), probabilities times values (T), down (F) and
// two RMSNorms (C each), plus rotary angles that transformers computes in fp32 and weft in
// fp64 (a position t's angle off by up to t u: T more); then the final norm and the head (C
// each). Each side is within N u of the exact logits, so the two within 2 N u, relative to the
// logits' norm, and elementwise within 2 N u of the largest logit. transformers' own fp32
// against fp64, as hf_reference.py prints it, is about 2e-7 on these models,
// and weft against transformers about the same.
double tolerance(const hf::ModelShape& s, int64_t seq) {
  const int64_t c = s.hidden_size, d = c / s.num_heads;
  const int64_t block = s.llama() ? 3 * c + d + seq + s.ffn_hidden_size + 2 * c + seq
                                  : c + d + seq + c + c + 4 * c + 2 * c;
  const double n = static_cast<double>(s.num_layers * block + 2 * c);
  return 2.0 * n * std::ldexp(1.0, -24);
}

// transformers' folder, imported: weft's forward gives transformers' logits; the flags printed
// are the shape's; exported again from a checkpoint of the import, the folder holds
// transformers' tensors bit for bit (the Llama's bf16 widened) and its config fields.
TEST_P(HfTransformers, ImportGivesTheLogitsOfTransformersAndExportItsTensors) {
  const HfCase& c = GetParam();
  const std::string dir = testing::temp_dir("hf-transformers-" + c.name);
  Result imported =
      weft_hf(fmt::format("import --input {} --output weft.safetensors", fixture(c.name)), dir);
  ASSERT_EQ(imported.code, 0) << imported.err;
  EXPECT_EQ(printed_flags(imported.out, "weft.safetensors"), c.flags);

  const nlohmann::json hf_config = read_json(fixture(c.name + "/config.json"));
  const hf::ModelShape s = hf::shape_from_hf_config(hf_config, "config.json");
  safetensors::File golden = safetensors::File::open(fixture("logits.safetensors"));
  const Tensor tokens = golden.get("tokens");
  const int64_t batch = tokens.dim(0), seq = tokens.dim(1);
  Tensor got;
  if (s.llama()) {
    LlamaConfig lc;
    lc.vocab_size = s.vocab_size, lc.num_layers = s.num_layers, lc.hidden_size = s.hidden_size;
    lc.num_heads = s.num_heads, lc.num_query_groups = s.num_query_groups;
    lc.ffn_hidden_size = s.ffn_hidden_size, lc.seq_length = seq;
    lc.rope_base = static_cast<float>(s.rotary_base);
    LlamaModel m = build_llama(lc, batch);
    got = logits(m, dir + "/weft.safetensors", tokens);
  } else {
    GptConfig gc;
    gc.vocab_size = s.vocab_size, gc.max_positions = s.max_positions;
    gc.num_layers = s.num_layers, gc.hidden_size = s.hidden_size, gc.num_heads = s.num_heads;
    gc.seq_length = seq;
    GptModel m = build_gpt(gc, batch);
    got = logits(m, dir + "/weft.safetensors", tokens);
  }
  const Tensor want = golden.get(c.name + ".logits");  // (B, T, V); weft's are (B T, V)
  ASSERT_EQ(got.numel(), want.numel()) << got.shape().str() << " vs " << want.shape().str();
  got = got.view(want.shape());
  const double tol = tolerance(s, seq);
  const double error = testing::rel_error(got, want);
  EXPECT_LT(error, tol);
  std::printf("%s: logits %.3g from transformers' (relative), tolerance %.3g\n", c.name.c_str(),
              error, tol);
  float largest = 0, worst = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    largest = std::max(largest, std::abs(want.data<float>()[i]));
    worst = std::max(worst, std::abs(got.data<float>()[i] - want.data<float>()[i]));
  }
  EXPECT_LE(worst, tol * largest);

  // A checkpoint of the import, as train_gpt saves one, exported.
  safetensors::File weft = safetensors::File::open(dir + "/weft.safetensors");
  NamedTensors model;
  for (const auto& info : weft.tensors()) model.emplace_back(info.name, weft.get(info.name));
  CheckpointMeta meta;
  meta.config = {
      {"arch", s.arch},           {"num_layers", s.num_layers}, {"hidden_size", s.hidden_size},
      {"num_heads", s.num_heads}, {"vocab_size", s.vocab_size}, {"max_positions", s.max_positions}};
  if (s.llama())
    meta.config.update({{"ffn_hidden_size", s.ffn_hidden_size},
                        {"num_query_groups", s.num_query_groups},
                        {"rotary_base", s.rotary_base}});
  save_checkpoint(dir + "/ckpt", model, {}, 0, meta);
  Result exported = weft_hf("export --load ckpt --output export", dir);
  ASSERT_EQ(exported.code, 0) << exported.err;
  expect_same_tensors(safetensors::File::open(dir + "/export/model.safetensors"),
                      safetensors::File::open(fixture(c.name + "/model.safetensors")));
  const nlohmann::json ours = read_json(dir + "/export/config.json");
  // But the dtype (the Llama fixture is bf16) and the special tokens, which a checkpoint does
  // not know.
  for (const auto& [key, value] : ours.items()) {
    if (hf_config.contains(key) && key != "torch_dtype" && key != "bos_token_id" &&
        key != "eos_token_id") {
      EXPECT_EQ(value, hf_config[key]) << key;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, HfTransformers,
    ::testing::Values(HfCase{"gpt2_tiny",
                             "--arch gpt2 --num-layers 2 --hidden-size 16 --num-attention-heads 4 "
                             "--max-position-embeddings 16 --vocab-size 96"},
                      HfCase{"llama_gqa_tiny",
                             "--arch llama --num-layers 2 --hidden-size 32 --num-attention-heads 4 "
                             "--group-query-attention --num-query-groups 2 --ffn-hidden-size 48 "
                             "--rotary-base 500 --vocab-size 96"}),
    [](const auto& p) { return p.param.name; });

// --- folders transformers writes in other ways ---

// A copy of a fixture folder, to change.
std::string copy_fixture(const std::string& name, const std::string& dir) {
  const std::string to = dir + "/" + name;
  fs::remove_all(to);
  fs::copy(fixture(name), to, fs::copy_options::recursive);
  return to;
}

// Rewrites dir/model.safetensors through `change` (its tensors, in file order).
void edit_tensors(const std::string& folder, const std::function<void(NamedTensors&)>& change) {
  const std::string path = folder + "/model.safetensors";
  NamedTensors tensors;
  {
    safetensors::File f = safetensors::File::open(path);
    for (const auto& info : f.tensors()) tensors.emplace_back(info.name, f.get(info.name).clone());
  }
  change(tensors);
  safetensors::save(path, tensors, {{"format", "pt"}});
}

void edit_config(const std::string& folder, const std::function<void(nlohmann::json&)>& change) {
  nlohmann::json j = read_json(folder + "/config.json");
  change(j);
  write_file(folder + "/config.json", j.dump(2));
}

TEST(HfImport, ShardsTheirIndexAndGpt2NamesWithoutPrefixReadAlike) {
  const std::string dir = testing::temp_dir("hf-shards");
  ASSERT_EQ(
      weft_hf(fmt::format("import --input {} --output one.safetensors", fixture("llama_gqa_tiny")),
              dir)
          .code,
      0);
  // Two shards and transformers' index of them.
  const std::string sharded = copy_fixture("llama_gqa_tiny", dir);
  {
    safetensors::File f = safetensors::File::open(sharded + "/model.safetensors");
    NamedTensors a, b;
    nlohmann::json map = nlohmann::json::object();
    for (const auto& info : f.tensors()) {
      const bool first = info.name.find("layers.1.") == std::string::npos;
      (first ? a : b).emplace_back(info.name, f.get(info.name).clone());
      map[info.name] =
          first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    }
    safetensors::save(sharded + "/model-00001-of-00002.safetensors", a, {{"format", "pt"}});
    safetensors::save(sharded + "/model-00002-of-00002.safetensors", b, {{"format", "pt"}});
    write_file(sharded + "/model.safetensors.index.json",
               nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump());
  }
  fs::remove(sharded + "/model.safetensors");
  ASSERT_EQ(weft_hf("import --input llama_gqa_tiny --output sharded.safetensors", dir).code, 0);
  expect_same_tensors(safetensors::File::open(dir + "/sharded.safetensors"),
                      safetensors::File::open(dir + "/one.safetensors"));

  // GPT-2 as GPT2Model saves it (the hub's gpt2): no "transformer.", with the mask buffers.
  ASSERT_EQ(
      weft_hf(fmt::format("import --input {} --output prefixed.safetensors", fixture("gpt2_tiny")),
              dir)
          .code,
      0);
  const std::string bare = copy_fixture("gpt2_tiny", dir);
  edit_tensors(bare, [](NamedTensors& ts) {
    for (auto& named : ts) named.first = named.first.substr(std::string("transformer.").size());
    ts.emplace_back("h.0.attn.bias", Tensor::zeros({1, 1, 16, 16}));
    ts.emplace_back("h.0.attn.masked_bias", Tensor::zeros({1}));
  });
  ASSERT_EQ(weft_hf("import --input gpt2_tiny --output bare.safetensors", dir).code, 0);
  expect_same_tensors(safetensors::File::open(dir + "/bare.safetensors"),
                      safetensors::File::open(dir + "/prefixed.safetensors"));
}

TEST(HfImport, ATiedLlamaHeadStartsAsTheEmbedding) {
  const std::string dir = testing::temp_dir("hf-tied");
  const std::string folder = copy_fixture("llama_gqa_tiny", dir);
  edit_config(folder, [](nlohmann::json& j) { j["tie_word_embeddings"] = true; });
  edit_tensors(folder, [](NamedTensors& ts) {
    std::erase_if(ts, [](const auto& nt) { return nt.first == "lm_head.weight"; });
  });
  Result r = weft_hf("import --input llama_gqa_tiny --output tied.safetensors", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "note: tie_word_embeddings")) << r.out;
  safetensors::File f = safetensors::File::open(dir + "/tied.safetensors");
  EXPECT_TRUE(f32_bits(f.get("lm_head.weight")) == f32_bits(f.get("wte.weight")));
}

// transformers 5 writes the rotary base into "rope_parameters"; earlier versions at the top.
TEST(HfImport, TheRotaryBaseOfEitherSpelling) {
  const std::string dir = testing::temp_dir("hf-rope-parameters");
  const std::string folder = copy_fixture("llama_gqa_tiny", dir);
  edit_config(folder, [](nlohmann::json& j) {
    j.erase("rope_theta");
    j.erase("rope_scaling");
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500.0}};
  });
  Result r = weft_hf("import --input llama_gqa_tiny --output five.safetensors", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(printed_flags(r.out, "five.safetensors"), "--rotary-base 500 ")) << r.out;
  edit_config(folder, [](nlohmann::json& j) {
    j["rope_parameters"] = nullptr;
    j["rope_scaling"] = {{"type", "default"}};  // transformers 4's spelling of none
    j["rope_theta"] = 20000.0;
  });
  r = weft_hf("import --input llama_gqa_tiny --output four.safetensors", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(printed_flags(r.out, "four.safetensors"), "--rotary-base 20000 ")) << r.out;
}

// --- refusals: each one line on stderr, naming the file and the field or tensor ---

struct Refusal {
  std::string name, fixture;
  std::function<void(const std::string& folder)> change;
  std::vector<std::string> says;  // besides the file's name
  std::string file = "config.json";
};

void PrintTo(const Refusal& c, std::ostream* os) { *os << c.name; }

class HfRefusal : public ::testing::TestWithParam<Refusal> {};

TEST_P(HfRefusal, OneLineNamingTheFileAndTheField) {
  const Refusal& c = GetParam();
  const std::string dir = testing::temp_dir("hf-refusal-" + c.name);
  const std::string folder = copy_fixture(c.fixture, dir);
  c.change(folder);
  Result r = weft_hf(fmt::format("import --input {} --output out.safetensors", c.fixture), dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(testing::count(r.err, "\n"), 1) << r.err;
  EXPECT_TRUE(r.err.starts_with("weft-hf import: ")) << r.err;
  EXPECT_TRUE(contains(r.err, c.file.empty() ? c.fixture + ":" : c.fixture + "/" + c.file))
      << r.err;
  for (const std::string& s : c.says) EXPECT_TRUE(contains(r.err, s)) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/out.safetensors"));
}

std::function<void(const std::string&)> set(const std::string& key, nlohmann::json value) {
  return [=](const std::string& folder) {
    edit_config(folder, [&](nlohmann::json& j) { j[key] = value; });
  };
}

// A safetensors file of one tensor with a dtype weft does not read (F16).
void write_f16_file(const std::string& path, const std::string& name) {
  std::string header =
      nlohmann::json{{name, {{"dtype", "F16"}, {"shape", {2}}, {"data_offsets", {0, 4}}}}}.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i)
    bytes[static_cast<size_t>(i)] = static_cast<char>(header.size() >> (8 * i));
  write_file(path, bytes + header + std::string(4, '\0'));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, HfRefusal,
    ::testing::Values(
        Refusal{"ModelType",
                "llama_gqa_tiny",
                set("model_type", "mistral"),
                {"\"model_type\" is \"mistral\"", "gpt2 and llama"}},
        Refusal{"RopeScaling",
                "llama_gqa_tiny",
                set("rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}),
                {"\"rope_scaling\" is {", "no scaling"}},
        Refusal{"RopeParameters",
                "llama_gqa_tiny",
                set("rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 500.0}}),
                {"\"rope_parameters\" is {", "no scaling"}},
        Refusal{"RopeField",
                "llama_gqa_tiny",
                set("rope_parameters", {{"rope_type", "default"}, {"partial_rotary_factor", 0.5}}),
                {"no \"partial_rotary_factor\""}},
        Refusal{"TwoRotaryBases",
                "llama_gqa_tiny",
                set("rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}}),
                {"\"rope_parameters\" gives rope_theta 10000, but \"rope_theta\" is 500"}},
        Refusal{"RmsNormEps",
                "llama_gqa_tiny",
                set("rms_norm_eps", 1e-6),
                {"\"rms_norm_eps\" is 1e-06", "RMSNorm epsilon is 1e-05"}},
        Refusal{"AttentionBias",
                "llama_gqa_tiny",
                set("attention_bias", true),
                {"\"attention_bias\" is true", "no biases"}},
        Refusal{"HiddenAct",
                "llama_gqa_tiny",
                set("hidden_act", "gelu"),
                {"\"hidden_act\" is \"gelu\""}},
        Refusal{"HeadDim", "llama_gqa_tiny", set("head_dim", 16), {"\"head_dim\" is 16"}},
        Refusal{"KeyValueHeads",
                "llama_gqa_tiny",
                set("num_key_value_heads", 3),
                {"num_key_value_heads (3) must divide num_attention_heads (4)"}},
        Refusal{"MissingField",
                "gpt2_tiny",
                [](const std::string& f) {
                  edit_config(f, [](nlohmann::json& j) { j.erase("n_head"); });
                },
                {"\"n_head\" is missing"}},
        Refusal{"UntiedGpt2",
                "gpt2_tiny",
                set("tie_word_embeddings", false),
                {"\"tie_word_embeddings\" is false"}},
        Refusal{"Activation",
                "gpt2_tiny",
                set("activation_function", "relu"),
                {"\"activation_function\" is \"relu\""}},
        Refusal{"Inner", "gpt2_tiny", set("n_inner", 32), {"\"n_inner\" is 32", "(64)"}},
        Refusal{"LayerNormEps",
                "gpt2_tiny",
                set("layer_norm_epsilon", 1e-6),
                {"\"layer_norm_epsilon\" is 1e-06"}},
        Refusal{"NotJson",
                "gpt2_tiny",
                [](const std::string& f) { write_file(f + "/config.json", "{\"n_embd\": "); },
                {"not valid JSON"}},
        Refusal{"MissingTensor",
                "llama_gqa_tiny",
                [](const std::string& f) {
                  edit_tensors(f, [](NamedTensors& ts) {
                    std::erase_if(ts, [](const auto& nt) {
                      return nt.first == "model.layers.1.mlp.up_proj.weight";
                    });
                  });
                },
                {"no tensor 'model.layers.1.mlp.up_proj.weight' (shape [48, 32])"},
                "model.safetensors"},
        Refusal{"ExtraTensor",
                "llama_gqa_tiny",
                [](const std::string& f) {
                  edit_tensors(f, [](NamedTensors& ts) {
                    ts.emplace_back("model.layers.2.mlp.up_proj.weight",
                                    Tensor::zeros({48, 32}, DType::BF16));
                  });
                },
                {"tensor 'model.layers.2.mlp.up_proj.weight' is not one of a llama of 2 layers"},
                "model.safetensors"},
        Refusal{"ShapeAgainstConfig",
                "llama_gqa_tiny",
                set("intermediate_size", 64),
                {"'model.layers.0.mlp.gate_proj.weight' has shape [48, 32]", "[64, 32]"},
                "model.safetensors"},
        Refusal{"IntegerWeights",
                "gpt2_tiny",
                [](const std::string& f) {
                  edit_tensors(f, [](NamedTensors& ts) {
                    for (auto& [name, tensor] : ts)
                      if (name == "transformer.ln_f.bias") tensor = Tensor::zeros({16}, DType::I32);
                  });
                },
                {"'transformer.ln_f.bias' has dtype I32"},
                "model.safetensors"},
        Refusal{"HalfPrecision",
                "gpt2_tiny",
                [](const std::string& f) {
                  write_f16_file(f + "/model.safetensors", "transformer.wte.weight");
                },
                {"'transformer.wte.weight'", "\"F16\""},
                "model.safetensors"},
        Refusal{"PickleOnly",
                "gpt2_tiny",
                [](const std::string& f) {
                  fs::rename(f + "/model.safetensors", f + "/pytorch_model.bin");
                },
                {"neither model.safetensors nor model.safetensors.index.json",
                 "pytorch_model.bin is not read"},
                ""}),
    [](const auto& p) { return p.param.name; });

TEST(HfExport, RefusesWhatItCannotRead) {
  const std::string dir = testing::temp_dir("hf-export-refusal");
  Result none = weft_hf("export --load nothing --output out", dir);
  EXPECT_EQ(none.code, 1);
  EXPECT_EQ(none.err, "weft-hf export: --load nothing: no such directory\n");

  CheckpointMeta meta;
  meta.config = {{"arch", "mixtral"}, {"num_layers", 1}};
  save_checkpoint(dir + "/ckpt", {{"wte.weight", Tensor::zeros({4, 4})}}, {}, 0, meta);
  Result arch = weft_hf("export --load ckpt --output out", dir);
  EXPECT_EQ(arch.code, 1);
  EXPECT_EQ(testing::count(arch.err, "\n"), 1) << arch.err;
  EXPECT_TRUE(contains(arch.err, "ckpt/iter_0000000/meta.json \"config\": \"arch\" is \"mixtral\""))
      << arch.err;

  meta.config = {{"arch", "gpt2"}, {"num_layers", 1}, {"hidden_size", 4},
                 {"num_heads", 2}, {"vocab_size", 4}, {"max_positions", 8}};
  save_checkpoint(dir + "/short", {{"wte.weight", Tensor::zeros({4, 4})}}, {}, 0, meta);
  Result lacks = weft_hf("export --load short --output out", dir);
  EXPECT_EQ(lacks.code, 1);
  EXPECT_TRUE(contains(lacks.err,
                       "short/iter_0000000: no tensor 'wpe.weight' "
                       "(shape [8, 4]), which a gpt2 of 1 layer,"))
      << lacks.err;
  EXPECT_FALSE(fs::exists(dir + "/out/model.safetensors"));
}

}  // namespace
}  // namespace weft
