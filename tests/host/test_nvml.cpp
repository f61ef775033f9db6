// detail/nvml/nvml.hpp without a GPU: a library that is not there, NVMLs that fail in each way
// the header names, and fake NVMLs of every generation (detail list, _v3 with either record
// size, _v2, the original), so each listing path is read with the layout its driver writes;
// and how a memory_report says what NVML said (listed, hidden, not available).
#include <cudamem/detail/nvml/nvml.hpp>
#include <cudamem/memory_report.hpp>

#include "mini_json.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <map>
#include <string>
#include <vector>

using namespace cudamem;
namespace nv = cudamem::detail::nvml;

namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// What the fake NVML reports; the fake's functions (plain C function pointers, as dlsym gives)
/// read it from here.
struct fake_state {
  nv::result init = nv::success;
  nv::result handle = nv::success;
  nv::result listing = nv::success;  // for the compute list
  std::vector<nv::process_detail_v1> compute;
  std::vector<nv::process_detail_v1> graphics;
  std::size_t grow_after_first_count = 0;  // processes that start between count and fetch
  int calls = 0;
  std::map<unsigned int, std::string> names;
  std::string bus_id_asked;
};
fake_state fake;

const std::vector<nv::process_detail_v1>& of_mode(unsigned int mode) {
  static const std::vector<nv::process_detail_v1> none;
  return mode == 0 ? fake.compute : mode == 1 ? fake.graphics : none;
}

/// Writes `records` into `out` in the layout of a record of `stride` bytes.
void write_records(const std::vector<nv::process_detail_v1>& records, void* out,
                   std::size_t stride) {
  auto* bytes = static_cast<unsigned char*>(out);
  for (std::size_t i = 0; i < records.size(); ++i) {
    std::memset(bytes + i * stride, 0xEE, stride);  // padding and unknown fields: garbage
    std::memcpy(bytes + i * stride, &records[i].pid, sizeof(unsigned int));
    std::memcpy(bytes + i * stride + 8, &records[i].used_gpu_memory, sizeof(unsigned long long));
  }
}

/// The running-process call of one generation: `Stride` bytes a record, `Mode` the list.
template <std::size_t Stride, unsigned int Mode>
nv::result fake_processes(nv::device_handle, unsigned int* count, void* records) {
  ++fake.calls;
  if (Mode == 0 && fake.listing != nv::success) {
    return fake.listing;
  }
  std::vector<nv::process_detail_v1> list = of_mode(Mode);
  if (fake.calls > 1 && fake.grow_after_first_count != 0) {  // more processes by the 2nd call
    list.resize(list.size() + fake.grow_after_first_count, {7000, 1u << 20, 0, 0, 0});
  }
  if (*count < list.size()) {
    *count = static_cast<unsigned int>(list.size());
    return list.empty() ? nv::success : nv::error_insufficient_size;
  }
  *count = static_cast<unsigned int>(list.size());
  write_records(list, records, Stride);
  return nv::success;
}

nv::result fake_detail_list(nv::device_handle, nv::process_detail_list_v1* request) {
  REQUIRE(request->version == nv::process_detail_list_version);
  ++fake.calls;
  if (request->mode == 0 && fake.listing != nv::success) {
    return fake.listing;
  }
  const std::vector<nv::process_detail_v1>& list = of_mode(request->mode);
  if (request->num_proc_array_entries < list.size()) {
    request->num_proc_array_entries = static_cast<unsigned int>(list.size());
    return list.empty() ? nv::success : nv::error_insufficient_size;
  }
  request->num_proc_array_entries = static_cast<unsigned int>(list.size());
  write_records(list, request->proc_array, sizeof(nv::process_detail_v1));
  return nv::success;
}

nv::result fake_init() { return fake.init; }
const char* fake_error_string(nv::result) { return "fake reason"; }
nv::result fake_handle(const char* bus_id, nv::device_handle* device) {
  fake.bus_id_asked = bus_id;
  *device = reinterpret_cast<nv::device_handle>(0x1234);
  return fake.handle;
}
nv::result fake_name(unsigned int pid, char* name, unsigned int length) {
  const auto it = fake.names.find(pid);
  if (it == fake.names.end()) {
    return nv::error_not_found;
  }
  std::snprintf(name, length, "%s", it->second.c_str());
  return nv::success;
}

