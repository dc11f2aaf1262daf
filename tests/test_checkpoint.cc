// Checkpoints that cannot be lost. The manifest lists every file (size,
// checksum) and every tensor (dtype, shape, checksum). The loader picks the
// newest checkpoint that verifies, names the file and tensor of each one it
// skips, and refuses one named explicitly that does not verify. train_gpt
// killed (WEFT_FAULT_INJECT) at every phase of a save resumes from the newest
// complete checkpoint with the uninterrupted run's losses bit for bit. A save
// slower than the communicators' deadline is no failure.
#include <weft/checkpoint.h>
#include <weft/layout.h>
#include <weft/local_communicator.h>
#include <weft/safetensors.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "models/gpt.h"
#include "test_util.h"

#include <signal.h>
#include <unistd.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <ostream>
#include <sstream>

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::error_message;
using testing::read_file;
using testing::write_file;

std::string hex(uint64_t h) { return fmt::format("{:016x}", h); }
std::string xxh3(const void* p, size_t n) { return hex(XXH3_64bits(p, n)); }
std::string xxh3(const std::string& bytes) { return xxh3(bytes.data(), bytes.size()); }

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Where tensor `name`'s bytes are in the safetensors file `path`: (offset, bytes).
std::pair<size_t, size_t> tensor_bytes(const std::string& path, const std::string& name) {
  const std::string bytes = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), sizeof(n));  // little-endian, as the host
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  const auto& offsets = header.at(name).at("data_offsets");
  const auto begin = offsets[0].get<size_t>(), end = offsets[1].get<size_t>();
  return {8 + n + begin, end - begin};
}

// Overwrites the first `count` floats of a tensor with finite garbage (0.5):
// a file that still parses, with every value a number.
void overwrite_floats(const std::string& path, const std::string& name, size_t count) {
  const auto [offset, size] = tensor_bytes(path, name);
  ASSERT_LE(count * sizeof(float), size);
  std::string bytes = read_file(path);
  const float garbage = 0.5f;
  for (size_t i = 0; i < count; ++i)
    std::memcpy(bytes.data() + offset + i * sizeof(float), &garbage, sizeof(float));
  write_file(path, bytes);
}

// Replaces the first `from` in a file with `to`.
void edit_file(const std::string& path, const std::string& from, const std::string& to) {
  std::string text = read_file(path);
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << "'" << from << "' not in " << path;
  text.replace(at, from.size(), to);
  write_file(path, text);
}

// --- the library: save_checkpoint, open_checkpoint, scan_checkpoints ---

// A small checkpoint whose values depend on the step.
NamedTensors model_tensors(int64_t step) {
  const auto seed = static_cast<uint64_t>(step);
  return {{"a.weight", testing::uniform_tensor({3, 4}, seed)},
          {"b.bias", testing::uniform_tensor({5}, seed + 100)}};
}

NamedTensors optimizer_tensors(int64_t step) {
  NamedTensors out;
  uint64_t seed = static_cast<uint64_t>(step) * 10;
  for (const auto& [name, t] : model_tensors(step))
    for (const char* suffix : {".exp_avg", ".exp_avg_sq"})
      out.emplace_back(name + suffix, testing::uniform_tensor(t.shape(), ++seed));
  return out;
}

void save_step(const std::string& dir, int64_t step) {
  CheckpointMeta meta;
  meta.step = step;
  meta.consumed_samples = step * 4;
  meta.config = {{"seed", 1}};
  save_checkpoint(dir, model_tensors(step), optimizer_tensors(step), step, meta);
}

std::string folder(const std::string& dir, int64_t step) {
  return fmt::format("{}/iter_{:07d}", dir, step);
}

// One writer's files.
const std::string kModel = "model-00001-of-00001.safetensors";
const std::string kOptimizer = "optimizer-00001-of-00001.safetensors";

TEST(Manifest, ListsEveryFileWithItsSizeAndEveryTensorWithItsChecksum) {
  const std::string dir = testing::temp_dir("manifest");
  save_step(dir, 7);
  const std::string f = folder(dir, 7);
  EXPECT_EQ(entries(f),
            (std::vector<std::string>{"manifest.json", "meta.json", kModel, kOptimizer}));
  const auto m = nlohmann::json::parse(read_file(f + "/manifest.json"));
  EXPECT_EQ(m["format"], "weft checkpoint manifest");
  EXPECT_EQ(m["version"], 2);
  EXPECT_EQ(m["checksum"], "xxh3_64");
  EXPECT_EQ(m["step"], 7);
  EXPECT_EQ(m["writers"], 1);
  ASSERT_EQ(m["files"].size(), 3u);
  std::vector<std::string> names;
  for (const auto& file : m["files"]) {
    const std::string name = file["name"];
    names.push_back(name);
    const std::string bytes = read_file(f + "/" + name);
    EXPECT_EQ(file["size"].get<size_t>(), bytes.size()) << name;
    if (name == "meta.json") {
      EXPECT_EQ(file["xxh3_64"], xxh3(bytes));
      EXPECT_FALSE(file.contains("tensors"));
      continue;
    }
    // A slice file: its header's checksum, and its tensors' (which fill the rest).
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), sizeof(n));
    EXPECT_EQ(file["header_xxh3_64"], xxh3(bytes.data(), 8 + n)) << name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{kModel, kOptimizer, "meta.json"}));
  EXPECT_EQ(m["files"][0]["holds"], "model");
  EXPECT_EQ(m["files"][1]["holds"], "optimizer");
  // Every tensor, in the order saved, with its dtype, shape, the checksum of
  // its bytes as they are in the file, and the slice it is: here all of it.
  auto expect_tensors = [&](const nlohmann::json& file, const NamedTensors& saved) {
    const std::string path = f + "/" + file["name"].get<std::string>();
    const std::string bytes = read_file(path);
    ASSERT_EQ(file["tensors"].size(), saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      const auto& listed = file["tensors"][i];
      const auto& [name, t] = saved[i];
      const std::vector<int64_t> dims(t.shape().dims.begin(), t.shape().dims.begin() + t.rank());
      EXPECT_EQ(listed["name"], name);
      EXPECT_EQ(listed["dtype"], "F32");
      EXPECT_EQ(listed["shape"].get<std::vector<int64_t>>(), dims);
      EXPECT_EQ(listed["xxh3_64"], xxh3(t.raw(), t.nbytes())) << name;
      const auto [offset, size] = tensor_bytes(path, name);
      EXPECT_EQ(listed["xxh3_64"], xxh3(bytes.data() + offset, size)) << name;
      EXPECT_EQ(listed["slice"]["shape"].get<std::vector<int64_t>>(), dims);
      EXPECT_EQ(listed["slice"]["dim"], -1);
      EXPECT_EQ(listed["slice"]["elements"], nlohmann::json::array({0, t.numel()}));
    }
  };
  expect_tensors(m["files"][0], model_tensors(7));
  expect_tensors(m["files"][1], optimizer_tensors(7));

  const Checkpoint c = open_checkpoint(f);
  EXPECT_TRUE(c.source.verified);
  EXPECT_EQ(c.source.step, 7);
  EXPECT_EQ(c.source.path, f);
  EXPECT_TRUE(c.source.skipped.empty());
  EXPECT_EQ(c.meta.consumed_samples, 28);
  EXPECT_EQ(c.bytes_read(), 0) << "opening reads no tensor data";
  const Tensor a = c.read_whole(Checkpoint::Part::Model, "a.weight");
  EXPECT_EQ(std::memcmp(a.raw(), model_tensors(7)[0].second.raw(), a.nbytes()), 0);
  EXPECT_EQ(c.bytes_read(), static_cast<int64_t>(a.nbytes()));
}

