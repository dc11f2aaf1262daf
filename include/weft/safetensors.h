// weft/safetensors.h — reading and writing the safetensors format.
//
// Layout: 8-byte little-endian header length N; N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value"}}; then the data section, offsets relative
// to its start. open() validates all of it up front and throws Error naming
// the file, the tensor and the rule broken; get() then cannot fail on format.
#pragma once

#include <weft/tensor.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace weft::safetensors {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  size_t begin = 0;  // byte offsets into the data section
  size_t end = 0;
};

class File {
 public:
  File() = default;
  File(const File&) = delete;  // a copy could lose the data's 64-byte alignment
  File& operator=(const File&) = delete;
  File(File&&) = default;
  File& operator=(File&&) = default;
  // Reads and validates the whole file. Supported dtypes: F32, I32, BF16.
  static File open(const std::string& path);
  // Reads and validates the header only (the same checks as open()); the
  // data stay on disk: get() refuses, and a reader takes a tensor's bytes
  // from data_start() + begin itself.
  static File open_header(const std::string& path);
  // The header as it is in the file (its 8-byte length, then the JSON).
  const std::string& header_bytes() const { return header_; }
  // Where the data section starts in the file, and its length.
  uint64_t data_start() const { return header_.size(); }
  uint64_t data_bytes() const { return data_bytes_; }

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
  // A read-only view of the tensor's bytes (valid while this File lives).
  // Throws Error naming the file when `name` is absent.
  Tensor get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  static File read(const std::string& path, bool data);
  std::string path_;
  std::vector<char> bytes_;  // the data section, 64-byte aligned copy
  bool has_data_ = false;    // false: opened by open_header
  std::string header_;
  uint64_t data_bytes_ = 0;
  size_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (CPU, contiguous) in the given order. Atomic: the bytes go to
// `path + ".tmp"`, are flushed, then renamed over `path`. `after_tensor(i)`,
// when given, runs once tensor i's bytes are written and the file is still
// partial (weft/checkpoint.h's fault injection stops a save there).
void save(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata = {},
          const std::function<void(size_t)>& after_tensor = {});

}  // namespace weft::safetensors
