#include <weft/checkpoint.h>
#include <weft/safetensors.h>

#include <fmt/ranges.h>
#include <xxhash.h>

#include <fcntl.h>
#include <sys/file.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <thread>

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

// Where a named tensor of a file goes: all of it, or this rank's piece. A
// padded vocabulary table (true_rows > 0) is stored without its padding rows,
// which load as zeros.
struct Dest {
  Tensor t;
  Shard shard;  // t holds piece shard of a tensor of shape shard.full when split
  int64_t true_rows = 0;
  const Shape& full() const { return shard.split() ? shard.full : t.shape(); }
  Shape stored() const {
    Shape s = full();
    if (true_rows > 0) s[0] = true_rows;
    return s;
  }
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
    check(info.shape == d.stored(), "{}: tensor '{}' has shape {} but the model expects {}{}",
          file.path(), info.name, info.shape.str(), d.stored().str(),
          d.true_rows > 0 ? fmt::format(" (padded to {} in memory)", d.full().str()) : "");
    check(found.insert(name).second, "{}: tensor '{}' appears twice (with and without prefix)",
          file.path(), name);
    Tensor src = file.get(info.name);
    if (d.true_rows > 0) {  // the padding rows are zero
      Tensor padded = Tensor::zeros(d.full());
      padded.slice0(0, d.true_rows).copy_from(src);
      src = padded;
    }
    if (d.shard.split())
      slice_shard(src, d.shard, d.t);
    else
      d.t.copy_from(src);
  }
  for (const auto& [name, d] : wanted)
    check(found.count(name) == 1, "{}: {} lacks tensor '{}' (shape {})", file.path(), what, name,
          d.stored().str());
}

std::map<std::string, Dest> param_dests(const std::vector<Param*>& params) {
  std::map<std::string, Dest> wanted;
  for (Param* p : params) wanted.emplace(p->name, Dest{p->value, p->shard, p->true_rows});
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

// Writes `text` to path.tmp, flushes it, runs `before_rename` (a fault
// injection point), then renames it over `path`.
void write_text_atomic(const std::string& path, const std::string& text,
                       const std::function<void()>& before_rename = {}) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    f.flush();
    check(f.good(), "cannot write {}", tmp);
  }
  sync_path(tmp);
  if (before_rename) before_rename();
  fs::rename(tmp, path);
  sync_path(fs::path(path).parent_path());
}

std::string iter_name(int64_t step) { return fmt::format("iter_{:07d}", step); }

// A checkpoint folder's name: "iter_0000020", or "iter_0000020.old" (set aside
// while step 20 is saved again). Returns the step, or -1 for another name.
int64_t folder_step(const fs::path& folder, bool* old = nullptr) {
  static const std::regex name("iter_([0-9]{7,})(\\.old)?");
  std::smatch m;
  const std::string n = folder.filename().string();
  if (!std::regex_match(n, m, name)) return -1;
  if (old != nullptr) *old = m[2].matched;
  return std::stoll(m[1].str());
}

// The complete checkpoints in `dir`: step -> directory.
std::map<int64_t, fs::path> complete_checkpoints(const std::string& dir) {
  std::map<int64_t, fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    bool old = false;
    const int64_t step = folder_step(e.path(), &old);
    if (e.is_directory() && step >= 0 && !old && fs::exists(e.path() / "meta.json"))
      out[step] = e.path();
  }
  return out;
}

// --- checksums (xxHash's XXH3, 64 bits), written as 16 hex digits ---

constexpr const char* kManifest = "manifest.json";
constexpr const char* kManifestFormat = "weft checkpoint manifest";
constexpr int kManifestVersion = 1;
constexpr const char* kChecksum = "xxh3_64";

std::string hex(uint64_t h) { return fmt::format("{:016x}", h); }

uint64_t checksum(const Tensor& t) { return XXH3_64bits(t.raw(), t.nbytes()); }

struct FileSum {
  uint64_t size = 0;
  uint64_t xxh3 = 0;
};

