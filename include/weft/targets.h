// weft/targets.h — the target that takes no part in a loss.
//
// A language model's target token of kIgnoredTarget adds no loss term and no
// gradient (PyTorch's ignore_index, Megatron's loss mask): the cross-entropy
// kernels give its row a loss of 0 and dlogits of 0, and the step's mean is
// over the other terms (BatchSource::loss_terms). --eod-mask-loss sets it
// where the input token is the end of a document.
#pragma once

#include <cstdint>

namespace weft {

inline constexpr int32_t kIgnoredTarget = -1;

}  // namespace weft
