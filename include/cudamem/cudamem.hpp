// cudamem/cudamem.hpp — every topic header in one include, for applications and examples.
// Libraries should prefer the topic headers: each translation unit pays only for what it
// includes (bench/compile_time.py measures both).
//
// Not in here: the interop headers that bring a CCCL library with them, which cost a translation
// unit more than all of cudamem together (thrust's and libcu++'s headers). Include them where
// they are used:
//   cudamem/thrust_allocator.hpp   thrust::device_vector over any resource
//   cudamem/exec_policy.hpp        thrust algorithms taking temporaries from a resource
//   cudamem/cccl_span.hpp          device memory as cuda::std::span / mdspan
//   cudamem/cccl_resource.hpp      resources as cuda::mr resource_refs
// nor cudamem/nccl.hpp and cudamem/nccl_pool.hpp, which need NCCL.
#pragma once

#include <cudamem/arena_resource.hpp>
#include <cudamem/async_resource.hpp>
#include <cudamem/context.hpp>
#include <cudamem/copy.hpp>
#include <cudamem/copy_stager.hpp>
#include <cudamem/cub_temp_storage.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/device_scope.hpp>
#include <cudamem/device_span.hpp>
#include <cudamem/error.hpp>
#include <cudamem/event.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/fd_passing.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/ipc_pool.hpp>
#include <cudamem/limit_guard.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/log_format.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/nvtx_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/peer_access.hpp>
#include <cudamem/per_device_resources.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/pmr_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/primary_context.hpp>
#include <cudamem/replay.hpp>
#include <cudamem/retry_adaptor.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/size_routing_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/sync_guard.hpp>
#include <cudamem/trace_export.hpp>
#include <cudamem/tracking_adaptor.hpp>
#include <cudamem/version.hpp>
#include <cudamem/vm_ipc.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>
