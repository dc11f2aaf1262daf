#include <weft/checkpoint.h>
#include <weft/safetensors.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
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

// Where a named tensor of a file goes: all of it, or this rank's piece.
struct Dest {
  Tensor t;
  Shard shard;  // t holds piece shard of a tensor of shape shard.full when split
  const Shape& full() const { return shard.split() ? shard.full : t.shape(); }
};

// Copies the tensors of `file` named in `wanted` (name -> destination).
void load_named(const safetensors::File& file, const std::map<std::string, Dest>& wanted,
                bool hf_names, const char* what) {
  std::set<std::string> found;
  for (const auto& info : file.tensors()) {
    std::string name = hf_names ? strip_prefix(info.name) : info.name;
    // HF GPT-2 buffers and its tied lm_head copy, unless the model has such a
    // parameter (an untied head, as Llama's).
    if (hf_names && ignored_hf_tensor(name) && !wanted.count(name)) continue;
    auto it = wanted.find(name);
    check(it != wanted.end(), "{}: {} has tensor '{}', which the model does not have",
          file.path(), what, info.name);
    check(info.dtype == DType::F32, "{}: tensor '{}' has dtype {}, expected F32", file.path(),
          info.name, dtype_name(info.dtype));
    const Dest& d = it->second;
    check(info.shape == d.full(), "{}: tensor '{}' has shape {} but the model expects {}",
          file.path(), info.name, info.shape.str(), d.full().str());
    check(found.insert(name).second, "{}: tensor '{}' appears twice (with and without prefix)",
          file.path(), name);
    if (d.shard.split())
      slice_shard(file.get(info.name), d.shard, d.t);
    else
      d.t.copy_from(file.get(info.name));
  }
  for (const auto& [name, d] : wanted)
    check(found.count(name) == 1, "{}: {} lacks tensor '{}' (shape {})", file.path(), what, name,
          d.full().str());
}

std::map<std::string, Dest> param_dests(const std::vector<Param*>& params) {
  std::map<std::string, Dest> wanted;
  for (Param* p : params) wanted.emplace(p->name, Dest{p->value, p->shard});
  return wanted;
}

// Makes a written file, or a directory's entries (renames in it), durable.
void sync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  check(fd >= 0, "cannot open {} to flush it to disk", p.string());
  const int rc = ::fsync(fd);
  ::close(fd);
  check(rc == 0, "cannot flush {} to disk", p.string());
}

void write_text_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    f.flush();
    check(f.good(), "cannot write {}", tmp);
  }
  sync_path(tmp);
  fs::rename(tmp, path);
  sync_path(fs::path(path).parent_path());
}

// The complete checkpoints in `dir`: step -> directory.
std::map<int64_t, fs::path> complete_checkpoints(const std::string& dir) {
  static const std::regex name("iter_([0-9]{7,})");
  std::map<int64_t, fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string n = e.path().filename().string();
    if (e.is_directory() && std::regex_match(n, m, name) && fs::exists(e.path() / "meta.json"))
      out[std::stoll(m[1].str())] = e.path();
  }
  return out;
}

std::string iter_name(int64_t step) { return fmt::format("iter_{:07d}", step); }

}  // namespace

void load_weights(const std::string& path, const std::vector<Param*>& params) {
  auto file = safetensors::File::open(path);
  load_named(file, param_dests(params), /*hf_names=*/true, "weights file");
}

void save_weights(const std::string& path, const std::vector<Param*>& params,
                  const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Tensor>> t;
  for (Param* p : params) t.emplace_back(p->name, p->value);
  safetensors::save(path, t, metadata);
}

void save_checkpoint(const std::string& dir, const NamedTensors& model,
                     const NamedTensors& optimizer, int64_t optimizer_steps,
                     const CheckpointMeta& meta) {
  fs::create_directories(dir);
  const fs::path final_dir = fs::path(dir) / iter_name(meta.step);
  const fs::path tmp_dir = fs::path(dir) / (iter_name(meta.step) + ".tmp");
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  safetensors::save((tmp_dir / "model.safetensors").string(), model, {{"format", "weft"}});
  safetensors::save((tmp_dir / "optimizer.safetensors").string(), optimizer,
                    {{"optimizer", "adamw"}, {"steps", std::to_string(optimizer_steps)}});
  nlohmann::json j = {{"step", meta.step},
                      {"consumed_samples", meta.consumed_samples},
                      {"optimizer_steps", optimizer_steps},
                      {"config", meta.config},
                      {"format_version", 1}};
  if (!meta.trainer.is_null()) j["trainer"] = meta.trainer;
  write_text_atomic((tmp_dir / "meta.json").string(), j.dump(2) + "\n");
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) sync_path(tmp_dir / f);
  sync_path(tmp_dir);
  // A complete checkpoint of this step (saved again) is set aside, not
  // deleted, until its replacement is in place.
  const fs::path old_dir = fs::path(dir) / (iter_name(meta.step) + ".old");
  fs::remove_all(old_dir);
  if (fs::exists(final_dir)) fs::rename(final_dir, old_dir);
  fs::rename(tmp_dir, final_dir);
  sync_path(dir);
  fs::remove_all(old_dir);
  write_text_atomic((fs::path(dir) / "latest_checkpointed_iteration.txt").string(),
                    std::to_string(meta.step) + "\n");
}

