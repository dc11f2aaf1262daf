// weft/sharding.h — Megatron-FSDP's data-parallel sharding strategies, by
// name: what GradSync (weft/grad_sync.h) runs and the planner (weft/plan.h)
// prices.
#pragma once

#include <string>

namespace weft {

// Megatron-FSDP's --data-parallel-sharding-strategy: what each
// data-parallel replica keeps only a slice of.
enum class ShardingStrategy {
  NoShard,           // nothing: plain data parallelism
  Optim,             // the optimizer state (ZeRO-1, --use-distributed-optimizer)
  OptimGrads,        // and the gradients (ZeRO-2)
  OptimGradsParams,  // and the parameters (ZeRO-3 / FSDP): not available yet
};
// "no_shard", "optim", "optim_grads", "optim_grads_params"; throws Error
// naming the value and the choices.
ShardingStrategy parse_sharding_strategy(const std::string& name);
const char* sharding_strategy_name(ShardingStrategy s);

}  // namespace weft
