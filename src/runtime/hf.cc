// Hugging Face transformers' GPT-2 and Llama weights, out and in (weft/hf.h).
#include <weft/bf16.h>
#include <weft/error.h>
#include <weft/hf.h>
#include <weft/safetensors.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include "models/llama.h"

namespace fs = std::filesystem;

namespace weft::hf {
namespace {

// weft's norm epsilons, which no flag changes: LayerNorm's default
// (layers/layernorm.h), which GPT-2 uses, and LlamaConfig's RMSNorm one.
constexpr float kLayerNormEps = 1e-5f;
constexpr float kRmsNormEps = LlamaConfig{}.norm_eps;

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A float as JSON writes it shortest: 1e-05, not 9.999999747378752e-06.
double shortest(float x) { return std::stod(fmt::format("{}", x)); }

std::string describe(const ModelShape& s) {
  std::string d = fmt::format("{} of {} layer{}, hidden size {}, {} heads", s.arch, s.num_layers,
                              s.num_layers == 1 ? "" : "s", s.hidden_size, s.num_heads);
  if (s.llama())
    d +=
        fmt::format(", {} key/value heads, SwiGLU width {}", s.num_query_groups, s.ffn_hidden_size);
  else
    d += fmt::format(", {} positions", s.max_positions);
  return d + fmt::format(", vocabulary {}", s.vocab_size);
}

// The rules a shape must keep on both sides; `where` names its source and
// `field` the spelling of its fields there.
void validate(const ModelShape& s, const std::string& where,
              const std::map<std::string, std::string>& field) {
  check(s.hidden_size % s.num_heads == 0, "{}: {} ({}) must be divisible by {} ({})", where,
        field.at("hidden_size"), s.hidden_size, field.at("num_heads"), s.num_heads);
  if (!s.llama()) return;
  const int64_t d = s.hidden_size / s.num_heads;
  check(d % 2 == 0, "{}: the head size {} ({} / {}) must be even for rotary embedding", where, d,
        field.at("hidden_size"), field.at("num_heads"));
  check(s.num_heads % s.num_query_groups == 0, "{}: {} ({}) must divide {} ({})", where,
        field.at("num_query_groups"), s.num_query_groups, field.at("num_heads"), s.num_heads);
  check(s.rotary_base > 0, "{}: {} ({}) must be positive", where, field.at("rotary_base"),
        s.rotary_base);
}

// Reads the fields of a JSON object, each error naming `where` and the field.
class Fields {
 public:
  Fields(const nlohmann::json& j, std::string where) : j_(j), where_(std::move(where)) {
    check(j_.is_object(), "{}: expected a JSON object, got {}", where_, j_.type_name());
  }
  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  const nlohmann::json& at(const char* key) const {
    check(has(key), "{}: \"{}\" is missing", where_, key);
    return j_[key];
  }
  int64_t positive(const char* key) const {
    const nlohmann::json& v = at(key);
    check(v.is_number_integer() && v.get<int64_t>() > 0, "{}: \"{}\" is {}, not a positive integer",
          where_, key, v.dump());
    return v.get<int64_t>();
  }
  double number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j_[key];
    check(v.is_number(), "{}: \"{}\" is {}, not a number", where_, key, v.dump());
    return v.get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j_[key];
    check(v.is_boolean(), "{}: \"{}\" is {}, not true or false", where_, key, v.dump());
    return v.get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j_[key];
    check(v.is_string(), "{}: \"{}\" is {}, not a string", where_, key, v.dump());
    return v.get<std::string>();
  }
  // Refuses a field whose value is not `want` (absent counts as `fallback`).
  void require(const char* key, bool fallback, bool want, const char* why) const {
    const bool v = boolean(key, fallback);
    check(v == want, "{}: \"{}\" is {}; {}", where_, key, v, why);
  }
  // An epsilon weft computes with: equal once rounded to fp32, as both add it
  // to an fp32 mean.
  void require_eps(const char* key, double fallback, float want, const char* what) const {
    const double v = number(key, fallback);
    check(static_cast<float>(v) == want, "{}: \"{}\" is {}, but weft's {} epsilon is {}", where_,
          key, v, what, want);
  }
  const std::string& where() const { return where_; }

