// weft/profile.h — measuring what each node of a graph costs on this machine.
//
// The partitioner's `time` method balances a CostModel; profile_costs fills
// one with measured seconds for every node's F, I and W (the median of a few
// runs of one micro-batch), and the analytic model's bytes.
#pragma once

#include <weft/partition.h>
#include <weft/trainer.h>

#include <nlohmann/json.hpp>

namespace weft {

CostModel profile_costs(const Graph& g, const LmGraph& io, const BatchSource& data,
                        int64_t micro_batch, int64_t seq_len, int repeats = 3);

// {"unit": "seconds", "nodes": [{"name", "f", "i", "w", "param_bytes", ...}]}
nlohmann::json cost_model_json(const CostModel& cost, const Graph& g);

}  // namespace weft
