// Action's text form: "<stage><KIND><micro-batch>", e.g. "2F0", "1SEND_B3".
// Gradient reductions name a stage and no micro-batch ("0REDUCE_GRAD"); the
// optimizer step names neither ("STEP").
#include <weft/error.h>
#include <weft/schedule.h>

#include <array>
#include <cctype>
#include <charconv>

namespace weft::sched {
namespace {

struct KindName {
  ActionKind kind;
  std::string_view name;
};

constexpr std::array<KindName, 11> kKindNames = {{
    {ActionKind::F, "F"},
    {ActionKind::B, "B"},
    {ActionKind::I, "I"},
    {ActionKind::W, "W"},
    {ActionKind::SEND_F, "SEND_F"},
    {ActionKind::RECV_F, "RECV_F"},
    {ActionKind::SEND_B, "SEND_B"},
    {ActionKind::RECV_B, "RECV_B"},
    {ActionKind::REDUCE_GRAD, "REDUCE_GRAD"},
    {ActionKind::REDUCE_TIED, "REDUCE_TIED"},
    {ActionKind::STEP, "STEP"},
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
