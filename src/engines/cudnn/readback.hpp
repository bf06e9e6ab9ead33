// Reading an operation graph back from its cuDNN descriptors, for the plan proof (proof.hpp):
// every operation, its mode, compute type and GEN_INDEX axis, and the tensors it reads and writes
// by unique id. Each attribute is asked of cuDNN with cudnnBackendGetAttribute first. cuDNN 9.19
// answers for tensors, matmuls and reductions, and declines (CUDNN_STATUS_NOT_SUPPORTED) for
// pointwise descriptors, pointwise operations and the operation graph's list of operations, with
// or without a device; for those the value cuDNN accepted when the descriptor was built is taken,
// and the record counts how many values came each way.
#pragma once

#include <cudnn_graph.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engines/cudnn/backend.hpp"

namespace flexattn::cudnn {

struct TensorRecord {
  std::int64_t uid = 0;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  std::vector<std::int64_t> dims, strides;
  bool is_virtual = false;
  bool by_value = false;
};

struct OperationRecord {
  enum class Kind { kPointwise, kMatmul, kReduction, kReshape };
  Kind kind = Kind::kPointwise;
  cudnnPointwiseMode_t mode = CUDNN_POINTWISE_IDENTITY;       // kPointwise
  cudnnDataType_t compute = CUDNN_DATA_FLOAT;                 // pointwise, matmul, reduction
  std::optional<std::int64_t> axis;                           // GEN_INDEX
  cudnnReduceTensorOp_t reduction = CUDNN_REDUCE_TENSOR_ADD;  // kReduction
  std::vector<std::int64_t> inputs;  // uids: pointwise X, B, T; matmul A, B; reduction, reshape X
  std::int64_t output = 0;
};

struct GraphRecord {
  std::vector<OperationRecord> operations;
  std::map<std::int64_t, TensorRecord> tensors;
  std::size_t answered = 0;     // values cuDNN answered through cudnnBackendGetAttribute
  std::size_t as_accepted = 0;  // values cuDNN declined to answer, taken as it accepted them
};

// Reads the operations `builder` gives to OPERATIONGRAPH_OPS. Throws Error(kCudnn) when a value
// is neither answered nor was ever accepted.
GraphRecord read_graph(const GraphBuilder& builder);

std::string_view to_string(cudnnPointwiseMode_t mode);

}  // namespace flexattn::cudnn