 private:
  const nlohmann::json& j_;
  std::string where_;
};

// One weft tensor and the transformers tensors that hold it. Untransposed:
// one tensor of the same shape. Transposed: each block of columns [begin,
// begin + width) of the weft tensor (rows, cols), stored as (width, rows).
struct Link {
  struct Block {
    std::string hf;
    int64_t begin = 0, width = 0;
  };
  std::string weft;
  Shape shape;  // weft's
  bool transposed = false;
  std::vector<Block> blocks;

  Shape hf_shape(const Block& b) const { return transposed ? Shape{b.width, shape[0]} : shape; }
};

std::vector<Link> links(const ModelShape& s) {
  std::vector<Link> out;
  const int64_t c = s.hidden_size, v = s.vocab_size;
  auto same = [&](const std::string& weft, const std::string& hf, Shape shape) {
    out.push_back({weft, shape, false, {{hf, 0, shape.last()}}});
  };
  if (!s.llama()) {
    auto gpt = [&](const std::string& name, Shape shape) {
      same(name, "transformer." + name, shape);
    };
    gpt("wte.weight", {v, c});
    gpt("wpe.weight", {s.max_positions, c});
    for (int64_t i = 0; i < s.num_layers; ++i) {
      const std::string h = fmt::format("h.{}.", i);
      gpt(h + "ln_1.weight", {c});
      gpt(h + "ln_1.bias", {c});
      gpt(h + "attn.c_attn.weight", {c, 3 * c});
      gpt(h + "attn.c_attn.bias", {3 * c});
      gpt(h + "attn.c_proj.weight", {c, c});
      gpt(h + "attn.c_proj.bias", {c});
      gpt(h + "ln_2.weight", {c});
      gpt(h + "ln_2.bias", {c});
      gpt(h + "mlp.c_fc.weight", {c, 4 * c});
      gpt(h + "mlp.c_fc.bias", {4 * c});
      gpt(h + "mlp.c_proj.weight", {4 * c, c});
      gpt(h + "mlp.c_proj.bias", {c});
    }
    gpt("ln_f.weight", {c});
    gpt("ln_f.bias", {c});
    return out;
  }
  const int64_t kv = s.num_query_groups * (c / s.num_heads), f = s.ffn_hidden_size;
  same("wte.weight", "model.embed_tokens.weight", {v, c});
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string h = fmt::format("h.{}.", i), m = fmt::format("model.layers.{}.", i);
    same(h + "input_norm.weight", m + "input_layernorm.weight", {c});
    out.push_back({h + "attn.qkv.weight",
                   {c, c + 2 * kv},
                   true,
                   {{m + "self_attn.q_proj.weight", 0, c},
                    {m + "self_attn.k_proj.weight", c, kv},
                    {m + "self_attn.v_proj.weight", c + kv, kv}}});
    out.push_back({h + "attn.o.weight", {c, c}, true, {{m + "self_attn.o_proj.weight", 0, c}}});
    same(h + "post_attn_norm.weight", m + "post_attention_layernorm.weight", {c});
    out.push_back({h + "mlp.gate_up.weight",
                   {c, 2 * f},
                   true,
                   {{m + "mlp.gate_proj.weight", 0, f}, {m + "mlp.up_proj.weight", f, f}}});
    out.push_back({h + "mlp.down.weight", {f, c}, true, {{m + "mlp.down_proj.weight", 0, c}}});
  }
  same("norm.weight", "model.norm.weight", {c});
  same("lm_head.weight", "lm_head.weight", {v, c});
  return out;
}

