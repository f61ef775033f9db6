// bench_replay — replays a logged run (logging_adaptor's log) through a resource stack on a
// simulated device, and says what it would have reserved and whether and where it would have
// run out: "which configuration would have avoided this OOM?", on a laptop.
//
//   bench_replay LOG [--resource pool|arena|direct|vm_pool] [--capacity 80GiB]
//                    [--layout first_fit|paged] [--handle-bytes 64MiB] [--trace out.json]
//                    [--sample-every N]
//   bench_replay --make-log TRACE OUT.log     write a standard trace (DESIGN.md) as a log
//
//   --resource  pool    pool_resource over the device (default)
//               arena   arena_resource over the device (frees are no-ops: a monotonic run)
//               direct  the device itself (first_fit: like cudaMalloc without virtual memory;
//                       paged: like cudaMalloc on a current GPU)
//               vm_pool vm_pool_resource over a simulated virtual-memory device (2 MiB
//                       granules; --handle-bytes sets its handle size, default 64 MiB;
//                       --layout does not apply)
//   --capacity  the device's size: a byte count or with a unit, B KiB MiB GiB TiB (default 80GiB)
//   --layout    the simulated device's layout (default first_fit)
//   --trace     also write a Chrome trace (ui.perfetto.dev): in use and reserved per resource
//
// Prints the counts, peak in use, peak reserved, and either "completed" or the event index,
// time, bytes and verdict of the first allocation that failed, with the full report.
// Exit status: 0 completed, 2 ran out of memory, 1 bad arguments or an unreadable log.
#include <cudamem/arena_resource.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/log_format.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/replay.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/trace_export.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "traces.hpp"

#include <charconv>
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

