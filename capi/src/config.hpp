// capi/src/config.hpp — an allocator's configuration for the C ABI: the keys, their parsing
// from "key=value, key=value" text and from CUDAMEM_<KEY> environment variables, and the
// checks that refuse a bad value with a sentence naming it.
//
//   allocator_config c;                                   // the defaults: vm_pool, no limit
//   apply_environment(c, std::getenv);                     // CUDAMEM_RESOURCE=pool, ...
//   apply_config_text(c, "limit_bytes=8GiB, grow_ahead_bytes=0", "install()");
//   describe(c);                                          // "resource=vm_pool, limit_bytes=..."
//
// Contract
// - Every failure throws config_error (a std::invalid_argument) whose message names the key,
//   the value, where it came from (the variable's name, or the caller's label) and what would
//   be accepted. Nothing is applied from a text or an environment that has an error in it.
// - Keys (see cudamem_c.h): resource, limit_bytes, grow_ahead_bytes, handle_bytes,
//   keep_free_bytes, bulk_handle_bytes, recent_frees, simulate_bytes, raise_on_oom. A key that
//   does not apply to the resource chosen (grow_ahead_bytes for `pool`) is an error, checked
//   once all keys are in (validate()), so the order of keys and sources does not matter.
// - Sizes: decimal digits, then optionally a unit K/KiB, M/MiB, G/GiB, T/TiB (powers of
//   1024; case-insensitive; spaces allowed before the unit). Overflow is an error. Counts
//   (recent_frees): decimal digits only.
#pragma once

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cudamem::capi {

/// A configuration that cannot be accepted; what() says which key and why.
class config_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class resource_choice { vm_pool, pool, async };

[[nodiscard]] inline std::string_view to_string(resource_choice r) noexcept {
  switch (r) {
    case resource_choice::vm_pool: return "vm_pool";
    case resource_choice::pool: return "pool";
    case resource_choice::async: return "async";
  }
  return "?";
}

/// The vm_pool's handle size for this library's users unless they set handle_bytes: 4 MiB,
/// not vm_resource's 64 MiB. A vm_pool gives a block of a handle or more whole handles, so a
/// block wastes up to a handle less 2 MiB; tensors of every size from 1 MiB to 1 GiB (what
/// PyTorch asks for) waste half a handle each on average. Measured by replaying a training
/// loop's allocations (bench/python/trace.py, then bench_replay --resource vm_pool on a
/// simulated device): the least device each needs, over its peak in use, was 1.15-1.21x with
/// 64 MiB handles and 1.01-1.03x with 4 MiB (2 MiB: the same within 1%; 8 MiB 1.04-1.05x).
/// The price is driver calls: access is given per handle (~25 us), 16 times as many per GiB
/// mapped, a few milliseconds per GiB of growth.
inline constexpr std::size_t default_handle_bytes = std::size_t{4} << 20;

/// The vm_pool's keep_free_bytes for this library's users unless they set it: 1 GiB (C++'s
/// vm_pool: 0). Why. A framework's process takes device memory outside its allocator in the
/// middle of a run: cuDNN and cuBLAS kernels loaded on first use, the local memory a new
/// kernel needs (vm_resource.hpp measures them: 140 MiB of modules, 792 MiB for a kernel with
/// 4 KiB of stack per thread). Without a reserve, a vm_pool that has once filled the device
/// keeps it full, and those fail: a transformer's training loop on an 8 GiB budget stopped at
/// batch 28 with cuDNN's attention failing ("mha_graph.execute"), where expandable segments
/// ran 30. With 512 MiB, 1 GiB or 2 GiB kept free it ran 30 (H100, bench/python/train.py);
/// 1 GiB covers one such kernel and the modules. It is not a limit: a request that recycling
/// cannot serve grows into it. The price is compactions (host waits) instead of growth
/// within the last GiB of the device.
inline constexpr std::size_t default_keep_free_bytes = std::size_t{1} << 30;

/// The vm_pool's bulk_handle_bytes for this library's users unless they set it: 32 MiB, where
/// the handle size in force divides it (C++'s vm_pool: 0, none). A tensor whose size is a whole
/// multiple of it (64 MiB, 128 MiB, ...) is made of 32 MiB handles; the rest of 4 MiB ones.
/// Why. cuMemSetAccess costs the driver ~34 us per handle whatever its size, so a 128 MiB
/// tensor made from memory that frees left in pieces cost 32 calls, ~1-1.4 ms, where PyTorch's
/// default takes ~0.2 ms; in 32 MiB handles it is 4 calls, ~0.16 ms. 32 MiB handles for every
/// block would strand more beside long-lived tensors of other sizes (bench/python/frag.py's
/// heavy trace: 0.953 of the device live against 0.982); a bulk tensor strands nothing, being
/// whole handles. bench/README.md ("Handle size") has the measurements.
inline constexpr std::size_t default_bulk_handle_bytes = std::size_t{32} << 20;

/// What an allocator is made of. Unset optionals mean "the resource's own default".
struct allocator_config {
  resource_choice resource = resource_choice::vm_pool;
  std::optional<std::size_t> limit_bytes;       ///< a limiting_adaptor with this budget
  std::optional<std::size_t> grow_ahead_bytes;  ///< vm_pool only
  std::optional<std::size_t> handle_bytes;      ///< vm_pool only; unset: default_handle_bytes
  std::optional<std::size_t> keep_free_bytes;   ///< vm_pool only; unset: default_keep_free_bytes
  std::optional<std::size_t> bulk_handle_bytes; ///< vm_pool only; 0: none; unset: see below
  std::optional<std::size_t> recent_frees;      ///< vm_pool only; unset: vm_resource's default
  std::optional<std::size_t> simulate_bytes;    ///< a pretend device (tests)
  bool raise_on_oom = true;                     ///< the torch entry points throw (else null)
};

/// The keys, in the order describe() prints them.
inline constexpr std::string_view config_keys[] = {
    "resource", "limit_bytes", "grow_ahead_bytes", "handle_bytes", "keep_free_bytes",
    "bulk_handle_bytes", "recent_frees", "simulate_bytes", "raise_on_oom"};

/// The most recent_frees accepts (vm_resource_options::recent_frees; kept here so that the
/// parser needs no cudamem header; test_config checks that the two agree).
inline constexpr std::size_t max_recent_frees = 256;

/// Whether `bulk` can be the bulk handle size over handles of `handle` bytes: a multiple of
/// it, larger than it (what vm_pool_options::bulk_handle_bytes accepts).
[[nodiscard]] constexpr bool bulk_fits(std::size_t bulk, std::size_t handle) noexcept {
  return bulk > handle && bulk % handle == 0;
}

/// The bulk handle size in force: the one set (0: none); else the default where it fits the
/// handle size in force; else none.
[[nodiscard]] inline std::size_t bulk_handle_bytes(const allocator_config& c) noexcept {
  if (c.bulk_handle_bytes) {
    return *c.bulk_handle_bytes;
  }
  const std::size_t handle = c.handle_bytes.value_or(default_handle_bytes);
  return bulk_fits(default_bulk_handle_bytes, handle) ? default_bulk_handle_bytes : 0;
}

namespace detail {

[[nodiscard]] inline std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())) != 0) {
    s.remove_prefix(1);
  }
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())) != 0) {
    s.remove_suffix(1);
  }
  return s;
}