// Columns [begin, begin + width) of w (rows, cols), transposed: (width, rows).
Tensor columns_transposed(const Tensor& w, int64_t begin, int64_t width) {
  const int64_t rows = w.dim(0), cols = w.dim(1);
  Tensor out = Tensor::empty({width, rows});
  const float* src = w.data<float>();
  float* dst = out.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) dst[j * rows + r] = src[r * cols + begin + j];
  return out;
}

// The reverse: t (width, rows) into columns [begin, begin + width) of w.
void set_columns_transposed(const Tensor& w, int64_t begin, const Tensor& t) {
  const int64_t rows = w.dim(0), cols = w.dim(1), width = t.dim(0);
  const float* src = t.data<float>();
  float* dst = w.data<float>();
  for (int64_t j = 0; j < width; ++j)
    for (int64_t r = 0; r < rows; ++r) dst[r * cols + begin + j] = src[j * rows + r];
}

// A tensor of a file as F32: a view of an F32 one, a converted copy of a BF16
// one (exact: bf16 is fp32's top half).
Tensor as_f32(const safetensors::File& file, const safetensors::TensorInfo& info) {
  check(info.dtype == DType::F32 || info.dtype == DType::BF16,
        "{}: tensor '{}' has dtype {}; weights are read as F32 or BF16", file.path(), info.name,
        dtype_name(info.dtype));
  Tensor t = file.get(info.name);
  if (info.dtype == DType::F32) return t;
  Tensor out = Tensor::empty(info.shape);
  const uint16_t* src = t.data<uint16_t>();
  float* dst = out.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) dst[i] = bf16_to_float(src[i]);
  return out;
}

// transformers' buffers and duplicates, which weft does not hold.
bool ignored_hf_tensor(const ModelShape& s, const std::string& name) {
  if (s.llama()) return ends_with(name, ".rotary_emb.inv_freq");
  return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
         name == "lm_head.weight";  // tied to wte
}

nlohmann::json read_json(const fs::path& path) {
  check(fs::exists(path), "{}: no such file", path.string());
  nlohmann::json j;
  try {
    std::ifstream(path) >> j;
  } catch (const nlohmann::json::exception& e) {
    throw Error("{}: not valid JSON: {}", path.string(), e.what());
  }
  return j;
}

// The tensors of a transformers folder, as F32, with the files that hold them.
struct HfTensors {
  std::vector<safetensors::File> files;  // the views in `tensors` point into these
  TensorMap tensors;
  std::string where;  // the file, or the shards' index
};

HfTensors read_hf_tensors(const fs::path& dir) {
  HfTensors out;
  const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  std::vector<fs::path> paths;
  std::map<std::string, std::string> weight_map;
  if (fs::exists(single)) {
    paths.push_back(single);
    out.where = single.string();
  } else if (fs::exists(index)) {
    out.where = index.string();
    const nlohmann::json j = read_json(index);
    const Fields f(j, out.where);
    const nlohmann::json& map = f.at("weight_map");
    check(map.is_object(), "{}: \"weight_map\" is {}, not an object", out.where, map.dump());
    std::set<std::string> shards;
    for (const auto& [name, file] : map.items()) {
      check(file.is_string(), "{}: weight_map's \"{}\" is {}, not a file name", out.where, name,
            file.dump());
      weight_map[name] = file.get<std::string>();
      shards.insert(file.get<std::string>());
    }
    for (const std::string& s : shards) paths.push_back(dir / s);
  } else {
    throw Error("{}: holds neither model.safetensors nor model.safetensors.index.json{}",
                dir.string(),
                fs::exists(dir / "pytorch_model.bin")
                    ? " (pytorch_model.bin is not read: save with safe_serialization=True)"
                    : "");
  }
  out.files.reserve(paths.size());
  for (const fs::path& p : paths) {
    out.files.push_back(safetensors::File::open(p.string()));
    const safetensors::File& file = out.files.back();
    for (const auto& info : file.tensors()) {
      check(out.tensors.emplace(info.name, as_f32(file, info)).second,
            "{}: tensor '{}' is in more than one shard", file.path(), info.name);
      auto listed = weight_map.find(info.name);
      check(weight_map.empty() ||
                (listed != weight_map.end() && fs::path(listed->second).filename() == p.filename()),
            "{}: tensor '{}' is in {}, but the index says {}", out.where, info.name,
            p.filename().string(), listed == weight_map.end() ? "nothing of it" : listed->second);
    }
  }
  for (const auto& [name, file] : weight_map)
    check(out.tensors.count(name) == 1, "{}: lists tensor '{}' in {}, which lacks it", out.where,
          name, file);
  return out;
}