/// A fake NVML with the named symbols only.
nv::library fake_library(const std::vector<std::string>& symbols) {
  std::map<std::string, void*> table = {
      {"nvmlInit_v2", reinterpret_cast<void*>(&fake_init)},
      {"nvmlErrorString", reinterpret_cast<void*>(&fake_error_string)},
      {"nvmlDeviceGetHandleByPciBusId_v2", reinterpret_cast<void*>(&fake_handle)},
      {"nvmlSystemGetProcessName", reinterpret_cast<void*>(&fake_name)},
      {"nvmlDeviceGetRunningProcessDetailList", reinterpret_cast<void*>(&fake_detail_list)},
      {"nvmlDeviceGetConfComputeMemSizeInfo", reinterpret_cast<void*>(&fake_init)},  // presence
      {"nvmlDeviceGetComputeRunningProcesses_v3/24",
       reinterpret_cast<void*>(&fake_processes<24, 0>)},
      {"nvmlDeviceGetComputeRunningProcesses_v3/32",
       reinterpret_cast<void*>(&fake_processes<32, 0>)},
      {"nvmlDeviceGetComputeRunningProcesses_v2", reinterpret_cast<void*>(&fake_processes<24, 0>)},
      {"nvmlDeviceGetComputeRunningProcesses", reinterpret_cast<void*>(&fake_processes<16, 0>)},
      {"nvmlDeviceGetGraphicsRunningProcesses_v3/24",
       reinterpret_cast<void*>(&fake_processes<24, 1>)},
      {"nvmlDeviceGetGraphicsRunningProcesses_v3/32",
       reinterpret_cast<void*>(&fake_processes<32, 1>)},
      {"nvmlDeviceGetGraphicsRunningProcesses", reinterpret_cast<void*>(&fake_processes<16, 1>)},
  };
  std::map<std::string, void*> offered;
  for (const std::string& s : symbols) {
    const std::string name = s.substr(0, s.find('/'));
    offered[name] = table.at(s);
  }
  return nv::library("fake NVML", [offered](const char* symbol) -> void* {
    const auto it = offered.find(symbol);
    return it == offered.end() ? nullptr : it->second;
  });
}

const std::vector<std::string> basics = {"nvmlInit_v2", "nvmlErrorString",
                                         "nvmlDeviceGetHandleByPciBusId_v2",
                                         "nvmlSystemGetProcessName"};

std::vector<std::string> with(std::vector<std::string> more) {
  std::vector<std::string> all = basics;
  all.insert(all.end(), more.begin(), more.end());
  return all;
}

constexpr unsigned int self = 100;
constexpr std::size_t MiB = std::size_t{1} << 20;

void reset_fake() {
  fake = {};
  fake.compute = {{self, 300 * MiB, ~0u, ~0u, 0},
                  {200, 5000 * MiB, ~0u, ~0u, 0},
                  {300, 40 * MiB, ~0u, ~0u, 0}};
  fake.graphics = {{300, 60 * MiB, ~0u, ~0u, 0}, {400, nv::value_not_available, 0, 0, 0}};
  fake.names = {{self, "/usr/bin/me"}, {200, "/opt/python3"}, {300, "Xorg"}};
}

/// The listing every generation must read the same: largest first, one entry per process.
void check_standard_listing(const nv::device_processes& d) {
  REQUIRE(d.status == nv::listing::listed);
  CHECK(d.reason.empty());
  REQUIRE(d.processes.size() == 4);
  CHECK(d.processes[0].pid == 200);
  CHECK(d.processes[0].name == "python3");  // the path's last part
  CHECK(d.processes[0].bytes == 5000 * MiB);
  CHECK(d.processes[1].pid == self);
  CHECK(d.processes[1].bytes == 300 * MiB);
  CHECK(d.processes[2].pid == 300);          // in both lists: once, at its larger figure
  CHECK(d.processes[2].bytes == 60 * MiB);
  CHECK(d.processes[2].name == "Xorg");
  CHECK(d.processes[3].pid == 400);
  CHECK_FALSE(d.processes[3].bytes.has_value());  // NVML_VALUE_NOT_AVAILABLE
}

}  // namespace

TEST_CASE("nvml: a library that is not there is said plainly") {
  const nv::library missing = nv::load_library("libcudamem-no-such-nvml.so.1");
  CHECK_FALSE(missing.loaded());
  CHECK(has(missing.reason(), "NVML could not be loaded"));
  CHECK(has(missing.reason(), "libcudamem-no-such-nvml.so.1"));
  const nv::device_processes d = nv::list_processes(missing, "0000:3B:00.0", self);
  CHECK(d.status == nv::listing::unavailable);
  CHECK(d.reason == missing.reason());
  CHECK(d.processes.empty());
}

