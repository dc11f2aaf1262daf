// weft/units.h — sizes as people read them, one spelling everywhere.
//
// Header-only (fmt alone), so the schedules and the partitioner, which need
// nothing of the engine, print bytes as the engine does.
#pragma once

#include <fmt/core.h>

#include <iterator>
#include <string>

namespace weft {

// "512 B", "176.0 MiB", "1.5 GiB": binary units, one decimal.
inline std::string format_bytes(double bytes) {
  if (bytes < 1024) return fmt::format("{:g} B", bytes);
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = bytes / 1024;
  size_t unit = 0;
  // 1023.96 KiB would print as "1024.0 KiB": that is 1.0 MiB.
  while (value >= 1023.95 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return fmt::format("{:.1f} {}", value, kUnits[unit]);
}

}  // namespace weft
