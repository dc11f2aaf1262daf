#include <weft/checkpoint.h>
#include <weft/safetensors.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

namespace fs = std::filesystem;

namespace weft {

namespace {

bool ignored_hf_tensor(const std::string& name) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias") || name == "lm_head.weight";
}

std::string strip_prefix(const std::string& name) {
  const std::string prefix = "transformer.";
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

// Copies the tensors of `file` named in `wanted` (name -> destination).
void load_named(const safetensors::File& file, const std::map<std::string, Tensor>& wanted,
                bool hf_names, const char* what) {
  std::set<std::string> found;
  for (const auto& info : file.tensors()) {
    std::string name = hf_names ? strip_prefix(info.name) : info.name;
    if (hf_names && ignored_hf_tensor(name)) continue;
    auto it = wanted.find(name);
    check(it != wanted.end(), "{}: {} has tensor '{}', which the model does not have",
          file.path(), what, info.name);
    check(info.dtype == DType::F32, "{}: tensor '{}' has dtype {}, expected F32", file.path(),
          info.name, dtype_name(info.dtype));
    check(info.shape == it->second.shape(),
          "{}: tensor '{}' has shape {} but the model expects {}", file.path(), info.name,
          info.shape.str(), it->second.shape().str());
    check(found.insert(name).second, "{}: tensor '{}' appears twice (with and without prefix)",
          file.path(), name);
    Tensor dst = it->second;
    dst.copy_from(file.get(info.name));
  }
  for (const auto& [name, t] : wanted)
    check(found.count(name) == 1, "{}: {} lacks tensor '{}' (shape {})", file.path(), what, name,
          t.shape().str());
}

void write_text_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    f.flush();
    check(f.good(), "cannot write {}", tmp);
  }
  fs::rename(tmp, path);
}

std::string iter_name(int64_t step) { return fmt::format("iter_{:07d}", step); }

}  // namespace

void load_weights(const std::string& path, const std::vector<Param*>& params) {
  auto file = safetensors::File::open(path);
  std::map<std::string, Tensor> wanted;
  for (Param* p : params) wanted.emplace(p->name, p->value);
  load_named(file, wanted, /*hf_names=*/true, "weights file");
}

void save_weights(const std::string& path, const std::vector<Param*>& params,
                  const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Tensor>> t;
  for (Param* p : params) t.emplace_back(p->name, p->value);
  safetensors::save(path, t, metadata);
}

void save_checkpoint(const std::string& dir, const std::vector<Param*>& params, AdamW& optimizer,
                     const CheckpointMeta& meta) {
  fs::create_directories(dir);
  const fs::path final_dir = fs::path(dir) / iter_name(meta.step);
  const fs::path tmp_dir = fs::path(dir) / (iter_name(meta.step) + ".tmp");
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  save_weights((tmp_dir / "model.safetensors").string(), params, {{"format", "weft"}});
  safetensors::save((tmp_dir / "optimizer.safetensors").string(), optimizer.state(),
                    {{"optimizer", "adamw"}, {"steps", std::to_string(optimizer.steps())}});
  nlohmann::json j = {{"step", meta.step},
                      {"consumed_samples", meta.consumed_samples},
                      {"optimizer_steps", optimizer.steps()},
                      {"config", meta.config},
                      {"format_version", 1}};
  write_text_atomic((tmp_dir / "meta.json").string(), j.dump(2) + "\n");
  fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);
  write_text_atomic((fs::path(dir) / "latest_checkpointed_iteration.txt").string(),
                    std::to_string(meta.step) + "\n");
}

CheckpointMeta load_checkpoint(const std::string& dir, const std::vector<Param*>& params,
                               AdamW& optimizer) {
  const fs::path latest = fs::path(dir) / "latest_checkpointed_iteration.txt";
  std::ifstream lf(latest);
  check(lf.good(), "--load {}: no checkpoint there ({} is missing)", dir, latest.string());
  int64_t step = -1;
  lf >> step;
  check(step >= 0, "--load {}: {} does not hold a step number", dir, latest.string());
  const fs::path d = fs::path(dir) / iter_name(step);
  std::ifstream mf(d / "meta.json");
  check(mf.good(), "--load {}: {} is missing", dir, (d / "meta.json").string());
  nlohmann::json j;
  try {
    mf >> j;
  } catch (const nlohmann::json::exception& e) {
    throw Error("--load {}: meta.json is not valid JSON: {}", dir, e.what());
  }
  auto model = safetensors::File::open((d / "model.safetensors").string());
  std::map<std::string, Tensor> wanted;
  for (Param* p : params) wanted.emplace(p->name, p->value);
  load_named(model, wanted, /*hf_names=*/false, "checkpoint");
  auto opt = safetensors::File::open((d / "optimizer.safetensors").string());
  std::map<std::string, Tensor> state;
  for (auto& [name, t] : optimizer.state()) state.emplace(name, t);
  load_named(opt, state, /*hf_names=*/false, "optimizer state");
  CheckpointMeta meta;
  meta.step = j.at("step").get<int64_t>();
  meta.consumed_samples = j.at("consumed_samples").get<int64_t>();
  meta.config = j.at("config");
  optimizer.set_steps(j.at("optimizer_steps").get<int64_t>());
  return meta;
}

}  // namespace weft
