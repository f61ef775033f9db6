// cudamem/_torch/allocator_history.hpp — torch.cuda.memory._record_memory_history: the events of
// every allocation, free, segment change and out-of-memory, with the caller's stack when asked,
// kept in one ring per device for snapshots (allocator_snapshot.hpp) and told to PyTorch's trace
// trackers (torch.compile's, the profiler's) as they happen.
//
//   torch.cuda.memory._record_memory_history(max_entries=100000)   # recordHistory
//   torch.cuda.memory._snapshot()["device_traces"]                 # what record_trace kept
//
// Owns: recordHistory in each release's form (2.7: no clear flag, the history cleared; 2.8: a
// clear flag; 2.11: a list of actions to skip, named as PyTorch names them), recordAnnotation,
// the compile contexts (2.8+) and user metadata (2.10+) of each thread, annotateMemory (2.14+),
// getContextForPointer (2.12+), and record_trace / note_segment_changes, which every other part
// calls.
#pragma once

#include "allocator_class.hpp"

#include <algorithm>

namespace {

/// This thread's compile contexts and user metadata (PyTorch keeps them per thread), or
/// nullptr once the thread's thread_local objects are destroyed: frees from static destructors
/// at exit still reach record_trace on the main thread, after them.
struct cudamem_torch_allocator::thread_annotations {
  std::vector<std::string> compile_contexts;
  std::string user_metadata;
  ~thread_annotations() { gone() = true; }
  static bool& gone() {
    thread_local bool flag = false;  // no destructor: valid to the thread's very end
    return flag;
  }
};

cudamem_torch_allocator::thread_annotations* cudamem_torch_allocator::annotations_of_this_thread() {
  if (thread_annotations::gone()) {
    return nullptr;
  }
  thread_local thread_annotations mine;
  return &mine;
}

#if CUDAMEM_TORCH_AT_LEAST(2, 11)
void cudamem_torch_allocator::recordHistory(bool enabled, hist::CreateContextFn recorder,
                                            std::size_t max_entries, hist::RecordContext when,
                                            bool clear_history,
                                            const std::vector<std::string>& skip_actions) {
  std::set<hist::TraceEntry::Action> skipped;
  for (const std::string& name : skip_actions) {
    skipped.insert(hist::parseTraceEntryAction(name));  // an unknown name: PyTorch's error
  }
  record_history(enabled, recorder, max_entries, when, clear_history, skipped);
}
#endif

void cudamem_torch_allocator::record_history(bool enabled, hist::CreateContextFn recorder,
                                             std::size_t max_entries, hist::RecordContext when,
                                             bool clear_history,
                                             const std::set<hist::TraceEntry::Action>& skipped) {
  TORCH_CHECK(when == hist::RecordContext::NEVER || recorder != nullptr,
              "cudamem: recording stacks needs a context recorder");
  const std::lock_guard lock(mutex_);
  record_history_ = enabled;
  recorder_ = enabled ? recorder : nullptr;
  record_context_ = enabled ? when : hist::RecordContext::NEVER;
  trace_capacity_ = std::max<std::size_t>(max_entries, 1);
  for (auto& ring : rings_) {
    ring.set_capacity(trace_capacity_);
  }
  annotations_.set_capacity(trace_capacity_);
  if (!enabled || clear_history) {
    for (auto& ring : rings_) {
      ring.clear();
    }
    annotations_.clear();
  }
  skipped_ = skipped;
}

void cudamem_torch_allocator::recordAnnotation(
    const std::vector<std::pair<std::string, std::string>>& md) {
  if (!record_history_) {
    return;
  }
  hist::AnnotationEntry e(c10::cuda::current_device(), c10::getApproximateTime());
  for (const auto& [name, value] : md) {
    e.recordUserMetadata(name, value);
  }
  const std::lock_guard lock(mutex_);
  annotations_.push(std::move(e));
}

#if CUDAMEM_TORCH_AT_LEAST(2, 8)
void cudamem_torch_allocator::pushCompileContext(std::string& md) {
  thread_annotations* mine = annotations_of_this_thread();
  if (record_history_ && mine != nullptr) {
    mine->compile_contexts.push_back(md);
  }
}

void cudamem_torch_allocator::popCompileContext() {
  thread_annotations* mine = annotations_of_this_thread();
  if (mine != nullptr && !mine->compile_contexts.empty()) {
    mine->compile_contexts.pop_back();
  }
}
#endif

#if CUDAMEM_TORCH_AT_LEAST(2, 10)
void cudamem_torch_allocator::setUserMetadata(const std::string& metadata) {
  if (thread_annotations* mine = annotations_of_this_thread()) {
    mine->user_metadata = metadata;
  }
}

std::string cudamem_torch_allocator::getUserMetadata() {
  const thread_annotations* mine = annotations_of_this_thread();
  return mine != nullptr ? mine->user_metadata : std::string{};
}
#endif

#if CUDAMEM_TORCH_AT_LEAST(2, 12)
/// The stack recorded when the block holding `ptr` was allocated (nullptr: none, or not ours).
std::shared_ptr<c10::GatheredContext> cudamem_torch_allocator::getContextForPointer(
    const void* ptr) {
  const std::lock_guard lock(mutex_);
  const block* b = find_containing(ptr);
  return b != nullptr ? b->context : nullptr;
}
#endif

#if CUDAMEM_TORCH_AT_LEAST(2, 14)
/// torch.cuda.memory._annotate_memory: an "annotate" event for the live block at `ptr`, the
/// metadata its payload. Not a block of ours, or no history: nothing to record.
void cudamem_torch_allocator::annotateMemory(const void* ptr, const std::string& metadata) {
  const std::lock_guard lock(mutex_);
  const auto it = live_.find(const_cast<void*>(ptr));
  if (it == live_.end() || !recording()) {
    return;
  }
  const block& b = it->second;
  record_trace(hist::TraceEntry::ANNOTATE, b.device, reinterpret_cast<std::uintptr_t>(ptr),
               b.requested, b.stream, b.pool, nullptr, &metadata);
}
#endif

/// The caller's stack, when the user asked for stacks at this level (outside the lock: the
/// recorder takes the GIL).
std::shared_ptr<c10::GatheredContext> cudamem_torch_allocator::maybe_gather(
    hist::RecordContext level) {
  const hist::CreateContextFn recorder = recorder_;
  if (recorder == nullptr || static_cast<int>(record_context_.load()) < static_cast<int>(level)) {
    return nullptr;
  }
  return recorder();
}

/// Adds an event to the history and tells the trackers (under the lock, as PyTorch does).
/// `metadata`: the event's payload in place of the thread's user metadata (annotateMemory).
void cudamem_torch_allocator::record_trace(hist::TraceEntry::Action action, DeviceIndex device,
                                           std::uintptr_t addr, std::size_t size,
                                           cudaStream_t stream, MempoolId_t pool,
                                           std::shared_ptr<c10::GatheredContext> context,
                                           const std::string* metadata) {
  if (!recording()) {
    return;
  }
  const bool keep_stack = static_cast<int>(record_context_.load()) >=
                          static_cast<int>(hist::RecordContext::ALLOC);
  const thread_annotations* mine = annotations_of_this_thread();
  const bool compiling = mine != nullptr && !mine->compile_contexts.empty();
  static const std::string no_compile_context = "N/A";
  static const std::string none;
  hist::TraceEntry te = make_trace_entry(
      action, device, addr, size, stream, pool, keep_stack ? std::move(context) : nullptr,
      compiling ? mine->compile_contexts.back() : no_compile_context,
      metadata != nullptr ? *metadata : mine != nullptr ? mine->user_metadata : none);
  for (const auto& tracker : trackers_) {
    tracker(te);
  }
  if (record_history_ && skipped_.count(action) == 0 && device >= 0 && device < device_count()) {
    rings_[device].push(std::move(te));
  }
}

/// Segment events for what cudamem mapped or unmapped since `before` (history only).
void cudamem_torch_allocator::note_segment_changes(
    const std::vector<std::vector<span>>& before, cudaStream_t stream,
    const std::shared_ptr<c10::GatheredContext>& context) {
  std::vector<std::vector<span>> after = all_segments();
  const std::lock_guard lock(mutex_);
  for (DeviceIndex d = 0; d < device_count() && d < static_cast<DeviceIndex>(after.size()); ++d) {
    const std::vector<span>& old =
        d < static_cast<DeviceIndex>(before.size()) ? before[d] : devices_[d].known_segments;
    for (const span& s : cudamem::torch_bridge::subtract(after[d], old)) {
      record_trace(hist::TraceEntry::SEGMENT_MAP, d, s.address, s.bytes, stream, default_pool,
                   context);
    }
    for (const span& s : cudamem::torch_bridge::subtract(old, after[d])) {
      record_trace(hist::TraceEntry::SEGMENT_UNMAP, d, s.address, s.bytes, stream,
                   default_pool, context);
    }
    devices_[d].known_segments = std::move(after[d]);
  }
}

}  // namespace
