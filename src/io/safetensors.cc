#include <weft/safetensors.h>

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

namespace weft::safetensors {
namespace {

// Tensor bytes are copied verbatim between memory and file, and the format is
// little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little-endian");

using Json = nlohmann::ordered_json;  // keeps the file's tensor order

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr size_t kAlign = 64;

std::string errno_str() { return std::strerror(errno); }

// A FILE* that closes itself; open() only reads, so close errors do not matter.
struct Reader {
  std::FILE* f = nullptr;
  ~Reader() {
    if (f) std::fclose(f);
  }
};

void read_exact(Reader& r, const std::string& path, void* dst, size_t n, const char* what) {
  if (n == 0) return;
  if (std::fread(dst, 1, n, r.f) != n) {
    if (std::ferror(r.f)) throw Error("{}: error reading the {}: {}", path, what, errno_str());
    throw Error("{}: file ended while reading the {} ({} bytes)", path, what, n);
  }
}

bool parse_dtype(const std::string& s, DType* out) {
  for (DType t : {DType::F32, DType::I32, DType::BF16}) {
    if (s == dtype_name(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

// A JSON value as a non-negative integer; false for anything else (floats,
// negatives, strings).
bool as_size(const Json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

TensorInfo parse_entry(const std::string& path, const std::string& name, const Json& e,
                       uint64_t data_bytes) {
  check(e.is_object(), "{}: tensor '{}' header entry is {}, not an object", path, name,
        e.type_name());
  TensorInfo info;
  info.name = name;

  auto dt = e.find("dtype");
  check(dt != e.end(), "{}: tensor '{}' is missing \"dtype\"", path, name);
  check(dt->is_string(), "{}: tensor '{}' dtype is {}, not a string", path, name, dt->dump());
  const std::string& dts = dt->get_ref<const std::string&>();
  check(parse_dtype(dts, &info.dtype),
        "{}: tensor '{}' has unsupported dtype \"{}\" (supported: F32, I32, BF16)", path, name,
        dts);

  auto sh = e.find("shape");
  check(sh != e.end(), "{}: tensor '{}' is missing \"shape\"", path, name);
  check(sh->is_array(), "{}: tensor '{}' shape {} is not an array", path, name, sh->dump());
  check(sh->size() <= static_cast<size_t>(Shape::kMaxRank),
        "{}: tensor '{}' shape {} has rank {}, more than the maximum of {}", path, name,
        sh->dump(), sh->size(), Shape::kMaxRank);
  // The product is bounded by data_bytes below, but must not wrap on the way there.
  uint64_t numel = 1;
  bool overflow = false, has_zero = false;
  for (size_t i = 0; i < sh->size(); ++i) {
    uint64_t d = 0;
    check(as_size((*sh)[i], &d),
          "{}: tensor '{}' shape {} dimension {} must be a non-negative integer", path, name,
          sh->dump(), i);
    check(d <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
          "{}: tensor '{}' shape {} dimension {} is too large", path, name, sh->dump(), i);
    info.shape.dims[i] = static_cast<int64_t>(d);
    if (d == 0) has_zero = true;
    if (d != 0 && numel > std::numeric_limits<uint64_t>::max() / d) overflow = true;
    numel *= d;
  }
  info.shape.rank = static_cast<int>(sh->size());
  if (has_zero) {  // a zero extent wins over any earlier wrap
    overflow = false;
    numel = 0;
  }
  check(!overflow, "{}: tensor '{}' shape {} has too many elements", path, name, sh->dump());

  auto off = e.find("data_offsets");
  check(off != e.end(), "{}: tensor '{}' is missing \"data_offsets\"", path, name);
  uint64_t begin = 0, end = 0;
  check(off->is_array() && off->size() == 2 && as_size((*off)[0], &begin) &&
            as_size((*off)[1], &end),
        "{}: tensor '{}' data_offsets {} must be [begin, end] with non-negative integers", path,
        name, off->dump());
  check(begin <= end, "{}: tensor '{}' data_offsets [{}, {}] have begin after end", path, name,
        begin, end);
  check(end <= data_bytes,
        "{}: tensor '{}' data_offsets [{}, {}] run past the end of the data section ({} bytes)",
        path, name, begin, end, data_bytes);
  uint64_t esize = dtype_size(info.dtype);
  check(numel <= data_bytes / esize && end - begin == numel * esize,
        "{}: tensor '{}' data_offsets [{}, {}] span {} bytes, but {} {} needs {} x {} bytes", path,
        name, begin, end, end - begin, dts, info.shape.str(), numel, esize);
  info.begin = static_cast<size_t>(begin);
  info.end = static_cast<size_t>(end);
  return info;
}

}  // namespace

File File::open(const std::string& path) { return read(path, /*data=*/true); }

File File::open_header(const std::string& path) { return read(path, /*data=*/false); }

File File::read(const std::string& path, bool data) {
  Reader r;
  r.f = std::fopen(path.c_str(), "rb");
  check(r.f != nullptr, "{}: cannot open: {}", path, errno_str());
  std::error_code ec;
  uint64_t file_bytes = std::filesystem::file_size(path, ec);
  check(!ec, "{}: cannot read the file size: {}", path, ec.message());
  check(file_bytes >= 8,
        "{}: file is {} bytes, shorter than the 8-byte header length of a safetensors file", path,
        file_bytes);

  unsigned char len_bytes[8];
  read_exact(r, path, len_bytes, 8, "header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  check(n <= file_bytes - 8, "{}: header length {} runs past the end of the file ({} bytes)",
        path, n, file_bytes);
  check(n <= kMaxHeaderBytes, "{}: header length {} exceeds the limit of {} bytes", path, n,
        kMaxHeaderBytes);

  std::string header(static_cast<size_t>(n), '\0');
  read_exact(r, path, header.data(), header.size(), "header");
  Json j;
  try {
    j = Json::parse(header);
  } catch (const Json::parse_error& e) {
    throw Error("{}: header is not valid JSON: {}", path, e.what());
  }
  check(j.is_object(), "{}: header JSON is {}, not an object", path, j.type_name());

  File file;
  file.path_ = path;
  uint64_t data_bytes = file_bytes - 8 - n;
  file.header_.assign(reinterpret_cast<const char*>(len_bytes), 8);
  file.header_ += header;
  file.data_bytes_ = data_bytes;
  file.has_data_ = data;
  for (const auto& [key, value] : j.items()) {
    if (key == "__metadata__") {
      check(value.is_object(), "{}: __metadata__ is {}, not an object", path, value.type_name());
      for (const auto& [mk, mv] : value.items()) {
        check(mv.is_string(), "{}: __metadata__ value for '{}' is {}, not a string", path, mk,
              mv.dump());
        file.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    file.tensors_.push_back(parse_entry(path, key, value, data_bytes));
  }

  if (!data) return file;
  // Over-allocate so the data can start on a 64-byte boundary inside bytes_.
  file.bytes_.resize(static_cast<size_t>(data_bytes) + kAlign);
  auto addr = reinterpret_cast<uintptr_t>(file.bytes_.data());
  file.data_offset_ = (kAlign - addr % kAlign) % kAlign;
  read_exact(r, path, file.bytes_.data() + file.data_offset_, static_cast<size_t>(data_bytes),
             "data section");
  return file;
}

const TensorInfo* File::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

Tensor File::get(const std::string& name) const {
  const TensorInfo* info = find(name);
  check(info != nullptr, "{}: no tensor named '{}' ({} tensors in the file)", path_, name,
        tensors_.size());
  check(has_data_, "{}: tensor '{}': only the header was read", path_, name);
  // The Tensor API has no const view; callers must treat file tensors as read-only.
  char* base = const_cast<char*>(bytes_.data()) + data_offset_;
  return Tensor(base + info->begin, info->shape, info->dtype, Device::cpu());
}

namespace {

// A POSIX fd so the bytes can be fsync'ed before the rename makes them visible.
class Writer {
 public:
  explicit Writer(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    check(fd_ >= 0, "{}: cannot create: {}", path, errno_str());
  }
  ~Writer() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      check(w > 0, "{}: write failed: {}", path_, w < 0 ? errno_str() : "no bytes written");
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void finish() {
    check(::fsync(fd_) == 0, "{}: fsync failed: {}", path_, errno_str());
    int fd = fd_;
    fd_ = -1;
    check(::close(fd) == 0, "{}: close failed: {}", path_, errno_str());
  }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace

void save(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata,
          const std::function<void(size_t)>& after_tensor) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::set<std::string> seen;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    check(name != "__metadata__", "{}: '__metadata__' is reserved and cannot name a tensor", path);
    check(seen.insert(name).second, "{}: tensor name '{}' appears more than once", path, name);
    check(t.defined(), "{}: tensor '{}' is undefined", path, name);
    check(t.device().is_cpu(), "{}: tensor '{}' is on {}; only CPU tensors can be saved", path,
          name, t.device().str());
    Json shape = Json::array();
    for (int i = 0; i < t.rank(); ++i) shape.push_back(t.dim(i));
    header[name] = {{"dtype", dtype_name(t.dtype())},
                    {"shape", std::move(shape)},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }

  std::string text = header.dump();
  // Readers may map the data section; padding keeps it 8-byte aligned in the file.
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len_bytes[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(n >> (8 * i));

  std::string tmp = path + ".tmp";
  try {
    Writer w(tmp);
    w.write(len_bytes, sizeof(len_bytes));
    w.write(text.data(), text.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i].second;
      if (t.nbytes()) w.write(t.raw(), t.nbytes());
      if (after_tensor) after_tensor(i);
    }
    w.finish();
  } catch (const Error&) {
    std::remove(tmp.c_str());
    throw;
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    throw Error("{}: cannot rename {} over it: {}", path, tmp, ec.message());
  }
}

}  // namespace weft::safetensors
