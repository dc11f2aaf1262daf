#include <weft/error.h>
#include <weft/sharding.h>

namespace weft {

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  for (ShardingStrategy s : {ShardingStrategy::NoShard, ShardingStrategy::Optim,
                             ShardingStrategy::OptimGrads, ShardingStrategy::OptimGradsParams})
    if (name == sharding_strategy_name(s)) return s;
  throw Error(
      "--data-parallel-sharding-strategy '{}' must be no_shard, optim, optim_grads or "
      "optim_grads_params",
      name);
}

const char* sharding_strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::NoShard:
      return "no_shard";
    case ShardingStrategy::Optim:
      return "optim";
    case ShardingStrategy::OptimGrads:
      return "optim_grads";
    case ShardingStrategy::OptimGradsParams:
      return "optim_grads_params";
  }
  return "?";
}

}  // namespace weft