// Each way a folder can differ from its manifest, named with the file (and
// the tensor) when the folder is loaded explicitly, and a reason to skip it
// when its directory is loaded.
TEST(Manifest, EveryMismatchIsNamedWithItsFileAndTensor) {
  struct Case {
    std::string what;
    std::function<void(const std::string&)> corrupt;  // the folder
    std::function<std::vector<std::string>(const std::string&)> fragments;
    bool when_read = false;  // the data: found as they are read, not when opened
  };
  const std::vector<Case> cases = {
      {"finite garbage in a weight",
       [](const std::string& f) { overwrite_floats(f + "/" + kModel, "b.bias", 2); },
       [](const std::string& f) {
         const auto m = nlohmann::json::parse(read_file(f + "/manifest.json"));
         const std::string stored = m["files"][0]["tensors"][1]["xxh3_64"];
         const auto [offset, size] = tensor_bytes(f + "/" + kModel, "b.bias");
         const std::string bytes = read_file(f + "/" + kModel);
         return std::vector<std::string>{f + "/" + kModel +
                                         ": tensor 'b.bias' checksum mismatch (stored " + stored +
                                         ", computed " + xxh3(bytes.data() + offset, size) + ")"};
       },
       /*when_read=*/true},
      {"a truncated file",
       [](const std::string& f) {
         const std::string bytes = read_file(f + "/" + kOptimizer);
         write_file(f + "/" + kOptimizer, bytes.substr(0, bytes.size() - 4));
       },
       [](const std::string& f) {
         const auto size = fs::file_size(f + "/" + kOptimizer);
         return std::vector<std::string>{
             fmt::format("{}/{}: {} bytes, the manifest says {}", f, kOptimizer, size, size + 4)};
       }},
      {"a missing file", [](const std::string& f) { fs::remove(f + "/" + kModel); },
       [](const std::string& f) {
         return std::vector<std::string>{f + "/" + kModel + " is missing (the manifest lists it)"};
       }},
      {"meta.json edited, same length",
       [](const std::string& f) {
         edit_file(f + "/meta.json", "\"consumed_samples\": 8", "\"consumed_samples\": 9");
       },
       [](const std::string& f) {
         return std::vector<std::string>{f + "/meta.json: checksum mismatch (stored "};
       }},
      {"a safetensors header edited, same length",
       [](const std::string& f) { edit_file(f + "/" + kOptimizer, "adamw", "adamx"); },
       [](const std::string& f) {
         return std::vector<std::string>{f + "/" + kOptimizer +
                                         ": header checksum mismatch (stored "};
       }},
      {"a tensor's dtype in the manifest",
       [](const std::string& f) {
         edit_file(f + "/manifest.json", "\"name\":\"a.weight\",\"dtype\":\"F32\"",
                   "\"name\":\"a.weight\",\"dtype\":\"I32\"");
       },
       [](const std::string& f) {
         return std::vector<std::string>{
             f + "/" + kModel + ": tensor 'a.weight' has dtype F32, the manifest says I32"};
       }},
      {"a tensor's shape in the manifest",
       [](const std::string& f) {
         edit_file(f + "/manifest.json", "\"shape\":[3,4]", "\"shape\":[4,3]");
       },
       [](const std::string& f) {
         return std::vector<std::string>{f + "/" + kModel +
                                         ": tensor 'a.weight' has shape [3, 4], the manifest says "
                                         "[4, 3]"};
       }},
      {"a tensor renamed in the manifest",
       [](const std::string& f) {
         edit_file(f + "/manifest.json", "{\"name\":\"b.bias\"", "{\"name\":\"c.bias\"");
       },
       [](const std::string& f) {
         return std::vector<std::string>{f + "/" + kModel +
                                         ": tensor 'c.bias' is missing (the manifest lists it)"};
       }},
      {"a manifest that is not JSON",
       [](const std::string& f) { write_file(f + "/manifest.json", "{ not json"); },
       [](const std::string& f) {
         return std::vector<std::string>{f + "/manifest.json is not valid JSON"};
       }},
      {"a manifest pointing outside its folder",
       [](const std::string& f) {
         edit_file(f + "/manifest.json", "{\"name\":\"meta.json\"", "{\"name\":\"../meta.json\"");
       },
       [](const std::string& f) {
         return std::vector<std::string>{
             f + "/manifest.json: '../meta.json' is not the name of a file of the checkpoint"};
       }},
      {"a checksum that is not hex",
       [](const std::string& f) {
         const auto m = nlohmann::json::parse(read_file(f + "/manifest.json"));
         edit_file(f + "/manifest.json", m["files"][2]["xxh3_64"].get<std::string>(),
                   "not-a-checksum!!");
       },
       [](const std::string& f) {
         return std::vector<std::string>{
             f + "/manifest.json: the checksum of meta.json must be 16 hex digits, got "
                 "'not-a-checksum!!'"};
       }},
      {"a slice that is not what its tensor holds",
       [](const std::string& f) {
         edit_file(f + "/manifest.json", "\"elements\":[0,5]", "\"elements\":[1,5]");
       },
       [](const std::string& f) {
         return std::vector<std::string>{f + "/" + kModel +
                                         ": tensor 'b.bias': the slice holds 5 elements, but "
                                         "elements [1, 5) of its piece are 4 of the tensor"};
       }},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string dir = testing::temp_dir("mismatch-" + std::to_string(n++));
    save_step(dir, 2);
    const std::string f = folder(dir, 2);
    c.corrupt(f);
    const std::vector<std::string> fragments = c.fragments(f);
    if (c.when_read) {
      const Checkpoint opened = open_checkpoint(f);
      const std::string msg =
          error_message([&] { opened.read_whole(Checkpoint::Part::Model, "b.bias"); });
      for (const std::string& part : fragments)
        EXPECT_TRUE(contains(msg, part)) << "missing '" << part << "' in: " << msg;
      continue;
    }
    const std::string msg = error_message([&] { open_checkpoint(f); });
    EXPECT_TRUE(contains(msg, "--load " + f + ": ")) << msg;
    for (const std::string& part : fragments)
      EXPECT_TRUE(contains(msg, part)) << "missing '" << part << "' in: " << msg;
    const CheckpointSource scan = scan_checkpoints(dir);
    EXPECT_EQ(scan.step, -1);
    ASSERT_EQ(scan.skipped.size(), 1u);
    EXPECT_EQ(scan.skipped[0].first, f);
    for (const std::string& part : fragments) EXPECT_TRUE(contains(scan.skipped[0].second, part));
  }
}

