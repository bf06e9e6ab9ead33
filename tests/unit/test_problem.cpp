// Problem validation, expected views, signatures, modifier hashes, the modifier catalogue and
// the plan argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/test_support.hpp"

namespace flexattn {
namespace {

using namespace flexattn::ir;

ProblemDesc small_desc() {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.seq_len_q = 16;
  desc.head_dim_qk = 8;
  return desc;
}

// Expects Problem(desc) to throw kInvalidArgument with a one-line message containing `fragment`.
void expect_invalid(const ProblemDesc& desc, const std::string& fragment) {
  try {
    const Problem problem(desc);
    ADD_FAILURE() << "no error; expected one containing: " << fragment;
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << message;
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(ProblemValidation, ResolvesDefaults) {
  const Problem problem(small_desc());
  EXPECT_EQ(problem.heads_kv(), 4);
  EXPECT_EQ(problem.seq_len_kv(), 16);
  EXPECT_EQ(problem.head_dim_v(), 8);
  EXPECT_DOUBLE_EQ(problem.scale(), 1.0 / std::sqrt(8.0));
  EXPECT_TRUE(problem.score_mod().is_identity_score());
  EXPECT_TRUE(problem.mask_mod().is_literal());
  EXPECT_EQ(problem.total_tokens_q(), 32);
  EXPECT_EQ(problem.seq_len_q_of(1), 16);
  EXPECT_THROW(problem.seq_len_q_of(2), Error);
}

TEST(ProblemValidation, RejectsBadSizes) {
  ProblemDesc desc = small_desc();
  desc.heads_q = 6;
  desc.heads_kv = 4;
  expect_invalid(desc, "heads_q (6) must be a multiple of heads_kv (4)");
  desc = small_desc();
  desc.batch = 0;
  expect_invalid(desc, "batch (0) must be positive");
  desc = small_desc();
  desc.head_dim_qk = -8;
  expect_invalid(desc, "head_dim_qk (-8) must be positive");
  desc = small_desc();
  desc.head_dim_v = -1;
  expect_invalid(desc, "head_dim_v (-1) must be positive");
  desc = small_desc();
  desc.seq_len_q = 0;
  expect_invalid(desc, "seq_len_q (0) must be positive");
  desc = small_desc();
  desc.heads_kv = -2;
  expect_invalid(desc, "heads_kv (-2) must be positive");
  desc = small_desc();
  desc.dtype = DType::kI32;
  expect_invalid(desc, "dtype int32 is not a floating-point storage type");
  desc = small_desc();
  desc.scale = std::numeric_limits<double>::infinity();
  expect_invalid(desc, "scale (inf) must be finite");
}

// Every size product is checked before anything multiplies it unchecked: overflowing shapes,
// shapes past 2^48 bytes and past the host's memory are refused naming their dimensions.
TEST(ProblemValidation, RefusesSizeProductsPastTheLimit) {
  ProblemDesc desc = small_desc();
  desc.head_dim_qk = std::int64_t{1} << 62;  // 2 x 16 x 4 x 2^62 wraps to 0 unchecked
  expect_invalid(desc,
                 "q would hold batch 2 x seq_len_q 16 x heads_q 4 x head_dim_qk "
                 "4611686018427387904 elements of 4 bytes: more than 2^48 bytes");
  desc = small_desc();
  desc.head_dim_v = std::numeric_limits<std::int64_t>::max();
  expect_invalid(desc, "v would hold");
  desc = small_desc();
  desc.heads_q = desc.seq_len_q = desc.head_dim_qk = 3'000'000;  // 2^88 bytes, no wrap to 0
  expect_invalid(desc, "heads_q 3000000");
  desc = small_desc();
  desc.seq_len_q = 3'000'000'000;  // q and kv are i32 in the IR
  desc.head_dim_qk = 1;
  expect_invalid(desc, "seq_len_q (3000000000) is past the modifiers' i32 indices");
  desc = small_desc();
  desc.layout = Layout::kTHD;
  desc.batch = 1;
  desc.seq_len_q = 0;
  desc.cu_seqlens_q = {0, std::int64_t{1} << 30};
  desc.head_dim_qk = std::int64_t{1} << 40;
  expect_invalid(desc, "tokens 1073741824 x heads_q 4 x head_dim_qk 1099511627776");
  desc = small_desc();
  desc.tensors["bias"] = TensorDecl{DType::kF32, {1 << 30, 1 << 30, 1 << 30}};
  expect_invalid(desc, "tensor 'bias' would hold axis 0 1073741824");
  desc = small_desc();
  desc.q_strides = std::vector<std::int64_t>{std::int64_t{1} << 61, 512, 64, 1};
  expect_invalid(desc, "q strides [2305843009213693952, 512, 64, 1] span more than 2^48 bytes");
  // 16 TB: below 2^48 bytes, past the memory of this machine on the CPU, fine on a device.
  desc = small_desc();
  desc.seq_len_q = 1'000'000'000;
  desc.head_dim_qk = 1'000;
  expect_invalid(desc, "the problem's tensors needs");
  desc.device = Device::kCuda;
  EXPECT_NO_THROW(Problem{desc});
}

TEST(ProblemValidation, RefusesNonFiniteParameters) {
  for (const double value : {std::nan(""), std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity()}) {
    ProblemDesc desc = small_desc();
    desc.params["cap"] = value;
    desc.score_mod = param("cap") * tanh(score() / param("cap"));
    expect_invalid(desc, "parameter 'cap'");
  }
}

TEST(ProblemValidation, AcceptsEveryFloatDTypeIncludingFp64) {
  for (DType dtype : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16}) {
    ProblemDesc desc = small_desc();
    desc.dtype = dtype;
    const Problem problem(desc);
    EXPECT_EQ(problem.expected("lse").dtype, dtype == DType::kF64 ? DType::kF64 : DType::kF32);
  }
}

TEST(ProblemValidation, ChecksThdOffsets) {
  ProblemDesc desc = small_desc();
  desc.layout = Layout::kTHD;
  desc.seq_len_q = 0;
  expect_invalid(desc, "layout thd needs cu_seqlens_q");
  desc.cu_seqlens_q = {0, 5};
  expect_invalid(desc, "cu_seqlens_q has 2 entries; thd needs batch + 1 = 3");
  desc.cu_seqlens_q = {1, 5, 9};
  expect_invalid(desc, "cu_seqlens_q must start at 0, not 1");
  desc.cu_seqlens_q = {0, 5, 3};
  expect_invalid(desc, "cu_seqlens_q must be non-decreasing");
  desc.cu_seqlens_q = {0, 0, 0};
  expect_invalid(desc, "cu_seqlens_q describes no query tokens");
  desc.cu_seqlens_q = {0, 5, 12};
  desc.cu_seqlens_kv = {0, 9};
  expect_invalid(desc, "cu_seqlens_kv has 2 entries");
  desc.cu_seqlens_kv = {0, 9, 10};
  desc.seq_len_q = 6;
  expect_invalid(desc, "must be 0 or the longest sequence (7, 9)");

  desc.seq_len_q = 0;
  const Problem problem(desc);
  EXPECT_EQ(problem.seq_len_q(), 7);  // derived: the longest sequence
  EXPECT_EQ(problem.seq_len_kv(), 9);
  EXPECT_EQ(problem.seq_len_q_of(0), 5);
  EXPECT_EQ(problem.seq_len_kv_of(1), 1);
  EXPECT_EQ(problem.total_tokens_q(), 12);
  EXPECT_EQ(problem.total_tokens_kv(), 10);
  const LeafRanges ranges = problem.leaf_ranges();
  EXPECT_EQ(ranges.query.hi, 6.0);
  EXPECT_EQ(ranges.query_length.lo, 5.0);
  EXPECT_EQ(ranges.query_length.hi, 7.0);
  EXPECT_EQ(ranges.key_length.lo, 1.0);
  EXPECT_EQ(ranges.key_length.hi, 9.0);

  desc.cu_seqlens_kv.clear();  // defaults to the query offsets
  EXPECT_EQ(Problem(desc).total_tokens_kv(), 12);

  ProblemDesc padded = small_desc();
  padded.cu_seqlens_q = {0, 16, 32};
  expect_invalid(padded, "cu_seqlens are only for layout thd, not bshd");
}

TEST(ProblemValidation, ChecksStrides) {
  ProblemDesc desc = small_desc();
  desc.q_strides = std::vector<std::int64_t>{512, 32, 8};
  expect_invalid(desc, "q_strides has 3 entries; layout bshd needs 4");
  desc.q_strides = std::vector<std::int64_t>{1024, 64, 16, 2};
  expect_invalid(desc, "q_strides [1024, 64, 16, 2]: the last stride must be 1");
  desc.q_strides.reset();
  desc.o_strides = std::vector<std::int64_t>{1024, -64, 16, 1};
  expect_invalid(desc, "o_strides [1024, -64, 16, 1]: strides must not be negative");
  desc.o_strides = std::vector<std::int64_t>{4096, 256, 64, 1};  // padded rows are fine
  EXPECT_EQ(Problem(desc).expected("o").strides, (std::vector<std::int64_t>{4096, 256, 64, 1}));
}

TEST(ProblemValidation, ChecksModifierTypes) {
  ProblemDesc desc = small_desc();
  desc.score_mod = query() >= key();
  expect_invalid(desc, "score_mod must be f32 or i32, got bool");
  desc = small_desc();
  desc.mask_mod = score() * 2.0;
  expect_invalid(desc, "mask_mod must be bool, got f32");
  desc = small_desc();
  desc.mask_mod = score() > 0.0;
  expect_invalid(desc, "mask_mod must not use `score`");

  desc = small_desc();
  desc.score_mod = query() - key();  // i32: promoted to f32
  const Problem problem(desc);
  EXPECT_EQ(problem.score_mod().type(), Type::kF32);
}

TEST(ProblemValidation, ChecksTensorsAndParams) {
  ProblemDesc desc = small_desc();
  desc.score_mod = score() + load("bias", Type::kF32, {head(), query(), key()});
  expect_invalid(desc, "score_mod loads tensor 'bias' which is not declared");
  desc.tensors["bias"] = TensorDecl{DType::kF32, {4, 16}};
  expect_invalid(desc, "score_mod loads 'bias' with 3 indices but it is declared with rank 2");
  desc.tensors["bias"] = TensorDecl{DType::kI32, {4, 16, 16}};
  expect_invalid(desc, "score_mod loads 'bias' as f32 but it is declared int32");
  desc.tensors["bias"] = TensorDecl{DType::kF32, {4, 16, 0}};
  expect_invalid(desc, "tensor 'bias' has a non-positive extent");
  desc.tensors["bias"] = TensorDecl{DType::kBF16, {4, 16, 16}};
  desc.tensors["unused"] = TensorDecl{DType::kF32, {3}};  // declared but unused: fine
  EXPECT_NO_THROW(Problem{desc});

  desc = small_desc();
  desc.mask_mod = load("doc", Type::kI32, {query()}) == load("doc", Type::kI32, {key()});
  desc.tensors["doc"] = TensorDecl{DType::kF64, {16}};
  expect_invalid(desc, "mask_mod loads 'doc' as i32 but it is declared fp64");
  desc.tensors["doc"] = TensorDecl{DType::kI64, {16}};
  EXPECT_NO_THROW(Problem{desc});

  desc = small_desc();
  desc.score_mod = param("cap") * tanh(score() / param("cap"));
  expect_invalid(desc, "score_mod uses parameter 'cap' but no value is given");
  desc.params["cap"] = 30.0;
  EXPECT_NO_THROW(Problem{desc});
}

TEST(ProblemValidation, ChecksLoadBounds) {
  ProblemDesc desc = small_desc();
  desc.seq_len_q = 128;
  desc.tensors["rel"] = TensorDecl{DType::kF32, {4, 100}};
  desc.score_mod = score() + load("rel", Type::kF32, {head(), key() - query() + 64});
  try {
    const Problem problem(desc);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("rel"), std::string::npos) << error.what();
  }
  desc.score_mod = score() + load("rel", Type::kF32, {head(), clamp(key() - query() + 64, 0, 99)});
  EXPECT_NO_THROW(Problem{desc});
}

TEST(ProblemExpected, ShapesPerLayout) {
  ProblemDesc desc = small_desc();
  desc.heads_kv = 2;
  desc.seq_len_kv = 24;
  desc.head_dim_v = 4;
  using Shape = std::vector<std::int64_t>;
  struct Want {
    Layout layout;
    Shape q, k, v, o;
  };
  const Want wants[] = {
      {Layout::kBSHD, {2, 16, 4, 8}, {2, 24, 2, 8}, {2, 24, 2, 4}, {2, 16, 4, 4}},
      {Layout::kSBHD, {16, 2, 4, 8}, {24, 2, 2, 8}, {24, 2, 2, 4}, {16, 2, 4, 4}},
      {Layout::kBHSD, {2, 4, 16, 8}, {2, 2, 24, 8}, {2, 2, 24, 4}, {2, 4, 16, 4}},
  };
  for (const Want& want : wants) {
    desc.layout = want.layout;
    const Problem problem(desc);
    EXPECT_EQ(problem.expected("q").shape, want.q) << to_string(want.layout);
    EXPECT_EQ(problem.expected("dq").shape, want.q);
    EXPECT_EQ(problem.expected("k").shape, want.k);
    EXPECT_EQ(problem.expected("v").shape, want.v);
    EXPECT_EQ(problem.expected("o").shape, want.o);
    EXPECT_EQ(problem.expected("dout").shape, want.o);
    EXPECT_EQ(problem.expected("q").strides, contiguous_strides(want.q));
    EXPECT_EQ(problem.expected("lse").shape, (Shape{2, 4, 16}));
    EXPECT_EQ(problem.expected("q").data, nullptr);
  }
  desc.layout = Layout::kTHD;
  desc.seq_len_q = desc.seq_len_kv = 0;
  desc.cu_seqlens_q = {0, 3, 10};
  desc.cu_seqlens_kv = {0, 20, 30};
  const Problem thd(desc);
  EXPECT_EQ(thd.expected("q").shape, (Shape{10, 4, 8}));
  EXPECT_EQ(thd.expected("k").shape, (Shape{30, 2, 8}));
  EXPECT_EQ(thd.expected("v").shape, (Shape{30, 2, 4}));
  EXPECT_EQ(thd.expected("o").shape, (Shape{10, 4, 4}));
  EXPECT_EQ(thd.expected("lse").shape, (Shape{4, 10}));
  EXPECT_EQ(thd.expected("lse").strides, (Shape{10, 1}));
  EXPECT_THROW(thd.expected("x"), Error);
  EXPECT_EQ(parse_layout("sbhd"), Layout::kSBHD);
  EXPECT_THROW(parse_layout("bhds"), Error);
}

TEST(ProblemSignature, DiffersWhenAnythingDiffers) {
  const ProblemDesc base = small_desc();
  const std::string signature = Problem(base).signature();
  EXPECT_EQ(Problem(base).signature(), signature);
  ProblemDesc strided = base;
  strided.k_strides = std::vector<std::int64_t>{1024, 64, 8, 1};
  EXPECT_NE(Problem(strided).signature(), signature);
  ProblemDesc same_strides = base;  // explicit contiguous strides are the same problem
  same_strides.k_strides = contiguous_strides({2, 16, 4, 8});
  EXPECT_EQ(Problem(same_strides).signature(), signature);
  ProblemDesc other = base;
  other.direction = Direction::kForwardBackward;
  EXPECT_NE(Problem(other).signature(), signature);
  other = base;
  other.dtype = DType::kBF16;
  EXPECT_NE(Problem(other).signature(), signature);
  other = base;
  other.want_lse = false;
  EXPECT_NE(Problem(other).signature(), signature);
  other = base;
  other.device = Device::kCuda;
  EXPECT_NE(Problem(other).signature(), signature);
  other = base;
  other.tensors["extra"] = TensorDecl{DType::kF32, {3}};
  EXPECT_NE(Problem(other).signature(), signature);
  other = base;
  other.params["p"] = 1.5;
  EXPECT_NE(Problem(other).signature(), signature);

  ProblemDesc thd = base;
  thd.layout = Layout::kTHD;
  thd.seq_len_q = 0;
  thd.cu_seqlens_q = {0, 4, 9};
  ProblemDesc thd_other = thd;
  thd_other.cu_seqlens_q = {0, 5, 9};
  EXPECT_NE(Problem(thd).signature(), Problem(thd_other).signature());
}

TEST(ProblemHash, FollowsTheModifierAndScale) {
  ProblemDesc desc = small_desc();
  desc.score_mod = 30.0 * tanh(score() / 30.0);
  desc.mask_mod = query() >= key();
  const Problem problem(desc);
  EXPECT_EQ(problem.modifier_hash(),
            modifier_hash(problem.score_mod(), problem.mask_mod(), problem.scale()));
  ProblemDesc rebuilt = small_desc();
  rebuilt.score_mod = parse("30 * tanh(score / 30)");
  rebuilt.mask_mod = parse("q >= kv");
  rebuilt.scale = 1.0 / std::sqrt(8.0);  // the default, given explicitly
  rebuilt.layout = Layout::kSBHD;        // the hash covers the function, not the data layout
  EXPECT_EQ(Problem(rebuilt).modifier_hash(), problem.modifier_hash());

  ProblemDesc scaled = desc;
  scaled.scale = 0.5;
  EXPECT_NE(Problem(scaled).modifier_hash(), problem.modifier_hash());
  ProblemDesc no_softcap = desc;
  no_softcap.score_mod.reset();
  EXPECT_NE(Problem(no_softcap).modifier_hash(), problem.modifier_hash());
  ProblemDesc no_mask = desc;
  no_mask.mask_mod.reset();
  EXPECT_NE(Problem(no_mask).modifier_hash(), problem.modifier_hash());
  ProblemDesc other_cap = desc;
  other_cap.score_mod = 20.0 * tanh(score() / 20.0);
  EXPECT_NE(Problem(other_cap).modifier_hash(), problem.modifier_hash());
}

TEST(ProblemFlops, CountsPerDesign) {
  ProblemDesc desc = small_desc();  // 2 x 4 x 16 x 16 x 8
  const double dense = 4.0 * 2 * 4 * 16 * 16 * 8;
  EXPECT_DOUBLE_EQ(attention_flops(Problem(desc), 1.0), dense);
  EXPECT_DOUBLE_EQ(attention_flops(Problem(desc), 0.5), dense / 2);
  desc.direction = Direction::kForwardBackward;
  EXPECT_DOUBLE_EQ(attention_flops(Problem(desc), 1.0), 3.5 * dense);
  desc = small_desc();
  desc.layout = Layout::kTHD;
  desc.seq_len_q = 0;
  desc.cu_seqlens_q = {0, 3, 10};
  EXPECT_DOUBLE_EQ(attention_flops(Problem(desc), 1.0), 4.0 * 4 * (9 + 49) * 8);
}

// ---- catalogue --------------------------------------------------------------------------------

TEST(Catalogue, EveryEntryBuildsAProblem) {
  const std::vector<std::string> names = {
      "softcap",       "alibi",     "relative_bias",       "post_scale_bias",
      "head_gate",     "causal",    "causal_bottom_right", "sliding_window",
      "document_mask", "prefix_lm", "softcap_causal"};
  for (const std::string& name : names) {
    const NamedModifier& modifier = find_modifier(name);
    EXPECT_EQ(modifier.name, name);
    EXPECT_FALSE(modifier.description.empty());
    ProblemDesc desc = small_desc();
    desc.seq_len_q = 300;
    apply_modifier(modifier, desc);
    const Problem problem(desc);
    EXPECT_EQ(problem.score_mod().is_identity_score(), modifier.score_mod.empty()) << name;
    EXPECT_EQ(problem.mask_mod().is_literal(), modifier.mask_mod.empty()) << name;
    const CatalogueDims dims{2, 4, 300, 300};
    for (const CatalogueTensor& tensor : modifier.tensors) {
      const HostTensor contents = make_catalogue_tensor(modifier, tensor, dims, 3);
      EXPECT_EQ(contents.shape(), desc.tensors.at(tensor.name).shape);
      EXPECT_EQ(contents.dtype(), tensor.dtype);
      const HostTensor again = make_catalogue_tensor(modifier, tensor, dims, 3);
      EXPECT_EQ(test::max_abs_error(contents, again), 0.0);
    }
  }
  EXPECT_GE(modifier_catalogue().size(), names.size());
}

TEST(Catalogue, ContentsAndShapes) {
  const CatalogueDims dims{2, 8, 64, 96};
  const NamedModifier& alibi = find_modifier("alibi");
  const HostTensor slopes = make_catalogue_tensor(alibi, alibi.tensors[0], dims, 1);
  EXPECT_DOUBLE_EQ(slopes.at(0), std::exp2(-1.0));
  EXPECT_DOUBLE_EQ(slopes.at(7), std::exp2(-8.0));
  const NamedModifier& bias = find_modifier("post_scale_bias");
  EXPECT_EQ(bias.tensor_shape(bias.tensors[0], dims), (std::vector<std::int64_t>{8, 64, 96}));
  const NamedModifier& rel = find_modifier("relative_bias");
  EXPECT_EQ(rel.tensor_shape(rel.tensors[0], dims), (std::vector<std::int64_t>{8, 129}));

  const NamedModifier& document = find_modifier("document_mask");
  const CatalogueDims square{1, 2, 200, 200};
  const HostTensor doc = make_catalogue_tensor(document, document.tensors[0], square, 5);
  EXPECT_EQ(doc.dtype(), DType::kI32);
  EXPECT_EQ(doc.at(0), 0.0);
  for (std::int64_t i = 1; i < doc.numel(); ++i) {
    EXPECT_GE(doc.at(i), doc.at(i - 1));
    EXPECT_LE(doc.at(i) - doc.at(i - 1), 1.0);
  }
  EXPECT_GE(doc.at(199), 2.0);  // a few documents, not one

  ProblemDesc desc = small_desc();
  desc.seq_len_kv = 32;
  EXPECT_THROW(apply_modifier(document, desc), Error);
  try {
    find_modifier("softcapp");
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("sliding_window"), std::string::npos);
  }
}

// ---- plan argument checks ---------------------------------------------------------------------

std::string forward_error(const Problem& problem, const ForwardArgs& args) {
  try {
    check_forward_args(problem, args);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    return error.what();
  }
  return {};
}

std::string backward_error(const Problem& problem, const BackwardArgs& args) {
  try {
    check_backward_args(problem, args);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    return error.what();
  }
  return {};
}

TEST(PlanArguments, ForwardChecks) {
  ProblemDesc desc = small_desc();
  desc.dtype = DType::kBF16;
  desc = test::catalogue_desc({"post_scale_bias", "causal"}, desc);
  const Problem problem(desc);
  const test::Inputs inputs = test::random_inputs(problem, 1);
  test::Outputs outputs;
  outputs.out = HostTensor(DType::kBF16, problem.expected("o").shape);
  outputs.lse = HostTensor(DType::kF32, problem.expected("lse").shape);
  ForwardArgs args = test::forward_args(inputs, outputs);
  EXPECT_EQ(forward_error(problem, args), "");
  args.lse = TensorView{};  // optional in forward
  EXPECT_EQ(forward_error(problem, args), "");

  const HostTensor wrong_q = inputs.q.to(DType::kF32);
  ForwardArgs bad = args;
  bad.q = wrong_q.view();
  EXPECT_EQ(forward_error(problem, bad),
            "argument q: expected bf16[2, 16, 4, 8] strides [512, 32, 8, 1], got fp32[2, 16, 4, "
            "8] strides [512, 32, 8, 1]");
  bad = args;
  bad.v.strides = {512, 8, 128, 1};
  EXPECT_NE(forward_error(problem, bad).find("argument v: expected"), std::string::npos);
  bad = args;
  bad.out = TensorView{};
  EXPECT_NE(forward_error(problem, bad).find("argument out: missing"), std::string::npos);
  bad = args;
  bad.k.device = Device::kCuda;
  EXPECT_NE(forward_error(problem, bad).find("on cuda"), std::string::npos);
  bad = args;
  bad.tensors.clear();
  EXPECT_NE(forward_error(problem, bad).find("argument tensor 'bias': missing"), std::string::npos);
  const HostTensor small_bias(DType::kF32, {4, 16, 8});
  bad.tensors["bias"] = small_bias.view();
  EXPECT_NE(forward_error(problem, bad).find("argument tensor 'bias': expected fp32[4, 16, 16]"),
            std::string::npos);
  bad = args;
  bad.lse = outputs.out.view();
  EXPECT_NE(forward_error(problem, bad).find("argument lse"), std::string::npos);
}

TEST(PlanArguments, BackwardChecks) {
  ProblemDesc desc = small_desc();
  desc = test::catalogue_desc({"relative_bias"}, desc);
  const Problem forward_only(desc);
  desc.direction = Direction::kForwardBackward;
  const Problem problem(desc);
  const test::Inputs inputs = test::random_inputs(problem, 1);
  test::Outputs outputs;
  outputs.out = HostTensor(DType::kF32, problem.expected("o").shape);
  outputs.lse = HostTensor(DType::kF32, problem.expected("lse").shape);
  outputs.dq = HostTensor(DType::kF32, problem.expected("dq").shape);
  outputs.dk = HostTensor(DType::kF32, problem.expected("dk").shape);
  outputs.dv = HostTensor(DType::kF32, problem.expected("dv").shape);
  outputs.tensor_grads.emplace("rel", HostTensor(DType::kF64, {4, 129}));
  const BackwardArgs args = test::backward_args(inputs, outputs);
  EXPECT_EQ(backward_error(problem, args), "");
  EXPECT_NE(backward_error(forward_only, args).find("forward direction only"), std::string::npos);

  BackwardArgs bad = args;
  bad.lse = TensorView{};  // required in backward
  EXPECT_NE(backward_error(problem, bad).find("argument lse: missing"), std::string::npos);
  bad = args;
  bad.dk = outputs.dq.view();
  bad.dk.shape = {2, 16, 4, 9};
  EXPECT_NE(backward_error(problem, bad).find("argument dk"), std::string::npos);
  bad = args;
  const HostTensor half_grad(DType::kF16, {4, 129});
  bad.tensor_grads["rel"] = half_grad.view();
  EXPECT_NE(backward_error(problem, bad).find("tensor_grads 'rel'"), std::string::npos);
  const HostTensor short_grad(DType::kF32, {4, 128});
  bad.tensor_grads["rel"] = short_grad.view();
  EXPECT_NE(backward_error(problem, bad).find("tensor_grads 'rel'"), std::string::npos);
  bad = args;
  bad.tensor_grads["nothing"] = short_grad.view();
  EXPECT_NE(backward_error(problem, bad).find("no floating-point tensor 'nothing'"),
            std::string::npos);
}

}  // namespace
}  // namespace flexattn