/// "80GiB", "1.5 GiB", "4096" -> bytes; empty if it is not a size.
std::optional<std::size_t> parse_size(std::string_view text) {
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || value < 0) {
    return std::nullopt;
  }
  std::string_view unit = text.substr(static_cast<std::size_t>(end - text.data()));
  while (!unit.empty() && unit.front() == ' ') {
    unit.remove_prefix(1);
  }
  static constexpr std::pair<std::string_view, double> units[] = {
      {"", 1.0},           {"B", 1.0},
      {"KiB", 1024.0},     {"MiB", 1048576.0},
      {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (const auto& [name, scale] : units) {
    if (unit == name) {
      return static_cast<std::size_t>(value * scale);
    }
  }
  return std::nullopt;
}

int usage(const char* why) {
  std::fprintf(stderr,
               "bench_replay: %s\n"
               "usage: bench_replay LOG [--resource pool|arena|direct|vm_pool] [--capacity 80GiB]\n"
               "                        [--layout first_fit|paged] [--handle-bytes 64MiB]\n"
               "                        [--trace out.json] [--sample-every N]\n"
               "       bench_replay --make-log TRACE OUT.log   (TRACE: a standard trace name)\n",
               why);
  return 1;
}

/// Writes standard trace `name` as a log, as if a program had run it through a
/// logging_adaptor (on a roomy paged simulated device).
int make_log(const std::string& name, const std::string& path) {
  for (const cudamem_bench::trace_spec& spec : cudamem_bench::standard_traces()) {
    if (spec.name != name) {
      continue;
    }
    const cudamem_bench::trace t = cudamem_bench::make_trace(spec);
    cudamem::simulated_resource device{{.capacity = std::size_t{1} << 45,
                                        .layout = cudamem::simulated_layout::paged}};
    cudamem::logging_adaptor logged{device, path};
    std::vector<void*> slots(t.blocks);
    cudamem_bench::replay(
        t, slots, [&](std::size_t n) { return logged.allocate(n); },
        [&](void* p, std::size_t n) { logged.deallocate(p, n); });
    std::printf("bench_replay: wrote %zu events of %s to %s\n", logged.events(), name.c_str(),
                path.c_str());
    return 0;
  }
  return usage(("no standard trace named " + name).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 3 && args[0] == "--make-log") {
    return make_log(args[1], args[2]);
  }
  std::string log_path;
  std::string resource = "pool";
  std::string layout = "first_fit";
  std::string trace_path;
  std::size_t capacity = std::size_t{80} << 30;
  std::size_t sample_every = 1;
  std::size_t handle_bytes = std::size_t{64} << 20;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool has_value = i + 1 < args.size();
    if (a == "--resource" && has_value) {
      resource = args[++i];
    } else if (a == "--layout" && has_value) {
      layout = args[++i];
    } else if (a == "--trace" && has_value) {
      trace_path = args[++i];
    } else if (a == "--capacity" && has_value) {
      const auto size = parse_size(args[++i]);
      if (!size || *size == 0) {
        return usage(("bad capacity " + args[i]).c_str());
      }
      capacity = *size;
    } else if (a == "--handle-bytes" && has_value) {
      const auto size = parse_size(args[++i]);
      if (!size || *size == 0) {
        return usage(("bad --handle-bytes " + args[i]).c_str());
      }
      handle_bytes = *size;
    } else if (a == "--sample-every" && has_value) {
      const auto n = parse_size(args[++i]);
      if (!n || *n == 0) {
        return usage(("bad --sample-every " + args[i]).c_str());
      }
      sample_every = *n;
    } else if (!a.starts_with("--") && log_path.empty()) {
      log_path = a;
    } else {
      return usage(("unexpected argument " + a).c_str());
    }
  }
  if (log_path.empty()) {
    return usage("no log given");
  }
  if (resource != "pool" && resource != "arena" && resource != "direct" && resource != "vm_pool") {
    return usage(("unknown resource " + resource).c_str());
  }
  if (layout != "first_fit" && layout != "paged") {
    return usage(("unknown layout " + layout).c_str());
  }

  try {
    std::ifstream in{log_path};
    if (!in) {
      std::fprintf(stderr, "bench_replay: cannot open %s\n", log_path.c_str());
      return 1;
    }
    const std::vector<cudamem::log_event> events = cudamem::read_log(in);

    cudamem::simulated_resource device{
        {.capacity = capacity,
         .layout = layout == "paged" ? cudamem::simulated_layout::paged
                                     : cudamem::simulated_layout::first_fit}};
    std::unique_ptr<cudamem::memory_resource> top;
    if (resource == "pool") {
      top = std::make_unique<cudamem::pool_resource>(device);
    } else if (resource == "arena") {
      top = std::make_unique<cudamem::arena_resource>(device);
    } else if (resource == "vm_pool") {
      cudamem::vm_pool_options options;
      options.handle_bytes = handle_bytes;
      top = std::make_unique<cudamem::vm_pool_resource>(
          std::make_unique<cudamem::detail::simulated_vm_mapping>(
              cudamem::detail::simulated_vm_options{.capacity = capacity,
                                                    .granularity = std::size_t{2} << 20}),
          options);
    }
    cudamem::memory_resource& stack = top ? *top : device;

    cudamem::chrome_trace trace;
    const cudamem::replay_result result = cudamem::replay_log(
        events, stack,
        {.trace = trace_path.empty() ? nullptr : &trace, .sample_every = sample_every});

    std::printf("replay of %s (%zu events) through %s on a simulated %s device (%s)\n",
                log_path.c_str(), events.size(), resource.c_str(),
                cudamem::format_bytes(capacity).c_str(), layout.c_str());
    std::fputs(result.to_text().c_str(), stdout);
    if (!trace_path.empty()) {
      trace.write_file(trace_path);
      std::printf("trace: %s (%zu events; open in https://ui.perfetto.dev)\n",
                  trace_path.c_str(), trace.size());
    }
    return result.failure ? 2 : 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "bench_replay: %s\n", error.what());
    return 1;
  }
}