// A folder without a manifest cannot be verified: a directory's scan skips
// it for an older one that verifies (garbage in it would otherwise train),
// and it loads only when named alone with allow_unverified, saying so
// through its source; its meta.json is still checked.
TEST(Manifest, AFolderWithoutOneLoadsOnlyWhenNamedAndAllowed) {
  const std::string dir = testing::temp_dir("no-manifest");
  save_step(dir, 2);
  save_step(dir, 3);
  fs::remove(folder(dir, 3) + "/manifest.json");
  const CheckpointSource scan = scan_checkpoints(dir);
  EXPECT_EQ(scan.step, 2);
  EXPECT_TRUE(scan.verified);
  ASSERT_EQ(scan.skipped.size(), 1u);
  EXPECT_TRUE(contains(scan.skipped[0].second,
                       folder(dir, 3) + "/manifest.json is missing, so nothing in the folder can "
                                        "be verified"))
      << scan.skipped[0].second;
  EXPECT_EQ(open_checkpoint(dir).meta.step, 2);
  const std::string refused = error_message([&] { open_checkpoint(folder(dir, 3)); });
  EXPECT_TRUE(contains(refused, "to load it anyway, name it alone: --load " + folder(dir, 3) +
                                    " --load-unverified"))
      << refused;
  // The slices cannot be placed without it, even when allowed.
  EXPECT_TRUE(contains(error_message([&] { open_checkpoint(folder(dir, 3), true); }),
                       "without it the slices of the folder's files cannot be placed"));

  // A checkpoint of whole tensors (version 1) without its manifest loads
  // when named and allowed; its meta.json is still checked.
  const std::string old = testing::temp_dir("no-manifest-v1") + "/iter_0000007";
  fs::copy(testing::source_path("tests/reference/fixtures/checkpoint-v1/iter_0000007"), old);
  fs::remove(old + "/manifest.json");
  const Checkpoint c = open_checkpoint(old, /*allow_unverified=*/true);
  EXPECT_FALSE(c.source.verified);
  EXPECT_EQ(c.source.step, 7);
  EXPECT_EQ(c.meta.step, 7);
  edit_file(old + "/meta.json", "\"step\": 7", "\"step\": -7");
  EXPECT_TRUE(contains(error_message([&] { open_checkpoint(old, true); }),
                       "'step' must be a non-negative integer, got -7"));
}

// A directory's checkpoint is its newest folder that verifies, whatever the
// pointer file says; the newer ones are skipped with their reasons.
TEST(Loader, PicksTheNewestThatVerifiesAndTrustsNoPointer) {
  const std::string dir = testing::temp_dir("loader");
  EXPECT_TRUE(contains(error_message([&] { open_checkpoint(dir); }),
                       "--load " + dir + ": no checkpoint there"));
  EXPECT_EQ(newest_checkpoint_step(dir), -1);
  EXPECT_EQ(newest_checkpoint_step(dir + "/absent"), -1);
  for (int64_t step : {1, 2, 3}) save_step(dir, step);
  EXPECT_EQ(read_file(dir + "/latest_checkpointed_iteration.txt"), "3\n");
  write_file(dir + "/latest_checkpointed_iteration.txt", "1\n");
  EXPECT_EQ(open_checkpoint(dir).meta.step, 3);

  // A header edited: found by the scan, which reads no tensor data.
  edit_file(folder(dir, 3) + "/" + kModel, "weft", "wxft");
  CheckpointSource scan = scan_checkpoints(dir);
  EXPECT_EQ(scan.step, 2);
  EXPECT_EQ(scan.path, folder(dir, 2));
  EXPECT_TRUE(scan.verified);
  ASSERT_EQ(scan.skipped.size(), 1u);
  EXPECT_EQ(scan.skipped[0].first, folder(dir, 3));
  EXPECT_TRUE(contains(scan.skipped[0].second,
                       folder(dir, 3) + "/" + kModel + ": header checksum mismatch"))
      << scan.skipped[0].second;
  EXPECT_EQ(newest_checkpoint_step(dir), 2);
  const Checkpoint c = open_checkpoint(dir);
  EXPECT_EQ(c.meta.step, 2);
  EXPECT_EQ(c.source.skipped, scan.skipped);
  // Loaded tensors are step 2's.
  const Tensor b = c.read_whole(Checkpoint::Part::Model, "b.bias");
  const Tensor want = model_tensors(2)[1].second;
  EXPECT_EQ(std::memcmp(b.raw(), want.raw(), want.nbytes()), 0);

  edit_file(folder(dir, 2) + "/meta.json", "\"step\": 2", "\"step\": 7");
  EXPECT_EQ(newest_checkpoint_step(dir), 1);
  EXPECT_EQ(scan_checkpoints(dir).skipped.size(), 2u);
  fs::remove(folder(dir, 1) + "/" + kOptimizer);
  scan = scan_checkpoints(dir);
  EXPECT_EQ(scan.step, -1);
  EXPECT_EQ(scan.skipped.size(), 3u);
  const std::string msg = error_message([&] { open_checkpoint(dir); });
  EXPECT_TRUE(contains(msg, "--load " + dir + ": none of its 3 checkpoint folders verifies: ")) << msg;
  for (int64_t step : {1, 2, 3}) EXPECT_TRUE(contains(msg, folder(dir, step) + "/")) << msg;
}

