// An SVG timeline of a simulated schedule: one row per rank, a box per
// compute action coloured by kind, and idle time left as white gaps, so the
// bubble is what the eye sees; the parameter update, when the costs have
// one, follows in grey. Only compute actions are <rect>s (the legend and
// the update are paths), which keeps the boxes countable.
//
// Every box carries its action ("3F7") twice: as a <title> tooltip and as
// visible text in the largest font, up to 10 px, that fits inside the box.
// The width stays 960 px however many boxes there are, so that a page that
// scales the picture to its column does not shrink the rows with it: at
// pp 4 and 8 micro-batches with uniform costs, ZB-V's labels are 7 px.
#include <weft/simulate.h>

#include <fmt/format.h>

#include <algorithm>

namespace weft::sched {
namespace {

constexpr double kLabelWidth = 64;
constexpr double kPlotWidth = 960;
constexpr double kMaxFont = 10;
constexpr double kBoxPadding = 1.5;  // each side, between a label and its box's edge
constexpr double kRowHeight = 22;
constexpr double kRowGap = 6;
constexpr double kTop = 28;
constexpr double kLegendHeight = 30;
constexpr const char* kUpdateColour = "#a0a0a0";

struct Kind {
  ActionKind kind;
  const char* label;
  const char* colour;
};
constexpr Kind kKinds[] = {
    {ActionKind::F, "forward", "#4c72b0"},
    {ActionKind::I, "input-grad", "#55a868"},
    {ActionKind::W, "weight-grad", "#dd8452"},
    {ActionKind::B, "full backward", "#17a398"},
};

const Kind* kind_of(ActionKind k) {
  for (const Kind& c : kKinds)
    if (c.kind == k) return &c;
  return nullptr;
}

std::string escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    if (ch == '<') out += "&lt;";
    else if (ch == '>') out += "&gt;";
    else if (ch == '&') out += "&amp;";
    else if (ch == '"') out += "&quot;";
    else out += ch;
  }
  return out;
}

double row_y(size_t rank) { return kTop + static_cast<double>(rank) * (kRowHeight + kRowGap); }

// A label's width in em, near enough for sans-serif: W is wide, digits and
// the other capitals about 0.62 em.
double label_ems(const std::string& text) {
  double ems = 0;
  for (char ch : text) ems += ch == 'W' ? 0.95 : 0.62;
  return ems;
}

std::string action_box(const Action& a, const ActionTime& t, const Kind& k, double x0,
                       double scale, size_t rank) {
  const double x = kLabelWidth + (t.start - x0) * scale;
  const double w = std::max(0.5, (t.end - t.start) * scale);
  const double y = row_y(rank);
  const std::string label = a.str();
  std::string out = fmt::format(
      "<rect class=\"action {}\" x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" "
      "fill=\"{}\" stroke=\"#ffffff\" stroke-width=\"0.5\"><title>{} [{:.3g}, {:.3g})</title>"
      "</rect>\n",
      k.label, x, y, w, kRowHeight, k.colour, label, t.start, t.end);
  // The largest font that fits; the text lets the pointer through to the tooltip.
  const double fits = (w - 2 * kBoxPadding) / label_ems(label);
  const double font = std::clamp(fits, 0.1, kMaxFont);
  out += fmt::format(
      "<text class=\"label\" x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"{:.2f}\" "
      "fill=\"#ffffff\" text-anchor=\"middle\" pointer-events=\"none\">{}</text>\n",
      x + w / 2, y + kRowHeight / 2 + 0.35 * font, font, label);
  return out;
}

std::string legend(double y, bool update) {
  std::string out;
  double x = kLabelWidth;
  auto swatch = [&](const char* colour, const char* label) {
    out += fmt::format("<path d=\"M{:.1f} {:.1f}h10v10h-10z\" fill=\"{}\"/>\n", x, y, colour);
    out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\">{}</text>\n", x + 14,
                       y + 9, label);
    x += 120;
  };
  for (const Kind& k : kKinds) swatch(k.colour, k.label);
  if (update) swatch(kUpdateColour, "update");
  out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\">idle: white</text>\n", x,
                     y + 9);
  return out;
}

}  // namespace

std::string timeline_svg(const Schedule& s, const SimResult& r, const std::string& unit) {
  const size_t ranks = s.actions.size();
  const double span = r.step_time > 0 ? r.step_time : 1;
  const double scale = kPlotWidth / span;
  const double plot_bottom = row_y(ranks);
  const double width = kLabelWidth + kPlotWidth + 16;
  const double height = plot_bottom + kLegendHeight;
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
      "viewBox=\"0 0 {:.0f} {:.0f}\" font-family=\"sans-serif\">\n",
      width, height, width, height);
  out += fmt::format(
      "<text x=\"{:.1f}\" y=\"18\" font-size=\"13\">{} (pp {}, chunks {}, micro-batches {}): "
      "step {:.4g}{}{}, bubble {:.1f}%</text>\n",
      kLabelWidth, escape(s.name), s.pp, s.chunks, s.micro_batches, r.step_time,
      unit.empty() ? "" : " ", escape(unit), 100 * r.bubble_fraction);
  for (size_t rank = 0; rank < ranks; ++rank) {
    const double y = row_y(rank);
    out += fmt::format("<text x=\"4\" y=\"{:.2f}\" font-size=\"11\">rank {}</text>\n",
                       y + kRowHeight / 2 + 4, rank);
    // The row's frame: what stays white inside it is idle time.
    out += fmt::format(
        "<path d=\"M{:.1f} {:.2f}h{:.1f}v{:.1f}h{:.1f}z\" fill=\"none\" stroke=\"#cccccc\"/>\n",
        kLabelWidth, y, kPlotWidth, kRowHeight, -kPlotWidth);
    for (size_t i = 0; i < s.actions[rank].size(); ++i)
      if (const Kind* k = kind_of(s.actions[rank][i].kind))
        out += action_box(s.actions[rank][i], r.times[rank][i], *k, r.first_start, scale, rank);
    if (rank < r.update.size() && r.update[rank] > 0)
      out += fmt::format(
          "<path d=\"M{:.2f} {:.2f}h{:.2f}v{:.1f}h{:.2f}z\" fill=\"{}\"><title>update "
          "{:.3g}</title></path>\n",
          kLabelWidth + r.pipeline_time * scale, y, std::max(0.5, r.update[rank] * scale),
          kRowHeight, -std::max(0.5, r.update[rank] * scale), kUpdateColour, r.update[rank]);
  }
  out += legend(plot_bottom + 6, r.update_time > 0);
  out += "</svg>\n";
  return out;
}

}  // namespace weft::sched
