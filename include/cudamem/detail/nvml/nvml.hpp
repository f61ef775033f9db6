// cudamem/detail/nvml/nvml.hpp — which processes hold a GPU's memory, from NVML (the NVIDIA
// Management Library that ships with the driver as libnvidia-ml.so.1), loaded at run time:
// cudamem links nothing but the CUDA runtime, and a machine without NVML (a container that
// does not mount it, a driver-less CI box) gets a plain "not available" instead of a loader
// failure.
//
//   const detail::nvml::library& nvml = detail::nvml::process_library();  // loaded once
//   detail::nvml::device_processes d = detail::nvml::list_processes(nvml, "0000:3B:00.0");
//   if (d.status == detail::nvml::listing::listed) { for (auto& p : d.processes) ... }
//   else std::puts(d.reason.c_str());       // why not, in one plain sentence
//
// What is in here, and why:
// - The ABI is declared here, not taken from <nvml.h>, which is not installed with every CUDA
//   toolkit: the types below are NVML's C structs, field for field (the static_asserts pin
//   their sizes on LP64). Nothing names an NVML function; each is looked up with dlsym.
// - The device is found by PCI bus id, never by index: CUDA_VISIBLE_DEVICES, containers and
//   CUDA's own ordering (fastest first) make CUDA's device 0 someone else's NVML device 0.
// - Listing processes, newest call first: nvmlDeviceGetRunningProcessDetailList (drivers 550
//   and later; a versioned struct, so its layout is never in doubt), else the _v3 call, else
//   _v2, else the original. Drivers disagree about the record _v3 fills: 24 bytes in most,
//   32 (with usedGpuCcProtectedMemory) in the ones that have nvmlDeviceGetConfComputeMemSizeInfo
//   but not the detail list; the buffer passed is sized for 32 bytes a record whatever the
//   stride, so a wrong guess can misread but never overrun it. Compute, graphics and MPS
//   processes are all listed (a process in more than one list counts once, at its largest).
// - What can stop it, each said plainly in `reason`: no library (dlopen's message), an NVML
//   too old, nvmlInit failing (driver not loaded, no permission), no device with that bus id,
//   no permission to list processes, or a listing that does not include this very process —
//   which means the driver reports process ids from another PID namespace (a container): the
//   ids cannot be matched to processes here, so they are not named.
// - `library` takes its entry points from any `symbol_source`: the real one is dlopen/dlsym;
//   tests give a fake table, or a library name that does not exist.
// - The process-wide library is loaded (and nvmlInit called) the first time a report asks, and
//   kept for the life of the process: it costs tens of milliseconds once, not per report.
//   Setting the environment variable CUDAMEM_NO_NVML (to anything) stops it being loaded.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <dlfcn.h>
#include <unistd.h>
#endif

