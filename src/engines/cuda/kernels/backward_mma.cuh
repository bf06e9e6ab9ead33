// Flash-attention-2 backward on tensor cores (bf16/fp16). Being written (lead); see
// backward_common.cuh for the shared interface.
#pragma once

#include "backward_common.cuh"