// A file's size and checksum, read in pieces of 1 MiB.
FileSum file_sum(const fs::path& path) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                  &XXH3_freeState);
  check(state != nullptr && XXH3_64bits_reset(state.get()) == XXH_OK,
        "{}: cannot start a checksum", path.string());
  std::ifstream f(path, std::ios::binary);
  check(f.good(), "{} cannot be read", path.string());
  std::vector<char> piece(size_t{1} << 20);
  FileSum sum;
  while (f) {
    f.read(piece.data(), static_cast<std::streamsize>(piece.size()));
    const auto n = static_cast<size_t>(f.gcount());
    XXH3_64bits_update(state.get(), piece.data(), n);
    sum.size += n;
  }
  check(f.eof(), "{}: read failed after {} bytes", path.string(), sum.size);
  sum.xxh3 = XXH3_64bits_digest(state.get());
  return sum;
}

// --- the manifest ---

struct ManifestTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t xxh3 = 0;
};

struct ManifestFile {
  std::string name;
  uint64_t size = 0, xxh3 = 0;
  std::vector<ManifestTensor> tensors;  // safetensors files only
};

std::string shape_str(const std::vector<int64_t>& dims) {
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

std::vector<int64_t> dims_of(const Shape& s) {
  return std::vector<int64_t>(s.dims.begin(), s.dims.begin() + s.rank);
}

nlohmann::ordered_json file_entry(const fs::path& folder, const char* name,
                                  const NamedTensors* tensors) {
  const FileSum sum = file_sum(folder / name);
  nlohmann::ordered_json e = {{"name", name}, {"size", sum.size}, {kChecksum, hex(sum.xxh3)}};
  if (tensors != nullptr) {
    e["tensors"] = nlohmann::ordered_json::array();
    for (const auto& [tname, t] : *tensors)
      e["tensors"].push_back({{"name", tname},
                              {"dtype", dtype_name(t.dtype())},
                              {"shape", dims_of(t.shape())},
                              {kChecksum, hex(checksum(t))}});
  }
  return e;
}

// The manifest's text: one line per file and per tensor, so that it reads
// (and diffs) line by line.
std::string manifest_text(int64_t step, const std::vector<nlohmann::ordered_json>& files) {
  std::string text = fmt::format(
      "{{\"format\": \"{}\", \"version\": {}, \"checksum\": \"{}\", \"step\": {},\n "
      "\"files\": [\n",
      kManifestFormat, kManifestVersion, kChecksum, step);
  for (size_t f = 0; f < files.size(); ++f) {
    nlohmann::ordered_json head = files[f];
    head.erase("tensors");
    text += "  " + head.dump();
    if (files[f].contains("tensors")) {
      text.pop_back();  // the closing brace: the tensors follow
      text += ", \"tensors\": [\n";
      const auto& tensors = files[f].at("tensors");
      for (size_t i = 0; i < tensors.size(); ++i)
        text += "    " + tensors[i].dump() + (i + 1 < tensors.size() ? ",\n" : "\n");
      text += "  ]}";
    }
    text += f + 1 < files.size() ? ",\n" : "\n";
  }
  return text + "]}\n";
}

// Reads and checks the manifest's own form; throws Error naming it and the
// rule it breaks.
std::vector<ManifestFile> read_manifest(const fs::path& path) {
  const std::string p = path.string();
  std::ifstream f(path);
  check(f.good(), "{} cannot be read", p);
  nlohmann::json j;
  try {
    f >> j;
  } catch (const nlohmann::json::exception& e) {
    throw Error("{} is not valid JSON: {}", p, e.what());
  }
  auto parse_hex = [&](const nlohmann::json& v, const std::string& what) {
    const std::string text = v.get<std::string>();
    uint64_t h = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), h, 16);
    check(text.size() == 16 && ec == std::errc() && end == text.data() + text.size(),
          "{}: the checksum of {} must be 16 hex digits, got '{}'", p, what, text);
    return h;
  };
  std::vector<ManifestFile> files;
  try {
    check(j.is_object() && j.value("format", "") == kManifestFormat,
          "{}: not a {} (its 'format' must be '{}')", p, kManifestFormat, kManifestFormat);
    check(j.at("version").get<int>() == kManifestVersion,
          "{}: version {} is not one this weft reads ({})", p, j.at("version").dump(),
          kManifestVersion);
    check(j.at("checksum").get<std::string>() == kChecksum, "{}: checksum '{}' is not {}", p,
          j.at("checksum").get<std::string>(), kChecksum);
    for (const auto& e : j.at("files")) {
      ManifestFile mf;
      mf.name = e.at("name").get<std::string>();
      // Plain names only: a manifest cannot point outside its folder.
      check(!mf.name.empty() && mf.name.find('/') == std::string::npos && mf.name != "." &&
                mf.name != ".." && mf.name != kManifest,
            "{}: '{}' is not the name of a file of the checkpoint", p, mf.name);
      mf.size = e.at("size").get<uint64_t>();
      mf.xxh3 = parse_hex(e.at(kChecksum), mf.name);
      if (e.contains("tensors")) {
        for (const auto& t : e.at("tensors")) {
          ManifestTensor mt;
          mt.name = t.at("name").get<std::string>();
          mt.dtype = t.at("dtype").get<std::string>();
          mt.shape = t.at("shape").get<std::vector<int64_t>>();
          mt.xxh3 = parse_hex(t.at(kChecksum), fmt::format("tensor '{}'", mt.name));
          mf.tensors.push_back(std::move(mt));
        }
      }
      files.push_back(std::move(mf));
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error("{}: malformed manifest: {}", p, e.what());
  }
  for (const char* need : {"model.safetensors", "optimizer.safetensors", "meta.json"})
    check(std::any_of(files.begin(), files.end(), [&](const ManifestFile& mf) { return mf.name == need; }),
          "{} does not list {}", p, need);
  return files;
}

