#include "engines/cuda/launch_support.hpp"

#include <limits>
#include <numbers>

#include "flexattn/error.hpp"

namespace flexattn::cuda {

using flexattn_kernels::BackwardParams;
using flexattn_kernels::ForwardParams;
using flexattn_kernels::SequenceView;

Support launch_limits(const Problem& problem) {
  if (problem.heads_q() > kMaxGridYZ || problem.batch() > kMaxGridYZ) {
    return Support::no(fmt::format("batch {} x heads {} exceeds the launch grid ({} each)",
                                   problem.batch(), problem.heads_q(), kMaxGridYZ));
  }
  constexpr auto kMaxInt = static_cast<std::int64_t>(std::numeric_limits<int>::max());
  if (problem.total_tokens_q() > kMaxInt || problem.total_tokens_kv() > kMaxInt) {
    return Support::no("more than 2^31 - 1 tokens in one launch");
  }
  return Support::yes();
}

// (batch, token, head) strides of a Q/K/V/O view (or of its gradient) in the problem's layout.
SequenceView sequence_view(const Problem& problem, std::string_view which) {
  const TensorView view = problem.expected(which);
  const std::vector<std::int64_t>& s = view.strides;
  switch (problem.layout()) {
    case Layout::kBSHD:
      return SequenceView{nullptr, s[0], s[1], s[2]};
    case Layout::kSBHD:
      return SequenceView{nullptr, s[1], s[0], s[2]};
    case Layout::kBHSD:
      return SequenceView{nullptr, s[0], s[2], s[1]};
    case Layout::kTHD:
      return SequenceView{nullptr, 0, s[0], s[1]};
  }
  throw_internal("cuda: unknown layout");
}

DeviceBuffer upload_ints(const std::shared_ptr<const Driver>& driver,
                         const std::vector<int>& values) {
  // An empty list still gets an address (a kernel argument is never null).
  const std::vector<int> stored = values.empty() ? std::vector<int>{0} : values;
  DeviceBuffer buffer(driver, stored.size() * sizeof(int));
  buffer.upload(stored.data(), stored.size() * sizeof(int));
  return buffer;
}

std::vector<int> to_ints(const std::vector<std::int64_t>& values) {
  return std::vector<int>(values.begin(), values.end());  // < 2^31: checked by lower_problem
}

const int* device_ints(const DeviceBuffer& buffer) {
  return reinterpret_cast<const int*>(buffer.address());
}

std::size_t align_scratch(std::size_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

// The forward parameters every kernel of a problem shares (views without data, lengths,
// scale, parameters); thd's sequence offsets are uploaded into `cu_seqlens_q` and
// `cu_seqlens_kv`, which must outlive every launch with them.
ForwardParams base_forward_params(const Problem& problem, const ModifierBindings& bindings,
                                  const std::shared_ptr<const Driver>& driver,
                                  DeviceBuffer& cu_seqlens_q, DeviceBuffer& cu_seqlens_kv) {
  ForwardParams base{};
  base.q = sequence_view(problem, "q");
  base.k = sequence_view(problem, "k");
  base.v = sequence_view(problem, "v");
  base.o = sequence_view(problem, "o");
  const TensorView lse = problem.expected("lse");
  if (problem.layout() == Layout::kTHD) {
    base.lse_batch_stride = 0;
    base.lse_head_stride = lse.strides[0];
    cu_seqlens_q = upload_ints(driver, to_ints(problem.desc().cu_seqlens_q));
    cu_seqlens_kv = upload_ints(driver, to_ints(problem.desc().cu_seqlens_kv));
    base.cu_seqlens_q = device_ints(cu_seqlens_q);
    base.cu_seqlens_kv = device_ints(cu_seqlens_kv);
  } else {
    base.lse_batch_stride = lse.strides[0];
    base.lse_head_stride = lse.strides[1];
  }
  base.seq_len_q = static_cast<int>(problem.seq_len_q());
  base.seq_len_kv = static_cast<int>(problem.seq_len_kv());
  base.heads_per_kv = static_cast<int>(problem.heads_q() / problem.heads_kv());
  base.scale = static_cast<float>(problem.scale());
  base.scale_log2 = static_cast<float>(problem.scale() * std::numbers::log2e);
  for (std::size_t i = 0; i < bindings.params.size(); ++i) {
    base.params[i] = static_cast<float>(problem.desc().params.at(bindings.params[i]));
  }
  return base;
}

void bind_views(const ForwardArgs& args, float* lse, ForwardParams& p) {
  p.q.data = args.q.data;
  p.k.data = args.k.data;
  p.v.data = args.v.data;
  p.o.data = args.out.data;
  p.lse = lse;
}

void bind_views(const BackwardArgs& args, BackwardParams& p) {
  p.fwd.q.data = args.q.data;
  p.fwd.k.data = args.k.data;
  p.fwd.v.data = args.v.data;
  p.fwd.o.data = args.out.data;
  p.fwd.lse = static_cast<float*>(args.lse.data);
  p.dout.data = args.dout.data;
  p.dq.data = args.dq.data;
  p.dk.data = args.dk.data;
  p.dv.data = args.dv.data;
}

// Points the modifier's tensor slots of `p` at the call's tensors (bindings.tensors order).
void bind_tensors(const ModifierBindings& bindings,
                  const std::map<std::string, TensorView>& tensors, ForwardParams& p) {
  for (std::size_t i = 0; i < bindings.tensors.size(); ++i) {
    p.tensors[i].data = tensors.at(bindings.tensors[i]).data;
  }
}

}  // namespace flexattn::cuda