namespace cudamem::detail::nvml {

// --- NVML's ABI, as documented (nvml.h) ----------------------------------------------------

using result = int;  // nvmlReturn_t
inline constexpr result success = 0;
inline constexpr result error_uninitialized = 1;
inline constexpr result error_invalid_argument = 2;
inline constexpr result error_not_supported = 3;
inline constexpr result error_no_permission = 4;
inline constexpr result error_not_found = 6;
inline constexpr result error_insufficient_size = 7;
inline constexpr result error_driver_not_loaded = 9;
inline constexpr result error_function_not_found = 13;
inline constexpr result error_gpu_is_lost = 15;

struct device_st;
using device_handle = device_st*;  // nvmlDevice_t

/// usedGpuMemory's "not available" (e.g. under Windows' WDDM).
inline constexpr unsigned long long value_not_available = ~0ull;

struct process_info_v1 {  // nvmlProcessInfo_v1_t: the original calls
  unsigned int pid;
  unsigned long long used_gpu_memory;
};
struct process_info_v2 {  // nvmlProcessInfo_v2_t: the _v2 calls, and _v3 in most drivers
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};
struct process_detail_v1 {  // nvmlProcessDetail_v1_t; also what some drivers' _v3 fills
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
  unsigned long long used_gpu_cc_protected_memory;
};
struct process_detail_list_v1 {  // nvmlProcessDetailList_v1_t
  unsigned int version;
  unsigned int mode;  // 0 compute, 1 graphics, 2 MPS compute
  unsigned int num_proc_array_entries;
  process_detail_v1* proc_array;
};
#if defined(__LP64__)
static_assert(sizeof(process_info_v1) == 16 && sizeof(process_info_v2) == 24);
static_assert(sizeof(process_detail_v1) == 32 && sizeof(process_detail_list_v1) == 24);
#endif
/// NVML_STRUCT_VERSION(ProcessDetailList, 1).
inline constexpr unsigned int process_detail_list_version =
    static_cast<unsigned int>(sizeof(process_detail_list_v1)) | (1u << 24);

/// The three kinds of process NVML lists separately.
enum class process_mode : unsigned int { compute = 0, graphics = 1, mps = 2 };

// --- the entry points ----------------------------------------------------------------------

using fn_void = result (*)();
using fn_error_string = const char* (*)(result);
using fn_handle_by_bus_id = result (*)(const char*, device_handle*);
using fn_detail_list = result (*)(device_handle, process_detail_list_v1*);
using fn_processes = result (*)(device_handle, unsigned int*, void*);  // any record stride
using fn_process_name = result (*)(unsigned int, char*, unsigned int);

/// The NVML functions cudamem uses; null where this NVML lacks one.
struct api {
  fn_void init = nullptr;  // nvmlInit_v2
  fn_error_string error_string = nullptr;
  fn_handle_by_bus_id handle_by_pci_bus_id = nullptr;  // nvmlDeviceGetHandleByPciBusId_v2
  fn_detail_list running_process_detail_list = nullptr;
  // [mode][0: _v3, 1: _v2, 2: the original], mode as process_mode
  std::array<std::array<fn_processes, 3>, 3> running_processes{};
  fn_process_name process_name = nullptr;  // nvmlSystemGetProcessName
  bool v3_records_are_32_bytes = false;    // see the header's notes
};

/// Looks a symbol up by name (dlsym, or a test's table): any callable taking the name and
/// returning its address, referred to (not copied) for the length of the call that takes it.
/// (A reference to a function, not std::function, whose header is a second's compile time.)
class symbol_source {
 public:
  template <class Lookup>
    requires(!std::is_same_v<std::remove_cvref_t<Lookup>, symbol_source>) &&
            std::is_invocable_r_v<void*, const Lookup&, const char*>
  symbol_source(const Lookup& lookup) noexcept  // NOLINT: implicit, as std::function's
      : target_(&lookup), call_([](const void* target, const char* name) -> void* {
          return (*static_cast<const Lookup*>(target))(name);
        }) {}

  void* operator()(const char* name) const { return call_(target_, name); }

 private:
  const void* target_;
  void* (*call_)(const void*, const char*);
};

/// An NVML that was found and initialised — or the reason it was not.
class library {
 public:
  /// Not loaded: `why` says why.
  explicit library(std::string why) : reason_(std::move(why)) {}

  /// Takes every entry point from `lookup` and calls nvmlInit. `name` is for messages.
  library(const std::string& name, const symbol_source& lookup) {
    auto get = [&](auto& slot, const char* symbol) {
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(lookup(symbol));
    };
    get(api_.init, "nvmlInit_v2");
    get(api_.error_string, "nvmlErrorString");
    get(api_.handle_by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    get(api_.running_process_detail_list, "nvmlDeviceGetRunningProcessDetailList");
    static constexpr const char* kinds[] = {"Compute", "Graphics", "MPSCompute"};
    static constexpr const char* suffixes[] = {"_v3", "_v2", ""};
    for (std::size_t m = 0; m < 3; ++m) {
      for (std::size_t v = 0; v < 3; ++v) {
        const std::string symbol =
            std::string("nvmlDeviceGet") + kinds[m] + "RunningProcesses" + suffixes[v];
        get(api_.running_processes[m][v], symbol.c_str());
      }
    }
    get(api_.process_name, "nvmlSystemGetProcessName");
    api_.v3_records_are_32_bytes = lookup("nvmlDeviceGetConfComputeMemSizeInfo") != nullptr &&
                                   api_.running_process_detail_list == nullptr;
    if (api_.init == nullptr || api_.handle_by_pci_bus_id == nullptr) {
      reason_ = name + " is too old (no nvmlInit_v2 or nvmlDeviceGetHandleByPciBusId_v2)";
      return;
    }
    const result initialised = api_.init();
    if (initialised != success) {
      reason_ = "nvmlInit failed in " + name + ": " + describe(initialised);
      return;
    }
    loaded_ = true;
  }

  [[nodiscard]] bool loaded() const noexcept { return loaded_; }
  /// Why it is not loaded (empty when it is).
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }
  [[nodiscard]] const api& functions() const noexcept { return api_; }

