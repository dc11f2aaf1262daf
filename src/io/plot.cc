#include <weft/error.h>
#include <weft/plot.h>

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

namespace weft {

namespace {

constexpr double kWidth = 720, kHeight = 420;
constexpr double kLeft = 70, kRight = 20, kTop = 40, kBottom = 50;

// A round tick step giving about `n` ticks over [lo, hi].
double tick_step(double lo, double hi, int n) {
  const double raw = std::max((hi - lo) / n, 1e-12);
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * p) return m * p;
  return 10 * p;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

}  // namespace

void write_loss_plot(const std::string& path, const std::vector<std::pair<double, double>>& train,
                     const std::vector<std::pair<double, double>>& validation,
                     const std::string& title) {
  double x0 = std::numeric_limits<double>::max(), x1 = std::numeric_limits<double>::lowest();
  double y0 = x0, y1 = x1;
  for (const auto* series : {&train, &validation})
    for (const auto& [x, y] : *series) {
      if (!std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  if (x0 > x1) x0 = 0, x1 = 1, y0 = 0, y1 = 1;  // nothing to draw: empty axes
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad, y1 += pad;
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return kTop + (y1 - y) / (y1 - y0) * ph; };

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n<text x=\"{}\" y=\"22\" font-size=\"14\">{}</text>\n",
      kWidth, kHeight, kLeft, escape(title));
  // Axes, ticks and grid.
  const double xs = tick_step(x0, x1, 8), ys = tick_step(y0, y1, 6);
  for (double x = std::ceil(x0 / xs) * xs; x <= x1 + 1e-9; x += xs)
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#eee\"/>"
        "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4:g}</text>\n",
        px(x), kTop, kTop + ph, kTop + ph + 16, x);
  for (double y = std::ceil(y0 / ys) * ys; y <= y1 + 1e-9; y += ys)
    svg += fmt::format(
        "<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#eee\"/>"
        "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5:g}</text>\n",
        kLeft, py(y), kLeft + pw, kLeft - 6, py(y) + 4, y);
  svg += fmt::format(
      "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n"
      "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n"
      "<text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">loss "
      "(nats)</text>\n",
      kLeft, kTop, pw, ph, kLeft + pw / 2, kHeight - 10, kTop + ph / 2, kTop + ph / 2);
  auto polyline = [&](const std::vector<std::pair<double, double>>& pts, const char* style) {
    std::string p;
    for (const auto& [x, y] : pts)
      if (std::isfinite(y)) p += fmt::format("{:.1f},{:.1f} ", px(x), py(y));
    return fmt::format("<polyline fill=\"none\" {} points=\"{}\"/>\n", style, p);
  };
  svg += polyline(train, "stroke=\"#1f77b4\" stroke-width=\"1.2\"");
  if (!validation.empty()) {
    svg += polyline(validation, "stroke=\"#d62728\" stroke-width=\"1.5\" stroke-dasharray=\"5 3\"");
    for (const auto& [x, y] : validation)
      if (std::isfinite(y))
        svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"#d62728\"/>\n",
                           px(x), py(y));
  }
  // Legend.
  const double lx = kLeft + pw - 150, ly = kTop + 14;
  svg += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"#1f77b4\" stroke-width=\"2\"/>"
      "<text x=\"{3}\" y=\"{4}\">train</text>\n",
      lx, ly, lx + 24, lx + 30, ly + 4);
  if (!validation.empty())
    svg += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"#d62728\" stroke-width=\"2\" "
        "stroke-dasharray=\"5 3\"/><text x=\"{3}\" y=\"{4}\">validation</text>\n",
        lx, ly + 18, lx + 24, lx + 30, ly + 22);
  svg += "</svg>\n";
  std::ofstream f(path, std::ios::trunc);
  f << svg;
  check(f.good(), "cannot write the loss plot {}", path);
}

}  // namespace weft