const ManifestFile& manifest_file(const std::vector<ManifestFile>& files, const std::string& name) {
  return *std::find_if(files.begin(), files.end(),
                       [&](const ManifestFile& mf) { return mf.name == name; });
}

// Every tensor of `file` against the manifest's list: the same names, each
// with its dtype, shape and checksum.
void verify_tensors(const safetensors::File& file, const ManifestFile& listed) {
  std::set<std::string> in_manifest;
  for (const ManifestTensor& mt : listed.tensors) {
    in_manifest.insert(mt.name);
    const safetensors::TensorInfo* info = file.find(mt.name);
    check(info != nullptr, "{}: tensor '{}' is missing (the manifest lists it)", file.path(),
          mt.name);
    check(dtype_name(info->dtype) == mt.dtype,
          "{}: tensor '{}' has dtype {}, the manifest says {}", file.path(), mt.name,
          dtype_name(info->dtype), mt.dtype);
    check(dims_of(info->shape) == mt.shape, "{}: tensor '{}' has shape {}, the manifest says {}",
          file.path(), mt.name, info->shape.str(), shape_str(mt.shape));
    const uint64_t computed = checksum(file.get(mt.name));
    check(computed == mt.xxh3, "{}: tensor '{}' checksum mismatch (stored {}, computed {})",
          file.path(), mt.name, hex(mt.xxh3), hex(computed));
  }
  for (const auto& info : file.tensors())
    check(in_manifest.count(info.name) == 1, "{}: tensor '{}' is not in the manifest",
          file.path(), info.name);
}

void verify_file_sum(const fs::path& path, const ManifestFile& listed, const char* what) {
  const FileSum sum = file_sum(path);
  check(sum.size == listed.size, "{}: {} bytes, the manifest says {}", path.string(), sum.size,
        listed.size);
  check(sum.xxh3 == listed.xxh3, "{}: checksum mismatch{} (stored {}, computed {})",
        path.string(), what, hex(listed.xxh3), hex(sum.xxh3));
}

// --- fault injection (weft/checkpoint.h) ---

constexpr const char* kFaultPhases[] = {"writing-tensors", "before-fsync", "between-renames",
                                        "pointer-update"};

struct FaultInjection {
  std::string phase;    // one of kFaultPhases, or empty
  int64_t step = -1;    // only the save of this step; -1: any
  int64_t slow_ms = 0;  // slow-save:MS

