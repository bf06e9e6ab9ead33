// The problem flags shared by `explain` and `run`, and how they become a validated problem: sizes
// from flags or from the --q/--k/--v files (checked against each other), tensors from files or
// from the modifier catalogue, modifiers from IR text or catalogue names.
#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <set>

#include "cli.hpp"
#include "flexattn/testing.hpp"

namespace flexattn::cli {

namespace {

// The sizes one Q/K/V file implies in a layout (batch is 0 for thd, where it is not in the shape).
struct FileDims {
  std::int64_t batch = 0, seq_len = 0, heads = 0, head_dim = 0;
};

FileDims dims_of(const HostTensor& tensor, Layout layout, const std::string& flag,
                 const std::string& path) {
  const std::vector<std::int64_t>& s = tensor.shape();
  const bool thd = layout == Layout::kTHD;
  const std::size_t rank = thd ? 3 : 4;
  if (s.size() != rank) {
    const char* order = layout == Layout::kBSHD   ? "(batch, seq, heads, head_dim)"
                        : layout == Layout::kSBHD ? "(seq, batch, heads, head_dim)"
                        : layout == Layout::kBHSD ? "(batch, heads, seq, head_dim)"
                                                  : "(tokens, heads, head_dim)";
    throw_invalid(fmt::format("{} '{}': layout {} needs a rank-{} array {}, got shape {}", flag,
                              path, to_string(layout), rank, order, tensor.view().describe()));
  }
  if (!is_floating(tensor.dtype())) {
    throw_invalid(fmt::format("{} '{}': expected floating-point data, got {}", flag, path,
                              to_string(tensor.dtype())));
  }
  switch (layout) {
    case Layout::kBSHD:
      return {s[0], s[1], s[2], s[3]};
    case Layout::kSBHD:
      return {s[1], s[0], s[2], s[3]};
    case Layout::kBHSD:
      return {s[0], s[2], s[1], s[3]};
    case Layout::kTHD:
      return {0, s[0], s[1], s[2]};
  }
  return {};
}

// Sets `target` from a file's size, or checks the flag's value against it.
void agree(std::int64_t& target, std::int64_t from_file, const char* flag, const char* what,
           const std::string& file_flag) {
  if (target != 0 && target != from_file) {
    throw_invalid(fmt::format("shape mismatch: {} is {} but {} has {} {}", flag, target, file_flag,
                              what, from_file));
  }
  target = from_file;
}

void same(std::int64_t a, std::int64_t b, const char* what, const char* flag_a,
          const char* flag_b) {
  if (a != b) {
    throw_invalid(
        fmt::format("shape mismatch: {} has {} {} but {} has {}", flag_a, what, a, flag_b, b));
  }
}

std::vector<std::int64_t> uniform_offsets(std::int64_t batch, std::int64_t length) {
  std::vector<std::int64_t> offsets;
  for (std::int64_t b = 0; b <= batch; ++b) offsets.push_back(b * length);
  return offsets;
}

bool is_identifier(const std::string& name) {
  if (name.empty() || std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

// CLI11 reads integers with strtoll/strtoull, which clamp past int64 (and wrap "-1" for unsigned)
// and take "010" as octal; these validators run first and let through only decimal integers in
// range, so a value outside int64 is refused, never clamped. They are transforms (CLI11 hands
// checks a copy) so that "010" reaches the conversion as "10".
// On success `text` is rewritten in canonical decimal (so "010" reaches CLI11 as "10").
template <typename Integer>
std::string decimal_error(std::string& text, Integer& value) {
  const char* const end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (error == std::errc::result_out_of_range && stop == end) {
    return fmt::format("{} is outside the range [{}, {}]", text,
                       std::numeric_limits<Integer>::min(), std::numeric_limits<Integer>::max());
  }
  if (text.empty() || error != std::errc() || stop != end) {
    return fmt::format("'{}' is not a decimal integer", text);
  }
  text = std::to_string(value);
  return {};
}

// A size flag given explicitly: 0 is refused, not read as "the default" (which is the flag left
// out), and so are negative values.
const CLI::Validator kPositiveSize(
    [](std::string& text) {
      std::int64_t value = 0;
      std::string error = decimal_error(text, value);
      if (error.empty() && value < 1) error = fmt::format("{} is not a size (at least 1)", text);
      return error;
    },
    "SIZE");

// Any int64 (the thd offsets; the problem checks their order).
const CLI::Validator kInt64(
    [](std::string& text) {
      std::int64_t value = 0;
      return decimal_error(text, value);
    },
    "INT64");

const CLI::Validator kUint64(
    [](std::string& text) {
      std::uint64_t value = 0;
      return decimal_error(text, value);
    },
    "UINT64");

// Text flags given explicitly must say something: an empty --score-mod, --dtype or --q is a
// mistake, not "none".
const CLI::Validator kNotEmpty(
    [](std::string& text) {
      return text.find_first_not_of(" \t\r\n") == std::string::npos
                 ? std::string("an empty value (leave the flag out for its default)")
                 : std::string();
    },
    "TEXT");

double parse_number(const std::string& text, const std::string& flag, const std::string& whole) {
  std::size_t used = 0;
  double value = 0.0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) {
    throw_invalid(fmt::format("{} '{}': '{}' is not a number", flag, whole, text));
  }
  if (!std::isfinite(value)) {
    throw_invalid(fmt::format("{} '{}': {} is not a finite number", flag, whole, text));
  }
  return value;
}

// Reads the three input files (all or none) into `setup` and sets the sizes they imply. With a
// KV cache (--page-size), --k and --v are pools (pages, page_size, heads_kv, head_dim).
void read_inputs(const ProblemFlags& flags, ProblemDesc& desc, Setup& setup) {
  const int given = !flags.q_file.empty() + !flags.k_file.empty() + !flags.v_file.empty();
  if (given == 0) return;
  if (given != 3) throw_invalid("--q, --k and --v must be given together");
  HostTensor q = read_npy(flags.q_file), k = read_npy(flags.k_file), v = read_npy(flags.v_file);
  const bool pool = flags.page_size > 0;
  const Layout kv_layout = pool ? Layout::kBSHD : desc.layout;  // a pool reads like bshd
  const FileDims dq = dims_of(q, desc.layout, "--q", flags.q_file);
  const FileDims dk = dims_of(k, kv_layout, "--k", flags.k_file);
  const FileDims dv = dims_of(v, kv_layout, "--v", flags.v_file);
  if (pool) {
    same(dk.batch, dv.batch, "pages", "--k", "--v");
    same(dk.seq_len, dv.seq_len, "page_size", "--k", "--v");
    same(dk.seq_len, flags.page_size, "page_size", "--k", "--page-size");
    if (flags.pages != 0) same(dk.batch, flags.pages, "pages", "--k", "--pages");
    setup.pool_pages = dk.batch;
  } else {
    same(dq.batch, dk.batch, "batch", "--q", "--k");
    same(dk.batch, dv.batch, "batch", "--k", "--v");
    same(dk.seq_len, dv.seq_len, desc.layout == Layout::kTHD ? "tokens" : "seq_len", "--k", "--v");
  }
  same(dq.head_dim, dk.head_dim, "head_dim", "--q", "--k");
  same(dk.heads, dv.heads, "heads", "--k", "--v");
  agree(desc.heads_q, dq.heads, "--heads-q", "heads", "--q");
  agree(desc.heads_kv, dk.heads, "--heads-kv", "heads", "--k");
  agree(desc.head_dim_qk, dq.head_dim, "--head-dim", "head_dim", "--q");
  agree(desc.head_dim_v, dv.head_dim, "--head-dim-v", "head_dim", "--v");
  if (desc.layout == Layout::kTHD) {
    // Sequences come from --cu-seqlens-q/kv, or are batch equal-length sequences.
    if (desc.cu_seqlens_q.empty()) {
      const std::int64_t batch = desc.batch == 0 ? kDefaultBatch : desc.batch;
      if (dq.seq_len % batch != 0 || (!pool && dk.seq_len % batch != 0)) {
        throw_invalid(fmt::format(
            "thd: {} query and {} key tokens do not split into {} equal sequences; give "
            "--cu-seqlens-q/--cu-seqlens-kv",
            dq.seq_len, dk.seq_len, batch));
      }
      desc.batch = batch;
      desc.cu_seqlens_q = uniform_offsets(batch, dq.seq_len / batch);
      if (!pool) desc.cu_seqlens_kv = uniform_offsets(batch, dk.seq_len / batch);
    }
    same(dq.seq_len, desc.cu_seqlens_q.back(), "tokens", "--q", "--cu-seqlens-q (last offset)");
    if (!pool) {
      const std::vector<std::int64_t>& cu_kv =
          desc.cu_seqlens_kv.empty() ? desc.cu_seqlens_q : desc.cu_seqlens_kv;
      same(dk.seq_len, cu_kv.back(), "tokens", "--k", "--cu-seqlens-kv (last offset)");
    }
  } else {
    agree(desc.batch, dq.batch, "--batch", "batch", "--q");
    agree(desc.seq_len_q, dq.seq_len, "--seq-len-q", "seq_len", "--q");
    if (!pool) agree(desc.seq_len_kv, dk.seq_len, "--seq-len-kv", "seq_len", "--k");
  }
  if (flags.dtype.empty()) desc.dtype = q.dtype();
  setup.q = q.to(desc.dtype);
  setup.k = k.to(desc.dtype);
  setup.v = v.to(desc.dtype);
}

// A KV cache from --page-size, --pages, --cache-lens and --page-table: the capacity is
// --seq-len-kv (default: the longest --cache-lens, else the query length) in whole pages; every
// sequence holds --cache-lens tokens (default --seq-len-kv); the pool has --pages pages (default
// one set per sequence).
void apply_kv_cache(const ProblemFlags& flags, ProblemDesc& desc, Setup& setup) {
  if (flags.page_size == 0) {
    for (const auto& [flag, used] : {std::pair{"--pages", flags.pages != 0},
                                     std::pair{"--cache-lens", !flags.cache_lens.empty()},
                                     std::pair{"--page-table", !flags.page_table_file.empty()}}) {
      if (used) throw_invalid(fmt::format("{} needs --page-size (a paged KV cache)", flag));
    }
    return;
  }
  if (!flags.cache_lens.empty() &&
      static_cast<std::int64_t>(flags.cache_lens.size()) != desc.batch) {
    throw_invalid(fmt::format("--cache-lens has {} values; the batch has {} sequences",
                              flags.cache_lens.size(), desc.batch));
  }
  std::int64_t longest_q = desc.seq_len_q;
  if (desc.layout == Layout::kTHD && desc.cu_seqlens_q.size() > 1) {
    for (std::size_t i = 1; i < desc.cu_seqlens_q.size(); ++i) {
      longest_q = std::max(longest_q, desc.cu_seqlens_q[i] - desc.cu_seqlens_q[i - 1]);
    }
  }
  std::int64_t length = desc.seq_len_kv;
  if (length == 0 && !flags.cache_lens.empty()) {
    length = *std::max_element(flags.cache_lens.begin(), flags.cache_lens.end());
  }
  if (length <= 0) length = longest_q;
  const std::int64_t max_pages = length / flags.page_size + (length % flags.page_size != 0 ? 1 : 0);
  std::int64_t pages = setup.pool_pages != 0 ? setup.pool_pages : flags.pages;
  if (pages == 0) {
    if (max_pages > std::numeric_limits<std::int64_t>::max() / desc.batch) {
      throw_invalid(fmt::format("--seq-len-kv {} in pages of {} for {} sequences is too many pages",
                                length, flags.page_size, desc.batch));
    }
    pages = desc.batch * max_pages;
  }
  desc.kv_cache = KvCacheDesc{pages, flags.page_size, max_pages};
  desc.seq_len_kv = 0;  // the capacity
  setup.cache_lens = flags.cache_lens.empty()
                         ? std::vector<std::int64_t>(static_cast<std::size_t>(desc.batch), length)
                         : flags.cache_lens;
  if (!flags.page_table_file.empty()) {
    HostTensor table = read_npy(flags.page_table_file);
    const std::vector<std::int64_t> expected{desc.batch, max_pages};
    if (table.dtype() != DType::kI32 || table.shape() != expected) {
      throw_invalid(
          fmt::format("--page-table '{}': expected int32 (batch, max_pages) = [{}, {}], "
                      "got {}",
                      flags.page_table_file, desc.batch, max_pages, table.view().describe()));
    }
    setup.page_table = std::move(table);
  }
}

// `paged`: a KV cache, whose lengths are no offsets.
void apply_defaults(ProblemDesc& desc, bool paged) {
  if (desc.batch == 0) desc.batch = kDefaultBatch;
  if (desc.heads_q == 0) desc.heads_q = desc.heads_kv != 0 ? desc.heads_kv : kDefaultHeads;
  if (desc.head_dim_qk == 0) desc.head_dim_qk = kDefaultHeadDim;
  if (desc.layout == Layout::kTHD) {
    // seq_len_q/kv stay 0 (derived from the offsets) unless given.
    if (desc.cu_seqlens_q.empty()) {
      const std::int64_t q_len = desc.seq_len_q == 0 ? kDefaultSeqLen : desc.seq_len_q;
      const std::int64_t kv_len = desc.seq_len_kv == 0 ? q_len : desc.seq_len_kv;
      desc.cu_seqlens_q = uniform_offsets(desc.batch, q_len);
      if (!paged) desc.cu_seqlens_kv = uniform_offsets(desc.batch, kv_len);
    }
  } else if (desc.seq_len_q == 0) {
    desc.seq_len_q = kDefaultSeqLen;
  }
}

// The catalogue modifiers named by --modifier, checked not to set what the flags or an earlier
// modifier already set.
std::vector<const NamedModifier*> catalogue_modifiers(const ProblemFlags& flags) {
  std::vector<const NamedModifier*> result;
  std::string score_from = flags.score_mod.empty() ? "" : "--score-mod";
  std::string mask_from = flags.mask_mod.empty() ? "" : "--mask-mod";
  for (const std::string& name : flags.modifiers) {
    const NamedModifier& modifier = find_modifier(name);
    const std::string here = "--modifier " + name;
    if (!modifier.score_mod.empty()) {
      if (!score_from.empty()) {
        throw_invalid(fmt::format("{} and {} both set the score modifier", score_from, here));
      }
      score_from = here;
    }
    if (!modifier.mask_mod.empty()) {
      if (!mask_from.empty()) {
        throw_invalid(fmt::format("{} and {} both set the mask", mask_from, here));
      }
      mask_from = here;
    }
    result.push_back(&modifier);
  }
  return result;
}

ir::Expr parse_flag(const std::string& text, const ProblemDesc& desc, const char* flag) {
  try {
    return ir::parse(text, desc.scope());
  } catch (const Error& error) {
    throw Error(error.code(), fmt::format("{}: {}", flag, error.what()));
  }
}

}  // namespace

void add_problem_flags(CLI::App& app, ProblemFlags& flags) {
  app.add_option("--batch", flags.batch, "batch size (default 1, or from --q)")
      ->transform(kPositiveSize);
  app.add_option("--heads-q", flags.heads_q, "query heads (default 4, or from --q)")
      ->transform(kPositiveSize);
  app.add_option("--heads-kv", flags.heads_kv, "key/value heads (default: heads-q; GQA/MQA)")
      ->transform(kPositiveSize);
  app.add_option("--seq-len-q", flags.seq_len_q, "query length (default 128, or from --q)")
      ->transform(kPositiveSize);
  app.add_option("--seq-len-kv", flags.seq_len_kv, "key/value length (default: seq-len-q)")
      ->transform(kPositiveSize);
  app.add_option("--head-dim", flags.head_dim, "head dim of q and k (default 64)")
      ->transform(kPositiveSize);
  app.add_option("--head-dim-v", flags.head_dim_v, "head dim of v and out (default: head-dim)")
      ->transform(kPositiveSize);
  app.add_option("--layout", flags.layout, "bshd, sbhd, bhsd or thd (default bshd)")
      ->check(kNotEmpty);
  app.add_option("--dtype", flags.dtype, "fp64, fp32, fp16 or bf16 (default: --q's, or fp32)")
      ->check(kNotEmpty);
  app.add_option_function<double>(
      "--scale", [&flags](const double& scale) { flags.scale = scale; },
      "score scale (default 1/sqrt(head-dim))");
  app.add_option("--score-mod", flags.score_mod,
                 "score modifier in IR text, e.g. '30 * tanh(score / 30)'")
      ->check(kNotEmpty);
  app.add_option("--mask-mod", flags.mask_mod, "mask in IR text, e.g. 'q >= kv'")->check(kNotEmpty);
  app.add_option("--modifier", flags.modifiers,
                 "catalogue modifier by name (softcap, alibi, causal, ...; repeatable)")
      ->check(kNotEmpty);
  app.add_option("--param", flags.params, "scalar parameter NAME=VALUE (repeatable)");
  app.add_option("--tensor", flags.tensors,
                 "tensor the modifiers read, NAME=FILE.npy (float32/64, int32/64), or "
                 "NAME=FILE.npy:fp32|fp16|bf16 to store a float tensor so (repeatable)");
  app.add_option("--cu-seqlens-q", flags.cu_seqlens_q, "thd: query offsets, batch + 1 values")
      ->delimiter(',')
      ->transform(kInt64);
  app.add_option("--cu-seqlens-kv", flags.cu_seqlens_kv, "thd: key offsets (default: query's)")
      ->delimiter(',')
      ->transform(kInt64);
  app.add_option("--page-size", flags.page_size,
                 "K and V as a paged KV cache of pages of this many tokens; capacity "
                 "--seq-len-kv; queries are the last tokens of each sequence (bshd or thd)")
      ->transform(kPositiveSize);
  app.add_option("--pages", flags.pages,
                 "KV cache: pages in the pool (default: every sequence its own)")
      ->transform(kPositiveSize);
  app.add_option("--cache-lens", flags.cache_lens,
                 "KV cache: tokens in each sequence, batch values (default --seq-len-kv each)")
      ->delimiter(',')
      ->transform(kInt64);
  app.add_option("--page-table", flags.page_table_file,
                 "KV cache: int32 (batch, max_pages) .npy of page ids (default: shuffled pages)")
      ->check(kNotEmpty);
  app.add_option("--q", flags.q_file, "queries .npy in the layout (gives the shapes)")
      ->check(kNotEmpty);
  app.add_option("--k", flags.k_file, "keys .npy in the layout")->check(kNotEmpty);
  app.add_option("--v", flags.v_file, "values .npy in the layout")->check(kNotEmpty);
  app.add_option("--engine", flags.engine, "engine to force, or auto (default auto)")
      ->check(kNotEmpty);
  app.add_flag("--backward", flags.backward, "forward and backward");
  app.add_option("--seed", flags.seed, "seed of the random inputs (default 0)")->transform(kUint64);
  app.add_flag("--with-planted-faults", flags.planted_faults,
               "add the deliberately faulty test engines")
      ->group("");
}

Problem problem_on(const ProblemDesc& desc, Device device) {
  ProblemDesc moved = desc;
  moved.device = device;
  return Problem(std::move(moved));
}

Setup build_setup(const ProblemFlags& flags) {
  Setup setup;
  ProblemDesc& desc = setup.desc;
  desc.batch = flags.batch;
  desc.heads_q = flags.heads_q;
  desc.heads_kv = flags.heads_kv;
  desc.seq_len_q = flags.seq_len_q;
  desc.seq_len_kv = flags.seq_len_kv;
  desc.head_dim_qk = flags.head_dim;
  desc.head_dim_v = flags.head_dim_v;
  desc.layout = parse_layout(flags.layout);
  desc.dtype = flags.dtype.empty() ? DType::kF32 : parse_dtype(flags.dtype);
  desc.scale = flags.scale;
  desc.cu_seqlens_q = flags.cu_seqlens_q;
  desc.cu_seqlens_kv = flags.cu_seqlens_kv;
  desc.direction = flags.backward ? Direction::kForwardBackward : Direction::kForward;
  for (std::int64_t size : {flags.batch, flags.heads_q, flags.heads_kv, flags.seq_len_q,
                            flags.seq_len_kv, flags.head_dim, flags.head_dim_v}) {
    if (size < 0) throw_invalid(fmt::format("sizes must be positive, got {}", size));
  }
  if (desc.layout == Layout::kTHD && desc.batch == 0 && desc.cu_seqlens_q.size() > 1) {
    desc.batch = static_cast<std::int64_t>(desc.cu_seqlens_q.size()) - 1;
  }
  read_inputs(flags, desc, setup);
  apply_defaults(desc, flags.page_size > 0);
  apply_kv_cache(flags, desc, setup);

  for (const std::string& assignment : flags.params) {
    const auto [name, value] = split_assignment(assignment, "--param");
    desc.params[name] = parse_number(value, "--param", assignment);
  }
  const std::vector<const NamedModifier*> modifiers = catalogue_modifiers(flags);
  for (const NamedModifier* modifier : modifiers) apply_modifier(*modifier, desc);
  std::set<std::string> from_files;
  for (const std::string& assignment : flags.tensors) {
    const auto [name, path] = split_assignment(assignment, "--tensor");
    if (!from_files.insert(name).second) {
      throw_invalid(fmt::format("--tensor '{}' is given twice", name));
    }
    const TensorFile file = parse_tensor_file(path);
    HostTensor tensor = read_npy(file.path);
    if (file.storage) {
      if (!is_floating(tensor.dtype())) {
        throw_invalid(fmt::format(
            "--tensor '{}': {} holds {} values; a storage suffix (:{}) "
            "applies to float tensors",
            assignment, file.path, to_string(tensor.dtype()), to_string(*file.storage)));
      }
      tensor = tensor.to(*file.storage);
    }
    desc.tensors[name] = TensorDecl{tensor.dtype(), tensor.shape()};
    setup.tensors[name] = std::move(tensor);
  }
  if (!flags.score_mod.empty()) desc.score_mod = parse_flag(flags.score_mod, desc, "--score-mod");
  if (!flags.mask_mod.empty()) desc.mask_mod = parse_flag(flags.mask_mod, desc, "--mask-mod");

  const Problem problem(desc);  // validates everything above
  CatalogueDims dims;
  dims.batch = problem.batch();
  dims.heads_q = problem.heads_q();
  dims.seq_len_q = problem.seq_len_q();
  dims.seq_len_kv = problem.seq_len_kv();
  for (const NamedModifier* modifier : modifiers) {
    for (const CatalogueTensor& tensor : modifier->tensors) {
      if (from_files.contains(tensor.name)) continue;
      setup.tensors[tensor.name] = make_catalogue_tensor(*modifier, tensor, dims, flags.seed);
    }
  }
  return setup;
}

TensorFile parse_tensor_file(const std::string& text) {
  const std::size_t colon = text.rfind(':');
  if (colon != std::string::npos) {
    const std::string suffix = text.substr(colon + 1);
    for (const DType storage : {DType::kF32, DType::kF16, DType::kBF16}) {
      if (suffix == to_string(storage)) return TensorFile{text.substr(0, colon), storage};
    }
  }
  return TensorFile{text, std::nullopt};
}

std::pair<std::string, std::string> split_assignment(const std::string& text,
                                                     const std::string& flag) {
  const std::size_t equals = text.find('=');
  if (equals == std::string::npos || equals == 0 || equals + 1 == text.size()) {
    throw_invalid(fmt::format("{} '{}': expected NAME=VALUE", flag, text));
  }
  std::string name = text.substr(0, equals);
  if (!is_identifier(name)) {
    throw_invalid(
        fmt::format("{} '{}': '{}' is not a name (letters, digits, '_')", flag, text, name));
  }
  return {std::move(name), text.substr(equals + 1)};
}

ContextOptions context_options(const std::string& engine, bool planted_faults) {
  ContextOptions options;
  if (engine != "auto") options.policy.force = engine;
  if (planted_faults) options.extra_engines = testing::planted_faulty_engines();
  return options;
}

}  // namespace flexattn::cli