// --- slices: every rank writes what it holds ---

// The whole tensors of the sharded tests: "w" (6 x 4) split by columns over
// tp 2, and "e" (5 real rows, padded to 6) split by rows; element i is i / 2.
Tensor whole_tensor(int64_t rows, int64_t cols) {
  Tensor t = Tensor::zeros({rows, cols});
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(i) * 0.5f;
  return t;
}

Shard piece_of(Shape full, int dim, int parts, int index) {
  Shard s;
  s.dim = dim, s.parts = parts, s.index = index, s.full = full;
  return s;
}

// What writer (dp d, tp t) of 2 x 2 holds: piece t of each tensor, and of it
// the elements [6 d, 6 d + 6).
RankSlices rank_slices(int d, int t, bool drop_w = false) {
  RankSlices out;
  const struct {
    const char* name;
    Shard shard;
    int64_t true_rows;
  } tensors[] = {{"w", piece_of({6, 4}, 1, 2, t), 0}, {"e", piece_of({6, 4}, 0, 2, t), 5}};
  for (const auto& x : tensors) {
    if (drop_w && std::string(x.name) == "w") continue;
    Tensor full = whole_tensor(6, 4), piece = Tensor::zeros(x.shard.local());
    slice_shard(full, x.shard, piece);
    SliceOut s;
    s.name = x.name, s.shard = x.shard, s.true_rows = x.true_rows;
    s.lo = 6 * d, s.hi = 6 * d + 6;
    s.data = Tensor::zeros({6});
    std::copy(piece.data<float>() + s.lo, piece.data<float>() + s.hi, s.data.data<float>());
    out.model.push_back(std::move(s));
  }
  return out;
}

void save_sharded(const std::string& dir, int64_t step, int skip_writer = -1, bool drop_w = false,
                  double timeout_s = 30) {
  begin_checkpoint(dir, step);
  for (int r = 0; r < 4; ++r)
    if (r != skip_writer)
      write_checkpoint_slices(dir, step, SaveRank{r, 4, timeout_s},
                              rank_slices(r / 2, r % 2, drop_w && r == 3), "adamw", step);
  CheckpointMeta meta;
  meta.step = step;
  finish_checkpoint(dir, meta, step, SaveRank{0, 4, timeout_s});
}

// Four writers (dp 2 x tp 2) each write their own file; the manifest maps
// the slices, which cover each tensor once, and a padded table's padding is
// never written. A reader at any cut gets its elements: at the writers' own
// cut, it reads exactly its own bytes; at another, the slices that hold
// them, each whole (so that its checksum is checked).
TEST(Sharded, EachWriterWritesItsSlicesAndAnyCutReadsThem) {
  const std::string dir = testing::temp_dir("sharded");
  save_sharded(dir, 3);
  const std::string f = folder(dir, 3);
  std::vector<std::string> want = {"manifest.json", "meta.json"};
  for (int r = 1; r <= 4; ++r) {
    want.push_back(fmt::format("model-{:05d}-of-00004.safetensors", r));
    want.push_back(fmt::format("optimizer-{:05d}-of-00004.safetensors", r));
  }
  std::sort(want.begin(), want.end());
  EXPECT_EQ(entries(f), want) << "the writers' parts are folded into the manifest";
  const auto m = nlohmann::json::parse(read_file(f + "/manifest.json"));
  EXPECT_EQ(m["writers"], 4);
  // Writer (dp 1, tp 1) holds rows 4 and 5 of e's second piece: row 5 is padding.
  const auto& last = m["files"][6];
  EXPECT_EQ(last["name"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(last["tensors"][1]["name"], "e");
  EXPECT_EQ(last["tensors"][1]["slice"]["elements"], nlohmann::json::array({6, 8}));
  EXPECT_EQ(last["tensors"][1]["shape"], nlohmann::json::array({2}));

  const Tensor w = whole_tensor(6, 4);
  Tensor e = whole_tensor(6, 4).slice0(0, 5).clone();
  {
    const Checkpoint c = open_checkpoint(f);
    EXPECT_EQ(c.bytes_read(), 0);
    const Tensor got_w = c.read_whole(Checkpoint::Part::Model, "w");
    const Tensor got_e = c.read_whole(Checkpoint::Part::Model, "e");
    EXPECT_EQ(std::memcmp(got_w.raw(), w.raw(), w.nbytes()), 0);
    ASSERT_EQ(got_e.shape(), (Shape{5, 4}));
    EXPECT_EQ(std::memcmp(got_e.raw(), e.raw(), e.nbytes()), 0);
  }
  // A writer's own slice: its 6 values and nothing else.
  {
    const Checkpoint c = open_checkpoint(f);
    Tensor mine = Tensor::zeros({6});
    c.read(Checkpoint::Part::Model, "w", piece_of({6, 4}, 1, 2, 1), 0, 6, 12, mine);
    EXPECT_EQ(c.bytes_read(), 6 * 4);
    EXPECT_EQ(c.bytes_wanted(), 6 * 4);
    const Tensor want_mine = rank_slices(1, 1).model[0].data;
    EXPECT_EQ(std::memcmp(mine.raw(), want_mine.raw(), 24), 0);
  }
  // Another cut: tp 4 by columns, the whole piece 3 (column 3), and e padded
  // to 8 rows by tp 4 (rows 6 and 7 past the table read as zero).
  {
    const Checkpoint c = open_checkpoint(f);
    Tensor col = Tensor::zeros({6});
    c.read(Checkpoint::Part::Model, "w", piece_of({6, 4}, 1, 4, 3), 0, 0, 6, col);
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(col.data<float>()[i], w.data<float>()[i * 4 + 3]);
    // Column 3 lies in tp piece 1 of both dp halves: both slices, read whole.
    EXPECT_EQ(c.bytes_wanted(), 6 * 4);
    EXPECT_EQ(c.bytes_read(), 12 * 4);
    Tensor rows = Tensor::zeros({8});
    c.read(Checkpoint::Part::Model, "e", piece_of({8, 4}, 0, 4, 2), 5, 0, 8, rows);
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(rows.data<float>()[i], e.data<float>()[16 + i]);
    for (int64_t i = 4; i < 8; ++i) EXPECT_EQ(rows.data<float>()[i], 0.0f) << "padding row";
  }
}

// A slice no writer wrote, a writer that never reports, and one that fails:
// the save stops naming the tensor or the writer, and nothing is put in place.
TEST(Sharded, ASaveMissingASliceOrAWriterIsNamed) {
  const std::string dir = testing::temp_dir("sharded-missing");
  std::string msg = error_message([&] { save_sharded(dir, 1, -1, /*drop_w=*/true); });
  EXPECT_TRUE(contains(msg, "elements [") &&
              contains(msg, "of tensor 'w' (shape [6, 4]) are in no slice"))
      << msg;
  msg = error_message([&] { save_sharded(dir, 1, /*skip_writer=*/2, false, 0.2); });
  EXPECT_TRUE(contains(msg, "writers 2 of 4 wrote no slices within 0.2 s")) << msg;
  begin_checkpoint(dir, 1);
  write_file(folder(dir, 1) + ".tmp/part-00003-of-00004.failed", "disk full\n");
  CheckpointMeta meta;
  meta.step = 1;
  msg = error_message([&] { finish_checkpoint(dir, meta, 1, SaveRank{0, 4, 30}); });
  EXPECT_TRUE(contains(msg, "writer 2 of 4 failed: disk full")) << msg;
  EXPECT_EQ(newest_checkpoint_step(dir), -1);
  EXPECT_FALSE(fs::exists(folder(dir, 1)));
}

// A checkpoint of whole tensors as weft wrote them before slices (manifest
// version 1, model.safetensors and optimizer.safetensors): it verifies and
// loads into a tensor-parallel piece as before.
TEST(Sharded, ACheckpointOfWholeTensorsFromBeforeLoads) {
  const std::string dir = testing::temp_dir("v1") + "/ckpt";
  fs::copy(testing::source_path("tests/reference/fixtures/checkpoint-v1"), dir,
           fs::copy_options::recursive);
  EXPECT_EQ(newest_checkpoint_step(dir), 7);
  const Checkpoint c = open_checkpoint(dir);
  EXPECT_TRUE(c.source.verified);
  EXPECT_EQ(c.optimizer_steps, 7);
  // a.weight (4 x 6): element i is i / 8 - 1.5; rows 2 and 3 are piece 1 of 2.
  Tensor rows = Tensor::zeros({12});
  c.read(Checkpoint::Part::Model, "a.weight", piece_of({4, 6}, 0, 2, 1), 0, 0, 12, rows);
  for (int64_t i = 0; i < 12; ++i)
    EXPECT_EQ(rows.data<float>()[i], static_cast<float>(12 + i) * 0.125f - 1.5f);
  // b.bias.exp_avg_sq (5): element i is i / 16 + 2.
  const Tensor v = c.read_whole(Checkpoint::Part::Optimizer, "b.bias.exp_avg_sq");
  for (int64_t i = 0; i < 5; ++i)
    EXPECT_EQ(v.data<float>()[i], static_cast<float>(i) * 0.0625f + 2);
}

// A save of a step that exists sets the old folder aside until the new one is
// in place, and removes the folders of later steps (a rewound run's).
TEST(Loader, ASaveReplacesItsStepAndRemovesLaterOnes) {
  const std::string dir = testing::temp_dir("resave");
  for (int64_t step : {2, 4, 6}) save_step(dir, step);
  save_step(dir, 4);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"iter_0000002", "iter_0000004",
                                                    "latest_checkpointed_iteration.txt"}));
  EXPECT_EQ(read_file(dir + "/latest_checkpointed_iteration.txt"), "4\n");
  EXPECT_EQ(newest_checkpoint_step(dir), 4);
}

