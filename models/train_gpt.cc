// train_gpt — train a GPT-2 or Llama-style model on a text or llm.c token
// file: the training job (weft/job.h) with weft's two model families.
//
//   train_gpt --model mini --data-path /usr/share/games/fortunes/fortunes
//             --micro-batch-size 16 --train-iters 300 --lr 1e-3
//
// Flags follow Megatron-LM's names (--help lists them). Errors print one
// line naming the value and the rule it broke, and exit with status 1.
#include <weft/job.h>

int main(int argc, char** argv) {
  weft::Job job;
  job.program = "train_gpt";
  job.about = "train_gpt: train a GPT-2-style model with weft";
  job.families = {weft::gpt_family(), weft::llama_family()};
  return weft::train_main(argc, argv, job);
}