// Writes `text` to path.tmp, then renames it over `path`.
void write_text(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    f.flush();
    check(f.good(), "{}: cannot write it", tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  check(!ec, "{}: cannot rename it to {}: {}", tmp.string(), path.string(), ec.message());
}

// Llama's rotary base. transformers before 5 writes "rope_theta", and
// "rope_scaling" null or {"rope_type": "default"}; 5 writes "rope_parameters"
// {"rope_type": "default", "rope_theta": ...}. Any other rope type (linear,
// dynamic, yarn, llama3, ...) or field is refused.
double rope_theta(const Fields& f) {
  std::optional<double> theta;
  if (f.has("rope_theta")) theta = f.number("rope_theta", 0.0);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!f.has(key)) continue;
    const nlohmann::json& r = f.at(key);
    check(r.is_object(), "{}: \"{}\" is {}, not an object", f.where(), key, r.dump());
    for (const char* type : {"rope_type", "type"})
      check(!r.contains(type) || r[type] == "default",
            "{}: \"{}\" is {}; weft's rotary embedding has no scaling (its rope_type is default)",
            f.where(), key, r.dump());
    for (const auto& item : r.items())
      check(item.key() == "rope_type" || item.key() == "type" || item.key() == "rope_theta",
            "{}: \"{}\" is {}; weft's rotary embedding has no \"{}\"", f.where(), key, r.dump(),
            item.key());
    if (!r.contains("rope_theta")) continue;
    const double v = Fields(r, fmt::format("{} \"{}\"", f.where(), key)).number("rope_theta", 0.0);
    check(!theta || *theta == v, "{}: \"{}\" gives rope_theta {}, but \"rope_theta\" is {}",
          f.where(), key, v, theta.value_or(v));
    theta = v;
  }
  return theta.value_or(10000.0);  // transformers' default
}

}  // namespace

std::vector<std::pair<std::string, Shape>> ModelShape::weft_tensors() const {
  std::vector<std::pair<std::string, Shape>> out;
  for (const Link& l : links(*this)) out.emplace_back(l.weft, l.shape);
  return out;
}

std::string ModelShape::train_gpt_flags() const {
  std::string f = fmt::format("--arch {} --num-layers {} --hidden-size {} --num-attention-heads {}",
                              arch, num_layers, hidden_size, num_heads);
  if (llama()) {
    if (num_query_groups != num_heads)
      f += fmt::format(" --group-query-attention --num-query-groups {}", num_query_groups);
    f += fmt::format(" --ffn-hidden-size {} --rotary-base {}", ffn_hidden_size,
                     static_cast<float>(rotary_base));
  } else {
    f += fmt::format(" --max-position-embeddings {}", max_positions);
  }
  return f + fmt::format(" --vocab-size {}", vocab_size);
}

ModelShape shape_from_meta(const nlohmann::json& config, const std::string& where) {
  const Fields f(config, where + " \"config\"");
  ModelShape s;
  s.arch = f.string("arch", "gpt2");  // checkpoints from before families are GPT-2's
  check(s.arch == "gpt2" || s.arch == "llama",
        "{}: \"arch\" is \"{}\"; weft-hf converts gpt2 and llama", f.where(), s.arch);
  s.num_layers = f.positive("num_layers");
  s.hidden_size = f.positive("hidden_size");
  s.num_heads = f.positive("num_heads");
  s.vocab_size = f.positive("vocab_size");
  s.max_positions = f.positive("max_positions");
  if (s.llama()) {
    s.ffn_hidden_size = f.positive("ffn_hidden_size");
    s.num_query_groups = f.positive("num_query_groups");
    f.at("rotary_base");
    s.rotary_base = f.number("rotary_base", 0.0);
  }
  validate(s, f.where(),
           {{"hidden_size", "hidden_size"},
            {"num_heads", "num_heads"},
            {"num_query_groups", "num_query_groups"},
            {"rotary_base", "rotary_base"}});
  return s;
}

