#include <weft/checkpoint.h>
#include <weft/safetensors.h>

#include <fmt/ranges.h>
#include <xxhash.h>

#include <fcntl.h>
#include <sys/file.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <iterator>
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
constexpr int kManifestVersion = 2;  // written; 1 is read too
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
  nlohmann::json slice;  // version 2: where it sits in the whole tensor
};

struct ManifestFile {
  std::string name;
  std::string holds;  // version 2's slice files: "model" or "optimizer"
  uint64_t size = 0, xxh3 = 0;
  uint64_t header_xxh3 = 0;             // slice files: their header's checksum instead
  std::vector<ManifestTensor> tensors;  // safetensors files only
};

struct Manifest {
  int version = kManifestVersion;
  std::vector<ManifestFile> files;
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
std::string manifest_text(int64_t step, int writers,
                          const std::vector<nlohmann::ordered_json>& files) {
  std::string text = fmt::format(
      "{{\"format\": \"{}\", \"version\": {}, \"checksum\": \"{}\", \"step\": {}, "
      "\"writers\": {},\n \"files\": [\n",
      kManifestFormat, kManifestVersion, kChecksum, step, writers);
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
Manifest read_manifest(const fs::path& path) {
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
  Manifest m;
  std::vector<ManifestFile>& files = m.files;
  try {
    check(j.is_object() && j.value("format", "") == kManifestFormat,
          "{}: not a {} (its 'format' must be '{}')", p, kManifestFormat, kManifestFormat);
    m.version = j.at("version").get<int>();
    check(m.version == 1 || m.version == 2, "{}: version {} is not one this weft reads (1 or 2)", p,
          j.at("version").dump());
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
      if (m.version >= 2 && e.contains("holds")) {
        mf.holds = e.at("holds").get<std::string>();
        check(mf.holds == "model" || mf.holds == "optimizer",
              "{}: file '{}' holds '{}'; a slice file holds model or optimizer", p, mf.name,
              mf.holds);
        mf.header_xxh3 = parse_hex(e.at("header_" + std::string(kChecksum)), mf.name);
      } else {
        mf.xxh3 = parse_hex(e.at(kChecksum), mf.name);
      }
      if (e.contains("tensors")) {
        for (const auto& t : e.at("tensors")) {
          ManifestTensor mt;
          mt.name = t.at("name").get<std::string>();
          mt.dtype = t.at("dtype").get<std::string>();
          mt.shape = t.at("shape").get<std::vector<int64_t>>();
          mt.xxh3 = parse_hex(t.at(kChecksum), fmt::format("tensor '{}'", mt.name));
          if (!mf.holds.empty()) mt.slice = t.at("slice");
          mf.tensors.push_back(std::move(mt));
        }
      }
      files.push_back(std::move(mf));
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error("{}: malformed manifest: {}", p, e.what());
  }
  const std::vector<const char*> needed =
      m.version == 1
          ? std::vector<const char*>{"model.safetensors", "optimizer.safetensors", "meta.json"}
          : std::vector<const char*>{"meta.json"};
  for (const char* need : needed)
    check(std::any_of(files.begin(), files.end(), [&](const ManifestFile& mf) { return mf.name == need; }),
          "{} does not list {}", p, need);
  return m;
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

// --- slices ---

// A slice's elements as runs of the whole tensor: elements [at, at + n) of
// the slice are [full, full + n) of the stored tensor (row-major). Elements
// past `stored` (a padded table's padding rows) are left out.
struct Run {
  int64_t full = 0, at = 0, n = 0;
};

std::vector<Run> slice_runs(const Shard& shard, int64_t lo, int64_t hi, int64_t stored) {
  std::vector<Run> out;
  for (const ShardRun& r : shard_runs(shard)) {
    if (r.part >= hi) break;
    const int64_t a = std::max(r.part, lo), b = std::min(r.part + r.n, hi);
    if (a >= b) continue;
    const int64_t full = r.full + (a - r.part);
    if (full >= stored) continue;
    out.push_back({full, a - lo, std::min(b - a, stored - full)});
  }
  return out;
}

int64_t numel_of(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

Shape shape_of(const std::vector<int64_t>& dims) {
  Shape s;
  check(dims.size() <= static_cast<size_t>(Shape::kMaxRank), "shape {} has too many dimensions",
        shape_str(dims));
  s.rank = static_cast<int>(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    check(dims[i] >= 0, "shape {} has a negative dimension", shape_str(dims));
    s.dims[i] = dims[i];
  }
  return s;
}

// One slice of a checkpoint: where its bytes are and what part of which
// tensor they hold.
struct Chunk {
  std::string file;    // its file's path
  std::string tensor;  // its name there: the whole tensor's
  uint64_t offset = 0, bytes = 0;
  uint64_t xxh3 = 0;
  const float* mem = nullptr;  // version 1: the bytes, read and checked when opened
  Shard shard;                 // shard.full: the writer's (padded) shape
  int64_t lo = 0, hi = 0;      // elements of the piece
};

nlohmann::ordered_json slice_json(const Shape& stored, const Shard& shard, int64_t lo, int64_t hi) {
  return {{"shape", dims_of(stored)}, {"padded", dims_of(shard.full)}, {"dim", shard.dim},
          {"parts", shard.parts},     {"index", shard.index},          {"blocks", shard.blocks},
          {"elements", {lo, hi}}};
}

// A manifest's slice description as a Chunk (and the stored shape), checked;
// throws Error naming `where`.
Chunk parse_slice(const nlohmann::json& j, int64_t numel, Shape& stored, const std::string& where) {
  Chunk c;
  try {
    stored = shape_of(j.at("shape").get<std::vector<int64_t>>());
    c.shard.full = shape_of(j.at("padded").get<std::vector<int64_t>>());
    c.shard.dim = j.at("dim").get<int>();
    c.shard.parts = j.at("parts").get<int>();
    c.shard.index = j.at("index").get<int>();
    c.shard.blocks = j.at("blocks").get<std::vector<int64_t>>();
    const auto elements = j.at("elements").get<std::vector<int64_t>>();
    check(elements.size() == 2, "{}: 'elements' must be [lo, hi]", where);
    c.lo = elements[0], c.hi = elements[1];
  } catch (const nlohmann::json::exception& e) {
    throw Error("{}: malformed slice: {}", where, e.what());
  }
  check(c.shard.dim >= -1 && c.shard.dim < c.shard.full.rank && c.shard.parts >= 1 &&
            c.shard.index >= 0 && c.shard.index < c.shard.parts,
        "{}: the slice's piece (dim {}, part {} of {}) is not one of shape {}", where, c.shard.dim,
        c.shard.index, c.shard.parts, c.shard.full.str());
  bool padded_ok = stored.rank == c.shard.full.rank;
  for (int i = 0; padded_ok && i < stored.rank; ++i)
    padded_ok = i == 0 ? stored[0] <= c.shard.full[0] : stored[i] == c.shard.full[i];
  check(padded_ok, "{}: padded shape {} is not shape {} with more rows", where, c.shard.full.str(),
        stored.str());
  const int64_t local = c.shard.local().numel();  // checks the blocks
  check(0 <= c.lo && c.lo <= c.hi && c.hi <= local,
        "{}: elements [{}, {}) are not within its piece's {}", where, c.lo, c.hi, local);
  int64_t kept = 0;
  for (const Run& r : slice_runs(c.shard, c.lo, c.hi, stored.numel())) kept += r.n;
  check(kept == c.hi - c.lo && numel == kept,
        "{}: the slice holds {} elements, but elements [{}, {}) of its piece are {} of the tensor",
        where, numel, c.lo, c.hi, kept);
  return c;
}

struct StoredTensor {
  Shape shape;
  std::vector<Chunk> chunks;
};
using StoredPart = std::map<std::string, StoredTensor>;

// Each tensor's slices cover it exactly once; throws Error naming `where`,
// the tensor and the elements at fault.
void check_coverage(const StoredPart& part, const std::string& where) {
  for (const auto& [name, t] : part) {
    std::vector<std::pair<Run, const Chunk*>> runs;
    for (const Chunk& c : t.chunks)
      for (const Run& r : slice_runs(c.shard, c.lo, c.hi, t.shape.numel())) runs.push_back({r, &c});
    std::sort(runs.begin(), runs.end(),
              [](const auto& a, const auto& b) { return a.first.full < b.first.full; });
    int64_t at = 0;
    const Chunk* last = nullptr;
    for (const auto& [r, c] : runs) {
      check(r.full >= at, "{}: elements [{}, {}) of tensor '{}' are in two slices ({} and {})",
            where, r.full, std::min(at, r.full + r.n), name, last->file, c->file);
      check(r.full == at, "{}: elements [{}, {}) of tensor '{}' (shape {}) are in no slice", where,
            at, r.full, name, t.shape.str());
      at = r.full + r.n;
      last = c;
    }
    check(at == t.shape.numel(), "{}: elements [{}, {}) of tensor '{}' (shape {}) are in no slice",
          where, at, t.shape.numel(), name, t.shape.str());
  }
}

void add_chunk(StoredPart& part, const std::string& name, const Shape& stored, Chunk c,
               const std::string& where) {
  auto [it, fresh] = part.try_emplace(name);
  if (fresh) it->second.shape = stored;
  check(it->second.shape == stored, "{}: slices of tensor '{}' disagree on its shape ({} and {})",
        where, name, it->second.shape.str(), stored.str());
  it->second.chunks.push_back(std::move(c));
}

// Reads `bytes` at `offset` of `path` (a positioned read).
void read_at(const std::string& path, uint64_t offset, uint64_t bytes, void* dst) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  check(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  char* out = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, out + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      throw Error("{}: read failed at byte {}: {}", path, offset + done,
                  n == 0 ? "the file ended" : std::strerror(err));
    }
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
}

}  // namespace

struct Checkpoint::Store {
  StoredPart parts[2];                   // Part::Model, Part::Optimizer
  std::vector<safetensors::File> files;  // version 1: read whole when opened
  std::atomic<int64_t> bytes_read{0};
  std::atomic<int64_t> bytes_wanted{0};
};

namespace {

// --- loading ---

// Version 2's slice files: headers against their checksums and the
// manifest, data sections made of the listed tensors only, and the slices
// covering each tensor once.
void open_slices(const fs::path& d, const Manifest& manifest, Checkpoint::Store& store) {
  for (const ManifestFile& mf : manifest.files) {
    if (mf.holds.empty()) continue;
    const std::string path = (d / mf.name).string();
    const safetensors::File f = safetensors::File::open_header(path);
    const uint64_t header = XXH3_64bits(f.header_bytes().data(), f.header_bytes().size());
    check(header == mf.header_xxh3, "{}: header checksum mismatch (stored {}, computed {})", path,
          hex(mf.header_xxh3), hex(header));
    check(f.tensors().size() == mf.tensors.size(), "{}: {} tensors, the manifest lists {}", path,
          f.tensors().size(), mf.tensors.size());
    // The tensors tile the data section, so their checksums cover it.
    std::vector<const safetensors::TensorInfo*> by_offset;
    for (const auto& info : f.tensors()) by_offset.push_back(&info);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const auto* a, const auto* b) { return a->begin < b->begin; });
    uint64_t at = 0;
    for (const auto* info : by_offset) {
      check(info->begin == at, "{}: bytes [{}, {}) of the data section are in no tensor", path, at,
            info->begin);
      at = info->end;
    }
    check(at == f.data_bytes(), "{}: bytes [{}, {}) of the data section are in no tensor", path, at,
          f.data_bytes());
    StoredPart& part = store.parts[mf.holds == "model" ? 0 : 1];
    for (const ManifestTensor& mt : mf.tensors) {
      const safetensors::TensorInfo* info = f.find(mt.name);
      check(info != nullptr, "{}: tensor '{}' is missing (the manifest lists it)", path, mt.name);
      check(dtype_name(info->dtype) == mt.dtype && info->dtype == DType::F32,
            "{}: tensor '{}' has dtype {}, the manifest says {} (slices are F32)", path, mt.name,
            dtype_name(info->dtype), mt.dtype);
      check(dims_of(info->shape) == mt.shape, "{}: tensor '{}' has shape {}, the manifest says {}",
            path, mt.name, info->shape.str(), shape_str(mt.shape));
      const std::string where = fmt::format("{}: tensor '{}'", path, mt.name);
      Shape stored;
      Chunk c = parse_slice(mt.slice, info->shape.numel(), stored, where);
      c.file = path;
      c.tensor = mt.name;
      c.offset = f.data_start() + info->begin;
      c.bytes = info->end - info->begin;
      c.xxh3 = mt.xxh3;
      add_chunk(part, mt.name, stored, std::move(c), where);
    }
  }
  for (const StoredPart& part : store.parts) check_coverage(part, (d / kManifest).string());
}

// Version 1: model.safetensors and optimizer.safetensors, read whole; each
// tensor is one slice.
void open_whole_files(const fs::path& d, const std::optional<Manifest>& manifest,
                      Checkpoint::Store& store) {
  const char* names[2] = {"model.safetensors", "optimizer.safetensors"};
  for (int k = 0; k < 2; ++k) {
    store.files.push_back(safetensors::File::open((d / names[k]).string()));
    const safetensors::File& f = store.files.back();
    if (manifest) verify_tensors(f, manifest_file(manifest->files, names[k]));
    for (const auto& info : f.tensors()) {
      Chunk c;
      c.file = f.path();
      c.tensor = info.name;
      c.shard.full = info.shape;
      c.hi = info.shape.numel();
      c.bytes = info.end - info.begin;
      check(info.dtype == DType::F32, "{}: tensor '{}' has dtype {}, expected F32", f.path(),
            info.name, dtype_name(info.dtype));
      c.mem = f.get(info.name).data<float>();
      add_chunk(store.parts[k], info.name, info.shape, std::move(c), f.path());
    }
    store.bytes_read += static_cast<int64_t>(fs::file_size(d / names[k]));
  }
  // What the tensors do not cover: headers and metadata, and any other file.
  if (manifest)
    for (const ManifestFile& f : manifest->files)
      if (f.name != "meta.json")
        verify_file_sum(d / f.name, f, f.tensors.empty() ? "" : " outside the tensors");
}

// Reads one checkpoint folder and verifies it against its manifest (version
// 2: all but the slices' data, which are checked as they are read); throws
// Error naming the file (and the tensor) that fails.
Checkpoint open_folder(const fs::path& d, bool allow_unverified) {
  Checkpoint c;
  c.store = std::make_shared<Checkpoint::Store>();
  c.source.path = d.string();
  const fs::path meta_file = d / "meta.json";
  const std::string meta_path = meta_file.string();
  std::optional<Manifest> manifest;
  if (fs::exists(d / kManifest)) {
    manifest = read_manifest(d / kManifest);
    // Sizes first, so a truncated file is named as such, not as malformed.
    for (const ManifestFile& mf : manifest->files) {
      const fs::path p = d / mf.name;
      check(fs::is_regular_file(p), "{} is missing (the manifest lists it)", p.string());
      const uint64_t size = fs::file_size(p);
      check(size == mf.size, "{}: {} bytes, the manifest says {}", p.string(), size, mf.size);
    }
    verify_file_sum(meta_file, manifest_file(manifest->files, "meta.json"), "");
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
  if (manifest && manifest->version >= 2) {
    open_slices(d, *manifest, *c.store);
  } else {
    check(manifest || fs::exists(d / "model.safetensors"),
          "{} is missing, and without it the slices of the folder's files cannot be placed",
          (d / kManifest).string());
    open_whole_files(d, manifest, *c.store);
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
    const fs::path& dir, std::vector<std::pair<std::string, std::string>>& skipped,
    const std::vector<std::pair<std::string, std::string>>& failed = {}) {
  for (const fs::path& folder : checkpoint_folders(dir)) {
    const auto seen = std::find_if(failed.begin(), failed.end(),
                                   [&](const auto& f) { return f.first == folder.string(); });
    if (seen != failed.end()) {  // its data did not verify when read
      skipped.push_back(*seen);
      continue;
    }
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

namespace {

std::string writer_file(const char* part, int rank, int ranks) {
  return fmt::format("{}-{:05d}-of-{:05d}.safetensors", part, rank + 1, ranks);
}
std::string part_file(int rank, int ranks, const char* ext) {
  return fmt::format("part-{:05d}-of-{:05d}.{}", rank + 1, ranks, ext);
}

fs::path tmp_folder(const std::string& dir, int64_t step) {
  return fs::path(dir) / (iter_name(step) + ".tmp");
}

// One writer's file of a part: its slices (padding rows left out), and the
// file's manifest entry.
nlohmann::ordered_json write_slices(const fs::path& path, const char* holds,
                                    const std::vector<SliceOut>& slices,
                                    const std::map<std::string, std::string>& metadata,
                                    const std::function<void(size_t)>& after_tensor) {
  NamedTensors tensors;
  std::vector<nlohmann::ordered_json> where;
  for (const SliceOut& s : slices) {
    check(s.data.dtype() == DType::F32 && s.data.device().is_cpu() && s.data.numel() == s.hi - s.lo,
          "slice '{}' [{}, {}): its data must be {} fp32 values on the host", s.name, s.lo, s.hi,
          s.hi - s.lo);
    Shape stored = s.shard.full;
    if (s.true_rows > 0) stored[0] = s.true_rows;
    // Padding rows come last in a piece (tables are split by rows), so the
    // elements kept are a prefix of the slice.
    int64_t kept = 0;
    for (const Run& r : slice_runs(s.shard, s.lo, s.hi, stored.numel())) {
      check(r.at == kept, "slice '{}' [{}, {}): padding rows inside it", s.name, s.lo, s.hi);
      kept += r.n;
    }
    if (kept == 0) continue;
    // As the piece's rows when the slice is whole rows of it, else flat.
    const Shape local = s.shard.local();
    const int64_t row = local.rank > 0 && local[0] > 0 ? local.numel() / local[0] : 1;
    Shape shape{kept};
    if (s.lo == 0 && local.rank > 0 && kept % row == 0) {
      shape = local;
      shape[0] = kept / row;
    }
    tensors.emplace_back(
        s.name, Tensor(const_cast<float*>(s.data.data<float>()), shape, DType::F32, Device::cpu()));
    where.push_back(slice_json(stored, s.shard, s.lo, s.lo + kept));
  }
  safetensors::save(path.string(), tensors, metadata, after_tensor);
  const safetensors::File f = safetensors::File::open_header(path.string());
  nlohmann::ordered_json e = {{"name", path.filename().string()},
                              {"holds", holds},
                              {"size", fs::file_size(path)},
                              {"header_" + std::string(kChecksum),
                               hex(XXH3_64bits(f.header_bytes().data(), f.header_bytes().size()))}};
  e["tensors"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i].second;
    e["tensors"].push_back({{"name", tensors[i].first},
                            {"dtype", dtype_name(t.dtype())},
                            {"shape", dims_of(t.shape())},
                            {kChecksum, hex(checksum(t))},
                            {"slice", where[i]}});
  }
  return e;
}

}  // namespace

void begin_checkpoint(const std::string& dir, int64_t step) {
  FaultInjection::from_env();  // a bad value fails the save before it writes anything
  fs::create_directories(dir);
  const fs::path tmp = tmp_folder(dir, step);
  fs::remove_all(tmp);
  fs::create_directories(tmp);
}

void write_checkpoint_slices(const std::string& dir, int64_t step, const SaveRank& who,
                             const RankSlices& slices, const std::string& optimizer,
                             int64_t optimizer_steps) {
  const FaultInjection fault = FaultInjection::from_env();
  const fs::path tmp = tmp_folder(dir, step);
  check(fs::is_directory(tmp), "the save of step {}: {} is missing (world rank 0 makes it first)",
        step, tmp.string());
  try {
    nlohmann::ordered_json part = {{"writer", who.rank}, {"writers", who.ranks}};
    part["files"] = {
        write_slices(tmp / writer_file("model", who.rank, who.ranks), "model", slices.model,
                     {{"format", "weft"}},
                     [&](size_t i) {
                       if (i == 0) fault.at("writing-tensors", step);
                     }),
        write_slices(tmp / writer_file("optimizer", who.rank, who.ranks), "optimizer",
                     slices.optimizer,
                     {{"optimizer", optimizer}, {"steps", std::to_string(optimizer_steps)}}, {})};
    write_text_atomic((tmp / part_file(who.rank, who.ranks, "json")).string(), part.dump() + "\n");
  } catch (const std::exception& e) {
    // Rank 0 waits for this writer's part: the reason ends its wait.
    std::ofstream((tmp / part_file(who.rank, who.ranks, "failed")).string()) << e.what() << "\n";
    throw;
  }
}

void finish_checkpoint(const std::string& dir, const CheckpointMeta& meta, int64_t optimizer_steps,
                       const SaveRank& who) {
  const FaultInjection fault = FaultInjection::from_env();
  const int64_t step = meta.step;
  const fs::path tmp_dir = tmp_folder(dir, step);
  const fs::path final_dir = fs::path(dir) / iter_name(step);
  if (fault.slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(fault.slow_ms));
  // Every writer's part, as each arrives.
  std::vector<nlohmann::ordered_json> parts(static_cast<size_t>(who.ranks));
  std::vector<char> arrived(static_cast<size_t>(who.ranks), 0);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(who.timeout_s * 1e3));
  for (int left = who.ranks;;) {
    for (int r = 0; r < who.ranks; ++r) {
      if (arrived[static_cast<size_t>(r)]) continue;
      const fs::path failed = tmp_dir / part_file(r, who.ranks, "failed");
      if (fs::exists(failed)) {
        std::ifstream in(failed);
        std::string why((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        while (!why.empty() && why.back() == '\n') why.pop_back();
        throw Error("the save of step {} to {}: writer {} of {} failed: {}", step, dir, r,
                    who.ranks, why);
      }
      const fs::path done = tmp_dir / part_file(r, who.ranks, "json");
      if (!fs::exists(done)) continue;
      std::ifstream f(done);
      try {
        f >> parts[static_cast<size_t>(r)];
      } catch (const nlohmann::json::exception& e) {
        throw Error("the save of step {}: {} is not valid JSON: {}", step, done.string(), e.what());
      }
      arrived[static_cast<size_t>(r)] = 1;
      --left;
    }
    if (left == 0) break;
    if (who.timeout_s > 0 && std::chrono::steady_clock::now() > deadline) {
      std::vector<int> missing;
      for (int r = 0; r < who.ranks; ++r)
        if (!arrived[static_cast<size_t>(r)]) missing.push_back(r);
      throw Error("the save of step {} to {}: writers {} of {} wrote no slices within {:g} s", step,
                  dir, fmt::join(missing, ", "), who.ranks, who.timeout_s);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // The slices cover every tensor once: checked before anything is put in place.
  std::vector<nlohmann::ordered_json> files;
  Checkpoint::Store store;
  const std::string where = fmt::format("the save of step {} to {}", step, dir);
  for (const nlohmann::ordered_json& part : parts)
    for (const nlohmann::ordered_json& e : part.at("files")) {
      files.push_back(e);
      StoredPart& into = store.parts[e.at("holds").get<std::string>() == "model" ? 0 : 1];
      for (const nlohmann::ordered_json& t : e.at("tensors")) {
        const std::string name = t.at("name").get<std::string>();
        Shape stored;
        Chunk c = parse_slice(t.at("slice"), numel_of(t.at("shape").get<std::vector<int64_t>>()),
                              stored, where + ": tensor '" + name + "'");
        c.file = e.at("name").get<std::string>();
        add_chunk(into, name, stored, std::move(c), where);
      }
    }
  for (const StoredPart& part : store.parts) check_coverage(part, where);
  nlohmann::json j = {{"step", step},
                      {"consumed_samples", meta.consumed_samples},
                      {"optimizer_steps", optimizer_steps},
                      {"config", meta.config},
                      {"format_version", 2}};
  if (!meta.trainer.is_null()) j["trainer"] = meta.trainer;
  write_text_atomic((tmp_dir / "meta.json").string(), j.dump(2) + "\n");
  files.push_back(file_entry(tmp_dir, "meta.json", nullptr));
  for (int r = 0; r < who.ranks; ++r) fs::remove(tmp_dir / part_file(r, who.ranks, "json"));
  // The manifest last: what a loader checks every other file against.
  write_text_atomic((tmp_dir / kManifest).string(), manifest_text(step, who.ranks, files));
  fault.at("before-fsync", step);
  for (const auto& f : files) sync_path(tmp_dir / f.at("name").get<std::string>());
  sync_path(tmp_dir / kManifest);
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

void save_checkpoint(const std::string& dir, const NamedTensors& model,
                     const NamedTensors& optimizer, int64_t optimizer_steps,
                     const CheckpointMeta& meta) {
  RankSlices slices;
  auto whole = [](const NamedTensors& tensors, std::vector<SliceOut>& out) {
    for (const auto& [name, t] : tensors) {
      SliceOut s;
      s.name = name;
      s.shard.full = t.shape();
      s.hi = t.numel();
      s.data = t;
      out.push_back(std::move(s));
    }
  };
  whole(model, slices.model);
  whole(optimizer, slices.optimizer);
  const std::string rule = meta.config.is_object() && meta.config.contains("optimizer")
                               ? meta.config["optimizer"].get<std::string>()
                               : std::string("adamw");
  begin_checkpoint(dir, meta.step);
  write_checkpoint_slices(dir, meta.step, SaveRank{}, slices, rule, optimizer_steps);
  finish_checkpoint(dir, meta, optimizer_steps, SaveRank{});
}

bool is_checkpoint_folder(const std::string& dir) {
  const fs::path d = without_trailing_slash(dir);
  return folder_step(d) >= 0 || fs::exists(d / "meta.json") || fs::exists(d / kManifest);
}

Checkpoint open_checkpoint(const std::string& dir, bool allow_unverified,
                           const std::vector<std::pair<std::string, std::string>>& failed) {
  const fs::path d = without_trailing_slash(dir);
  // One folder: named iter_N, or holding a checkpoint's files.
  if (is_checkpoint_folder(dir)) {
    check(fs::is_directory(d), "--load {}: no such checkpoint folder", dir);
    try {
      return open_folder(d, allow_unverified);
    } catch (const std::exception& e) {
      throw Error("--load {}: {}", dir, e.what());
    }
  }
  check(fs::is_directory(d), "--load {}: no such directory", dir);
  std::vector<std::pair<std::string, std::string>> skipped;
  if (std::optional<Checkpoint> c = newest_verified(d, skipped, failed)) return std::move(*c);
  check(!skipped.empty(), "--load {}: no checkpoint there (no iter_NNNNNNN folder)", dir);
  std::vector<std::string> why;
  for (const auto& [folder, reason] : skipped) why.push_back(reason);
  throw Error("--load {}: none of its {} checkpoint folders verifies: {}", dir, skipped.size(),
              fmt::join(why, "; "));
}

std::vector<std::pair<std::string, Shape>> Checkpoint::tensors(Part part) const {
  std::vector<std::pair<std::string, Shape>> out;
  for (const auto& [name, t] : store->parts[static_cast<int>(part)])
    out.emplace_back(name, t.shape);
  return out;
}

int64_t Checkpoint::bytes_read() const { return store->bytes_read.load(); }
int64_t Checkpoint::bytes_wanted() const { return store->bytes_wanted.load(); }

void Checkpoint::read(Part part, const std::string& name, const Shard& shard, int64_t true_rows,
                      int64_t lo, int64_t hi, const Tensor& dest) const {
  const StoredPart& stored_part = store->parts[static_cast<int>(part)];
  const char* what = part == Part::Model ? "checkpoint" : "optimizer state";
  auto it = stored_part.find(name);
  Shape want = shard.full;
  if (true_rows > 0) want[0] = true_rows;
  check(it != stored_part.end(), "{}: {} lacks tensor '{}' (shape {})", source.path, what, name,
        want.str());
  const StoredTensor& t = it->second;
  check(t.shape == want, "{}: tensor '{}' has shape {} but the model expects {}{}", source.path,
        name, t.shape.str(), want.str(),
        true_rows > 0 ? fmt::format(" (padded to {} in memory)", shard.full.str()) : "");
  check(dest.device().is_cpu() && dest.dtype() == DType::F32 && dest.numel() == hi - lo,
        "reading '{}' [{}, {}): the destination must be {} fp32 values on the host", name, lo, hi,
        hi - lo);
  float* out = dest.data<float>();
  std::fill(out, out + dest.numel(), 0.0f);  // padding rows, which no slice holds
  const std::vector<Run> want_runs = slice_runs(shard, lo, hi, t.shape.numel());
  if (want_runs.empty()) return;
  for (const Run& r : want_runs) store->bytes_wanted += r.n * static_cast<int64_t>(sizeof(float));
  const int64_t first = want_runs.front().full;
  const int64_t last = want_runs.back().full + want_runs.back().n;
  std::vector<float> bytes;
  for (const Chunk& c : t.chunks) {
    const std::vector<Run> have = slice_runs(c.shard, c.lo, c.hi, t.shape.numel());
    if (have.empty() || have.back().full + have.back().n <= first || have.front().full >= last)
      continue;
    // The overlaps of the two sorted run lists.
    std::vector<Run> copies;  // full: offset in the chunk, at: in dest
    size_t i = 0, k = 0;
    while (i < want_runs.size() && k < have.size()) {
      const Run& a = want_runs[i];
      const Run& b = have[k];
      const int64_t from = std::max(a.full, b.full), to = std::min(a.full + a.n, b.full + b.n);
      if (from < to) copies.push_back({b.at + (from - b.full), a.at + (from - a.full), to - from});
      if (a.full + a.n < b.full + b.n)
        ++i;
      else
        ++k;
    }
    if (copies.empty()) continue;
    const float* src = c.mem;
    if (src == nullptr) {  // read the slice whole, and check it
      bytes.resize(static_cast<size_t>(c.bytes / sizeof(float)));
      read_at(c.file, c.offset, c.bytes, bytes.data());
      store->bytes_read += static_cast<int64_t>(c.bytes);
      const uint64_t sum = XXH3_64bits(bytes.data(), c.bytes);
      check(sum == c.xxh3, "{}: tensor '{}' checksum mismatch (stored {}, computed {})", c.file,
            c.tensor, hex(c.xxh3), hex(sum));
      src = bytes.data();
    }
    for (const Run& r : copies) std::copy(src + r.full, src + r.full + r.n, out + r.at);
  }
}

Tensor Checkpoint::read_whole(Part part, const std::string& name) const {
  const StoredPart& stored_part = store->parts[static_cast<int>(part)];
  auto it = stored_part.find(name);
  check(it != stored_part.end(), "{}: no tensor '{}'", source.path, name);
  Tensor t = Tensor::zeros(it->second.shape);
  Shard whole;
  whole.full = it->second.shape;
  read(part, name, whole, 0, 0, t.numel(), t.view(Shape{t.numel()}));
  return t;
}

void Checkpoint::check_model(const std::vector<Param*>& params) const {
  std::set<std::string> names;
  for (const Param* p : params) names.insert(p->name);
  for (const auto& [name, t] : store->parts[0])
    check(names.count(name) == 1, "{}: checkpoint has tensor '{}', which the model does not have",
          source.path, name);
}

void Checkpoint::read_model(const std::vector<Param*>& params) const {
  check_model(params);
  read_values(params);
}

void Checkpoint::read_values(const std::vector<Param*>& params) const {
  for (Param* p : params) {
    Tensor host = Tensor::zeros({p->value.numel()});
    read(Part::Model, p->name, p->shard, p->true_rows, 0, p->value.numel(), host);
    p->value.copy_from(host.view(p->value.shape()));
  }
}

NamedTensors Checkpoint::read_optimizer(const std::vector<Param*>& params,
                                        const std::vector<std::string>& suffixes) const {
  NamedTensors out;
  for (Param* p : params)
    for (const std::string& suffix : suffixes) {
      Tensor t = Tensor::zeros(p->value.shape());
      read(Part::Optimizer, p->name + suffix, p->shard, p->true_rows, 0, t.numel(),
           t.view(Shape{t.numel()}));
      out.emplace_back(p->name + suffix, t);
    }
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