  static FaultInjection from_env() {
    FaultInjection f;
    const char* env = std::getenv("WEFT_FAULT_INJECT");
    if (env == nullptr || *env == '\0') return f;
    const std::string v = env;
    auto number = [](const std::string& text, int64_t& out) {
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
      return !text.empty() && ec == std::errc() && end == text.data() + text.size() && out >= 0;
    };
    const std::string slow = "slow-save:";
    if (v.rfind(slow, 0) == 0) {
      check(number(v.substr(slow.size()), f.slow_ms),
            "WEFT_FAULT_INJECT '{}': slow-save needs milliseconds >= 0 (slow-save:2000)", v);
      return f;
    }
    const size_t at = v.find('@');
    f.phase = v.substr(0, at);
    const bool known = std::find(std::begin(kFaultPhases), std::end(kFaultPhases), f.phase) !=
                       std::end(kFaultPhases);
    check(known && (at == std::string::npos || number(v.substr(at + 1), f.step)),
          "WEFT_FAULT_INJECT '{}' must be one of {} (each optionally @STEP: only the save of "
          "that step), or slow-save:MILLISECONDS",
          v, fmt::join(kFaultPhases, ", "));
    return f;
  }

  // Ends the process as kill -9 would, at `here` of the save of `save_step`.
  void at(const char* here, int64_t save_step) const {
    if (phase != here || (step >= 0 && step != save_step)) return;
    fmt::print(stderr, "WEFT_FAULT_INJECT: SIGKILL at {} of the save of step {}\n", here,
               save_step);
    std::fflush(stderr);
    ::kill(::getpid(), SIGKILL);
  }
};

// --- loading ---

// Reads one checkpoint folder and verifies it against its manifest; throws
// Error naming the file (and the tensor) that fails.
Checkpoint open_folder(const fs::path& d, bool allow_unverified) {
  Checkpoint c;
  c.source.path = d.string();
  const fs::path model_path = d / "model.safetensors", optimizer_path = d / "optimizer.safetensors";
  const fs::path meta_file = d / "meta.json";
  const std::string meta_path = meta_file.string();
  std::optional<std::vector<ManifestFile>> manifest;
  if (fs::exists(d / kManifest)) {
    manifest = read_manifest(d / kManifest);
    // Sizes first, so a truncated file is named as such, not as malformed.
    for (const ManifestFile& mf : *manifest) {
      const fs::path p = d / mf.name;
      check(fs::is_regular_file(p), "{} is missing (the manifest lists it)", p.string());
      const uint64_t size = fs::file_size(p);
      check(size == mf.size, "{}: {} bytes, the manifest says {}", p.string(), size, mf.size);
    }
    verify_file_sum(meta_file, manifest_file(*manifest, "meta.json"), "");
  } else {
    check(allow_unverified,
          "{} is missing, so nothing in the folder can be verified (saved before checkpoints had "
          "a manifest, or copied without it); to load it anyway, name it alone: --load {} "
          "--load-unverified",
          (d / kManifest).string(), d.string());
  }
  std::ifstream mf(meta_file);
  check(mf.good(), "{} is missing", meta_path);
  nlohmann::json j;
  try {
    mf >> j;
  } catch (const nlohmann::json::exception& e) {
    throw Error("{} is not valid JSON: {}", meta_path, e.what());
  }
  auto field = [&](const char* key) {
    check(j.is_object() && j.contains(key) && j.at(key).is_number_integer() &&
              j.at(key).get<int64_t>() >= 0,
          "{}: '{}' must be a non-negative integer, got {}", meta_path, key,
          j.is_object() && j.contains(key) ? j.at(key).dump() : "nothing");
    return j.at(key).get<int64_t>();
  };
  c.meta.step = field("step");
  c.meta.consumed_samples = field("consumed_samples");
  c.optimizer_steps = field("optimizer_steps");
  check(!j.contains("config") || j.at("config").is_object() || j.at("config").is_null(),
        "{}: 'config' must be an object, got {}", meta_path,
        j.contains("config") ? j.at("config").dump() : "");
  if (j.contains("config")) c.meta.config = j.at("config");
  if (j.contains("trainer")) c.meta.trainer = j.at("trainer");
  const int64_t named = folder_step(d);
  check(named < 0 || named == c.meta.step, "{} says step {}, but its folder is {}", meta_path,
        c.meta.step, d.filename().string());
  c.model = safetensors::File::open(model_path.string());
  c.optimizer = safetensors::File::open(optimizer_path.string());
  if (manifest) {
    verify_tensors(c.model, manifest_file(*manifest, "model.safetensors"));
    verify_tensors(c.optimizer, manifest_file(*manifest, "optimizer.safetensors"));
    // What the tensors do not cover: headers and metadata, and any other file.
    for (const ManifestFile& f : *manifest)
      if (f.name != "meta.json")
        verify_file_sum(d / f.name, f, f.tensors.empty() ? "" : " outside the tensors");
  }
  c.source.step = c.meta.step;
  c.source.verified = manifest.has_value();
  return c;
}

