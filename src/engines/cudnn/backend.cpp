#include "engines/cudnn/backend.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "flexattn/error.hpp"

namespace flexattn::cudnn {
namespace {

// The alignment cuDNN may assume for every tensor's base address (the frontend's default); run()
// checks the pointers it is given against it.
constexpr std::int64_t kTensorAlignment = 16;
constexpr std::size_t kRank = 4;

// The size of one element of an attribute type, for the types the engine sets (0 for others:
// their values are not kept).
std::size_t element_bytes(cudnnBackendAttributeType_t type) {
  switch (type) {
    case CUDNN_TYPE_INT64:
      return sizeof(std::int64_t);
    case CUDNN_TYPE_BOOLEAN:
      return sizeof(bool);
    case CUDNN_TYPE_DATA_TYPE:
      return sizeof(cudnnDataType_t);
    case CUDNN_TYPE_POINTWISE_MODE:
      return sizeof(cudnnPointwiseMode_t);
    case CUDNN_TYPE_REDUCTION_OPERATOR_TYPE:
      return sizeof(cudnnReduceTensorOp_t);
    case CUDNN_TYPE_BACKEND_DESCRIPTOR:
      return sizeof(cudnnBackendDescriptor_t);
    case CUDNN_TYPE_HANDLE:
      return sizeof(cudnnHandle_t);
    case CUDNN_TYPE_HEUR_MODE:
      return sizeof(cudnnBackendHeurMode_t);
    default:
      return 0;
  }
}

}  // namespace

// ---- Descriptor ------------------------------------------------------------------------------

Descriptor::Descriptor(std::shared_ptr<const Library> library, cudnnBackendDescriptorType_t type,
                       std::string name)
    : library_(std::move(library)), type_(type), name_(std::move(name)) {
  library_->check(library_->api().create_descriptor(type, &handle_),
                  fmt::format("create descriptor '{}'", name_));
}

Descriptor::~Descriptor() { release(); }

Descriptor::Descriptor(Descriptor&& other) noexcept
    : library_(std::move(other.library_)),
      handle_(other.handle_),
      type_(other.type_),
      name_(std::move(other.name_)),
      accepted_(std::move(other.accepted_)) {
  other.handle_ = nullptr;
}

Descriptor& Descriptor::operator=(Descriptor&& other) noexcept {
  if (this != &other) {
    release();
    library_ = std::move(other.library_);
    handle_ = other.handle_;
    type_ = other.type_;
    name_ = std::move(other.name_);
    accepted_ = std::move(other.accepted_);
    other.handle_ = nullptr;
  }
  return *this;
}

void Descriptor::release() noexcept {
  if (handle_ != nullptr && library_ != nullptr) library_->api().destroy_descriptor(handle_);
  handle_ = nullptr;
}

void Descriptor::set(cudnnBackendAttributeName_t attribute, cudnnBackendAttributeType_t type,
                     std::int64_t count, const void* values,
                     std::string_view attribute_name) const {
  library_->check(library_->api().set_attribute(handle_, attribute, type, count, values),
                  fmt::format("set {} of '{}'", attribute_name, name_));
  const std::size_t size =
      element_bytes(type) * static_cast<std::size_t>(std::max<std::int64_t>(count, 0));
  std::vector<std::byte> bytes(size);
  if (size > 0) std::memcpy(bytes.data(), values, size);
  for (Accepted& entry : accepted_) {
    if (entry.attribute == attribute) {
      entry.bytes = std::move(bytes);
      return;
    }
  }
  accepted_.push_back(Accepted{attribute, std::move(bytes)});
}

const std::vector<std::byte>* Descriptor::accepted(cudnnBackendAttributeName_t attribute) const {
  for (const Accepted& entry : accepted_) {
    if (entry.attribute == attribute) return &entry.bytes;
  }
  return nullptr;
}

void Descriptor::set_int64(cudnnBackendAttributeName_t attribute, std::int64_t value,
                           std::string_view attribute_name) const {
  set(attribute, CUDNN_TYPE_INT64, 1, &value, attribute_name);
}

void Descriptor::set_int64s(cudnnBackendAttributeName_t attribute,
                            const std::vector<std::int64_t>& values,
                            std::string_view attribute_name) const {
  set(attribute, CUDNN_TYPE_INT64, static_cast<std::int64_t>(values.size()), values.data(),
      attribute_name);
}

void Descriptor::set_data_type(cudnnBackendAttributeName_t attribute, cudnnDataType_t value,
                               std::string_view attribute_name) const {
  set(attribute, CUDNN_TYPE_DATA_TYPE, 1, &value, attribute_name);
}

void Descriptor::set_bool(cudnnBackendAttributeName_t attribute, bool value,
                          std::string_view attribute_name) const {
  set(attribute, CUDNN_TYPE_BOOLEAN, 1, &value, attribute_name);
}

void Descriptor::set_descriptor(cudnnBackendAttributeName_t attribute, const Descriptor& value,
                                std::string_view attribute_name) const {
  cudnnBackendDescriptor_t handle = value.get();
  set(attribute, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &handle, attribute_name);
}

void Descriptor::finalize() const {
  library_->check(try_finalize(), fmt::format("finalize '{}'", name_));
}

cudnnStatus_t Descriptor::try_finalize() const { return library_->api().finalize(handle_); }

std::int64_t Descriptor::get_int64(cudnnBackendAttributeName_t attribute,
                                   std::string_view attribute_name) const {
  std::int64_t value = 0;
  std::int64_t count = 0;
  library_->check(
      library_->api().get_attribute(handle_, attribute, CUDNN_TYPE_INT64, 1, &count, &value),
      fmt::format("get {} of '{}'", attribute_name, name_));
  return value;
}

std::int64_t Descriptor::get(cudnnBackendAttributeName_t attribute,
                             cudnnBackendAttributeType_t type, std::int64_t capacity, void* values,
                             std::string_view attribute_name) const {
  std::int64_t count = 0;
  library_->check(library_->api().get_attribute(handle_, attribute, type, capacity, &count, values),
                  fmt::format("get {} of '{}'", attribute_name, name_));
  return count;
}

std::vector<Descriptor> Descriptor::get_descriptors(cudnnBackendAttributeName_t attribute,
                                                    cudnnBackendDescriptorType_t type,
                                                    std::int64_t capacity,
                                                    std::string_view attribute_name) const {
  std::vector<Descriptor> result;
  std::vector<cudnnBackendDescriptor_t> handles;
  for (std::int64_t i = 0; i < capacity; ++i) {
    result.emplace_back(library_, type, fmt::format("{} {} of '{}'", attribute_name, i, name_));
    handles.push_back(result.back().get());
  }
  std::int64_t count = 0;
  library_->check(library_->api().get_attribute(handle_, attribute, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                                capacity, &count, handles.data()),
                  fmt::format("get {} of '{}'", attribute_name, name_));
  result.erase(result.begin() + std::clamp<std::int64_t>(count, 0, capacity), result.end());
  return result;
}

// ---- GraphBuilder ------------------------------------------------------------------------------

std::vector<std::int64_t> packed_strides(const std::vector<std::int64_t>& dims) {
  std::vector<std::int64_t> strides(dims.size(), 1);
  for (std::size_t i = dims.size(); i-- > 1;) strides[i - 1] = strides[i] * dims[i];
  return strides;
}

GraphBuilder::GraphBuilder(std::shared_ptr<const Library> library) : library_(std::move(library)) {}

TensorId GraphBuilder::tensor(TensorSpec spec) {
  if (spec.dims.size() != kRank || spec.strides.size() != kRank) {
    throw_internal(fmt::format("cudnn: tensor '{}' is not of rank 4", spec.name));
  }
  const auto id = static_cast<TensorId>(specs_.size());
  Descriptor& d = tensors_.emplace_back(library_, CUDNN_BACKEND_TENSOR_DESCRIPTOR,
                                        fmt::format("tensor {}", spec.name));
  d.set_int64(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid(id), "TENSOR_UNIQUE_ID");
  d.set_data_type(CUDNN_ATTR_TENSOR_DATA_TYPE, spec.type, "TENSOR_DATA_TYPE");
  d.set_int64s(CUDNN_ATTR_TENSOR_DIMENSIONS, spec.dims, "TENSOR_DIMENSIONS");
  d.set_int64s(CUDNN_ATTR_TENSOR_STRIDES, spec.strides, "TENSOR_STRIDES");
  d.set_int64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, kTensorAlignment, "TENSOR_BYTE_ALIGNMENT");
  d.set_bool(CUDNN_ATTR_TENSOR_IS_VIRTUAL, spec.is_virtual, "TENSOR_IS_VIRTUAL");
  if (spec.by_value) d.set_bool(CUDNN_ATTR_TENSOR_IS_BY_VALUE, true, "TENSOR_IS_BY_VALUE");
  d.finalize();
  specs_.push_back(std::move(spec));
  return id;
}