  /// "NVML_ERROR_NO_PERMISSION (Insufficient Permissions)"-style text for a result.
  [[nodiscard]] std::string describe(result r) const {
    const char* name = nullptr;
    switch (r) {
      case error_uninitialized: name = "NVML_ERROR_UNINITIALIZED"; break;
      case error_invalid_argument: name = "NVML_ERROR_INVALID_ARGUMENT"; break;
      case error_not_supported: name = "NVML_ERROR_NOT_SUPPORTED"; break;
      case error_no_permission: name = "NVML_ERROR_NO_PERMISSION"; break;
      case error_not_found: name = "NVML_ERROR_NOT_FOUND"; break;
      case error_insufficient_size: name = "NVML_ERROR_INSUFFICIENT_SIZE"; break;
      case error_driver_not_loaded: name = "NVML_ERROR_DRIVER_NOT_LOADED"; break;
      case error_function_not_found: name = "NVML_ERROR_FUNCTION_NOT_FOUND"; break;
      case error_gpu_is_lost: name = "NVML_ERROR_GPU_IS_LOST"; break;
      default: break;
    }
    std::string text = name != nullptr ? name : "NVML error " + std::to_string(r);
    if (api_.error_string != nullptr) {
      if (const char* s = api_.error_string(r); s != nullptr && *s != '\0') {
        text += std::string(" (") + s + ")";
      }
    }
    return text;
  }

 private:
  api api_;
  bool loaded_ = false;
  std::string reason_;
};

/// NVML from the shared library `name` (dlopen; the library stays loaded).
inline library load_library(const char* name) {
#if defined(__linux__)
  void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return library(std::string("NVML could not be loaded: ") +
                   (error != nullptr ? error : name));
  }
  return library(name, [handle](const char* symbol) { return dlsym(handle, symbol); });
#else
  return library(std::string("NVML is only looked for on Linux (") + name + ")");
#endif
}

/// The process-wide NVML: loaded the first time it is asked for (see the header).
inline const library& process_library() {
  static const library instance = [] {
    if (std::getenv("CUDAMEM_NO_NVML") != nullptr) {
      return library("NVML was not asked (CUDAMEM_NO_NVML is set)");
    }
    return load_library("libnvidia-ml.so.1");
  }();
  return instance;
}

// --- processes on a device -------------------------------------------------------------------

/// One process using the device, as NVML reports it.
struct process_usage {
  unsigned int pid = 0;
  std::string name;                  ///< empty when neither NVML nor /proc could say
  std::optional<std::size_t> bytes;  ///< device memory it holds; empty: not available
};

enum class listing {
  listed,       ///< `processes` is every process NVML reports on the device
  unavailable,  ///< NVML could not be loaded or could not list (see `reason`)
  hidden,       ///< NVML listed processes, but not this one: ids from another PID namespace
};

/// What NVML says about the processes on one device.
struct device_processes {
  listing status = listing::unavailable;
  std::string reason;                   ///< why not listed (empty when listed)
  std::vector<process_usage> processes; ///< largest first; this process among them when listed
};

/// This process's id, as NVML would report it.
inline unsigned int this_process_id() noexcept {
#if defined(__linux__)
  return static_cast<unsigned int>(getpid());
#else
  return 0;
#endif
}