// What a save killed between its renames leaves: the step's old folder as
// iter_N.old, the new one as iter_N.tmp. The loader reads the .old; the
// cleaner puts it back.
TEST(Loader, AnInterruptedReplacementIsReadAndRestored) {
  const std::string dir = testing::temp_dir("old");
  save_step(dir, 2);
  save_step(dir, 4);
  fs::rename(folder(dir, 4), folder(dir, 4) + ".old");
  fs::create_directories(folder(dir, 4) + ".tmp");
  write_file(folder(dir, 4) + ".tmp/" + kModel + ".tmp", "half a file");
  write_file(dir + "/latest_checkpointed_iteration.txt.tmp", "4\n");
  write_file(dir + "/latest_checkpointed_iteration.txt", "2\n");
  const CheckpointSource scan = scan_checkpoints(dir);
  EXPECT_EQ(scan.step, 4);
  EXPECT_EQ(scan.path, folder(dir, 4) + ".old");
  EXPECT_TRUE(scan.skipped.empty());

  const std::vector<std::string> lines = clean_stale_checkpoint_files(dir);
  EXPECT_EQ(lines, (std::vector<std::string>{
                       "restored " + dir + "/iter_0000004 from " + dir +
                           "/iter_0000004.old, which an interrupted save had set aside",
                       "removed " + dir + "/iter_0000004.tmp, left by an interrupted save",
                       "removed " + dir +
                           "/latest_checkpointed_iteration.txt.tmp, left by an interrupted save",
                       "pointed " + dir +
                           "/latest_checkpointed_iteration.txt at step 4, the newest complete "
                           "checkpoint"}));
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"iter_0000002", "iter_0000004",
                                                    "latest_checkpointed_iteration.txt"}));
  EXPECT_EQ(read_file(dir + "/latest_checkpointed_iteration.txt"), "4\n");
  EXPECT_EQ(scan_checkpoints(dir).path, folder(dir, 4));
  EXPECT_TRUE(clean_stale_checkpoint_files(dir).empty());

  // Killed after the new folder's rename: the .old copy goes.
  fs::copy(folder(dir, 4), folder(dir, 4) + ".old");
  EXPECT_EQ(clean_stale_checkpoint_files(dir),
            (std::vector<std::string>{"removed " + dir +
                                      "/iter_0000004.old, left by an interrupted save"}));
}

TEST(FaultInjection, ValuesAreCheckedUpFront) {
  for (const char* good : {"writing-tensors", "before-fsync@3", "between-renames@0",
                           "pointer-update", "slow-save:250"}) {
    ScopedEnv env("WEFT_FAULT_INJECT", good);
    EXPECT_NO_THROW(check_fault_injection()) << good;
  }
  for (const char* bad : {"before-sync", "pointer-update@", "pointer-update@-1",
                          "writing-tensors@2x", "slow-save:", "slow-save:fast"}) {
    ScopedEnv env("WEFT_FAULT_INJECT", bad);
    const std::string msg = error_message([] { check_fault_injection(); });
    EXPECT_TRUE(contains(msg, std::string("WEFT_FAULT_INJECT '") + bad + "'")) << msg;
  }
  // A bad value fails a save before it writes anything.
  ScopedEnv env("WEFT_FAULT_INJECT", "everything");
  const std::string dir = testing::temp_dir("bad-fault");
  EXPECT_TRUE(contains(error_message([&] { save_step(dir, 1); }), "must be one of"));
  EXPECT_TRUE(entries(dir).empty());
}

