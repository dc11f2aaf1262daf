// weft/units.h — sizes as people read them, one spelling everywhere.
//
// Header-only (fmt alone), so the schedules and the partitioner, which need
// nothing of the engine, print bytes as the engine does.
#pragma once

#include <weft/error.h>

#include <fmt/core.h>

#include <cmath>
#include <exception>

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

// "2GiB", "512MiB", "64KiB" or a number of bytes; throws weft::Error naming
// the flag.
inline double parse_bytes(const std::string& flag, const std::string& text) {
  size_t end = 0;
  double v = 0;
  try {
    v = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  const std::string unit = text.substr(end);
  const double scale = unit.empty() || unit == "B" ? 1.0
                       : unit == "KiB"             ? 1024.0
                       : unit == "MiB"             ? 1024.0 * 1024
                       : unit == "GiB"             ? 1024.0 * 1024 * 1024
                       : unit == "TiB"             ? 1024.0 * 1024 * 1024 * 1024
                                                   : -1;
  check(end > 0 && scale > 0 && std::isfinite(v) && v > 0,
        "{} '{}' must be a positive size: bytes, or a number with KiB, MiB, GiB or TiB", flag,
        text);
  return v * scale;
}

}  // namespace weft