// The checkpoint folders of `dir`, newest first; for one step, iter_N before
// the iter_N.old that an interrupted replacement of it left.
std::vector<fs::path> checkpoint_folders(const fs::path& dir) {
  std::vector<std::tuple<int64_t, bool, fs::path>> found;
  for (const auto& e : fs::directory_iterator(dir)) {
    bool old = false;
    const int64_t step = folder_step(e.path(), &old);
    if (step >= 0 && e.is_directory()) found.emplace_back(step, old, e.path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) > std::get<0>(b)
                                            : std::get<1>(a) < std::get<1>(b);
  });
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(std::get<2>(f));
  return out;
}

// The newest folder of `dir` that verifies, with the newer ones skipped in
// its source; nullopt (and every folder in `skipped`) when none does.
std::optional<Checkpoint> newest_verified(
    const fs::path& dir, std::vector<std::pair<std::string, std::string>>& skipped) {
  for (const fs::path& folder : checkpoint_folders(dir)) {
    try {
      Checkpoint c = open_folder(folder, /*allow_unverified=*/false);
      c.source.skipped = skipped;
      return c;
    } catch (const std::exception& e) {
      skipped.emplace_back(folder.string(), e.what());
    }
  }
  return std::nullopt;
}

// "ckpt/iter_0000020/" -> "ckpt/iter_0000020", so that its name is its filename.
fs::path without_trailing_slash(const std::string& dir) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  return d;
}

}  // namespace

void load_weights(const std::string& path, const std::vector<Param*>& params) {
  auto file = safetensors::File::open(path);
  load_named(file, param_dests(params), /*hf_names=*/true, "weights file");
}

void save_weights(const std::string& path, const std::vector<Param*>& params,
                  const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Tensor>> t;
  for (Param* p : params)
    t.emplace_back(p->name, p->shard.split() ? p->value : unpad_rows(*p, p->value));
  safetensors::save(path, t, metadata);
}

void check_fault_injection() { FaultInjection::from_env(); }