TEST_CASE("nvml: too old, init failing, no such device, no permission") {
  reset_fake();
  const nv::library old = fake_library({"nvmlInit_v2"});
  CHECK_FALSE(old.loaded());
  CHECK(has(old.reason(), "too old"));

  fake.init = nv::error_driver_not_loaded;
  const nv::library no_driver = fake_library(with({"nvmlDeviceGetComputeRunningProcesses_v2"}));
  CHECK_FALSE(no_driver.loaded());
  CHECK(has(no_driver.reason(), "nvmlInit failed"));
  CHECK(has(no_driver.reason(), "NVML_ERROR_DRIVER_NOT_LOADED (fake reason)"));

  reset_fake();
  fake.handle = nv::error_not_found;
  const nv::library nvml = fake_library(with({"nvmlDeviceGetComputeRunningProcesses_v2"}));
  REQUIRE(nvml.loaded());
  nv::device_processes d = nv::list_processes(nvml, "0000:3B:00.0", self);
  CHECK(d.status == nv::listing::unavailable);
  CHECK(fake.bus_id_asked == "0000:3B:00.0");  // the device is found by its bus id
  CHECK(has(d.reason, "no device at PCI bus id 0000:3B:00.0"));

  fake.handle = nv::success;
  fake.listing = nv::error_no_permission;
  d = nv::list_processes(nvml, "0000:3B:00.0", self);
  CHECK(d.status == nv::listing::unavailable);
  CHECK(has(d.reason, "no permission to list the processes"));
  CHECK(has(d.reason, "NVML_ERROR_NO_PERMISSION"));

  fake.listing = nv::error_gpu_is_lost;
  d = nv::list_processes(nvml, "0000:3B:00.0", self);
  CHECK(has(d.reason, "could not list the processes"));

  const nv::library nothing_to_list = fake_library(basics);
  d = nv::list_processes(nothing_to_list, "0000:3B:00.0", self);
  CHECK(d.status == nv::listing::unavailable);
  CHECK(has(d.reason, "cannot list"));
}

TEST_CASE("nvml: every generation of the process call is read with its own layout") {
  SECTION("the detail list (drivers 550+), preferred when present") {
    reset_fake();
    check_standard_listing(nv::list_processes(
        fake_library(with({"nvmlDeviceGetRunningProcessDetailList",
                           "nvmlDeviceGetComputeRunningProcesses_v3/24"})),
        "bus", self));
  }
  SECTION("_v3 with 24-byte records (most drivers)") {
    reset_fake();
    check_standard_listing(nv::list_processes(
        fake_library(with({"nvmlDeviceGetComputeRunningProcesses_v3/24",
                           "nvmlDeviceGetGraphicsRunningProcesses_v3/24"})),
        "bus", self));
  }
  SECTION("_v3 with 32-byte records (drivers with confidential computing, no detail list)") {
    reset_fake();
    check_standard_listing(nv::list_processes(
        fake_library(with({"nvmlDeviceGetConfComputeMemSizeInfo",
                           "nvmlDeviceGetComputeRunningProcesses_v3/32",
                           "nvmlDeviceGetGraphicsRunningProcesses_v3/32"})),
        "bus", self));
  }
  SECTION("_v2") {
    reset_fake();
    fake.graphics.clear();
    fake.compute.push_back({300, 60 * MiB, 0, 0, 0});
    fake.compute.push_back({400, nv::value_not_available, 0, 0, 0});
    check_standard_listing(nv::list_processes(
        fake_library(with({"nvmlDeviceGetComputeRunningProcesses_v2"})), "bus", self));
  }
  SECTION("the original call (16-byte records)") {
    reset_fake();
    check_standard_listing(nv::list_processes(
        fake_library(with({"nvmlDeviceGetComputeRunningProcesses",
                           "nvmlDeviceGetGraphicsRunningProcesses"})),
        "bus", self));
  }
}

TEST_CASE("nvml: processes that start between counting and listing are still all read") {
  reset_fake();
  fake.graphics.clear();
  fake.grow_after_first_count = 12;  // far more than the room counted the first time
  const nv::device_processes d = nv::list_processes(
      fake_library(with({"nvmlDeviceGetComputeRunningProcesses_v3/24"})), "bus", self);
  REQUIRE(d.status == nv::listing::listed);
  CHECK(d.processes.size() == 3 + 1);  // 12 newcomers, all pid 7000: one entry
  CHECK(fake.calls >= 2);
}

TEST_CASE("nvml: a listing without this process is from another PID namespace: not named") {
  reset_fake();
  const nv::device_processes d = nv::list_processes(
      fake_library(with({"nvmlDeviceGetComputeRunningProcesses_v3/24"})), "bus",
      /*self=*/12345);
  CHECK(d.status == nv::listing::hidden);
  CHECK(has(d.reason, "another PID namespace"));
  CHECK(has(d.reason, "12345"));
  CHECK(d.processes.size() == 3);  // the figures stay; the names are not looked up
  for (const nv::process_usage& p : d.processes) {
    CHECK(p.name.empty());
  }
  fake.compute.clear();
  const nv::device_processes none = nv::list_processes(
      fake_library(with({"nvmlDeviceGetComputeRunningProcesses_v3/24"})), "bus", 12345);
  CHECK(none.status == nv::listing::hidden);
  CHECK(has(none.reason, "not even this one"));
}