Checkpoint open_checkpoint(const std::string& dir) {
  // A checkpoint directory (the newest step its pointer names), or one
  // iter_N directory itself.
  fs::path d;
  int64_t step = -1;
  if (fs::exists(fs::path(dir) / "meta.json")) {
    d = dir;
  } else {
    const fs::path latest = fs::path(dir) / "latest_checkpointed_iteration.txt";
    std::ifstream lf(latest);
    check(lf.good(), "--load {}: no checkpoint there ({} is missing)", dir, latest.string());
    lf >> step;
    check(step >= 0, "--load {}: {} does not hold a step number", dir, latest.string());
    d = fs::path(dir) / iter_name(step);
    // Interrupted while replacing this step's checkpoint: the complete old one.
    if (!fs::exists(d / "meta.json") && fs::exists(fs::path(dir) / (iter_name(step) + ".old")))
      d = fs::path(dir) / (iter_name(step) + ".old");
  }
  const std::string meta_path = (d / "meta.json").string();
  std::ifstream mf(meta_path);
  check(mf.good(), "--load {}: {} is missing", dir, meta_path);
  nlohmann::json j;
  try {
    mf >> j;
  } catch (const nlohmann::json::exception& e) {
    throw Error("--load {}: {} is not valid JSON: {}", dir, meta_path, e.what());
  }
  Checkpoint c;
  auto field = [&](const char* key) {
    check(j.contains(key) && j.at(key).is_number_integer() && j.at(key).get<int64_t>() >= 0,
          "--load {}: {}: '{}' must be a non-negative integer, got {}", dir, meta_path, key,
          j.contains(key) ? j.at(key).dump() : "nothing");
    return j.at(key).get<int64_t>();
  };
  c.meta.step = field("step");
  c.meta.consumed_samples = field("consumed_samples");
  c.optimizer_steps = field("optimizer_steps");
  check(!j.contains("config") || j.at("config").is_object() || j.at("config").is_null(),
        "--load {}: {}: 'config' must be an object, got {}", dir, meta_path,
        j.contains("config") ? j.at("config").dump() : "");
  if (j.contains("config")) c.meta.config = j.at("config");
  if (j.contains("trainer")) c.meta.trainer = j.at("trainer");
  check(step < 0 || c.meta.step == step,
        "--load {}: {} says step {}, but the checkpoint pointer and directory say {}", dir,
        meta_path, c.meta.step, step);
  const std::string name = d.filename().string();
  check(name.rfind("iter_", 0) != 0 || name.rfind(iter_name(c.meta.step), 0) == 0,
        "--load {}: {} says step {}, but its directory is {}", dir, meta_path, c.meta.step, name);
  c.model = safetensors::File::open((d / "model.safetensors").string());
  c.optimizer = safetensors::File::open((d / "optimizer.safetensors").string());
  return c;
}

void Checkpoint::read_model(const std::vector<Param*>& params) const {
  load_named(model, param_dests(params), /*hf_names=*/false, "checkpoint");
}

NamedTensors Checkpoint::read_optimizer(const std::vector<Param*>& params) const {
  NamedTensors out;
  std::map<std::string, Dest> wanted;
  for (Param* p : params)
    for (const char* suffix : {".exp_avg", ".exp_avg_sq"}) {
      Tensor t = Tensor::zeros(p->value.shape());
      out.emplace_back(p->name + suffix, t);
      wanted.emplace(p->name + suffix, Dest{t, p->shard});
    }
  // Every moment in the file must belong to the model; these params may be a
  // subset of it (one pipeline stage), so only their entries are required.
  std::set<std::string> extra;
  for (const auto& info : optimizer.tensors())
    if (!wanted.count(info.name)) extra.insert(info.name);
  std::map<std::string, Dest> all = wanted;
  for (const auto& name : extra) {
    const auto* info = optimizer.find(name);
    all.emplace(name, Dest{Tensor::zeros(info->shape), Shard{}});
  }
  load_named(optimizer, all, /*hf_names=*/false, "optimizer state");
  return out;
}

int64_t newest_checkpoint_step(const std::string& dir) {
  std::ifstream lf(fs::path(dir) / "latest_checkpointed_iteration.txt");
  int64_t step = -1;
  if (lf.good()) lf >> step;
  return lf.fail() ? -1 : step;
}

void prune_checkpoints(const std::string& dir, int64_t keep) {
  if (keep <= 0) return;
  const auto all = complete_checkpoints(dir);
  int64_t extra = static_cast<int64_t>(all.size()) - keep;
  for (const auto& [step, path] : all) {  // oldest first
    if (extra-- <= 0) break;
    fs::remove_all(path);
  }
}

std::vector<std::string> clean_stale_checkpoint_files(const std::string& dir) {
  std::vector<std::string> removed;
  if (!fs::is_directory(dir)) return removed;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    const bool tmp = n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0;
    const bool old = n.size() > 4 && n.compare(n.size() - 4, 4, ".old") == 0 &&
                     fs::exists(fs::path(dir) / n.substr(0, n.size() - 4) / "meta.json");
    if (n.rfind("iter_", 0) == 0 && (tmp || old)) {
      fs::remove_all(e.path());
      removed.push_back(e.path().string());
    }
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

}  // namespace weft