void save_checkpoint(const std::string& dir, const NamedTensors& model,
                     const NamedTensors& optimizer, int64_t optimizer_steps,
                     const CheckpointMeta& meta) {
  const FaultInjection fault = FaultInjection::from_env();
  const int64_t step = meta.step;
  fs::create_directories(dir);
  const fs::path final_dir = fs::path(dir) / iter_name(step);
  const fs::path tmp_dir = fs::path(dir) / (iter_name(step) + ".tmp");
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  if (fault.slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(fault.slow_ms));
  safetensors::save((tmp_dir / "model.safetensors").string(), model, {{"format", "weft"}},
                    [&](size_t i) {
                      if (i == 0) fault.at("writing-tensors", step);
                    });
  safetensors::save((tmp_dir / "optimizer.safetensors").string(), optimizer,
                    {{"optimizer", meta.config.is_object() && meta.config.contains("optimizer")
                                       ? meta.config["optimizer"].get<std::string>()
                                       : std::string("adamw")},
                     {"steps", std::to_string(optimizer_steps)}});
  nlohmann::json j = {{"step", step},
                      {"consumed_samples", meta.consumed_samples},
                      {"optimizer_steps", optimizer_steps},
                      {"config", meta.config},
                      {"format_version", 1}};
  if (!meta.trainer.is_null()) j["trainer"] = meta.trainer;
  write_text_atomic((tmp_dir / "meta.json").string(), j.dump(2) + "\n");
  // The manifest last: what a loader checks every other file against.
  const std::vector<nlohmann::ordered_json> files = {
      file_entry(tmp_dir, "model.safetensors", &model),
      file_entry(tmp_dir, "optimizer.safetensors", &optimizer),
      file_entry(tmp_dir, "meta.json", nullptr)};
  write_text_atomic((tmp_dir / kManifest).string(), manifest_text(step, files));
  fault.at("before-fsync", step);
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "meta.json", kManifest})
    sync_path(tmp_dir / f);
  sync_path(tmp_dir);
  // A complete checkpoint of this step (saved again) is set aside, not
  // deleted, until its replacement is in place.
  const fs::path old_dir = fs::path(dir) / (iter_name(step) + ".old");
  fs::remove_all(old_dir);
  if (fs::exists(final_dir)) fs::rename(final_dir, old_dir);
  fault.at("between-renames", step);
  fs::rename(tmp_dir, final_dir);
  sync_path(dir);
  fs::remove_all(old_dir);
  // This step is now the newest: folders of later steps (a run rewound to an
  // earlier checkpoint abandons them) would otherwise be what a resume reads.
  for (const std::string& folder : checkpoints_after(dir, step)) fs::remove_all(folder);
  write_text_atomic((fs::path(dir) / "latest_checkpointed_iteration.txt").string(),
                    std::to_string(step) + "\n", [&] { fault.at("pointer-update", step); });
}

Checkpoint open_checkpoint(const std::string& dir, bool allow_unverified) {
  const fs::path d = without_trailing_slash(dir);
  // One folder: named iter_N, or holding a checkpoint's files.
  if (folder_step(d) >= 0 || fs::exists(d / "meta.json") || fs::exists(d / kManifest)) {
    check(fs::is_directory(d), "--load {}: no such checkpoint folder", dir);
    try {
      return open_folder(d, allow_unverified);
    } catch (const std::exception& e) {
      throw Error("--load {}: {}", dir, e.what());
    }
  }
  check(fs::is_directory(d), "--load {}: no such directory", dir);
  std::vector<std::pair<std::string, std::string>> skipped;
  if (std::optional<Checkpoint> c = newest_verified(d, skipped)) return std::move(*c);
  check(!skipped.empty(), "--load {}: no checkpoint there (no iter_NNNNNNN folder)", dir);
  std::vector<std::string> why;
  for (const auto& [folder, reason] : skipped) why.push_back(reason);
  throw Error("--load {}: none of its {} checkpoint folders verifies: {}", dir, skipped.size(),
              fmt::join(why, "; "));
}

void Checkpoint::read_model(const std::vector<Param*>& params) const {
  load_named(model, param_dests(params), /*hf_names=*/false, "checkpoint");
}

