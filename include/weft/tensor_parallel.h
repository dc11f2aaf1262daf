// weft/tensor_parallel.h — instantiating a logical graph on one rank of a
// tensor-parallel group (Megatron-style).
//
// models/ builds a logical graph that never mentions tp. For tp > 1 each rank
// replays it node by node, asking every layer for its tensor-parallel form
// (Layer::tensor_parallel): a column-parallel Linear keeps its slice of the
// output columns, a row-parallel Linear its slice of the input rows followed
// by an all-reduce, attention its heads/tp heads, the embedding and the tied
// LM head their slice of the vocabulary (no rank ever holds full logits).
// Layers without splits are copied. The result has the same nodes and values
// in the same order (so a StagePlan of the logical graph applies unchanged);
// only the shapes of values inside the split regions differ.
//
// Activations enter and leave a split region through the conjugate pairs of
// layers/tp_regions.h (the vocab-parallel cross-entropy also all-reduces its
// per-token max and sums, inside the layer). The parallel layers:
// ColumnParallelLinear and RowParallelLinear (layers/tp_linear.h), the
// vocabulary-parallel Embedding and TiedLmHeadLoss (their own files), and
// GeluMlp (column then row in one node). Building a graph communicates
// nothing, so a config that does not divide fails on every rank before any
// message.
//
// With sequence parallelism (Megatron's --sequence-parallel) the values
// outside the split regions hold 1/tp of the tokens (layers/tp_regions.h):
// the layers that split parameters enter and leave their regions by
// all-gather and reduce-scatter instead, and each must have that form. A
// layer between regions (a norm, a residual add) is instantiated as it is:
// it must work token by token (its outputs keep its inputs' leading
// dimensions, or the graph is refused naming it), and the gradients of its
// whole parameters, which each rank now computes from its tokens only, are
// summed over the group after every W.
#pragma once

#include <weft/communicator.h>
#include <weft/graph.h>

#include <memory>

namespace weft {

class SequenceScratch;  // layers/tp_regions.h

// What a layer needs to build its form for one rank.
struct TpBuild {
  TpBuild(Communicator* g, ParamStore* s) : group(g), store(s) {}
  Communicator* group = nullptr;  // the tensor-parallel group (any size >= 1)
  ParamStore* store = nullptr;    // this rank's parameters
  // Sequence parallelism: the rank's shared whole-sequence buffers, or null
  // without it. A layer that builds its sequence-parallel form sets
  // `took_sequence` (layers/tp_regions.h: sequence_parallel(build)).
  std::shared_ptr<SequenceScratch> sequence;
  bool took_sequence = false;

  // This rank's parameter for `logical`: its piece along `dim` (of each of
  // the packed blocks of widths `blocks`, one block when empty; see Shard),
  // or the whole tensor for dim = -1 (a replica:
  // its Shard still records the group size and rank). Created
  // (zero-filled, with the logical parameter's name and Init) on first use;
  // later calls for the same name return the same Param, so tied weights stay
  // tied. Throws Error naming the parameter, the dimension and the group size
  // when the dimension does not divide.
  Param* param(const Param& logical, int dim, std::vector<int64_t> blocks = {});
  // The same, the dimension being `equal_blocks` blocks of one width.
  Param* param(const Param& logical, int dim, int equal_blocks);
};

// The graph rank `tp.rank()` runs. Parameters are created in `store` (pass an
// empty one) and must be initialised afterwards (init_param gives each rank
// its piece of the full tensor). Throws Error naming the node and the rule
// when a layer has no tensor-parallel form or a size does not divide.
Graph tensor_parallel_graph(const Graph& logical, Communicator& tp,
                            std::shared_ptr<ParamStore> store, bool sequence_parallel = false);

// Throws what tensor_parallel_graph would throw at size `tp` (a head count or
// vocabulary that does not divide, a layer without a tensor-parallel form),
// without any communicator: call it before building the mesh.
void check_tensor_parallel(const Graph& logical, int tp, bool sequence_parallel = false);

}  // namespace weft