[[nodiscard]] inline std::string lowercase(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

[[noreturn]] inline void refuse(std::string_view key, std::string_view value,
                                std::string_view source, std::string_view why) {
  throw config_error("cudamem: " + std::string(key) + "=" + std::string(value) + " (from " +
                     std::string(source) + "): " + std::string(why));
}

}  // namespace detail

/// A size in bytes ("64MiB", "8 GiB", "4096"); nullopt if `text` is not one.
[[nodiscard]] inline std::optional<std::size_t> parse_size(std::string_view text) {
  text = detail::trim(text);
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits])) != 0) {
    ++digits;
  }
  if (digits == 0) {
    return std::nullopt;
  }
  std::size_t value = 0;
  for (std::size_t i = 0; i < digits; ++i) {
    const auto d = static_cast<std::size_t>(text[i] - '0');
    if (value > (std::numeric_limits<std::size_t>::max() - d) / 10) {
      return std::nullopt;
    }
    value = value * 10 + d;
  }
  const std::string unit = detail::lowercase(detail::trim(text.substr(digits)));
  unsigned shift = 0;
  if (unit.empty() || unit == "b") {
    shift = 0;
  } else if (unit == "k" || unit == "kib") {
    shift = 10;
  } else if (unit == "m" || unit == "mib") {
    shift = 20;
  } else if (unit == "g" || unit == "gib") {
    shift = 30;
  } else if (unit == "t" || unit == "tib") {
    shift = 40;
  } else {
    return std::nullopt;
  }
  if (shift != 0 && value > (std::numeric_limits<std::size_t>::max() >> shift)) {
    return std::nullopt;
  }
  return value << shift;
}