TensorId GraphBuilder::virtual_tensor(std::string name, cudnnDataType_t type,
                                      std::vector<std::int64_t> dims) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.type = type;
  spec.strides = packed_strides(dims);
  spec.dims = std::move(dims);
  spec.is_virtual = true;
  return tensor(std::move(spec));
}

namespace {

template <class Value>
std::int64_t slot_of(Value value) {
  std::int64_t slot = 0;
  static_assert(sizeof(Value) <= sizeof(slot));
  std::memcpy(&slot, &value, sizeof(Value));
  return slot;
}

TensorSpec scalar_spec(std::string name, cudnnDataType_t type) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.type = type;
  spec.dims = {1, 1, 1, 1};
  spec.strides = {1, 1, 1, 1};
  spec.by_value = true;
  return spec;
}

}  // namespace

TensorId GraphBuilder::scalar_f32(float value, std::string name) {
  const TensorId id = tensor(scalar_spec(std::move(name), CUDNN_DATA_FLOAT));
  scalar_storage_.push_back(slot_of(value));
  scalars_.emplace_back(id, scalar_storage_.size() - 1);
  return id;
}

TensorId GraphBuilder::scalar_i32(std::int32_t value, std::string name) {
  const TensorId id = tensor(scalar_spec(std::move(name), CUDNN_DATA_INT32));
  scalar_storage_.push_back(slot_of(value));
  scalars_.emplace_back(id, scalar_storage_.size() - 1);
  return id;
}