nlohmann::json hf_config(const ModelShape& s) {
  // A checkpoint does not name its tokenizer: GPT-2's vocabulary of 50257 ends
  // with <|endoftext|>, another's special tokens are unknown.
  const nlohmann::json eos = !s.llama() && s.vocab_size == 50257 ? nlohmann::json(50256) : nullptr;
  if (!s.llama())
    return {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"vocab_size", s.vocab_size},
            {"n_positions", s.max_positions},
            {"n_embd", s.hidden_size},
            {"n_layer", s.num_layers},
            {"n_head", s.num_heads},
            {"n_inner", nullptr},  // 4 x n_embd
            {"activation_function", "gelu_new"},
            {"layer_norm_epsilon", shortest(kLayerNormEps)},
            {"resid_pdrop", 0.0},  // weft trains without dropout
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"initializer_range", 0.02},
            {"scale_attn_weights", true},
            {"scale_attn_by_inverse_layer_idx", false},
            {"reorder_and_upcast_attn", false},
            {"tie_word_embeddings", true},
            {"bos_token_id", eos},
            {"eos_token_id", eos},
            {"torch_dtype", "float32"}};
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", s.vocab_size},
          {"hidden_size", s.hidden_size},
          {"intermediate_size", s.ffn_hidden_size},
          {"num_hidden_layers", s.num_layers},
          {"num_attention_heads", s.num_heads},
          {"num_key_value_heads", s.num_query_groups},
          {"head_dim", s.hidden_size / s.num_heads},
          {"hidden_act", "silu"},
          {"max_position_embeddings", s.max_positions},
          {"rms_norm_eps", shortest(kRmsNormEps)},
          {"rope_theta", shortest(static_cast<float>(s.rotary_base))},
          {"rope_scaling", nullptr},
          {"attention_bias", false},
          {"attention_dropout", 0.0},
          {"mlp_bias", false},
          {"pretraining_tp", 1},
          {"initializer_range", 0.02},
          {"tie_word_embeddings", false},
          {"bos_token_id", eos},
          {"eos_token_id", eos},
          {"torch_dtype", "float32"}};
}

