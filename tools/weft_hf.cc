// weft-hf: weft checkpoints to Hugging Face transformers' GPT-2 and Llama
// folders, and back (weft/hf.h holds the names and layouts).
//
//   weft-hf export --load ckpt --output hf-model
//       then GPT2LMHeadModel.from_pretrained("hf-model") (or LlamaForCausalLM's)
//   weft-hf import --input hf-model --output init.safetensors
//       then train_gpt --init-from init.safetensors with the flags it prints
#include <weft/error.h>
#include <weft/hf.h>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <string>

namespace {

struct Options {
  std::string load, input, output;
  bool load_unverified = false;
};

int run_export(const Options& o) {
  const weft::hf::ExportResult r = weft::hf::export_checkpoint(o.load, o.output, o.load_unverified);
  for (const auto& [folder, why] : r.source.skipped)
    fmt::print(stderr, "weft-hf export: skipped {}, which does not verify: {}\n", folder, why);
  if (!r.source.verified)
    fmt::print(stderr, "weft-hf export: {} has no manifest; its files were not verified\n",
               r.source.path);
  fmt::print("wrote {}/model.safetensors ({} tensors) and {}/config.json: the {} of {} (step {})\n",
             o.output, r.tensors, o.output, r.shape.arch, r.source.path, r.source.step);
  return 0;
}

int run_import(const Options& o) {
  const weft::hf::ImportResult r = weft::hf::import_folder(o.input, o.output);
  fmt::print("wrote {}: {} tensors, {} parameters of the {} in {}\n", o.output, r.tensors,
             r.parameters, r.shape.arch, o.input);
  fmt::print("train_gpt --init-from {} {}\n", o.output, r.shape.train_gpt_flags());
  if (r.shape.llama())
    fmt::print("note: max_position_embeddings is {}: keep --seq-length at or below it\n",
               r.shape.max_positions);
  else
    fmt::print("note: --seq-length can be at most --max-position-embeddings ({})\n",
               r.shape.max_positions);
  for (const std::string& note : r.notes) fmt::print("note: {}\n", note);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "weft-hf: weft checkpoints to Hugging Face transformers' GPT-2 and Llama folders "
      "(model.safetensors + config.json), and back"};
  app.require_subcommand(1);
  Options o;
  CLI::App* exp = app.add_subcommand(
      "export", "a checkpoint to a folder that GPT2LMHeadModel or LlamaForCausalLM loads");
  exp->add_option("--load", o.load,
                  "a checkpoint folder (its newest step that verifies) or one iter_N folder")
      ->required();
  exp->add_option("--output", o.output, "the folder to write model.safetensors and config.json to")
      ->required();
  exp->add_flag("--load-unverified", o.load_unverified,
                "read an iter_N folder that has no manifest (saved before manifests)");
  CLI::App* imp = app.add_subcommand(
      "import", "a transformers folder to one safetensors file for train_gpt --init-from");
  imp->add_option("--input", o.input,
                  "a folder with config.json and model.safetensors (or its shards' index)")
      ->required();
  imp->add_option("--output", o.output, "the safetensors file to write")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    fmt::print(stderr, "weft-hf: {}\n", e.what());
    return 1;
  }
  try {
    return exp->parsed() ? run_export(o) : run_import(o);
  } catch (const std::exception& e) {  // weft::Error, and the standard library's own
    fmt::print(stderr, "weft-hf {}: {}\n", exp->parsed() ? "export" : "import", e.what());
    return 1;
  }
}