TensorId GraphBuilder::scalar_bool(bool value, std::string name) {
  const TensorId id = tensor(scalar_spec(std::move(name), CUDNN_DATA_BOOLEAN));
  scalar_storage_.push_back(slot_of(value));
  scalars_.emplace_back(id, scalar_storage_.size() - 1);
  return id;
}

std::vector<std::pair<std::int64_t, void*>> GraphBuilder::by_value_pointers() const {
  std::vector<std::pair<std::int64_t, void*>> pointers;
  for (const auto& [id, index] : scalars_) {
    // cuDNN reads the host value through a non-const pointer in the variant pack.
    pointers.emplace_back(uid(id), const_cast<std::int64_t*>(&scalar_storage_[index]));
  }
  return pointers;
}

void GraphBuilder::add_operation(Descriptor operation) {
  operation.finalize();
  operations_.push_back(std::move(operation));
}

TensorId GraphBuilder::pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t compute,
                                 const std::vector<TensorId>& inputs, cudnnDataType_t output_type,
                                 std::string name, std::optional<std::int64_t> axis) {
  if (inputs.empty()) throw_internal("cudnn: pointwise op without inputs");
  std::vector<std::int64_t> dims(kRank, 1);
  for (TensorId input : inputs) {
    const std::vector<std::int64_t>& d = spec(input).dims;
    for (std::size_t i = 0; i < kRank; ++i) dims[i] = std::max(dims[i], d[i]);
  }
  const TensorId output = virtual_tensor(name, output_type, dims);
  pointwise_into(mode, compute, inputs, output, std::move(name), axis);
  return output;
}