/// Sets one key of `c` from text; `source` names where it came from, for the message.
inline void set_key(allocator_config& c, std::string_view key, std::string_view value,
                    std::string_view source) {
  key = detail::trim(key);
  value = detail::trim(value);
  const auto size_or_refuse = [&](bool zero_allowed) {
    const std::optional<std::size_t> bytes = parse_size(value);
    if (!bytes) {
      detail::refuse(key, value, source,
                     "not a size (bytes, optionally with a unit: 512, 64KiB, 2MiB, 8GiB, 1TiB)");
    }
    if (!zero_allowed && *bytes == 0) {
      detail::refuse(key, value, source, "must be more than 0");
    }
    return *bytes;
  };
  if (key == "resource") {
    const std::string v = detail::lowercase(value);
    if (v == "vm_pool") {
      c.resource = resource_choice::vm_pool;
    } else if (v == "pool") {
      c.resource = resource_choice::pool;
    } else if (v == "async") {
      c.resource = resource_choice::async;
    } else {
      detail::refuse(key, value, source, "unknown resource; one of vm_pool, pool, async");
    }
  } else if (key == "limit_bytes") {
    c.limit_bytes = size_or_refuse(false);
  } else if (key == "grow_ahead_bytes") {
    c.grow_ahead_bytes = size_or_refuse(true);
  } else if (key == "handle_bytes") {
    const std::size_t bytes = size_or_refuse(false);
    constexpr std::size_t granule = std::size_t{2} << 20;
    if (bytes % granule != 0) {
      detail::refuse(key, value, source, "must be a multiple of 2 MiB (the mapping granularity)");
    }
    c.handle_bytes = bytes;
  } else if (key == "keep_free_bytes") {
    c.keep_free_bytes = size_or_refuse(true);
  } else if (key == "bulk_handle_bytes") {
    const std::size_t bytes = size_or_refuse(true);
    if (bytes % (std::size_t{2} << 20) != 0) {
      detail::refuse(key, value, source, "must be 0 (none) or a multiple of 2 MiB");
    }
    c.bulk_handle_bytes = bytes;
  } else if (key == "recent_frees") {
    const std::optional<std::size_t> count = parse_size(value);
    if (!count || value.find_first_not_of("0123456789") != std::string_view::npos ||
        *count > max_recent_frees) {
      detail::refuse(key, value, source,
                     "not a count from 0 to " + std::to_string(max_recent_frees) +
                         " (blocks kept aside once freed; 0: none)");
    }
    c.recent_frees = *count;
  } else if (key == "simulate_bytes") {
    c.simulate_bytes = size_or_refuse(false);
  } else if (key == "raise_on_oom") {
    const std::string v = detail::lowercase(value);
    if (v == "1" || v == "true" || v == "yes" || v == "on") {
      c.raise_on_oom = true;
    } else if (v == "0" || v == "false" || v == "no" || v == "off") {
      c.raise_on_oom = false;
    } else {
      detail::refuse(key, value, source, "not a boolean (1/0, true/false, yes/no, on/off)");
    }
  } else {
    std::string known;
    for (const std::string_view k : config_keys) {
      known += (known.empty() ? "" : ", ") + std::string(k);
    }
    throw config_error("cudamem: unknown key '" + std::string(key) + "' (from " +
                       std::string(source) + "); known keys: " + known);
  }
}

/// The environment variable of a key: CUDAMEM_ and the key in capitals.
[[nodiscard]] inline std::string environment_name(std::string_view key) {
  std::string name = "CUDAMEM_";
  for (const char ch : key) {
    name += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  }
  return name;
}