// --- the barrier after a save, on threads ---

const TokenData& text_data() {
  static const TokenData data = testing::best_of_times_tokens(40);
  return data;
}

// Two data-parallel ranks; rank 0 writes the checkpoint (slowly, with
// WEFT_FAULT_INJECT) while rank 1 waits. The save of step 1 is written whole
// and both ranks go on training after it.
void train_and_save_on_threads(const std::string& dir, CommOptions comm) {
  GptConfig cfg;
  cfg.vocab_size = 256, cfg.num_layers = 1, cfg.hidden_size = 16, cfg.num_heads = 2;
  cfg.seq_length = 8;
  run_local(2, [&](Communicator& world) {
    TokenBatches batches(text_data(), 4, cfg.seq_length);
    GptModel model = build_gpt(cfg, 2);
    TrainOptions opt;
    opt.micro_batch = 2;
    opt.global_batch = 4;
    RankLayout rank(&world, model.graph, model.io, batches, opt, LayoutOptions{}, 7);
    rank.trainer().train_step();
    rank.trainer().save(dir);
    rank.trainer().train_step();
  }, comm);
}

TEST(SlowSave, OutlastsTheCommTimeoutOnThreads) {
  const std::string dir = testing::temp_dir("slow-threads");
  ScopedEnv slow("WEFT_FAULT_INJECT", "slow-save:2500");
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(train_and_save_on_threads(dir, CommOptions{std::chrono::milliseconds(1000)}));
  EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.5);
  const CheckpointSource scan = scan_checkpoints(dir);
  EXPECT_EQ(scan.step, 1);
  EXPECT_TRUE(scan.verified);
}

// A writer that fails still ends the rank that waits for it.
TEST(SlowSave, AWriterThatFailsEndsTheJob) {
  const std::string dir = testing::temp_dir("failed-writer") + "/a-file";
  write_file(dir, "not a directory");
  const auto start = std::chrono::steady_clock::now();
  const std::string msg =
      error_message([&] { train_and_save_on_threads(dir, CommOptions{std::chrono::seconds(60)}); });
  EXPECT_TRUE(contains(msg, "rank 0: ")) << msg;
  EXPECT_TRUE(contains(msg, dir)) << msg;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

// --- train_gpt: corrupt bytes, old checkpoints, and kill -9 during saves ---

struct TrainRun {
  int code = -1;        // exit status; -1 when killed
  bool killed = false;  // by SIGKILL
  std::string out;      // stdout and stderr
  std::vector<nlohmann::json> records;  // the JSONL log, one per step
};

class TrainGpt : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_dir_ = new std::string(testing::temp_dir("ckpt-data"));
    std::string text;
    for (int i = 0; i < 60; ++i) text += "Call me Ishmael. Some years ago, never mind how long. ";
    write_file(*data_dir_ + "/text.txt", text);
  }
  static void TearDownTestSuite() {
    delete data_dir_;
    data_dir_ = nullptr;
  }

  void SetUp() override {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');  // a parameterised test's name has one
    dir_ = testing::temp_dir(name);
    ckpt_ = dir_ + "/ckpt";
  }

  // A tiny GPT whose learning rate depends on the step (warmup, cosine), so
  // a resumed run must know where it is; the same schedule whatever
  // --train-iters a run stops at.
  static std::string flags() {
    return "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
           "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --min-lr 1e-3 "
           "--lr-decay-style cosine --lr-warmup-iters 2 --lr-decay-iters 6 --threads 1 "
           "--device cpu --data-path " +
           *data_dir_ + "/text.txt ";
  }

  // Runs train_gpt with `args`, WEFT_FAULT_INJECT=`fault` when given.
  TrainRun train(const std::string& args, const std::string& fault = "") const {
    const char* exe = std::getenv("WEFT_TRAIN_GPT");
    EXPECT_NE(exe, nullptr) << "WEFT_TRAIN_GPT is set by meson test";
    const std::string jsonl = dir_ + "/run.jsonl", out = dir_ + "/out.txt";
    fs::remove(jsonl);
    const std::string cmd = (fault.empty() ? "" : "WEFT_FAULT_INJECT=" + fault + " ") +
                            std::string(exe ? exe : "train_gpt") + " " + flags() + args +
                            " --log-jsonl " + jsonl + " >" + out + " 2>&1";
    const int status = std::system(cmd.c_str());
    TrainRun r;
    // The shell reports a child killed by a signal as 128 + the signal.
    r.killed = (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) ||
               (WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGKILL);
    r.code = WIFEXITED(status) && !r.killed ? WEXITSTATUS(status) : -1;
    r.out = read_file(out);
    if (fs::exists(jsonl)) r.records = testing::jsonl_steps(jsonl);  // not the header lines
    return r;
  }

  // The uninterrupted run's records, steps 1..6, computed once.
  static const std::vector<nlohmann::json>& reference(const TrainGpt& t) {
    static const std::vector<nlohmann::json> records = [&] {
      const TrainRun r = t.train("--train-iters 6");
      EXPECT_EQ(r.code, 0) << r.out;
      return r.records;
    }();
    return records;
  }

  // The records are the uninterrupted run's steps first+1.. bit for bit.
  void expect_reference_steps(const std::vector<nlohmann::json>& records, int first) const {
    const auto& ref = reference(*this);
    ASSERT_EQ(ref.size(), 6u);
    ASSERT_EQ(records.size(), ref.size() - static_cast<size_t>(first));
    for (size_t i = 0; i < records.size(); ++i) {
      const auto& want = ref[static_cast<size_t>(first) + i];
      EXPECT_EQ(records[i]["step"], want["step"]);
      EXPECT_EQ(records[i]["loss"].get<double>(), want["loss"].get<double>())
          << "step " << want["step"];
      EXPECT_EQ(records[i]["grad_norm"].get<double>(), want["grad_norm"].get<double>())
          << "step " << want["step"];
    }
  }

  static std::string* data_dir_;
  std::string dir_, ckpt_;
};

