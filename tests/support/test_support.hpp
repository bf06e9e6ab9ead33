// Helpers shared by every test executable. Sections: golden cases, layout conversion, random
// problems and inputs, running an engine, tolerances.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flexattn/conformance.hpp"
#include "flexattn/flexattn.hpp"

namespace flexattn::test {

// ---- files ------------------------------------------------------------------------------

// The names of the entries of `folder`, sorted (a test's check that nothing was left behind).
std::vector<std::string> file_names(const std::string& folder);
// The whole content of a file; empty when it cannot be read.
std::string read_text(const std::string& path);

// ---- golden cases (tests/data/golden, see its README.md) ---------------------------------

std::string golden_dir();  // FLEXATTN_GOLDEN_DIR
bool golden_available();
// Names of the case folders, sorted; empty when the golden data is absent.
std::vector<std::string> golden_case_names();

struct GoldenCase {
  std::string name;
  std::string dir;
  std::int64_t batch = 0, heads_q = 0, heads_kv = 0, seq_len_q = 0, seq_len_kv = 0;
  std::int64_t head_dim_qk = 0, head_dim_v = 0;
  double scale = 0.0;
  std::string score_mod, mask_mod;   // IR text; empty when absent
  std::vector<std::string> tensors;  // extra tensors, as `<name>.npy` in the folder
  std::string note;

  // `<dir>/<array>.npy`, e.g. array("q"), array("dbias").
  HostTensor array(const std::string& array) const;
  // The problem of this case in `layout` and `dtype`, with the extra tensors declared as stored
  // (float32 or int64). thd packs the batch as equal-length sequences.
  ProblemDesc desc(Layout layout, DType dtype, Direction direction) const;
};
GoldenCase load_golden_case(const std::string& name);

// Fails the current test when the golden data is absent (it is part of the repository, so a
// missing folder is a broken checkout or a wrong FLEXATTN_GOLDEN_DIR, never a reason to skip).
#define FLEXATTN_REQUIRE_GOLDEN()                                                    \
  do {                                                                               \
    if (!::flexattn::test::golden_available()) {                                     \
      GTEST_FAIL() << "golden data not found at " << ::flexattn::test::golden_dir(); \
    }                                                                                \
  } while (false)

// ---- layouts --------------------------------------------------------------------------------

// A (batch, heads, seq, dim) bhsd array as `layout` by transposed copy: bshd (B, S, H, D),
// sbhd (S, B, H, D), bhsd (a copy), thd (B * S, H, D) (equal-length sequences).
HostTensor from_bhsd(const HostTensor& bhsd, Layout layout);
// The inverse; thd needs the batch size.
HostTensor to_bhsd(const HostTensor& tensor, Layout layout, std::int64_t batch = 0);
// An LSE output as the golden data keeps it, (batch, heads_q, seq_len_q) in float64: thd keeps
// the LSE as (heads_q, tokens).
HostTensor lse_as_bhs(const HostTensor& lse, Layout layout, const GoldenCase& golden);
// Equal-length thd offsets: {0, length, 2 * length, ..., batch * length}.
std::vector<std::int64_t> uniform_offsets(std::int64_t batch, std::int64_t length);

// ---- random problems and inputs ---------------------------------------------------------------

// Contiguous inputs of a problem, in its dtype and layout.
struct Inputs {
  HostTensor q, k, v, dout;
  std::map<std::string, HostTensor> tensors;  // the declared extra tensors
};
// q, k, v, dout ~ N(0, stddev^2) (v scaled by v_stddev); float tensors ~ N(0, 1); integer
// tensors are non-decreasing small ids (like document ids), so any index use stays plausible.
Inputs random_inputs(const Problem& problem, std::uint64_t seed, double v_stddev = 1.0);

// A problem from a catalogue modifier (score_mod and/or mask, by name; "" for none).
ProblemDesc catalogue_desc(const std::vector<std::string>& modifiers, ProblemDesc base);
// Inputs with the catalogue's tensor contents (ALiBi slopes, document ids, ...).
Inputs catalogue_inputs(const Problem& problem, const std::vector<std::string>& modifiers,
                        std::uint64_t seed);

// ---- running an engine ------------------------------------------------------------------------

struct Outputs {
  HostTensor out, lse;                             // lse fp64 for fp64 problems, fp32 otherwise
  HostTensor dq, dk, dv;                           // only when the problem wants backward
  std::map<std::string, HostTensor> tensor_grads;  // "name" -> gradient of each float tensor
};

// A built-in engine by name; fails the test (and returns null) when absent.
std::shared_ptr<const Engine> builtin_engine(std::string_view name);
// Plans `problem` on `engine` and runs forward, then backward when the problem wants it
// (gradients of every float tensor the modifiers read, in fp64 for fp64 problems, else fp32).
Outputs run_engine(const Engine& engine, const Problem& problem, const Inputs& inputs);
ForwardArgs forward_args(const Inputs& inputs, const Outputs& outputs);
BackwardArgs backward_args(const Inputs& inputs, const Outputs& outputs);

// ---- tolerances (docs/design.md section 5)
// ---------------------------------------------------------

// max |result - reference| over all elements; equal infinities count as 0, and any NaN, or an
// infinity against a different value, gives NaN or infinity. Shapes must match.
double max_abs_error(const HostTensor& result, const HostTensor& reference);
// The largest finite |value|.
double max_abs_value(const HostTensor& tensor);
// The flash-attention rule: twice the error of a plain same-precision implementation, plus a
// rounding floor.
double allowed_error(double plain_error, double rounding_floor);
// Passes when every element is within `allowed` of the reference (NaN never is); the failure
// message names the worst element.
::testing::AssertionResult within_tolerance(const HostTensor& result, const HostTensor& reference,
                                            double allowed);

// Softcap 6, causal, on normal inputs (scores ~ N(0, 1)), bf16, head dims 64 and 128: about half
// of the warps' tiles hold a score beyond 0.6 * 6 and take the exponential tanh, the others its
// small form (the cuda kernels' small_tanh_tile), in the same launch. Forward or backward cases.
std::vector<conformance::Case> mixed_tanh_tile_cases(bool backward);

// ---- environment ----------------------------------------------------------------------------

// Sets an environment variable (or unsets it, for a null value) for its scope and restores the
// previous value: the engines read their switches (FLEXATTN_*) when they plan.
class ScopedEnvironment {
 public:
  ScopedEnvironment(const char* name, const char* value);
  ~ScopedEnvironment();
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;

 private:
  const char* name_;
  std::optional<std::string> previous_;
};

}  // namespace flexattn::test