namespace impl {

/// Sorts `items` by `before`, keeping equal ones in order (a stable insertion sort): a device
/// lists tens of processes, and std::sort's header is a measurable share of every translation
/// unit's compile time.
template <class T, class Before>
void insertion_sort(std::vector<T>& items, Before before) {
  for (std::size_t i = 1; i < items.size(); ++i) {
    T moving = std::move(items[i]);
    std::size_t j = i;
    for (; j > 0 && before(moving, items[j - 1]); --j) {
      items[j] = std::move(items[j - 1]);
    }
    items[j] = std::move(moving);
  }
}

/// Reads one of the record arrays the running-process calls fill, whatever its stride.
inline void collect(const unsigned char* records, std::size_t count, std::size_t stride,
                    std::vector<process_usage>& into) {
  for (std::size_t i = 0; i < count; ++i) {
    process_info_v1 r{};  // pid at offset 0, usedGpuMemory at 8, in every layout
    std::memcpy(&r.pid, records + i * stride, sizeof r.pid);
    std::memcpy(&r.used_gpu_memory, records + i * stride + 8, sizeof r.used_gpu_memory);
    process_usage p;
    p.pid = r.pid;
    if (r.used_gpu_memory != value_not_available) {
      p.bytes = static_cast<std::size_t>(r.used_gpu_memory);
    }
    into.push_back(std::move(p));
  }
}

/// The processes of one mode, by the newest call this NVML has. Returns success, or the
/// error that stopped it (error_function_not_found: no call for this mode at all).
inline result list_mode(const api& nvml, device_handle device, process_mode mode,
                        std::vector<process_usage>& into) {
  const auto m = static_cast<std::size_t>(mode);
  // Room for a few more processes than were counted, in case some start in between; retried
  // while the driver says the room was not enough.
  if (nvml.running_process_detail_list != nullptr) {
    std::vector<process_detail_v1> records;
    for (int attempt = 0; attempt < 4; ++attempt) {
      process_detail_list_v1 request{process_detail_list_version, static_cast<unsigned int>(mode),
                                     static_cast<unsigned int>(records.size()),
                                     records.empty() ? nullptr : records.data()};
      const result r = nvml.running_process_detail_list(device, &request);
      if (r == success) {
        const std::size_t count = request.num_proc_array_entries < records.size()
                                      ? std::size_t{request.num_proc_array_entries}
                                      : records.size();
        collect(reinterpret_cast<const unsigned char*>(records.data()), count,
                sizeof(process_detail_v1), into);
        return success;
      }
      if (r != error_insufficient_size) {
        return r;
      }
      records.resize(std::size_t{request.num_proc_array_entries} * 2 + 8);
    }
    return error_insufficient_size;
  }
  for (std::size_t v = 0; v < 3; ++v) {
    const fn_processes call = nvml.running_processes[m][v];
    if (call == nullptr) {
      continue;
    }
    const std::size_t stride = v == 2   ? sizeof(process_info_v1)
                               : v == 1 ? sizeof(process_info_v2)
                                        : (nvml.v3_records_are_32_bytes ? sizeof(process_detail_v1)
                                                                        : sizeof(process_info_v2));
    // Sized as if every record were the largest (32 bytes): never overrun, whatever the driver.
    std::vector<process_detail_v1> buffer;
    for (int attempt = 0; attempt < 4; ++attempt) {
      auto room = static_cast<unsigned int>(buffer.size() * sizeof(process_detail_v1) / stride);
      const result r = call(device, &room, buffer.empty() ? nullptr : buffer.data());
      if (r == success) {
        const std::size_t fits = buffer.size() * sizeof(process_detail_v1) / stride;
        collect(reinterpret_cast<const unsigned char*>(buffer.data()),
                std::size_t{room} < fits ? std::size_t{room} : fits,
                stride, into);
        return success;
      }
      if (r != error_insufficient_size) {
        return r;
      }
      buffer.resize(std::size_t{room} * 2 + 8);
    }
    return error_insufficient_size;
  }
  return error_function_not_found;
}

/// The name NVML gives `pid`, else /proc/<pid>/comm, else empty.
inline std::string process_name(const api& nvml, unsigned int pid) {
  if (nvml.process_name != nullptr) {
    std::array<char, 256> name{};
    if (nvml.process_name(pid, name.data(), static_cast<unsigned int>(name.size())) == success &&
        name[0] != '\0') {
      name.back() = '\0';
      std::string text = name.data();
      const std::size_t slash = text.find_last_of('/');  // NVML gives the path
      return slash == std::string::npos ? text : text.substr(slash + 1);
    }
  }
#if defined(__linux__)
  const std::string path = "/proc/" + std::to_string(pid) + "/comm";
  if (std::FILE* f = std::fopen(path.c_str(), "r")) {
    std::array<char, 64> comm{};
    const bool read = std::fgets(comm.data(), static_cast<int>(comm.size()), f) != nullptr;
    std::fclose(f);
    if (read) {
      std::string text = comm.data();
      while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) {
        text.pop_back();
      }
      return text;
    }
  }
#endif
  return {};
}

}  // namespace impl