std::string* TrainGpt::data_dir_ = nullptr;

// Finite garbage over some weights of the newest checkpoint: the automatic
// resume skips it, saying which file and tensor, and trains on from the one
// before with the uninterrupted run's losses; loading it by name fails.
TEST_F(TrainGpt, CorruptWeightsAreSkippedOnResumeAndRefusedWhenNamed) {
  TrainRun r = train("--train-iters 4 --save-interval 2 --save " + ckpt_);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string newest = ckpt_ + "/iter_0000004";
  overwrite_floats(newest + "/" + kModel, "h.0.attn.c_attn.weight", 16);

  r = train("--train-iters 6 --load " + newest);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(r.records.empty());
  // The data are checked as they are read, before step 1: no step runs.
  EXPECT_FALSE(contains(r.out, "step ")) << r.out;
  for (const std::string& part :
       {"train_gpt: error: --load " + newest + ": " + newest + "/" + kModel +
            ": tensor 'h.0.attn.c_attn.weight' checksum mismatch (stored ",
        std::string(", computed ")})
    EXPECT_TRUE(contains(r.out, part)) << "missing '" << part << "' in: " << r.out;

  r = train("--train-iters 6 --save-interval 2 --save " + ckpt_);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "warning: skipped " + newest + ", which does not verify: " + newest +
                                  "/" + kModel +
                                  ": tensor 'h.0.attn.c_attn.weight' checksum mismatch (stored "))
      << r.out;
  EXPECT_TRUE(contains(r.out, "resumed from " + ckpt_ + " at step 2 (automatic")) << r.out;
  expect_reference_steps(r.records, 2);
  // Saved again: step 4 verifies now.
  const CheckpointSource scan = scan_checkpoints(ckpt_);
  EXPECT_EQ(scan.step, 6);
  EXPECT_TRUE(scan.skipped.empty());
  EXPECT_NO_THROW(open_checkpoint(newest));
}

// When every checkpoint in --save is corrupt, the run neither starts over
// nor resumes: it says so, and --no-load --overwrite-checkpoints starts over.
TEST_F(TrainGpt, NoCheckpointThatVerifiesIsAnError) {
  TrainRun r = train("--train-iters 2 --save " + ckpt_);
  ASSERT_EQ(r.code, 0) << r.out;
  overwrite_floats(ckpt_ + "/iter_0000002/" + kOptimizer, "wte.weight.exp_avg", 1);
  r = train("--train-iters 4 --save " + ckpt_);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--load " + ckpt_ + ": none of its 1 checkpoint folders verifies: " +
                                  ckpt_ + "/iter_0000002/" + kOptimizer +
                                  ": tensor "
                                  "'wte.weight.exp_avg' checksum mismatch"))
      << r.out;
  EXPECT_TRUE(r.records.empty()) << r.out;
  // Its slices' data are read only by a load, so --no-load sees step 2 there.
  r = train("--train-iters 4 --no-load --save " + ckpt_);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "already holds checkpoints (the newest is step 2)")) << r.out;
  r = train("--train-iters 4 --no-load --overwrite-checkpoints --save " + ckpt_);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(newest_checkpoint_step(ckpt_), 4);
}

// A checkpoint without a manifest is not resumed from --save (nothing in it
// can be verified), and its slices cannot be placed even when named with
// --load-unverified.
TEST_F(TrainGpt, ACheckpointWithoutManifestResumesOnlyWhenNamed) {
  TrainRun r = train("--train-iters 3 --save " + ckpt_);
  ASSERT_EQ(r.code, 0) << r.out;
  fs::remove(ckpt_ + "/iter_0000003/manifest.json");
  r = train("--train-iters 6 --save " + ckpt_);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "holds checkpoints, but none of them verifies")) << r.out;
  EXPECT_TRUE(contains(r.out, "manifest.json is missing")) << r.out;
  r = train("--train-iters 6 --load " + ckpt_ + "/iter_0000003 --save " + ckpt_);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--load-unverified")) << r.out;
  // Its slices cannot be placed without it (a checkpoint of whole tensors
  // from before manifests can: Manifest.AFolderWithoutOneLoadsOnlyWhenNamedAndAllowed).
  r = train("--train-iters 6 --load " + ckpt_ + "/iter_0000003 --load-unverified --save " + ckpt_);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out,
                       "manifest.json is missing, and without it the slices of the "
                       "folder's files cannot be placed"))
      << r.out;
}

// A rewind: --load of an older step with --save holding newer ones is
// refused, naming them, since the first save would remove them; with
// --overwrite-checkpoints the run says which it removes, and does.
TEST_F(TrainGpt, ARewindNamesTheCheckpointsItWouldRemove) {
  TrainRun r = train("--train-iters 4 --save-interval 2 --save " + ckpt_);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string older = ckpt_ + "/iter_0000002", newer = ckpt_ + "/iter_0000004";
  r = train("--train-iters 4 --load " + older + " --save " + ckpt_);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--load " + older + " starts after step 2, but --save " + ckpt_ +
                                  " holds newer checkpoints (" + newer +
                                  "): the run's first save would remove them; add "
                                  "--overwrite-checkpoints"))
      << r.out;
  EXPECT_TRUE(fs::exists(newer));
  r = train("--train-iters 3 --load " + older + " --overwrite-checkpoints --save " + ckpt_);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "note: --overwrite-checkpoints: the first save removes " + newer))
      << r.out;
  EXPECT_FALSE(fs::exists(newer));
  EXPECT_EQ(newest_checkpoint_step(ckpt_), 3);
}

// One writer per --save folder: while a process holds the folder's lock, a
// job saving there stops before it trains, naming that process's host and
// PID; once the holder is gone, the job runs.
TEST_F(TrainGpt, ASecondJobOnOneSaveFolderStopsNamingTheFirst) {
  std::string pid = std::to_string(::getpid());
  {
    SaveDirLock held(ckpt_);
    TrainRun r = train("--train-iters 2 --save " + ckpt_);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(contains(r.out, "--save " + ckpt_ + " is in use by another job (host ")) << r.out;
    EXPECT_TRUE(contains(r.out, "pid " + pid + ")")) << r.out;
    EXPECT_FALSE(contains(r.out, "step     1")) << r.out;
    EXPECT_TRUE(contains(error_message([&] { SaveDirLock again(ckpt_); }), "is in use"));
  }
  TrainRun r = train("--train-iters 2 --save " + ckpt_);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(newest_checkpoint_step(ckpt_), 2);
}

