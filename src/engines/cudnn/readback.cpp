#include "engines/cudnn/readback.hpp"

#include <fmt/format.h>

#include <cstring>

#include "flexattn/error.hpp"

namespace flexattn::cudnn {
namespace {

constexpr std::int64_t kRank = 4;

[[noreturn]] void unreadable(std::string_view what, std::string_view descriptor) {
  throw Error(ErrorCode::kCudnn,
              fmt::format("cudnn: the plan proof cannot read {} of '{}': cuDNN does not answer "
                          "and no value was accepted",
                          what, descriptor));
}

// One value of `attribute`: asked of `asked` first; when cuDNN declines, the value `accepted_from`
// accepted. Null `asked` skips the question.
template <class Value>
std::optional<Value> read_value(const Library& library, cudnnBackendDescriptor_t asked,
                                const Descriptor* accepted_from,
                                cudnnBackendAttributeName_t attribute,
                                cudnnBackendAttributeType_t type, GraphRecord& record) {
  Value value{};
  if (asked != nullptr) {
    std::int64_t count = 0;
    const cudnnStatus_t status =
        library.api().get_attribute(asked, attribute, type, 1, &count, &value);
    if (status == CUDNN_STATUS_SUCCESS && count >= 1) {
      ++record.answered;
      return value;
    }
    if (status != CUDNN_STATUS_SUCCESS && !is_not_supported(status)) {
      library.check(status, fmt::format("read back attribute {}", static_cast<int>(attribute)));
    }
  }
  const std::vector<std::byte>* bytes =
      accepted_from != nullptr ? accepted_from->accepted(attribute) : nullptr;
  if (bytes == nullptr || bytes->size() < sizeof(Value)) return std::nullopt;
  std::memcpy(&value, bytes->data(), sizeof(Value));
  ++record.as_accepted;
  return value;
}

template <class Value>
Value require_value(const Library& library, cudnnBackendDescriptor_t asked,
                    const Descriptor* accepted_from, cudnnBackendAttributeName_t attribute,
                    cudnnBackendAttributeType_t type, GraphRecord& record, std::string_view what,
                    std::string_view descriptor) {
  const std::optional<Value> value =
      read_value<Value>(library, asked, accepted_from, attribute, type, record);
  if (!value) unreadable(what, descriptor);
  return *value;
}

// A tensor, from cuDNN (tensor descriptors answer every attribute the engine sets).
TensorRecord read_tensor(const Library& library, cudnnBackendDescriptor_t tensor,
                         GraphRecord& record) {
  TensorRecord result;
  const auto check = [&](cudnnStatus_t status, std::string_view what) {
    library.check(status, fmt::format("read back the {} of a tensor", what));
    ++record.answered;
  };
  std::int64_t count = 0;
  check(library.api().get_attribute(tensor, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1,
                                    &count, &result.uid),
        "unique id");
  check(library.api().get_attribute(tensor, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1,
                                    &count, &result.type),
        "data type");
  result.dims.assign(kRank, 0);
  result.strides.assign(kRank, 0);
  check(library.api().get_attribute(tensor, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, kRank,
                                    &count, result.dims.data()),
        "dimensions");
  result.dims.resize(static_cast<std::size_t>(std::clamp<std::int64_t>(count, 0, kRank)));
  check(library.api().get_attribute(tensor, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, kRank,
                                    &count, result.strides.data()),
        "strides");
  result.strides.resize(static_cast<std::size_t>(std::clamp<std::int64_t>(count, 0, kRank)));
  check(library.api().get_attribute(tensor, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1,
                                    &count, &result.is_virtual),
        "virtual flag");
  check(library.api().get_attribute(tensor, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1,
                                    &count, &result.by_value),
        "by-value flag");
  return result;
}

// The tensor an operation's `port` names: the descriptor cuDNN answers with, else the one it
// accepted. Empty when the port was never set.
std::optional<std::int64_t> read_port(const Descriptor& operation, cudnnBackendAttributeName_t port,
                                      GraphRecord& record) {
  const Library& library = operation.library();
  Descriptor answer(operation.library_pointer(), CUDNN_BACKEND_TENSOR_DESCRIPTOR,
                    fmt::format("port of '{}'", operation.name()));
  cudnnBackendDescriptor_t handle = answer.get();
  std::int64_t count = 0;
  const cudnnStatus_t status = library.api().get_attribute(
      operation.get(), port, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count, &handle);
  cudnnBackendDescriptor_t tensor = nullptr;
  if (status == CUDNN_STATUS_SUCCESS && count == 1) {
    ++record.answered;
    tensor = answer.get();
  } else {
    if (status != CUDNN_STATUS_SUCCESS && !is_not_supported(status)) {
      library.check(status, fmt::format("read back a port of '{}'", operation.name()));
    }
    const std::vector<std::byte>* bytes = operation.accepted(port);
    if (bytes == nullptr || bytes->size() < sizeof(cudnnBackendDescriptor_t)) return std::nullopt;
    std::memcpy(&tensor, bytes->data(), sizeof(tensor));
    ++record.as_accepted;
  }
  TensorRecord read = read_tensor(library, tensor, record);
  const std::int64_t uid = read.uid;
  record.tensors.emplace(uid, std::move(read));
  return uid;
}

std::int64_t require_port(const Descriptor& operation, cudnnBackendAttributeName_t port,
                          std::string_view port_name, GraphRecord& record) {
  const std::optional<std::int64_t> uid = read_port(operation, port, record);
  if (!uid) unreadable(port_name, operation.name());
  return *uid;
}

// The part (pointwise, matmul or reduction descriptor) an operation refers to: the copy cuDNN
// answers with (asked first for each value), and the one the builder gave it.
struct Part {
  std::optional<Descriptor> answer;
  const Descriptor* accepted = nullptr;
  cudnnBackendDescriptor_t asked() const { return answer ? answer->get() : nullptr; }
};

Part read_part(const GraphBuilder& builder, const Descriptor& operation,
               cudnnBackendAttributeName_t attribute, cudnnBackendDescriptorType_t type,
               GraphRecord& record) {
  const Library& library = operation.library();
  Part part;
  Descriptor answer(operation.library_pointer(), type,
                    fmt::format("part of '{}'", operation.name()));
  cudnnBackendDescriptor_t handle = answer.get();
  std::int64_t count = 0;
  const cudnnStatus_t status = library.api().get_attribute(
      operation.get(), attribute, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count, &handle);
  if (status == CUDNN_STATUS_SUCCESS && count == 1) {
    ++record.answered;
    part.answer.emplace(std::move(answer));
  }
  const std::vector<std::byte>* bytes = operation.accepted(attribute);
  if (bytes != nullptr && bytes->size() >= sizeof(cudnnBackendDescriptor_t)) {
    cudnnBackendDescriptor_t accepted = nullptr;
    std::memcpy(&accepted, bytes->data(), sizeof(accepted));
    part.accepted = builder.part(accepted);
  }
  if (!part.answer && part.accepted == nullptr) unreadable("its descriptor", operation.name());
  return part;
}

OperationRecord read_pointwise(const GraphBuilder& builder, const Descriptor& operation,
                               GraphRecord& record) {
  const Library& library = operation.library();
  OperationRecord result;
  result.kind = OperationRecord::Kind::kPointwise;
  const Part part = read_part(builder, operation, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR,
                              CUDNN_BACKEND_POINTWISE_DESCRIPTOR, record);
  result.mode = require_value<cudnnPointwiseMode_t>(
      library, part.asked(), part.accepted, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE,
      record, "POINTWISE_MODE", operation.name());
  result.compute = require_value<cudnnDataType_t>(
      library, part.asked(), part.accepted, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE,
      record, "POINTWISE_MATH_PREC", operation.name());
  if (result.mode == CUDNN_POINTWISE_GEN_INDEX) {
    result.axis =
        require_value<std::int64_t>(library, part.asked(), part.accepted, CUDNN_ATTR_POINTWISE_AXIS,
                                    CUDNN_TYPE_INT64, record, "POINTWISE_AXIS", operation.name());
  }
  for (cudnnBackendAttributeName_t port :
       {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_ATTR_OPERATION_POINTWISE_BDESC,
        CUDNN_ATTR_OPERATION_POINTWISE_TDESC}) {
    const std::optional<std::int64_t> uid = read_port(operation, port, record);
    if (!uid) break;
    result.inputs.push_back(*uid);
  }
  if (result.inputs.empty()) unreadable("XDESC", operation.name());
  result.output = require_port(operation, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, "YDESC", record);
  return result;
}

OperationRecord read_matmul(const GraphBuilder& builder, const Descriptor& operation,
                            GraphRecord& record) {
  OperationRecord result;
  result.kind = OperationRecord::Kind::kMatmul;
  const Part part = read_part(builder, operation, CUDNN_ATTR_OPERATION_MATMUL_DESC,
                              CUDNN_BACKEND_MATMUL_DESCRIPTOR, record);
  result.compute = require_value<cudnnDataType_t>(operation.library(), part.asked(), part.accepted,
                                                  CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE,
                                                  record, "MATMUL_COMP_TYPE", operation.name());
  result.inputs = {require_port(operation, CUDNN_ATTR_OPERATION_MATMUL_ADESC, "ADESC", record),
                   require_port(operation, CUDNN_ATTR_OPERATION_MATMUL_BDESC, "BDESC", record)};
  result.output = require_port(operation, CUDNN_ATTR_OPERATION_MATMUL_CDESC, "CDESC", record);
  return result;
}

OperationRecord read_reduction(const GraphBuilder& builder, const Descriptor& operation,
                               GraphRecord& record) {
  OperationRecord result;
  result.kind = OperationRecord::Kind::kReduction;
  const Part part = read_part(builder, operation, CUDNN_ATTR_OPERATION_REDUCTION_DESC,
                              CUDNN_BACKEND_REDUCTION_DESCRIPTOR, record);
  result.reduction = require_value<cudnnReduceTensorOp_t>(
      operation.library(), part.asked(), part.accepted, CUDNN_ATTR_REDUCTION_OPERATOR,
      CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, record, "REDUCTION_OPERATOR", operation.name());
  result.compute = require_value<cudnnDataType_t>(
      operation.library(), part.asked(), part.accepted, CUDNN_ATTR_REDUCTION_COMP_TYPE,
      CUDNN_TYPE_DATA_TYPE, record, "REDUCTION_COMP_TYPE", operation.name());
  result.inputs = {
      require_port(operation, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, "REDUCTION_XDESC", record)};
  result.output =
      require_port(operation, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, "REDUCTION_YDESC", record);
  return result;
}

OperationRecord read_reshape(const Descriptor& operation, GraphRecord& record) {
  OperationRecord result;
  result.kind = OperationRecord::Kind::kReshape;
  result.inputs = {
      require_port(operation, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, "RESHAPE_XDESC", record)};
  result.output =
      require_port(operation, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, "RESHAPE_YDESC", record);
  return result;
}

}  // namespace

GraphRecord read_graph(const GraphBuilder& builder) {
  GraphRecord record;
  for (const Descriptor& operation : builder.operations()) {
    switch (operation.type()) {
      case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
        record.operations.push_back(read_pointwise(builder, operation, record));
        break;
      case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
        record.operations.push_back(read_matmul(builder, operation, record));
        break;
      case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
        record.operations.push_back(read_reduction(builder, operation, record));
        break;
      case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR:
        record.operations.push_back(read_reshape(operation, record));
        break;
      default:
        throw Error(ErrorCode::kCudnn,
                    fmt::format("cudnn: the plan proof does not read operations of descriptor "
                                "type {} ('{}')",
                                static_cast<int>(operation.type()), operation.name()));
    }
  }
  return record;
}

std::string_view to_string(cudnnPointwiseMode_t mode) {
  switch (mode) {
    case CUDNN_POINTWISE_ADD:
      return "ADD";
    case CUDNN_POINTWISE_SUB:
      return "SUB";
    case CUDNN_POINTWISE_MUL:
      return "MUL";
    case CUDNN_POINTWISE_DIV:
      return "DIV";
    case CUDNN_POINTWISE_MOD:
      return "MOD";
    case CUDNN_POINTWISE_EXP:
      return "EXP";
    case CUDNN_POINTWISE_LOG:
      return "LOG";
    case CUDNN_POINTWISE_BINARY_SELECT:
      return "BINARY_SELECT";
    case CUDNN_POINTWISE_GEN_INDEX:
      return "GEN_INDEX";
    case CUDNN_POINTWISE_IDENTITY:
      return "IDENTITY";
    default:
      return "another mode";
  }
}

}  // namespace flexattn::cudnn