/// Checks that every key set applies to the resource chosen and that the keys agree.
inline void validate(const allocator_config& c, std::string_view source) {
  const auto only_vm_pool = [&](std::string_view key, const std::optional<std::size_t>& v) {
    if (v && c.resource != resource_choice::vm_pool) {
      throw config_error("cudamem: " + std::string(key) + " (set in " + std::string(source) +
                         " or by " + environment_name(key) +
                         ") applies to resource=vm_pool only, not resource=" +
                         std::string(to_string(c.resource)));
    }
  };
  only_vm_pool("grow_ahead_bytes", c.grow_ahead_bytes);
  only_vm_pool("handle_bytes", c.handle_bytes);
  only_vm_pool("keep_free_bytes", c.keep_free_bytes);
  only_vm_pool("bulk_handle_bytes", c.bulk_handle_bytes);
  only_vm_pool("recent_frees", c.recent_frees);
  const std::size_t handle = c.handle_bytes.value_or(default_handle_bytes);
  if (c.bulk_handle_bytes && *c.bulk_handle_bytes != 0 &&
      !bulk_fits(*c.bulk_handle_bytes, handle)) {
    throw config_error("cudamem: bulk_handle_bytes=" + std::to_string(*c.bulk_handle_bytes) +
                       " (set in " + std::string(source) + " or by CUDAMEM_BULK_HANDLE_BYTES) "
                       "must be 0 or a multiple of the handle size (" + std::to_string(handle) +
                       " bytes) larger than it");
  }
  if (c.simulate_bytes && c.resource == resource_choice::async) {
    throw config_error("cudamem: simulate_bytes (set in " + std::string(source) +
                       " or by CUDAMEM_SIMULATE_BYTES) cannot simulate resource=async (it is "
                       "the CUDA driver's own pool); "
                       "use vm_pool or pool");
  }
}

/// Applies "key=value, key=value" text (empty: nothing) to `c`: all of it, or none of it.
inline void apply_config_text(allocator_config& c, std::string_view text,
                              std::string_view source) {
  allocator_config next = c;
  while (!detail::trim(text).empty()) {
    const std::size_t comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    if (detail::trim(item).empty()) {
      continue;
    }
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      throw config_error("cudamem: '" + std::string(detail::trim(item)) + "' (from " +
                         std::string(source) + ") is not key=value");
    }
    set_key(next, item.substr(0, eq), item.substr(eq + 1), source);
  }
  validate(next, source);
  c = next;
}

/// Applies every CUDAMEM_<KEY> variable that `getenv` finds: all of them, or none.
template <class Getenv>
void apply_environment(allocator_config& c, Getenv&& getenv) {
  allocator_config next = c;
  for (const std::string_view key : config_keys) {
    const std::string name = environment_name(key);
    if (const char* value = getenv(name.c_str()); value != nullptr) {
      set_key(next, key, value, "environment variable " + name);
    }
  }
  validate(next, "the environment");
  c = next;
}

/// Every key with its value in force, "key=value, ...": what describe() reports.
[[nodiscard]] inline std::string describe(const allocator_config& c) {
  const auto size = [](const std::optional<std::size_t>& v) {
    return v ? std::to_string(*v) : std::string("default");
  };
  std::string s = "resource=" + std::string(to_string(c.resource));
  s += ", limit_bytes=" + (c.limit_bytes ? std::to_string(*c.limit_bytes) : std::string("none"));
  if (c.resource == resource_choice::vm_pool) {
    s += ", grow_ahead_bytes=" + size(c.grow_ahead_bytes);
    s += ", handle_bytes=" + size(c.handle_bytes);
    s += ", keep_free_bytes=" + size(c.keep_free_bytes);
    s += ", bulk_handle_bytes=" + size(c.bulk_handle_bytes);
    s += ", recent_frees=" + size(c.recent_frees);
  }
  if (c.simulate_bytes) {
    s += ", simulate_bytes=" + std::to_string(*c.simulate_bytes);
  }
  s += std::string(", raise_on_oom=") + (c.raise_on_oom ? "1" : "0");
  return s;
}

}  // namespace cudamem::capi