NamedTensors Checkpoint::read_optimizer(const std::vector<Param*>& params,
                                        const std::vector<std::string>& suffixes) const {
  NamedTensors out;
  std::map<std::string, Dest> wanted;
  for (Param* p : params)
    for (const std::string& suffix : suffixes) {
      Tensor t = Tensor::zeros(p->value.shape());
      out.emplace_back(p->name + suffix, t);
      wanted.emplace(p->name + suffix, Dest{t, p->shard, p->true_rows});
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

CheckpointSource scan_checkpoints(const std::string& dir) {
  const fs::path d = without_trailing_slash(dir);
  if (!fs::is_directory(d)) return {};
  std::vector<std::pair<std::string, std::string>> skipped;
  if (std::optional<Checkpoint> c = newest_verified(d, skipped)) return c->source;
  CheckpointSource none;
  none.skipped = std::move(skipped);
  return none;
}

int64_t newest_checkpoint_step(const std::string& dir) { return scan_checkpoints(dir).step; }

std::vector<std::string> checkpoints_after(const std::string& dir, int64_t step) {
  std::vector<std::string> out;
  if (!fs::is_directory(dir)) return out;
  for (const fs::path& folder : checkpoint_folders(dir))
    if (folder_step(folder) > step) out.push_back(folder.string());
  return out;
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
  std::vector<std::string> done;
  if (!fs::is_directory(dir)) return done;
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(dir)) entries.push_back(e.path());
  std::sort(entries.begin(), entries.end());
  auto ends_with = [](const std::string& n, const std::string& tail) {
    return n.size() > tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (const fs::path& p : entries) {
    const std::string n = p.filename().string();
    const bool tmp = n.rfind("iter_", 0) == 0 && ends_with(n, ".tmp");
    if (tmp || n == "latest_checkpointed_iteration.txt.tmp") {
      fs::remove_all(p);
      done.push_back(fmt::format("removed {}, left by an interrupted save", p.string()));
    } else if (n.rfind("iter_", 0) == 0 && ends_with(n, ".old")) {
      const fs::path replacement = fs::path(dir) / n.substr(0, n.size() - 4);
      if (fs::exists(replacement / "meta.json")) {
        fs::remove_all(p);
        done.push_back(fmt::format("removed {}, left by an interrupted save", p.string()));
      } else if (!fs::exists(replacement)) {
        fs::rename(p, replacement);
        sync_path(dir);
        done.push_back(fmt::format("restored {} from {}, which an interrupted save had set aside",
                                   replacement.string(), p.string()));
      }
    }
  }
  // The pointer names the newest complete checkpoint, which a save killed
  // after its rename (or a rewound run) may have left it behind.
  const auto complete = complete_checkpoints(dir);
  if (!complete.empty()) {
    const int64_t newest = complete.rbegin()->first;
    const fs::path pointer = fs::path(dir) / "latest_checkpointed_iteration.txt";
    int64_t named = -1;
    std::ifstream(pointer) >> named;
    if (named != newest) {
      write_text_atomic(pointer.string(), std::to_string(newest) + "\n");
      done.push_back(fmt::format("pointed {} at step {}, the newest complete checkpoint",
                                 pointer.string(), newest));
    }
  }
  return done;
}

SaveDirLock::SaveDirLock(const std::string& dir) {
  check(!fs::exists(dir) || fs::is_directory(dir),
        "--save {} is a file, not a folder: checkpoints are folders inside it", dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  check(!ec, "--save {}: cannot make the folder: {}", dir, ec.message());
  const std::string path = (fs::path(dir) / kFile).string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  check(fd_ >= 0, "--save {}: cannot write there ({}: {}); checkpoints would be lost at the first "
                  "save", dir, path, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    char buf[512];
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    if (n > 0) holder.assign(buf, static_cast<size_t>(n));
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    check(err == EWOULDBLOCK, "--save {}: cannot lock {}: {}", dir, path, std::strerror(err));
    throw Error("--save {} is in use by another job ({}): two jobs saving into one folder would "
                "replace each other's checkpoints; stop that job, or save elsewhere",
                dir, holder.empty() ? "its lock file names no one" : holder);
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string me = fmt::format("host {}, pid {}\n", host, ::getpid());
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) < 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw Error("--save {}: cannot write there ({}: {}); checkpoints would be lost at the first "
                "save", dir, path, std::strerror(err));
  }
}

SaveDirLock::~SaveDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

nlohmann::json data_fingerprint(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return nullptr;
  f.seekg(0, std::ios::end);
  const int64_t size = static_cast<int64_t>(f.tellg());
  constexpr int64_t kBlock = int64_t{1} << 20;
  std::string bytes(static_cast<size_t>(std::min(size, kBlock)), '\0');
  f.seekg(0);
  f.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (size > kBlock) {
    std::string tail(static_cast<size_t>(std::min(size - kBlock, kBlock)), '\0');
    f.seekg(size - static_cast<int64_t>(tail.size()));
    f.read(tail.data(), static_cast<std::streamsize>(tail.size()));
    bytes += tail;
  }
  return {{"bytes", size},
          {"head_tail_xxh3", fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size()))}};
}

}  // namespace weft