// --- what the report says -------------------------------------------------------------------

namespace {

constexpr std::size_t GiB = std::size_t{1} << 30;

memory_report device_report() {
  memory_report r;
  r.requested_bytes = 2 * GiB;
  r.device = 0;
  r.device_total = 80 * GiB;
  r.device_free = 1 * GiB;
  resource_snapshot leaf;
  leaf.name = "device_resource";
  leaf.stats.reserved_bytes = leaf.stats.used_bytes = 10 * GiB;
  r.chain.push_back(leaf);
  r.verdict = oom_verdict::held_by_others;
  return r;
}

}  // namespace

TEST_CASE("report: every holder named, this process's share split") {
  memory_report r = device_report();
  r.holders = device_holders{};
  r.holders->listed = true;
  r.holders->this_pid = 4200;
  r.holders->this_process = 10 * GiB + 700 * MiB;
  r.holders->others = {{4242, "python3", 60 * GiB}, {17, "Xorg", 20 * MiB}};
  r.context = context_reservations{1024, 132 * 2048, 8 * MiB, 1 * MiB};
  const std::string text = r.to_text();
  CHECK(has(text, "Other processes: pid 4242 (python3) 60.00 GiB, pid 17 (Xorg) 20.00 MiB."));
  CHECK(has(text, "This process (pid 4200) holds 10.68 GiB: 10.00 GiB through this chain, "
                  "273.00 MiB reserved by its CUDA context for kernels (stacks 1.00 KiB x "
                  "270336 threads, malloc heap 8.00 MiB, printf 1.00 MiB), 427.00 MiB otherwise"));
  // 79 GiB used: 60 GiB + 20 MiB + 10.68 GiB named; the rest is nobody's.
  CHECK(has(text, "No process accounts for 8.30 GiB"));
  CHECK(has(text, "60.02 GiB by other processes, 700.00 MiB by this process outside this chain"));
  CHECK(has(r.hint(), "the largest: pid 4242 (python3) 60.00 GiB"));
  CHECK(has(r.hint(), "CUDA_VISIBLE_DEVICES"));
  CHECK(r.process_outside_chain() == 700 * MiB);

  const auto json = cudamem_test::parse_json(r.to_json());
  const auto& holders = json["holders"];
  CHECK(holders["listed"].boolean);
  CHECK(holders["this_pid"].number == 4200);
  CHECK(holders["others"].items.size() == 2);
  CHECK(holders["others"].items[0]["name"].text == "python3");
  CHECK(holders["others"].items[0]["bytes"].number == static_cast<double>(60 * GiB));
  CHECK(json["context"]["total"].number == static_cast<double>(273 * MiB));

  // This process outside the chain holds more than the others: the advice turns to it.
  r.holders->others = {{4242, "python3", 100 * MiB}};
  r.holders->this_process = 70 * GiB;
  r.context->stack_per_thread = 16 * 1024;
  CHECK(has(r.hint(), "This process holds 60.00 GiB outside this chain"));
  CHECK(has(r.hint(), "lower cudaLimitStackSize (16.00 KiB per thread reserves 4.12 GiB)"));
}

TEST_CASE("report: holders hidden, or not known, said plainly") {
  memory_report r = device_report();
  r.holders = device_holders{};
  r.holders->reason = "NVML could not be loaded: libnvidia-ml.so.1: cannot open shared object file";
  std::string text = r.to_text();
  CHECK(has(text, "Which processes hold the device's memory is not known: NVML could not be "
                  "loaded: libnvidia-ml.so.1: cannot open shared object file."));
  CHECK(has(r.hint(), "nvidia-smi"));  // nothing better to say without the holders
  CHECK_FALSE(r.unattributed().has_value());

  r.holders->reason = "NVML's process ids do not include this process (9): they come from "
                      "another PID namespace (a container), so the processes cannot be named "
                      "from here";
  r.holders->others = {{31337, "", 50 * GiB}, {31338, "", 1 * GiB}};
  text = r.to_text();
  CHECK(has(text, "NVML reports 2 processes holding 51.00 GiB, but cannot name them"));
  CHECK(has(text, "another PID namespace"));
  const auto json = cudamem_test::parse_json(r.to_json());
  CHECK_FALSE(json["holders"]["listed"].boolean);
  CHECK(has(json["holders"]["reason"].text, "PID namespace"));

  // Host memory and simulated devices: no holders at all, and nothing said about them.
  r.holders.reset();
  CHECK_FALSE(has(r.to_text(), "Which processes"));
  CHECK_FALSE(has(r.to_text(), "Other processes:"));
  CHECK_FALSE(has(r.to_text(), "NVML"));
  CHECK(cudamem_test::parse_json(r.to_json())["holders"].kind == cudamem_test::json_value::type::null);
}
