// Backward on the fp32 units. Being written (helper B); see backward_common.cuh.
#pragma once

#include "backward_common.cuh"