/// The processes NVML reports on the GPU at `pci_bus_id` (as cudaDeviceGetPCIBusId writes it),
/// or the reason it cannot say. `self` is this process's id (a parameter for tests). Never
/// throws but for std::bad_alloc.
inline device_processes list_processes(const library& nvml, const std::string& pci_bus_id,
                                       unsigned int self = this_process_id()) {
  device_processes out;
  if (!nvml.loaded()) {
    out.reason = nvml.reason();
    return out;
  }
  const api& fns = nvml.functions();
  device_handle device = nullptr;
  if (const result r = fns.handle_by_pci_bus_id(pci_bus_id.c_str(), &device); r != success) {
    out.reason = "NVML has no device at PCI bus id " + pci_bus_id + ": " + nvml.describe(r);
    return out;
  }
  std::vector<process_usage> all;
  bool any_mode = false;
  for (const process_mode mode : {process_mode::compute, process_mode::graphics, process_mode::mps}) {
    const result r = impl::list_mode(fns, device, mode, all);
    if (r == success) {
      any_mode = true;
    } else if (r == error_no_permission) {
      out.reason = "no permission to list the processes on the device (" + nvml.describe(r) + ")";
      return out;
    } else if (r != error_function_not_found && r != error_not_supported &&
               mode == process_mode::compute) {
      out.reason = "NVML could not list the processes on the device: " + nvml.describe(r);
      return out;
    }
  }
  if (!any_mode) {
    out.reason = "this NVML cannot list the processes on a device";
    return out;
  }
  // One entry per process, at the largest figure any list gave it.
  impl::insertion_sort(all, [](const process_usage& a, const process_usage& b) {
    return a.pid != b.pid ? a.pid < b.pid : a.bytes.value_or(0) > b.bytes.value_or(0);
  });
  for (process_usage& p : all) {
    if (!out.processes.empty() && out.processes.back().pid == p.pid) {
      continue;
    }
    out.processes.push_back(std::move(p));
  }
  bool self_listed = false;
  for (const process_usage& p : out.processes) {
    self_listed = self_listed || p.pid == self;
  }
  if (!self_listed) {
    out.status = listing::hidden;
    out.reason = out.processes.empty()
                     ? "NVML lists no process on the device, not even this one: it reports "
                       "processes of another PID namespace (a container) or none at all"
                     : "NVML's process ids do not include this process (" +
                           std::to_string(self) +
                           "): they come from another PID namespace (a container), so the "
                           "processes cannot be named from here";
    return out;
  }
  for (process_usage& p : out.processes) {
    p.name = impl::process_name(fns, p.pid);
  }
  impl::insertion_sort(out.processes, [](const process_usage& a, const process_usage& b) {
    return a.bytes.value_or(0) > b.bytes.value_or(0);
  });
  out.status = listing::listed;
  return out;
}

}  // namespace cudamem::detail::nvml