void GraphBuilder::pointwise_into(cudnnPointwiseMode_t mode, cudnnDataType_t compute,
                                  const std::vector<TensorId>& inputs, TensorId output,
                                  std::string name, std::optional<std::int64_t> axis) {
  constexpr std::size_t kMaxInputs = 3;  // X, B and T ports
  if (inputs.empty() || inputs.size() > kMaxInputs) {
    throw_internal(fmt::format("cudnn: pointwise op '{}' with {} inputs", name, inputs.size()));
  }
  Descriptor& pw = parts_.emplace_back(library_, CUDNN_BACKEND_POINTWISE_DESCRIPTOR,
                                       fmt::format("pointwise {}", name));
  pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "POINTWISE_MODE");
  pw.set_data_type(CUDNN_ATTR_POINTWISE_MATH_PREC, compute, "POINTWISE_MATH_PREC");
  if (axis) pw.set_int64(CUDNN_ATTR_POINTWISE_AXIS, *axis, "POINTWISE_AXIS");
  pw.finalize();
  Descriptor op(library_, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
                fmt::format("operation {}", name));
  op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, "PW_DESCRIPTOR");
  const cudnnBackendAttributeName_t ports[kMaxInputs] = {CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
                                                         CUDNN_ATTR_OPERATION_POINTWISE_BDESC,
                                                         CUDNN_ATTR_OPERATION_POINTWISE_TDESC};
  const char* const port_names[kMaxInputs] = {"XDESC", "BDESC", "TDESC"};
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    op.set_descriptor(ports[i], tensors_[static_cast<std::size_t>(inputs[i])], port_names[i]);
  }
  op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_YDESC,
                    tensors_[static_cast<std::size_t>(output)], "YDESC");
  add_operation(std::move(op));
}

void GraphBuilder::matmul(TensorId a, TensorId b, TensorId c, std::string name) {
  Descriptor& mm = parts_.emplace_back(library_, CUDNN_BACKEND_MATMUL_DESCRIPTOR,
                                       fmt::format("matmul {}", name));
  mm.set_data_type(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT, "MATMUL_COMP_TYPE");
  mm.finalize();
  Descriptor op(library_, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
                fmt::format("operation {}", name));
  op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_ADESC, tensors_[static_cast<std::size_t>(a)],
                    "MATMUL_ADESC");
  op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_BDESC, tensors_[static_cast<std::size_t>(b)],
                    "MATMUL_BDESC");
  op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_CDESC, tensors_[static_cast<std::size_t>(c)],
                    "MATMUL_CDESC");
  op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, "MATMUL_DESC");
  add_operation(std::move(op));
}

void GraphBuilder::reduction(cudnnReduceTensorOp_t mode, TensorId x, TensorId y, std::string name) {
  Descriptor& rd = parts_.emplace_back(library_, CUDNN_BACKEND_REDUCTION_DESCRIPTOR,
                                       fmt::format("reduction {}", name));
  rd.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode,
         "REDUCTION_OPERATOR");
  rd.set_data_type(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT, "REDUCTION_COMP_TYPE");
  rd.finalize();
  Descriptor op(library_, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
                fmt::format("operation {}", name));
  op.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, tensors_[static_cast<std::size_t>(x)],
                    "REDUCTION_XDESC");
  op.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, tensors_[static_cast<std::size_t>(y)],
                    "REDUCTION_YDESC");
  op.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, "REDUCTION_DESC");
  add_operation(std::move(op));
}

void GraphBuilder::reshape(TensorId x, TensorId y, std::string name) {
  Descriptor op(library_, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
                fmt::format("operation {}", name));
  op.set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, tensors_[static_cast<std::size_t>(x)],
                    "RESHAPE_XDESC");
  op.set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, tensors_[static_cast<std::size_t>(y)],
                    "RESHAPE_YDESC");
  add_operation(std::move(op));
}

const Descriptor* GraphBuilder::part(cudnnBackendDescriptor_t handle) const {
  for (const Descriptor& descriptor : parts_) {
    if (descriptor.get() == handle) return &descriptor;
  }
  return nullptr;
}

Descriptor GraphBuilder::build(cudnnHandle_t handle) const {
  Descriptor graph(library_, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  std::vector<cudnnBackendDescriptor_t> handles;
  for (const Descriptor& op : operations_) handles.push_back(op.get());
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
            static_cast<std::int64_t>(handles.size()), handles.data(), "OPERATIONGRAPH_OPS");
  // OPERATIONGRAPH_HANDLE (800) is marked deprecated in the 9.x headers, yet the releases we
  // target still read the handle from it; named by value so the deprecation warning stays off.
  constexpr auto kOperationGraphHandle = static_cast<cudnnBackendAttributeName_t>(800);
  graph.set(kOperationGraphHandle, CUDNN_TYPE_HANDLE, 1, &handle, "OPERATIONGRAPH_HANDLE");
  graph.finalize();
  return graph;
}

}  // namespace flexattn::cudnn
