// cudamem/detail/cuda/driver.hpp — the CUDA driver API, reached without linking libcuda.
//
//   #include <cudamem/detail/cuda/driver.hpp>
//
//   const auto& cu = cudamem::detail::driver();      // throws no_device_error with no driver
//   CUdevice dev = 0;
//   cudamem::detail::check_driver(cu.device_get(&dev, 0), "cuDeviceGet");
//   CUcontext ctx = nullptr;
//   cudamem::detail::check_driver(cu.ctx_get_current(&ctx), "cuCtxGetCurrent");
//
//   // In a destructor (noexcept): report, never throw; quiet while the driver is unloading.
//   cudamem::detail::report_driver_error(cu.ctx_destroy(ctx), "cuCtxDestroy");
//
// Why not call cuCtxCreate directly? Calling a `cu*` function makes the program link
// libcuda.so, which only the driver installs: a program built that way does not even start
// on a machine without the driver, and every consumer of a header-only library would have to
// add `-lcuda`. The runtime (libcudart, which cudamem links anyway) hands out the driver's
// entry points through `cudaGetDriverEntryPointByVersion`; we ask once, keep the pointers in
// a table, and a machine without a driver gets cudamem's ordinary `no_device_error`.
// `<cuda.h>` and `<cudaTypedefs.h>` are included for their types only (CUresult, CUcontext,
// the PFN_ pointer typedefs); nothing here names a `cu*` function, so nothing needs libcuda.
//
// Contract
// - `driver()` returns the table, loading it on first use; loading is thread-safe (a
//   function-local static). It throws `no_device_error` when the runtime cannot reach a
//   driver (cudaErrorInsufficientDriver, cudaErrorNoDevice, the stub library), when the driver
//   lacks one of the entry points (too old for this library), or when `cuInit` finds no
//   device. A failed load is retried on the next call, so a process that checks again after
//   the driver appears (rare) is not stuck with the first answer.
// - Every pointer in a loaded table is non-null.
// - ABI versions. `cudaGetDriverEntryPointByVersion(symbol, fn, version, ...)` returns the
//   variant of `symbol` whose signature was current in CUDA `version`. We ask for each symbol
//   at the version named by the PFN_ typedef we store it in, so signature and pointer always
//   agree, whatever toolkit compiles us. In particular `cuCtxCreate` is asked for at 12050
//   (CUDA 12.5): that is `cuCtxCreate_v4(CUcontext*, CUctxCreateParams*, unsigned, CUdevice)`,
//   the form CUDA 13's `<cuda.h>` maps `cuCtxCreate` to (the older (flags, device) form,
//   version 3020, was dropped from CUDA 13's headers). `cuCtxSynchronize` and `cuCtxGetDevice`
//   are asked for at their pre-13 versions (no context argument: they act on the current one).
// - `check_driver(result, context)` does nothing for CUDA_SUCCESS and otherwise throws:
//   `no_device_error` for "no usable device" results (CUDA_ERROR_NO_DEVICE,
//   CUDA_ERROR_STUB_LIBRARY, CUDA_ERROR_NOT_INITIALIZED — cuInit never succeeded — and
//   CUDA_ERROR_SYSTEM_DRIVER_MISMATCH), else `driver_error`, a `cuda_error` that also keeps
//   the CUresult and the driver's name for it (`CUDA_ERROR_OUT_OF_MEMORY`). Its `code()` is
//   the runtime error with the same number (the runtime's codes were renumbered to match the
//   driver's; the static_asserts below check the ones cudamem relies on), so code that
//   catches `cuda_error` and tests `code() == cudaErrorMemoryAllocation` works for both APIs.
// - `report_driver_error(result, message)` is the noexcept form for destructors: it goes to
//   the error handler, and CUDA_ERROR_DEINITIALIZED (the driver unloading at process exit) is
//   dropped like cudaErrorCudartUnloading.
#pragma once

#include <cudamem/error.hpp>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <source_location>
#include <string>
#include <string_view>

#if CUDART_VERSION < 12050
#error "cudamem's driver layer needs CUDA 12.5 or newer (cudaGetDriverEntryPointByVersion)."
#endif

