// cudamem/cudamem.hpp — everything in one include. Prefer the topic headers in libraries
// (they compile faster); this is for applications and examples.
#pragma once

#include <cudamem/arena_resource.hpp>
#include <cudamem/async_resource.hpp>
#include <cudamem/cccl_resource.hpp>  // declares nothing unless CCCL's experimental macro is on
#include <cudamem/cccl_span.hpp>
#include <cudamem/context.hpp>
#include <cudamem/copy.hpp>
#include <cudamem/cub_temp_storage.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/device_scope.hpp>
#include <cudamem/device_span.hpp>
#include <cudamem/error.hpp>
#include <cudamem/event.hpp>
#include <cudamem/exec_policy.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/limit_guard.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/log_format.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/nvtx_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/pmr_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/primary_context.hpp>
#include <cudamem/replay.hpp>
#include <cudamem/retry_adaptor.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/sync_guard.hpp>
#include <cudamem/thrust_allocator.hpp>
#include <cudamem/trace_export.hpp>
#include <cudamem/tracking_adaptor.hpp>
#include <cudamem/version.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>
