// Action's text form: "<stage><KIND><micro-batch>", e.g. "2F0", "1SEND_B3".
// Gradient reductions name a stage and no micro-batch ("0REDUCE_GRAD"); the
// optimizer step names neither ("STEP").
#include <weft/error.h>
#include <weft/schedule.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>

namespace weft::sched {
namespace {

struct KindName {
  ActionKind kind;
  std::string_view name;
  std::string_view meaning;  // the legend's line
};

constexpr std::array<KindName, 11> kKindNames = {{
    {ActionKind::F, "F", "forward"},
    {ActionKind::B, "B", "full backward (I then W)"},
    {ActionKind::I, "I", "backward for the input (the activation gradient)"},
    {ActionKind::W, "W", "backward for the weights"},
    {ActionKind::SEND_F, "SEND_F", "send the stage's output to the next stage's rank"},
    {ActionKind::RECV_F, "RECV_F", "receive the stage's input from the previous stage's rank"},
    {ActionKind::SEND_B, "SEND_B", "send the stage's input gradient to the previous stage's rank"},
    {ActionKind::RECV_B, "RECV_B",
     "receive the stage's output gradient from the next stage's rank"},
    {ActionKind::REDUCE_GRAD, "REDUCE_GRAD", "reduce the stage's gradients across replicas"},
    {ActionKind::REDUCE_TIED, "REDUCE_TIED", "sum tied-weight gradients across their stages"},
    {ActionKind::STEP, "STEP", "optimizer step"},
}};

std::string_view kind_name(ActionKind kind) {
  for (const KindName& k : kKindNames)
    if (k.kind == kind) return k.name;
  throw Error("action kind {} is not one of weft's action kinds", static_cast<int>(kind));
}

// Which fields a kind's text carries; the parser insists on exactly these so
// that every accepted text prints back the same.
bool has_stage(ActionKind kind) { return kind != ActionKind::STEP; }
bool has_micro_batch(ActionKind kind) {
  return kind != ActionKind::STEP && kind != ActionKind::REDUCE_GRAD &&
         kind != ActionKind::REDUCE_TIED;
}

// Reads a run of decimal digits at the front of `text`; -1 when there are none.
int take_number(std::string_view& text, std::string_view whole) {
  size_t n = 0;
  while (n < text.size() && std::isdigit(static_cast<unsigned char>(text[n]))) ++n;
  if (n == 0) return -1;
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + n, value);
  check(ec == std::errc(), "action '{}': the number '{}' does not fit an int", whole,
        text.substr(0, n));
  text.remove_prefix(n);
  return value;
}

}  // namespace

std::string Action::str() const {
  std::string out;
  if (has_stage(kind)) out += std::to_string(stage);
  out += kind_name(kind);
  if (has_micro_batch(kind)) out += std::to_string(micro_batch);
  return out;
}

std::string render_legend(const Schedule& s) {
  auto appears = [&](ActionKind kind) {
    return std::any_of(s.actions.begin(), s.actions.end(), [&](const std::vector<Action>& list) {
      return std::any_of(list.begin(), list.end(), [&](const Action& a) { return a.kind == kind; });
    });
  };
  std::vector<const KindName*> used;
  size_t width = 0;
  for (const KindName& k : kKindNames) {
    if (!appears(k.kind)) continue;
    used.push_back(&k);
    width = std::max(width, k.name.size());
  }
  std::string out = "2F0 = stage 2 (of pp x chunks, from 0), kind F, micro-batch 0; the kinds:\n";
  for (const KindName* k : used)
    out += fmt::format("  {:<{}}  {}\n", k->name, width, k->meaning);
  return out;
}

Action Action::parse(std::string_view text) {
  std::string_view rest = text;
  const int stage = take_number(rest, text);
  size_t n = 0;
  while (n < rest.size() && (std::isupper(static_cast<unsigned char>(rest[n])) || rest[n] == '_'))
    ++n;
  const std::string_view name = rest.substr(0, n);
  rest.remove_prefix(n);
  const int micro_batch = take_number(rest, text);
  check(rest.empty(), "action '{}': unexpected '{}' after the micro-batch", text, rest);

  for (const KindName& k : kKindNames) {
    if (k.name != name) continue;
    check(has_stage(k.kind) == (stage >= 0), "action '{}': {} {} a leading stage number", text,
          name, has_stage(k.kind) ? "needs" : "takes no");
    check(has_micro_batch(k.kind) == (micro_batch >= 0),
          "action '{}': {} {} a trailing micro-batch number", text, name,
          has_micro_batch(k.kind) ? "needs" : "takes no");
    return Action{k.kind, stage, micro_batch};
  }
  throw Error(
      "action '{}': '{}' is not a kind (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, "
      "REDUCE_GRAD, REDUCE_TIED, STEP)",
      text, name);
}

}  // namespace weft::sched