namespace cudamem {

// The runtime codes are the driver codes renumbered to match: cudamem converts by value.
static_assert(static_cast<int>(CUDA_ERROR_OUT_OF_MEMORY) == static_cast<int>(cudaErrorMemoryAllocation));
static_assert(static_cast<int>(CUDA_ERROR_INVALID_VALUE) == static_cast<int>(cudaErrorInvalidValue));
static_assert(static_cast<int>(CUDA_ERROR_DEINITIALIZED) == static_cast<int>(cudaErrorCudartUnloading));
static_assert(static_cast<int>(CUDA_ERROR_NO_DEVICE) == static_cast<int>(cudaErrorNoDevice));
static_assert(static_cast<int>(CUDA_ERROR_STUB_LIBRARY) == static_cast<int>(cudaErrorStubLibrary));
static_assert(static_cast<int>(CUDA_ERROR_INVALID_DEVICE) == static_cast<int>(cudaErrorInvalidDevice));
static_assert(static_cast<int>(CUDA_ERROR_INVALID_CONTEXT) == static_cast<int>(cudaErrorDeviceUninitialized));
static_assert(static_cast<int>(CUDA_ERROR_CONTEXT_IS_DESTROYED) == static_cast<int>(cudaErrorContextIsDestroyed));
static_assert(static_cast<int>(CUDA_ERROR_NOT_SUPPORTED) == static_cast<int>(cudaErrorNotSupported));
static_assert(static_cast<int>(CUDA_ERROR_UNSUPPORTED_LIMIT) == static_cast<int>(cudaErrorUnsupportedLimit));
static_assert(static_cast<int>(CUDA_ERROR_UNKNOWN) == static_cast<int>(cudaErrorUnknown));

/// The runtime error code with the same meaning as a driver result.
[[nodiscard]] constexpr cudaError_t to_runtime_error(CUresult result) noexcept {
  switch (result) {
    // The two driver results the runtime has no number for.
    case CUDA_ERROR_CONTEXT_ALREADY_CURRENT:
    case CUDA_ERROR_KEY_ROTATION:
      return cudaErrorUnknown;
    default:
      return static_cast<cudaError_t>(static_cast<int>(result));
  }
}

/// True for the driver results that mean "no usable device": they throw no_device_error.
[[nodiscard]] constexpr bool is_no_device(CUresult result) noexcept {
  return result == CUDA_ERROR_NO_DEVICE || result == CUDA_ERROR_STUB_LIBRARY ||
         result == CUDA_ERROR_NOT_INITIALIZED || result == CUDA_ERROR_SYSTEM_DRIVER_MISMATCH;
}

/// True for the result the driver returns while it is being unloaded at process exit.
[[nodiscard]] constexpr bool is_teardown(CUresult result) noexcept {
  return result == CUDA_ERROR_DEINITIALIZED;
}

namespace detail {

/// The driver's entry points cudamem uses, as loaded by `driver()`. Members are named after
/// the driver functions in snake_case (`ctx_create` is cuCtxCreate): `<cuda.h>` #defines the
/// cu* names to versioned ones (cuCtxCreate -> cuCtxCreate_v4), so reusing them as member
/// names would be renamed behind the reader's back.
struct driver_api {
  // --- initialisation, errors, devices
  PFN_cuInit_v2000 init = nullptr;
  PFN_cuDriverGetVersion_v2020 driver_get_version = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetCount_v2000 device_get_count = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuDeviceCanAccessPeer_v4000 device_can_access_peer = nullptr;
  // --- primary contexts
  PFN_cuDevicePrimaryCtxRetain_v7000 device_primary_ctx_retain = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 device_primary_ctx_release = nullptr;
  PFN_cuDevicePrimaryCtxGetState_v7000 device_primary_ctx_get_state = nullptr;
  // --- contexts
  PFN_cuCtxCreate_v12050 ctx_create = nullptr;  // cuCtxCreate_v4: (ctx*, params*, flags, dev)
  PFN_cuCtxDestroy_v4000 ctx_destroy = nullptr;
  PFN_cuCtxPushCurrent_v4000 ctx_push_current = nullptr;
  PFN_cuCtxPopCurrent_v4000 ctx_pop_current = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
  PFN_cuCtxSetCurrent_v4000 ctx_set_current = nullptr;
  PFN_cuCtxGetDevice_v2000 ctx_get_device = nullptr;      // of the current context
  PFN_cuCtxGetFlags_v7000 ctx_get_flags = nullptr;        // of the current context
  PFN_cuCtxSynchronize_v2000 ctx_synchronize = nullptr;   // the current context
  PFN_cuMemGetInfo_v3020 mem_get_info = nullptr;          // of the current context's device
  // --- virtual memory management (reserve address space, create and map physical memory)
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemGetAccess_v10020 mem_get_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  // --- sharing physical memory between processes (vm_ipc.hpp)
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle = nullptr;
  PFN_cuMemGetAllocationPropertiesFromHandle_v10020 mem_get_allocation_properties_from_handle =
      nullptr;
};

/// Asks the runtime for `symbol` at ABI `version` and stores it in `slot`; throws
/// no_device_error when there is no driver or the driver lacks the symbol.
template <class Pointer>
void load_entry_point(Pointer& slot, const char* symbol, unsigned version,
                      const std::source_location& where) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t code =
      cudaGetDriverEntryPointByVersion(symbol, &function, version, cudaEnableDefault, &found);
  if (code != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    // No driver, or no device: the runtime's own answer, with what we were doing.
    if (cudamem::is_no_device(code) || code == cudaErrorInitializationError) {
      throw no_device_error(code, std::string("loading the CUDA driver API (") + symbol + ")",
                            where);
    }
    throw cuda_error(code, std::string("cudaGetDriverEntryPointByVersion(") + symbol + ")", where);
  }
  if (found != cudaDriverEntryPointSuccess || function == nullptr) {
    throw no_device_error(
        cudaErrorInsufficientDriver,
        std::string("the CUDA driver has no ") + symbol + " at ABI version " +
            std::to_string(version) +
            (found == cudaDriverEntryPointVersionNotSufficent ? " (driver too old)" : ""),
        where);
  }
  slot = reinterpret_cast<Pointer>(function);  // the runtime returns it as void*
}

/// Loads every entry point and initialises the driver. `where` is the user's call that
/// needed the driver: a no-device error names that line, not this header.
inline driver_api load_driver_api(const std::source_location& where) {
  driver_api api;
  const auto load = [&where](auto& slot, const char* symbol, unsigned version) {
    load_entry_point(slot, symbol, version, where);
  };
  // The version numbers below are the suffixes of the PFN_ typedefs in driver_api.
  load(api.init, "cuInit", 2000);
  load(api.driver_get_version, "cuDriverGetVersion", 2020);
  load(api.get_error_name, "cuGetErrorName", 6000);
  load(api.get_error_string, "cuGetErrorString", 6000);
  load(api.device_get, "cuDeviceGet", 2000);
  load(api.device_get_count, "cuDeviceGetCount", 2000);
  load(api.device_get_attribute, "cuDeviceGetAttribute", 2000);
  load(api.device_can_access_peer, "cuDeviceCanAccessPeer", 4000);
  load(api.device_primary_ctx_retain, "cuDevicePrimaryCtxRetain", 7000);
  load(api.device_primary_ctx_release, "cuDevicePrimaryCtxRelease", 11000);
  load(api.device_primary_ctx_get_state, "cuDevicePrimaryCtxGetState", 7000);
  load(api.ctx_create, "cuCtxCreate", 12050);
  load(api.ctx_destroy, "cuCtxDestroy", 4000);
  load(api.ctx_push_current, "cuCtxPushCurrent", 4000);
  load(api.ctx_pop_current, "cuCtxPopCurrent", 4000);
  load(api.ctx_get_current, "cuCtxGetCurrent", 4000);
  load(api.ctx_set_current, "cuCtxSetCurrent", 4000);
  load(api.ctx_get_device, "cuCtxGetDevice", 2000);
  load(api.ctx_get_flags, "cuCtxGetFlags", 7000);
  load(api.ctx_synchronize, "cuCtxSynchronize", 2000);
  load(api.mem_get_info, "cuMemGetInfo", 3020);
  load(api.mem_address_reserve, "cuMemAddressReserve", 10020);
  load(api.mem_address_free, "cuMemAddressFree", 10020);
  load(api.mem_create, "cuMemCreate", 10020);
  load(api.mem_release, "cuMemRelease", 10020);
  load(api.mem_map, "cuMemMap", 10020);
  load(api.mem_unmap, "cuMemUnmap", 10020);
  load(api.mem_set_access, "cuMemSetAccess", 10020);
  load(api.mem_get_access, "cuMemGetAccess", 10020);
  load(api.mem_get_allocation_granularity, "cuMemGetAllocationGranularity", 10020);
  load(api.mem_export_to_shareable_handle, "cuMemExportToShareableHandle", 10020);
  load(api.mem_import_from_shareable_handle, "cuMemImportFromShareableHandle", 10020);
  load(api.mem_get_allocation_properties_from_handle, "cuMemGetAllocationPropertiesFromHandle",
       10020);

  const CUresult initialised = api.init(0);
  if (initialised != CUDA_SUCCESS) {
    const cudaError_t code = to_runtime_error(initialised);
    throw no_device_error(cudamem::is_no_device(code) ? code : cudaErrorNoDevice,
                          "cuInit failed with driver result " +
                              std::to_string(static_cast<int>(initialised)),
                          where);
  }
  return api;
}

/// The driver's entry points, loaded on first use; see the contract above.
[[nodiscard]] inline const driver_api& driver(
    std::source_location where = std::source_location::current()) {
  // If load_driver_api throws, the static stays uninitialised and the next call tries again.
  static const driver_api api = load_driver_api(where);
  return api;
}

/// The driver's name for `result` ("CUDA_ERROR_OUT_OF_MEMORY"), without needing the table to
/// have loaded (then "CUresult <n>").
[[nodiscard]] inline std::string driver_result_name(CUresult result) noexcept {
  try {
    const char* name = nullptr;
    if (driver().get_error_name(result, &name) == CUDA_SUCCESS && name != nullptr) {
      return name;
    }
    return "CUresult " + std::to_string(static_cast<int>(result));
  } catch (...) {
    return {};  // no driver (or no memory for the string): the caller prints the number alone
  }
}

/// The driver's description of `result` ("out of memory"); empty when it has none.
[[nodiscard]] inline std::string driver_result_description(CUresult result) noexcept {
  try {
    const char* text = nullptr;
    if (driver().get_error_string(result, &text) == CUDA_SUCCESS && text != nullptr) {
      return text;
    }
  } catch (...) {
  }
  return {};
}

/// "cuCtxCreate: CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
inline std::string describe_driver_result(CUresult result, std::string_view context) {
  std::string text(context);
  std::string name = driver_result_name(result);
  if (name.empty()) {
    name = "CUresult " + std::to_string(static_cast<int>(result));
  }
  text.append(text.empty() ? "" : ": ").append(name);
  const std::string description = driver_result_description(result);
  if (!description.empty()) {
    text.append(" (").append(description).append(")");
  }
  return text;
}

}  // namespace detail

