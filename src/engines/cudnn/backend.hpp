// RAII over cuDNN backend descriptors, and a small builder of operation graphs (tensors,
// pointwise, matmul, reduction and reshape operations) that checks every call. Every attribute a
// descriptor accepted is also kept as cuDNN was given it, so the plan proof (readback.hpp) can
// read what cuDNN does not answer through cudnnBackendGetAttribute.
#pragma once

#include <cudnn_graph.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engines/cudnn/library.hpp"

namespace flexattn::cudnn {

// An owned cudnnBackendDescriptor_t. Every setter and finalize() throws Error(kCudnn) naming the
// descriptor and the attribute on failure.
class Descriptor {
 public:
  Descriptor(std::shared_ptr<const Library> library, cudnnBackendDescriptorType_t type,
             std::string name);
  ~Descriptor();
  Descriptor(Descriptor&& other) noexcept;
  Descriptor& operator=(Descriptor&& other) noexcept;
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  cudnnBackendDescriptor_t get() const { return handle_; }
  cudnnBackendDescriptorType_t type() const { return type_; }
  const std::string& name() const { return name_; }
  const Library& library() const { return *library_; }
  const std::shared_ptr<const Library>& library_pointer() const { return library_; }

  void set(cudnnBackendAttributeName_t attribute, cudnnBackendAttributeType_t type,
           std::int64_t count, const void* values, std::string_view attribute_name) const;
  void set_int64(cudnnBackendAttributeName_t attribute, std::int64_t value,
                 std::string_view attribute_name) const;
  void set_int64s(cudnnBackendAttributeName_t attribute, const std::vector<std::int64_t>& values,
                  std::string_view attribute_name) const;
  void set_data_type(cudnnBackendAttributeName_t attribute, cudnnDataType_t value,
                     std::string_view attribute_name) const;
  void set_bool(cudnnBackendAttributeName_t attribute, bool value,
                std::string_view attribute_name) const;
  void set_descriptor(cudnnBackendAttributeName_t attribute, const Descriptor& value,
                      std::string_view attribute_name) const;

  void finalize() const;
  // finalize() without throwing, for steps where a refusal is an answer (an engine config cuDNN
  // declines).
  cudnnStatus_t try_finalize() const;

  std::int64_t get_int64(cudnnBackendAttributeName_t attribute,
                         std::string_view attribute_name) const;
  // Reads up to `capacity` plain elements of `type` into `values`; returns how many cuDNN wrote.
  std::int64_t get(cudnnBackendAttributeName_t attribute, cudnnBackendAttributeType_t type,
                   std::int64_t capacity, void* values, std::string_view attribute_name) const;
  // Reads `count` nested descriptors (pre-created with `type`, as cuDNN requires).
  std::vector<Descriptor> get_descriptors(cudnnBackendAttributeName_t attribute,
                                          cudnnBackendDescriptorType_t type, std::int64_t capacity,
                                          std::string_view attribute_name) const;

  // The bytes cuDNN accepted for `attribute` (the last successful set), or null when it was never
  // set.
  const std::vector<std::byte>* accepted(cudnnBackendAttributeName_t attribute) const;

 private:
  struct Accepted {
    cudnnBackendAttributeName_t attribute;
    std::vector<std::byte> bytes;
  };
  void release() noexcept;
  std::shared_ptr<const Library> library_;
  cudnnBackendDescriptor_t handle_ = nullptr;
  cudnnBackendDescriptorType_t type_;
  std::string name_;
  // Kept beside the cuDNN object, which the const setters change too.
  mutable std::vector<Accepted> accepted_;
};

using TensorId = std::int32_t;

struct TensorSpec {
  std::string name;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  std::vector<std::int64_t> dims;     // rank 4: (batch, heads, rows, columns)
  std::vector<std::int64_t> strides;  // elements
  bool is_virtual = false;
  bool by_value = false;
};

// Row-major strides of `dims`.
std::vector<std::int64_t> packed_strides(const std::vector<std::int64_t>& dims);

// The operations of one operation graph, in the order they are added, and the tensors they
// connect. Tensor unique ids are assigned in creation order from 1. By-value scalars keep their
// host storage here, so their pointers stay valid for the builder's lifetime.
class GraphBuilder {
 public:
  explicit GraphBuilder(std::shared_ptr<const Library> library);
  GraphBuilder(const GraphBuilder&) = delete;
  GraphBuilder& operator=(const GraphBuilder&) = delete;

  TensorId tensor(TensorSpec spec);
  // A virtual tensor with packed strides.
  TensorId virtual_tensor(std::string name, cudnnDataType_t type, std::vector<std::int64_t> dims);
  TensorId scalar_f32(float value, std::string name);
  TensorId scalar_i32(std::int32_t value, std::string name);
  TensorId scalar_bool(bool value, std::string name);

  // Pointwise op over 1 to 3 inputs (X, B, T); the output is virtual with the inputs' broadcast
  // dims, unless `output` names an existing tensor.
  TensorId pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t compute,
                     const std::vector<TensorId>& inputs, cudnnDataType_t output_type,
                     std::string name, std::optional<std::int64_t> axis = std::nullopt);
  void pointwise_into(cudnnPointwiseMode_t mode, cudnnDataType_t compute,
                      const std::vector<TensorId>& inputs, TensorId output, std::string name,
                      std::optional<std::int64_t> axis = std::nullopt);
  void matmul(TensorId a, TensorId b, TensorId c, std::string name);
  void reduction(cudnnReduceTensorOp_t mode, TensorId x, TensorId y, std::string name);
  void reshape(TensorId x, TensorId y, std::string name);

  // The finalized operation graph.
  Descriptor build(cudnnHandle_t handle) const;
  // The operation descriptors, in the order build() gives them to OPERATIONGRAPH_OPS.
  const std::vector<Descriptor>& operations() const { return operations_; }
  // The pointwise, matmul or reduction descriptor an operation refers to by `handle`, or null.
  const Descriptor* part(cudnnBackendDescriptor_t handle) const;

  const TensorSpec& spec(TensorId id) const { return specs_.at(static_cast<std::size_t>(id)); }
  std::int64_t uid(TensorId id) const { return static_cast<std::int64_t>(id) + 1; }
  std::size_t operation_count() const { return operations_.size(); }
  // (uid, host pointer) of every by-value scalar.
  std::vector<std::pair<std::int64_t, void*>> by_value_pointers() const;

 private:
  void add_operation(Descriptor operation);

  std::shared_ptr<const Library> library_;
  std::vector<TensorSpec> specs_;
  std::deque<Descriptor> tensors_;
  std::deque<Descriptor> parts_;  // pointwise/matmul/reduction descriptors the operations use
  std::vector<Descriptor> operations_;
  // By-value storage: float, int32 or bool, 8 bytes each; deque keeps addresses stable.
  std::deque<std::int64_t> scalar_storage_;
  std::vector<std::pair<TensorId, std::size_t>> scalars_;  // tensor, index into storage
};

}  // namespace flexattn::cudnn