// Unusable --save paths are refused before any step, not at the first save:
// a file, a folder that cannot be made, a path past the system's limits.
TEST_F(TrainGpt, UnusableSavePathsAreRefusedBeforeTraining) {
  write_file(dir_ + "/a-file", "x");
  TrainRun r = train("--train-iters 2 --save " + dir_ + "/a-file");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--save " + dir_ + "/a-file is a file, not a folder")) << r.out;
  r = train("--train-iters 2 --save " + dir_ + "/a-file/under");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--save " + dir_ + "/a-file/under: cannot make the folder"))
      << r.out;
  r = train("--train-iters 2 --save " + dir_ + "/" + std::string(300, 'x'));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "has 300 bytes, past the system's limit of 255")) << r.out;
  std::string deep = dir_;
  while (deep.size() < 4200) deep += "/" + std::string(200, 'd');
  r = train("--train-iters 2 --save " + deep);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--save is too long")) << r.out;
  EXPECT_FALSE(contains(r.out, "step     1")) << r.out;
}

// kill -9 at every phase of a save: during a save at the interval, during
// the final step's save, and during a save of a step that exists (a run
// rewound to step 2 saving step 4 again). A plain re-run resumes from the
// newest complete checkpoint and ends with the uninterrupted run's losses.
enum class When { Interval, Final, Resave };

struct KillCase {
  std::string phase;
  When when;
  int resumes_at;  // the step the re-run resumes from
};

// gtest names a failing case by its phase and moment.
void PrintTo(const KillCase& k, std::ostream* os) {
  *os << k.phase << (k.when == When::Interval ? " at the interval"
                     : k.when == When::Final  ? " at the final step"
                                              : " saving a step again");
}

class KilledSave : public TrainGpt, public ::testing::WithParamInterface<KillCase> {};

TEST_P(KilledSave, ResumesFromTheNewestCompleteCheckpointWithTheSameLosses) {
  const KillCase& k = GetParam();
  const int killed_at = k.when == When::Final ? 6 : 4;  // the step whose save is killed
  std::string args = "--train-iters 6 --save-interval 2 --save " + ckpt_;
  if (k.when == When::Resave) {
    const TrainRun first = train("--train-iters 4 --save-interval 2 --save " + ckpt_);
    ASSERT_EQ(first.code, 0) << first.out;
    args += " --load " + ckpt_ + "/iter_0000002 --overwrite-checkpoints";  // a rewind
  }
  const TrainRun killed = train(args, k.phase + "@" + std::to_string(killed_at));
  ASSERT_TRUE(killed.killed) << "code " << killed.code << ":\n" << killed.out;
  EXPECT_TRUE(contains(killed.out, "WEFT_FAULT_INJECT: SIGKILL at " + k.phase +
                                       " of the save of step " + std::to_string(killed_at)))
      << killed.out;
  // Every step up to the killed save ran (and was logged) as in the uninterrupted run.
  const int started = k.when == When::Resave ? 2 : 0;
  ASSERT_EQ(killed.records.size(), static_cast<size_t>(killed_at - started));
  EXPECT_EQ(killed.records.back()["loss"].get<double>(),
            reference(*this)[static_cast<size_t>(killed_at - 1)]["loss"].get<double>());

  // What the kill left where.
  const std::string f = fmt::format("{}/iter_{:07d}", ckpt_, killed_at);
  if (k.phase == "writing-tensors") {
    EXPECT_TRUE(fs::exists(f + ".tmp/" + kModel + ".tmp"));
    EXPECT_FALSE(fs::exists(f + ".tmp/manifest.json"));
  } else if (k.phase == "before-fsync") {
    EXPECT_TRUE(fs::exists(f + ".tmp/manifest.json"));
  } else if (k.phase == "between-renames") {
    EXPECT_TRUE(fs::exists(f + ".tmp/manifest.json"));
    EXPECT_FALSE(fs::exists(f));
    EXPECT_EQ(fs::exists(f + ".old"), k.when == When::Resave);
  } else {
    EXPECT_TRUE(fs::exists(f + "/manifest.json"));
    EXPECT_EQ(read_file(ckpt_ + "/latest_checkpointed_iteration.txt.tmp"),
              std::to_string(killed_at) + "\n");
  }
  EXPECT_EQ(newest_checkpoint_step(ckpt_), k.resumes_at);

  const TrainRun resumed = train("--train-iters 6 --save-interval 2 --save " + ckpt_);
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_TRUE(contains(resumed.out, "resumed from " + ckpt_ + " at step " +
                                        std::to_string(k.resumes_at) + " (automatic"))
      << resumed.out;
  EXPECT_TRUE(contains(resumed.out, "left by an interrupted save") ||
              contains(resumed.out, "which an interrupted save had set aside"))
      << resumed.out;
  expect_reference_steps(resumed.records, k.resumes_at);
  // Every step saved, each verifying; nothing left over but the writer's lock.
  EXPECT_EQ(entries(ckpt_), (std::vector<std::string>{"iter_0000002", "iter_0000004",
                                                      "iter_0000006",
                                                      "latest_checkpointed_iteration.txt",
                                                      "weft.lock"}));
  EXPECT_EQ(read_file(ckpt_ + "/latest_checkpointed_iteration.txt"), "6\n");
  for (int step : {2, 4, 6})
    EXPECT_TRUE(open_checkpoint(fmt::format("{}/iter_{:07d}", ckpt_, step)).source.verified);
}

std::vector<KillCase> kill_cases() {
  std::vector<KillCase> cases;
  for (const char* phase :
       {"writing-tensors", "before-fsync", "between-renames", "pointer-update"}) {
    const bool in_place = std::string(phase) == "pointer-update";  // iter_N renamed in
    cases.push_back({phase, When::Interval, in_place ? 4 : 2});
    cases.push_back({phase, When::Final, in_place ? 6 : 4});
    cases.push_back({phase, When::Resave, 4});  // the old step 4, or the new one
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryPhase, KilledSave, ::testing::ValuesIn(kill_cases()),
                         [](const ::testing::TestParamInfo<KillCase>& param_info) {
                           std::string n = param_info.param.phase;
                           std::replace(n.begin(), n.end(), '-', '_');
                           const When w = param_info.param.when;
                           return n + (w == When::Interval ? "_interval"
                                       : w == When::Final  ? "_final_step"
                                                           : "_resave");
                         });

}  // namespace
}  // namespace weft