ModelShape shape_from_hf_config(const nlohmann::json& config, const std::string& where) {
  const Fields f(config, where);
  const std::string type = f.at("model_type").is_string() ? f.at("model_type").get<std::string>()
                                                          : f.at("model_type").dump();
  ModelShape s;
  if (type == "gpt2") {
    s.arch = "gpt2";
    s.num_layers = f.positive("n_layer");
    s.hidden_size = f.positive("n_embd");
    s.num_heads = f.positive("n_head");
    s.max_positions = f.positive("n_positions");
    s.vocab_size = f.positive("vocab_size");
    if (f.has("n_inner"))
      check(f.positive("n_inner") == 4 * s.hidden_size,
            "{}: \"n_inner\" is {}, but weft's GPT-2 MLP is 4 x n_embd ({}) wide", where,
            f.at("n_inner").dump(), 4 * s.hidden_size);
    const std::string act = f.string("activation_function", "gelu_new");
    check(act == "gelu_new" || act == "gelu_pytorch_tanh",
          "{}: \"activation_function\" is \"{}\"; weft's GPT-2 uses GELU's tanh approximation "
          "(gelu_new)",
          where, act);
    f.require_eps("layer_norm_epsilon", 1e-5, kLayerNormEps, "LayerNorm");
    f.require("tie_word_embeddings", true, true, "weft's GPT-2 head is the embedding (tied)");
    f.require("scale_attn_weights", true, true,
              "weft scales attention scores by 1/sqrt(head size)");
    f.require("scale_attn_by_inverse_layer_idx", false, false,
              "weft does not scale attention by the layer");
    f.require("add_cross_attention", false, false, "weft's GPT-2 has no cross-attention");
  } else if (type == "llama") {
    s.arch = "llama";
    s.num_layers = f.positive("num_hidden_layers");
    s.hidden_size = f.positive("hidden_size");
    s.num_heads = f.positive("num_attention_heads");
    s.num_query_groups =
        f.has("num_key_value_heads") ? f.positive("num_key_value_heads") : s.num_heads;
    s.ffn_hidden_size = f.positive("intermediate_size");
    s.vocab_size = f.positive("vocab_size");
    s.max_positions = f.positive("max_position_embeddings");
    s.rotary_base = rope_theta(f);
    const std::string act = f.string("hidden_act", "silu");
    check(act == "silu", "{}: \"hidden_act\" is \"{}\"; weft's SwiGLU gates with silu", where, act);
    f.require("attention_bias", false, false, "weft's Llama has no biases");
    f.require("mlp_bias", false, false, "weft's Llama has no biases");
    // transformers' own default is 1e-6.
    f.require_eps("rms_norm_eps", 1e-6, kRmsNormEps, "RMSNorm");
    if (f.has("head_dim"))
      check(f.positive("head_dim") * s.num_heads == s.hidden_size,
            "{}: \"head_dim\" is {}, but weft's heads are hidden_size / num_attention_heads "
            "({} / {}) wide",
            where, f.at("head_dim").dump(), s.hidden_size, s.num_heads);
  } else {
    throw Error("{}: \"model_type\" is {}; weft-hf reads gpt2 and llama", where,
                f.at("model_type").dump());
  }
  validate(s, where,
           {{"hidden_size", s.llama() ? "hidden_size" : "n_embd"},
            {"num_heads", s.llama() ? "num_attention_heads" : "n_head"},
            {"num_query_groups", "num_key_value_heads"},
            {"rotary_base", "rope_theta"}});
  return s;
}

NamedTensors to_hf(const ModelShape& shape, const TensorMap& weft, const std::string& where) {
  const std::vector<Link> ls = links(shape);
  std::set<std::string> known;
  for (const Link& l : ls) known.insert(l.weft);
  for (const auto& [name, t] : weft)
    check(known.count(name) == 1, "{}: tensor '{}' is not one of a {}", where, name,
          describe(shape));
  NamedTensors out;
  for (const Link& l : ls) {
    auto it = weft.find(l.weft);
    check(it != weft.end(), "{}: no tensor '{}' (shape {}), which a {} has", where, l.weft,
          l.shape.str(), describe(shape));
    const Tensor& t = it->second;
    check(t.dtype() == DType::F32, "{}: tensor '{}' has dtype {}, expected F32", where, l.weft,
          dtype_name(t.dtype()));
    check(t.shape() == l.shape, "{}: tensor '{}' has shape {}, but a {} has {}", where, l.weft,
          t.shape().str(), describe(shape), l.shape.str());
    for (const Link::Block& b : l.blocks)
      out.emplace_back(b.hf, l.transposed ? columns_transposed(t, b.begin, b.width) : t);
  }
  return out;
}

