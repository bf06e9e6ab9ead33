// Decoding against a paged KV cache: a prompt of 8 tokens per sequence, then one token at a time.
// Each new token's K and V are appended to its sequence's pages (a page is taken from the free
// list when the last one is full); one plan per query count serves every step, since the lengths
// and the page table are arguments of the run, not of the problem.
//   flexattn_decode           on the CPU (float32)
//   flexattn_decode cuda      on the GPU (bf16): pools, page table and lengths in device memory
#include <cstdio>
#include <memory>
#include <string_view>
#include <vector>

#include "flexattn/flexattn.hpp"

namespace {

// Device memory for a host tensor's bytes, through the engine's DeviceMemory (an inference engine
// would pass its own allocations: any device pointer with the expected strides serves).
class DeviceCopy {
 public:
  DeviceCopy(const flexattn::DeviceMemory& memory, const flexattn::HostTensor& host)
      : memory_(memory), bytes_(host.bytes()), pointer_(memory.allocate(bytes_)) {}
  ~DeviceCopy() { memory_.release(pointer_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;

  // Copies bytes [offset, offset + count) of `host` to the same place on the device.
  void upload(const flexattn::HostTensor& host, std::size_t offset, std::size_t count) const {
    memory_.copy_to_device(static_cast<char*>(pointer_) + offset,
                           static_cast<const char*>(host.data()) + offset, count);
  }
  void upload(const flexattn::HostTensor& host) const { upload(host, 0, bytes_); }
  void download(flexattn::HostTensor& host) const {
    memory_.synchronize();
    memory_.copy_to_host(host.data(), pointer_, bytes_);
  }
  flexattn::TensorView view(const flexattn::HostTensor& host) const {
    flexattn::TensorView view = host.view();
    view.data = pointer_;
    view.device = flexattn::Device::kCuda;
    return view;
  }

 private:
  const flexattn::DeviceMemory& memory_;
  std::size_t bytes_;
  void* pointer_;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace flexattn;
  const bool gpu = argc > 1 && std::string_view(argv[1]) == "cuda";
  constexpr std::int64_t kBatch = 2, kHeadsQ = 8, kHeadsKv = 2, kDim = 64;
  constexpr std::int64_t kPageSize = 16, kPages = 64, kMaxPages = 16;  // capacity 256 tokens
  constexpr std::int64_t kPrompt = 8, kSteps = 40;
  const DType dtype = gpu ? DType::kBF16 : DType::kF32;

  // The GPU's memory, through the cuda engine (when asked for and usable).
  // `cuda` owns the memory: it lives as long as the memory is used.
  std::shared_ptr<const Engine> cuda;
  const DeviceMemory* memory = nullptr;
  if (gpu) {
    for (const std::shared_ptr<const Engine>& engine : builtin_engines()) {
      if (engine->name() != "cuda") continue;
      cuda = engine;
      if (const Support available = engine->available(); !available) {
        std::fprintf(stderr, "error: the cuda engine is unavailable: %s\n",
                     available.reason().c_str());
        return 1;
      }
      memory = engine->memory();
    }
    if (memory == nullptr) {
      std::fprintf(stderr, "error: this build of flexattn has no cuda engine\n");
      return 1;
    }
  }

  const auto make_problem = [&](std::int64_t new_tokens) {
    ProblemDesc desc;  // queries in bshd: (batch, new tokens, heads, dim)
    desc.batch = kBatch, desc.heads_q = kHeadsQ, desc.heads_kv = kHeadsKv;
    desc.seq_len_q = new_tokens, desc.head_dim_qk = kDim;
    desc.dtype = dtype;
    desc.device = gpu ? Device::kCuda : Device::kCpu;
    desc.kv_cache = KvCacheDesc{kPages, kPageSize, kMaxPages};
    desc.score_mod = ir::parse("30 * tanh(score / 30)");
    desc.mask_mod = ir::parse("q >= kv");  // positions in the sequence: the new tokens are last
    return Problem(desc);
  };
  const Problem prefill = make_problem(kPrompt), decode = make_problem(1);

  // The pools, the page table and the lengths live with the caller, like any other tensor (on
  // the GPU: a host copy that is written, and the device copy the kernels read).
  HostTensor k_pool(dtype, prefill.expected("k").shape);  // (pages, page_size, heads, dim)
  HostTensor v_pool(dtype, prefill.expected("v").shape);
  HostTensor page_table(DType::kI32, {kBatch, kMaxPages});
  HostTensor cache_lens(DType::kI32, {kBatch});
  std::unique_ptr<DeviceCopy> k_device, v_device, table_device, lens_device;
  if (gpu) {
    k_device = std::make_unique<DeviceCopy>(*memory, k_pool);
    v_device = std::make_unique<DeviceCopy>(*memory, v_pool);
    table_device = std::make_unique<DeviceCopy>(*memory, page_table);
    lens_device = std::make_unique<DeviceCopy>(*memory, cache_lens);
  }
  std::vector<std::int64_t> free_pages;
  for (std::int64_t page = kPages - 1; page >= 0; --page) free_pages.push_back(page);

  // Appends `count` tokens of random K and V to every sequence (a model would write its own).
  std::uint64_t seed = 1;
  const auto append = [&](std::int64_t count) {
    HostTensor row(DType::kF32, {kHeadsKv * kDim});
    for (std::int64_t b = 0; b < kBatch; ++b) {
      for (std::int64_t t = 0; t < count; ++t) {
        const auto length = static_cast<std::int64_t>(cache_lens.at(b));
        if (length % kPageSize == 0) {  // the last page is full: take a free one
          page_table.set(b * kMaxPages + length / kPageSize,
                         static_cast<double>(free_pages.back()));
          free_pages.pop_back();
        }
        const auto page =
            static_cast<std::int64_t>(page_table.at(b * kMaxPages + length / kPageSize));
        const std::int64_t base = (page * kPageSize + length % kPageSize) * kHeadsKv * kDim;
        for (HostTensor* pool : {&k_pool, &v_pool}) {
          row.fill_normal(seed++);
          for (std::int64_t i = 0; i < kHeadsKv * kDim; ++i) pool->set(base + i, row.at(i));
        }
        if (gpu) {  // the new rows only
          const std::size_t element = size_of(dtype);
          const auto offset = static_cast<std::size_t>(base) * element;
          const auto bytes = static_cast<std::size_t>(kHeadsKv * kDim) * element;
          k_device->upload(k_pool, offset, bytes);
          v_device->upload(v_pool, offset, bytes);
        }
        cache_lens.set(b, static_cast<double>(length + 1));
      }
    }
    if (gpu) {
      table_device->upload(page_table);
      lens_device->upload(cache_lens);
    }
  };

  Context context;
  const auto attend = [&](const Problem& problem, std::uint64_t query_seed) {
    HostTensor q(dtype, problem.expected("q").shape), out(dtype, problem.expected("o").shape);
    HostTensor lse(DType::kF32, problem.expected("lse").shape);
    q.fill_normal(query_seed);
    const auto plan = context.select(problem);  // the same plan at every step
    ForwardArgs args;
    if (!gpu) {
      args.q = q.view(), args.k = k_pool.view(), args.v = v_pool.view();
      args.out = out.view(), args.lse = lse.view();  // the LSE lets callers merge partial results
      args.page_table = page_table.view(), args.cache_lens = cache_lens.view();
      plan->forward(args);  // checks the lengths and every page the sequences use
      return std::pair{plan->info().engine, out.at(0)};
    }
    const DeviceCopy q_device(*memory, q), out_device(*memory, out), lse_device(*memory, lse);
    q_device.upload(q);
    args.q = q_device.view(q), args.k = k_device->view(k_pool), args.v = v_device->view(v_pool);
    args.out = out_device.view(out), args.lse = lse_device.view(lse);
    args.page_table = table_device->view(page_table);
    args.cache_lens = lens_device->view(cache_lens);
    plan->forward(args);  // on the default stream; a bad length or page gives NaN rows
    out_device.download(out);
    return std::pair{plan->info().engine, out.at(0)};
  };

  append(kPrompt);  // the prompt's keys and values, then attention over them
  auto [engine, first] = attend(prefill, 1000);
  std::printf("prefill of %lld tokens per sequence on %s: out[0] = %.6f\n",
              static_cast<long long>(kPrompt), engine.c_str(), first);
  double last = 0;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    append(1);
    last = attend(decode, 2000 + static_cast<std::uint64_t>(step)).second;
  }
  std::printf("%lld decoding steps: %lld tokens cached per sequence in %lld pages, out[0] = %.6f\n",
              static_cast<long long>(kSteps), static_cast<long long>(cache_lens.at(0)),
              static_cast<long long>(kPages - static_cast<std::int64_t>(free_pages.size())), last);
}