/// A failed driver API call. `code()` is the runtime code with the same meaning (see the
/// contract); `result()` and `result_name()` are the driver's own.
class driver_error : public cuda_error {
 public:
  /// An error for the driver's `result`; `context` says what was being done.
  driver_error(CUresult result, std::string_view context,
               std::source_location where = std::source_location::current())
      : driver_error(result, detail::describe_driver_result(result, context), where) {}

  /// The driver's result code.
  [[nodiscard]] CUresult result() const noexcept { return result_; }
  /// The driver's name for the result, e.g. "CUDA_ERROR_OUT_OF_MEMORY".
  [[nodiscard]] const std::string& result_name() const noexcept { return result_name_; }

 private:
  driver_error(CUresult result, std::string described, std::source_location where)
      : cuda_error(to_runtime_error(result), described, where),
        result_(result),
        result_name_(detail::driver_result_name(result)) {}

  CUresult result_;
  std::string result_name_;
};

namespace detail {

/// Throws `no_device_error` or `driver_error` unless `result` is CUDA_SUCCESS.
inline void check_driver(CUresult result, std::string_view context = {},
                         std::source_location where = std::source_location::current()) {
  if (result == CUDA_SUCCESS) [[likely]] {
    return;
  }
  if (cudamem::is_no_device(result)) {
    throw no_device_error(to_runtime_error(result), describe_driver_result(result, context), where);
  }
  throw driver_error(result, context, where);
}

/// Reports a failed driver call from a place that cannot throw; quiet at process exit.
inline void report_driver_error(CUresult result, std::string_view message,
                                std::source_location where = std::source_location::current()) noexcept {
  if (result == CUDA_SUCCESS || cudamem::is_teardown(result)) {
    return;
  }
  try {
    const std::string text = describe_driver_result(result, message);
    get_error_handler()(error_report{to_runtime_error(result), text, where});
  } catch (...) {
    // No memory to describe it: report the bare message.
    get_error_handler()(error_report{to_runtime_error(result), message, where});
  }
}

}  // namespace detail
}  // namespace cudamem