NamedTensors from_hf(const ModelShape& shape, const TensorMap& hf, const std::string& where) {
  const std::vector<Link> ls = links(shape);
  std::set<std::string> known;
  for (const Link& l : ls)
    for (const Link::Block& b : l.blocks) known.insert(b.hf);
  // transformers' names as the links spell them: GPT-2's files come with and
  // without "transformer." (GPT2LMHeadModel's and GPT2Model's).
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : hf) {
    if (ignored_hf_tensor(shape, name)) continue;
    const std::string key =
        shape.llama() || starts_with(name, "transformer.") ? name : "transformer." + name;
    check(known.count(key) == 1, "{}: tensor '{}' is not one of a {}", where, name,
          describe(shape));
    check(by_name.emplace(key, &t).second,
          "{}: tensor '{}' is there twice, with and without \"transformer.\"", where, key);
  }
  auto get = [&](const Link& l, const Link::Block& b) -> const Tensor& {
    auto it = by_name.find(b.hf);
    check(it != by_name.end(), "{}: no tensor '{}' (shape {}), which a {} has", where, b.hf,
          l.hf_shape(b).str(), describe(shape));
    const Tensor& t = *it->second;
    check(t.dtype() == DType::F32, "{}: tensor '{}' has dtype {}, expected F32", where, b.hf,
          dtype_name(t.dtype()));
    check(t.shape() == l.hf_shape(b), "{}: tensor '{}' has shape {}, but a {} has {}", where, b.hf,
          t.shape().str(), describe(shape), l.hf_shape(b).str());
    return t;
  };
  NamedTensors out;
  for (const Link& l : ls) {
    if (!l.transposed) {
      out.emplace_back(l.weft, get(l, l.blocks.front()));
      continue;
    }
    Tensor w = Tensor::empty(l.shape);
    for (const Link::Block& b : l.blocks) set_columns_transposed(w, b.begin, get(l, b));
    out.emplace_back(l.weft, w);
  }
  return out;
}

ExportResult export_checkpoint(const std::string& load, const std::string& dir,
                               bool allow_unverified) {
  Checkpoint ck = open_checkpoint(load, allow_unverified);
  ExportResult r;
  r.source = ck.source;
  r.shape = shape_from_meta(ck.meta.config, (fs::path(ck.source.path) / "meta.json").string());
  TensorMap weft;
  for (const auto& [name, shape] : ck.tensors(Checkpoint::Part::Model))
    weft.emplace(name, ck.read_whole(Checkpoint::Part::Model, name));
  const NamedTensors hf = to_hf(r.shape, weft, ck.source.path);
  std::error_code ec;
  fs::create_directories(dir, ec);
  check(!ec && fs::is_directory(dir), "--output {}: cannot make the folder: {}", dir,
        ec ? ec.message() : "a file of that name is there");
  // transformers refuses a safetensors file whose format is not one of its frameworks'.
  safetensors::save((fs::path(dir) / "model.safetensors").string(), hf, {{"format", "pt"}});
  write_text(fs::path(dir) / "config.json", hf_config(r.shape).dump(2) + "\n");
  r.tensors = static_cast<int64_t>(hf.size());
  return r;
}

ImportResult import_folder(const std::string& dir, const std::string& output) {
  const fs::path d(dir);
  check(fs::is_directory(d), "--input {}: no such folder", dir);
  const fs::path config_path = d / "config.json";
  const nlohmann::json config = read_json(config_path);
  ImportResult r;
  r.shape = shape_from_hf_config(config, config_path.string());
  HfTensors files = read_hf_tensors(d);
  if (r.shape.llama() &&
      Fields(config, config_path.string()).boolean("tie_word_embeddings", false)) {
    // weft's Llama head is a parameter of its own: it starts as the embedding
    // and trains apart from it.
    auto embed = files.tensors.find("model.embed_tokens.weight");
    if (embed != files.tensors.end()) files.tensors["lm_head.weight"] = embed->second;
    r.notes.push_back(
        "tie_word_embeddings: weft's lm_head.weight is a copy of model.embed_tokens.weight, "
        "trained apart from it");
  }
  const NamedTensors weft = from_hf(r.shape, files.tensors, files.where);
  for (const auto& [name, t] : weft) r.parameters += t.numel();
  r.tensors = static_cast<int64_t>(weft.size());
  safetensors::save(output, weft, {{"train_gpt_flags", r.shape.train_gpt_flags()}});
  return r;
}

}  // namespace weft::hf
