// The training job's flags (weft/job.h): Megatron-LM's names, each with its
// help line; CLI11 parses them into Args.
#include "src/job/job_internal.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <charconv>
#include <limits>
#include <string>
#include <system_error>
#include <vector>

namespace weft::job_detail {

void add_flags(CLI::App& app, Args& a, const Job& job) {
  app.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--model", a.model, "shape preset: toy, mini, small, gpt2 (flags override)");
  std::vector<std::string> families;
  for (const ModelFamily& f : job.families) families.push_back(fmt::format("{} ({})", f.name, f.about));
  app.add_option("--arch", a.arch,
                 fmt::format("model family: {} (default: the one the flags below describe, else "
                             "the first)",
                             fmt::join(families, "; ")));
  app.add_option("--normalization", a.normalization, "LayerNorm or RMSNorm");
  app.add_option("--position-embedding-type", a.position_embedding_type,
                 "learned_absolute or rope");
  app.add_flag("--swiglu", a.swiglu, "SwiGLU MLP");
  app.add_flag("--untie-embeddings-and-output-weights", a.untie, "an LM head of its own");
  app.add_flag("--disable-bias-linear", a.disable_bias, "linear layers without biases");
  app.add_flag("--group-query-attention", a.gqa,
               "grouped-query attention: query heads share key/value heads (llama)");
  app.add_option("--num-query-groups", a.num_query_groups,
                 "key/value heads with --group-query-attention (default 1); must divide "
                 "--num-attention-heads and be divisible by --tp");
  app.add_option("--ffn-hidden-size", a.ffn_hidden_size,
                 "SwiGLU width (llama; default 8 x hidden / 3 rounded up to 64)");
  app.add_option("--rotary-base", a.rotary_base, "rotary embedding base (llama)");
  app.add_option("--num-layers", a.gpt.num_layers, "transformer blocks");
  app.add_option("--hidden-size", a.gpt.hidden_size, "model width");
  app.add_option("--num-attention-heads", a.gpt.num_heads, "attention heads");
  app.add_option("--seq-length", a.gpt.seq_length, "tokens per sequence");
  app.add_option("--max-position-embeddings", a.gpt.max_positions,
                 "rows of the position table (default: --seq-length)");
  app.add_option("--vocab-size", a.gpt.vocab_size, "vocabulary (256 for byte data)");
  app.add_option("--make-vocab-size-divisible-by", a.vocab_divisor,
                 "pad the vocabulary table to a multiple of this x --tp (default 128; 1: no "
                 "padding); padding rows are masked, zero and never saved");
  app.add_option("--micro-batch-size", a.micro_batch, "sequences per micro-batch");
  app.add_option("--global-batch-size", a.global_batch,
                 "sequences per step (a multiple of the micro-batch size; default: one micro-batch)");
  app.add_option("--train-iters", a.train_iters, "steps to train (in total, when resuming)");
  app.add_option("--lr", a.lr, "peak learning rate");
  app.add_option("--min-lr", a.min_lr, "final learning rate of the cosine decay");
  app.add_option("--lr-decay-style", a.lr_decay_style, "constant or cosine");
  app.add_option("--lr-warmup-iters", a.lr_warmup_iters, "linear warmup steps");
  app.add_option("--lr-decay-iters", a.lr_decay_iters, "cosine length (default: --train-iters)");
  app.add_option("--weight-decay", a.weight_decay, "AdamW decay on 2-D parameters");
  app.add_option("--clip-grad", a.clip_grad, "global gradient-norm clip (0 = off)");
  app.add_option("--max-loss", a.max_loss,
                 "stop, naming the step, at a loss above this (default: 4 x ln(vocabulary), four "
                 "times a uniform guess's; 0 = off)");
  app.add_option("--adam-beta1", a.beta1);
  app.add_option("--adam-beta2", a.beta2);
  app.add_option("--adam-eps", a.eps);
  app.add_option("--seed", a.seed, "initialisation seed");
  app.add_option("--data-path", a.data_path_given,
                 "datasets to train on, split by --split: PATH, or WEIGHT PATH WEIGHT PATH ..., or "
                 "PATH PATH ... (weighted by size); a PATH is a text file (bytes), an llm.c .bin, "
                 "a Megatron indexed dataset (PREFIX of PREFIX.bin and PREFIX.idx) or, with "
                 "--data-format uint16, nanoGPT's .bin")
      ->expected(1, -1);
  app.add_option("--train-data-path", a.train_data_path_given,
                 "datasets to train on, whole (as --data-path; instead of it and --split)")
      ->expected(1, -1);
  app.add_option("--valid-data-path", a.valid_data_path_given,
                 "datasets to validate on, whole (with --train-data-path)")
      ->expected(1, -1);
  app.add_option("--data-format", a.data_format,
                 "auto (by name: PREFIX with .idx and .bin is indexed, another .bin is llm.c's, "
                 "anything else text), text, llmc, uint16 (nanoGPT's header-less .bin), indexed");
  app.add_option("--data-order", a.data_order,
                 "shuffled (default: each dataset's windows in an order drawn from --seed, "
                 "another each epoch) or file (in file order)");
  app.add_option("--init-from", a.init_from, "safetensors weights with Hugging Face GPT-2 names");
  app.add_option("--save", a.save, "checkpoint directory to write");
  app.add_option("--load", a.load,
                 "checkpoint directory (or one iter_N in it) to resume from (default: --save, "
                 "when it holds one)");
  app.add_flag("--no-load", a.no_load, "start over even when --save holds checkpoints");
  app.add_flag("--finetune", a.finetune,
               "start from the weights of --load only: no optimizer state, step 0, and flags may "
               "differ from its meta.json");
  app.add_flag("--override-opt_param-scheduler", a.override_scheduler,
               "on a resume, let --lr, --min-lr, --lr-decay-style, --lr-warmup-iters and "
               "--lr-decay-iters that differ from the checkpoint's win (Megatron's flag)");
  app.add_flag("--override-checkpoint-args", a.override_checkpoint_args,
               "let flags that contradict the checkpoint's meta.json win (shape, data path, "
               "global batch, seed); flags left out still come from it");
  app.add_flag("--overwrite-checkpoints", a.overwrite_checkpoints,
               "with --no-load: let the new run replace the checkpoints in --save; with --load "
               "of an older step: let its saves remove the newer ones in --save");
  app.add_flag("--load-unverified", a.load_unverified,
               "load the one folder --load names although it has no manifest.json (nothing in "
               "it can be verified)");
  app.add_flag("--async-save", a.async_save,
               "write each checkpoint on a thread of each rank while training goes on (the "
               "ranks stall only to copy their slices to the host)");
  app.add_option("--save-interval", a.save_interval, "save every N steps (0 = only at the end)");
  app.add_option("--optimizer", a.optimizer,
                 "adam (AdamW, the default), sgd (torch.optim.SGD; --weight-decay as L2) or lion "
                 "(Lion: every element moves by the learning rate, so take it 3-10x smaller "
                 "than AdamW's; --weight-decay decoupled)");
  app.add_option("--lion-beta1", a.lion_beta1,
                 "Lion's interpolation of momentum and gradient (with --optimizer lion)");
  app.add_option("--lion-beta2", a.lion_beta2, "Lion's momentum decay (with --optimizer lion)");
  app.add_option("--sgd-momentum", a.sgd_momentum, "SGD's momentum (with --optimizer sgd)");
  app.add_option("--local-steps", a.local_steps,
                 "local SGD: each data-parallel replica updates alone from its own gradients, "
                 "and the replicas' parameters are averaged every N steps (0: reduce every step)");
  app.add_option("--outer-optimizer", a.outer_optimizer,
                 "with --local-steps: none (take the average) or nesterov (DiLoCo's outer step "
                 "on start - average)");
  app.add_option("--ps-ranks", a.ps_ranks,
                 "parameter servers: the last K ranks hold the parameters and the optimizer; "
                 "the others are workers, one data-parallel replica each (0: none)");
  app.add_option("--max-staleness", a.max_staleness,
                 "with --ps-ranks: no worker starts a step more than S steps ahead of the "
                 "slowest (0: synchronous, the same steps as data parallelism)");
  app.add_option("--slow-rank", a.slow_rank,
                 "benchmarking, with --ps-ranks: this worker takes --slow-factor times its "
                 "compute time per step");
  app.add_option("--slow-factor", a.slow_factor, "how much slower --slow-rank computes (> 1)");
  app.add_option("--outer-lr", a.outer_lr, "DiLoCo's outer learning rate");
  app.add_option("--outer-momentum", a.outer_momentum, "DiLoCo's outer Nesterov momentum");
  app.add_flag("--check-for-spiky-loss", a.check_spiky_loss,
               "skip the update of a step whose loss is over --spiky-loss-factor x the mean of the "
               "last 10 updated steps, and log it");
  app.add_option("--spiky-loss-factor", a.spiky_loss_factor,
                 "with --check-for-spiky-loss: how far over the recent mean a loss spikes");
  app.add_option("--max-skipped-steps", a.max_skipped_steps,
                 "with --check-for-spiky-loss: stop with an error after this many skipped steps");
  app.add_flag("--check-links", a.check_links,
               "measure every link between the ranks (bandwidth and latency, by rank and host), "
               "print them slowest first and exit: a check of a new cluster");
  app.add_option("--check-links-mib", a.check_links_mib,
                 "message size of --check-links, in MiB");
  app.add_option("--exit-interval", a.exit_interval,
                 "stop (saving with --save) after a step divisible by N (0: never)");
  app.add_option("--exit-duration-in-mins", a.exit_duration_mins,
                 "stop (saving with --save) after the step that ends this many minutes into "
                 "training (0: never)");
  app.add_option("--keep-last-checkpoints", a.keep_last,
                 "keep only the newest N checkpoints in --save (0: keep all)");
  app.add_option("--log-interval", a.log_interval, "print every N steps");
  app.add_option("--log-jsonl", a.log_jsonl, "write one JSON object per step here");
  app.add_flag("--eod-mask-loss", a.eod_mask_loss,
               "no loss on the token after each end-of-document token (the next document's "
               "first): the mean is over the other tokens");
  app.add_flag("--reset-position-ids", a.reset_position_ids,
               "positions restart at 0 after each end-of-document token");
  app.add_flag("--reset-attention-mask", a.reset_attention_mask,
               "a token attends only to its own document's tokens (attention runs unfused)");
  app.add_option("--split", a.split,
                 "train,valid,test weights over the data's windows, e.g. 98,2,0 (default: all "
                 "train)");
  app.add_option("--eval-interval", a.eval_interval,
                 "validation loss every N steps and at the end (0: never; needs --split)");
  app.add_option("--eval-iters", a.eval_iters, "global batches per validation");
  app.add_option("--loss-plot", a.loss_plot, "write the train and validation loss curve (SVG)");
  app.add_option("--sample", a.sample, "generate N tokens at the end");
  app.add_option("--sample-temperature", a.sample_temperature, "0 = greedy");
  app.add_option("--sample-prompt", a.sample_prompt, "text the sample continues (text data)");
  app.add_option("--tokenizer", a.tokenizer,
                 "llm.c tokenizer file (e.g. gpt2_tokenizer.bin) to decode samples of token data");
  app.add_option("--tokenizer-type", a.tokenizer_type,
                 "GPT2BPETokenizer (--vocab-file, --merge-file) or HuggingFaceTokenizer "
                 "(--tokenizer-model): encodes --sample-prompt and decodes the sample of token "
                 "data");
  app.add_option("--vocab-file", a.vocab_file, "GPT-2's vocab.json (GPT2BPETokenizer)");
  app.add_option("--merge-file", a.merge_file, "GPT-2's merges.txt (GPT2BPETokenizer)");
  app.add_option("--tokenizer-model", a.tokenizer_model,
                 "a byte-level BPE tokenizer.json (HuggingFaceTokenizer)");
  app.add_option("--threads", a.threads, "CPU threads (default: cores / local ranks)");
  app.add_option("--device", a.device,
                 "cpu, cuda, cuda:N or auto: cuda when a GPU is visible; each rank takes the GPU "
                 "of its local rank (cuda:N: one process on GPU N)");
  app.add_option("--comm-backend", a.comm_backend,
                 "auto, mpi or nccl: how ranks on GPUs exchange tensors (mpi: staged through "
                 "host memory, which works when ranks share a GPU)");
  app.add_option("--cpu-gemm", a.cpu_gemm,
                 "auto, openblas or onednn: the library of the CPU's GEMMs (auto: oneDNN where "
                 "weft was built with it, else OpenBLAS; WEFT_CPU_GEMM overrides auto)");
  app.add_flag("--tf32", a.tf32, "GEMMs on tensor cores with TF32 inputs (--device cuda)");
  app.add_option("--attention-backend", a.attention_backend,
                 "auto, fused or unfused (--device cuda): fused is cuDNN's fused flash attention "
                 "(bf16 q, k, v; no T x T tensor); auto takes it with bf16 GEMMs");
  app.add_flag("--bf16", a.bf16,
               "mixed precision: GEMM inputs rounded to bf16 and activations stored in bf16; "
               "fp32 master weights, gradients and optimizer state (emulated on the CPU)");
  app.add_flag("--fp16", a.fp16,
               "mixed precision: GEMM inputs rounded to fp16, with a dynamic loss scale "
               "(emulated on the CPU)");
  app.add_option("--loss-scale", a.loss_scale,
                 "with --fp16: a fixed loss scale instead of the dynamic one");
  app.add_option("--initial-loss-scale", a.initial_loss_scale,
                 "with --fp16: the dynamic loss scale's start (2^32)");
  app.add_option("--min-loss-scale", a.min_loss_scale,
                 "with --fp16: the dynamic loss scale's floor (1)");
  app.add_option("--loss-scale-window", a.loss_scale_window,
                 "with --fp16: steps without overflow before the loss scale doubles (1000)");
  app.add_option("--hysteresis", a.hysteresis,
                 "with --fp16: overflows before the loss scale halves (2)");
  app.add_option("--tensor-model-parallel-size,--tp", a.tp, "tensor-parallel ranks");
  app.add_option("--pipeline-model-parallel-size,--pp", a.pp, "pipeline ranks");
  app.add_flag("--sequence-parallel", a.sequence_parallel,
               "with --tp > 1: split the norms, residual adds and the loss's input along the "
               "sequence across the tensor-parallel ranks (all-gather and reduce-scatter in "
               "place of each all-reduce)");
  app.add_option("--schedule", a.schedule,
                 "pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v");
  app.add_option("--virtual-stages", a.virtual_stages, "model chunks per pipeline rank");
  app.add_option("--num-layers-per-virtual-pipeline-stage", a.layers_per_virtual,
                 "layers per chunk (sets the virtual stages as Megatron does)");
  app.add_option("--partition", a.partition, "stage partition: uniform, parameters, time");
  app.add_flag("--recompute", a.recompute,
               "recompute whole pipeline stages in the backward pass (needs --pp > 1)");
  app.add_option("--recompute-granularity", a.recompute_granularity,
                 "full: recompute transformer blocks from their inputs in the backward pass "
                 "(with --recompute-method); selective: recompute each attention from its qkv "
                 "(no (B, H, T, T) probabilities held); at any --pp");
  app.add_option("--recompute-method", a.recompute_method,
                 "uniform: each stage's blocks in groups of --recompute-num-layers, each group "
                 "recomputed from its input; block: the first --recompute-num-layers blocks of "
                 "each stage, the rest kept");
  app.add_option("--recompute-num-layers", a.recompute_num_layers,
                 "blocks per recomputed group (uniform), or recomputed per stage (block)");
  app.add_option("--memory-budget", a.memory_budget,
                 "per pipeline rank, for the partitioner (e.g. 2GiB): stages are cut so that each "
                 "rank's weights, optimizer state and stashed activations fit, or the run is "
                 "refused naming the least any cut needs");
  app.add_option("--trace", a.trace,
                 "write a Chrome trace (Perfetto) of every pipeline action on every rank");
  app.add_option("--profile-step-start", a.profile_step_start,
                 "open the CUDA profiler's range (cudaProfilerStart: nsys --capture-range="
                 "cudaProfilerApi, ncu --profile-from-start off) when this many steps have run");
  app.add_option("--profile-step-end", a.profile_step_end,
                 "close it (cudaProfilerStop) when this many steps have run");
  app.add_option("--profile", a.profile,
                 "time every node's F, I and W on this machine's --device (rank 0, the whole "
                 "model: on a GPU it must fit there), write them to this JSON file and use them "
                 "for --partition time");
  app.add_flag("--use-distributed-optimizer", a.distributed_optimizer,
               "shard AdamW's state across data-parallel replicas (ZeRO-1); "
               "--data-parallel-sharding-strategy optim");
  app.add_option("--data-parallel-sharding-strategy", a.sharding_strategy,
                 "what each data-parallel replica keeps a slice of: no_shard, optim (ZeRO-1), "
                 "optim_grads (ZeRO-2: the gradients too), optim_grads_params (ZeRO-3: the "
                 "parameters too, gathered before each layer's forward and backward); default "
                 "no_shard");
  app.add_option("--ddp-bucket-size", a.ddp_bucket_size,
                 "gradient elements per data-parallel reduction bucket");
  // Two flags, so that --help shows the real default (a negated alias would print {false}).
  app.add_flag("--overlap-grad-reduce", a.overlap_grad_reduce,
               "start each bucket's reduction as soon as its gradients are final (default on)")
      ->default_str("");
  app.add_flag_callback(
      "--no-overlap-grad-reduce", [&a] { a.overlap_grad_reduce = false; },
      "reduce every bucket after the backward instead");
  app.add_flag("--overlap-p2p-comm", a.overlap_p2p_comm,
               "post each pipeline receive before the compute action ahead of it, so the "
               "message arrives while that computes (default off: each receive is posted "
               "when its action comes)");
  app.add_option("--grad-reduce-dtype", a.grad_reduce_dtype,
                 "data-parallel gradient reduction: fp32, or bf16 (rounded; half the bytes); with "
                 "--local-steps, the averages' deltas and optimizer state");
  app.add_option("--grad-compression", a.grad_compression,
                 "data-parallel gradient compression: none, or powersgd (error feedback; plain "
                 "data parallelism only); with --local-steps, the averages' deltas");
  app.add_option("--powersgd-rank", a.powersgd_rank, "rank of the PowerSGD gradient factors");
  app.add_option("--powersgd-start-iter", a.powersgd_start_iter,
                 "steps reduced uncompressed before PowerSGD starts (e.g. the LR warmup)");
  app.add_option("--plan", a.plan,
                 "auto: run the layout weft-sched plan ranks fastest (dp, pp, tp, schedule, "
                 "virtual stages, micro-batch size, recompute, ZeRO-1); layout flags given fix "
                 "theirs");
  app.add_option("--plan-costs", a.plan_costs,
                 "node costs for --plan auto: a --profile file of this model");
  app.add_option("--plan-memory", a.plan_memory, "memory per rank for --plan auto, e.g. 4GiB");
  app.add_option("--plan-link-latency", a.plan_latency, "seconds per message for --plan auto");
  app.add_option("--plan-bandwidth", a.plan_bandwidth, "link bytes per second for --plan auto");
  app.add_option("--plan-cores", a.plan_cores,
                 "cores the ranks share for --plan auto (default: this machine's; 0: one per rank)");
  app.add_option("--plan-compute-scale", a.plan_compute_scale,
                 "multiply the profiled F, I and W times for --plan auto (a calibration)");
  app.add_option("--plan-wake", a.plan_wake,
                 "seconds a rank that waited takes to run again, per received message and "
                 "all-reduce round, for --plan auto (weft-sched plan --wake)");
  app.add_option("--save-timeout", a.save_timeout,
                 "seconds the ranks wait for a checkpoint's writer before failing (default 1800; "
                 "0: no deadline)");
  app.add_option("--comm-timeout", a.comm_timeout,
                 "seconds any rank waits for a message or collective before failing");
  // A whole number past 64 bits is refused, not saturated (CLI11 would give
  // --seed 99999999999999999999 as INT64_MAX).
  const CLI::Validator in_range(
      [](std::string& text) -> std::string {
        int64_t v = 0;
        const char* end = text.data() + text.size();
        if (std::from_chars(text.data(), end, v).ec == std::errc::result_out_of_range)
          return "the value " + text + " is past the range of a 64-bit integer";
        return {};
      },
      "");
  for (CLI::Option* o : app.get_options())
    if (o->get_type_name() == "INT" || o->get_type_name() == "UINT") o->check(in_range);
}

}  // namespace weft::job_detail
