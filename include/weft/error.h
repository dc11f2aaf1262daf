// weft/error.h — the one exception type that crosses weft's boundaries.
//
// Errors carry the offending values and the rule they broke:
//   throw Error("heads ({}) must divide the hidden size ({})", heads, hidden);
// A command-line program catches Error, prints its message on one line and
// exits non-zero; library code never calls exit().
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace weft {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
  template <typename... Args>
  explicit Error(fmt::format_string<Args...> f, Args&&... args)
      : std::runtime_error(fmt::format(f, std::forward<Args>(args)...)) {}
};

// Throws Error with the formatted message when `cond` is false.
template <typename... Args>
inline void check(bool cond, fmt::format_string<Args...> f, Args&&... args) {
  if (!cond) throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace weft
