// cudamem/_torch/capture_order.hpp — inside a CUDA graph capture, whether what was captured so
// far on some streams comes before everything a stream will capture next: what lets a block
// freed during a capture after Tensor.record_stream be reused in that same capture.
//
//   // at the free: the capture's last nodes on every stream that used the block
//   std::optional<std::vector<cudaGraphNode_t>> markers = capture_markers({s0, s1});
//   // at a later allocation on s0 (same capture)
//   capture_order order;
//   if (markers && order.all_before_next(s0, *markers)) { /* the block may go to s0 now */ }
//   order.forget();                                      // the captures have ended
//
// Why. Outside a capture, a block used on other streams (record_stream) is free once an event
// recorded on each of them at the free has passed. During a capture there is no such event to
// ask: nothing has run. What orders the captured work is the graph itself. With PyTorch's
// `graph_capture_record_stream_reuse` setting, its allocator reuses such a block inside the
// capture once the graph shows that every use comes first; this does the same for cudamem.
//
// How. At the free, the markers are the nodes the next work on each using stream would depend
// on (cudaStreamGetCaptureInfo's dependencies): the block's last uses are at or before them.
// A later request on stream s may take the block when every marker is a node of the graph at
// or before one of s's current dependencies: whatever s captures next depends on all of
// those, so it runs after every use. The nodes at or before s's dependencies are found by a
// walk up the graph's edges, kept per capture and stream: they only grow as the capture goes
// on (s's new dependencies come after its old ones), so a later walk stops where an earlier
// one went.
//
// Contract
// - Call only while the streams named are being captured, or are not (then capture_markers
//   returns nullopt: the free must wait for the capture to end). No event is recorded or
//   queried: only the capture's own graph is read, which is allowed during a capture.
// - Never throws a CUDA error: the free path runs in tensors' destructors. A call that fails
//   (a capture invalidated meanwhile...) counts as "not shown to be ordered", so the block
//   waits for the capture's end as it would without the setting; the error is cleared.
// - Not thread-safe: the allocator's lock guards it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

namespace cudamem::torch_bridge {

/// Where a stream's capture stands: its id and the nodes its next work will depend on.
struct capture_point {
  bool capturing = false;
  unsigned long long id = 0;
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* dependencies = nullptr;
  std::size_t count = 0;
};

/// Where `stream`'s capture stands; not capturing also when the query fails.
inline capture_point capture_point_of(cudaStream_t stream) {
  capture_point p;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
#if CUDART_VERSION >= 13000
  const cudaError_t e = cudaStreamGetCaptureInfo(stream, &status, &p.id, &p.graph,
                                                 &p.dependencies, nullptr, &p.count);
#else
  const cudaError_t e = cudaStreamGetCaptureInfo_v2(stream, &status, &p.id, &p.graph,
                                                    &p.dependencies, &p.count);
#endif
  if (e != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return capture_point{};
  }
  p.capturing = status == cudaStreamCaptureStatusActive;
  return p;
}

/// The nodes `node` depends on directly, into `parents`; false when the query fails.
inline bool graph_parents(cudaGraphNode_t node, std::vector<cudaGraphNode_t>& parents) {
  std::size_t count = 0;
#if CUDART_VERSION >= 13000
  // Edge data must be asked for: edges with data of their own (programmatic launches) make a
  // query without it fail as lossy.
  cudaError_t e = cudaGraphNodeGetDependencies(node, nullptr, nullptr, &count);
  parents.assign(count, nullptr);
  std::vector<cudaGraphEdgeData> edges(count);
  if (e == cudaSuccess && count != 0) {
    e = cudaGraphNodeGetDependencies(node, parents.data(), edges.data(), &count);
  }
#else
  cudaError_t e = cudaGraphNodeGetDependencies(node, nullptr, &count);
  parents.assign(count, nullptr);
  if (e == cudaSuccess && count != 0) {
    e = cudaGraphNodeGetDependencies(node, parents.data(), &count);
  }
#endif
  if (e != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return false;
  }
  parents.resize(count);
  return true;
}

/// The markers of a free during a capture: the dependencies of every stream in `streams`, or
/// nullopt if one of them is not being captured (or they are not in one capture), or none of
/// them has captured anything yet. Then the free waits for the capture to end.
inline std::optional<std::vector<cudaGraphNode_t>> capture_markers(
    const std::vector<cudaStream_t>& streams) {
  std::vector<cudaGraphNode_t> markers;
  std::optional<unsigned long long> capture;
  for (const cudaStream_t s : streams) {
    const capture_point p = capture_point_of(s);
    if (!p.capturing || (capture && *capture != p.id)) {
      return std::nullopt;
    }
    capture = p.id;
    markers.insert(markers.end(), p.dependencies, p.dependencies + p.count);
  }
  if (markers.empty()) {
    return std::nullopt;
  }
  return markers;
}

/// The graph nodes at or before each capturing stream's dependencies, kept while the captures
/// last (see the header).
class capture_order {
 public:
  /// Whether every node of `markers` comes before whatever `stream` captures next (false when
  /// `stream` is not being captured).
  bool all_before_next(cudaStream_t stream, const std::vector<cudaGraphNode_t>& markers) {
    const capture_point p = capture_point_of(stream);
    if (!p.capturing) {
      return false;
    }
    std::unordered_set<cudaGraphNode_t>& before = before_[{p.id, stream}];
    std::vector<cudaGraphNode_t> walk(p.dependencies, p.dependencies + p.count);
    std::vector<cudaGraphNode_t> parents;
    while (!walk.empty()) {
      const cudaGraphNode_t node = walk.back();
      walk.pop_back();
      if (before.count(node) != 0) {
        continue;  // seen: so is everything before it
      }
      if (!graph_parents(node, parents)) {
        return false;  // the node is not recorded: a later walk tries it again
      }
      before.insert(node);
      walk.insert(walk.end(), parents.begin(), parents.end());
    }
    for (const cudaGraphNode_t m : markers) {
      if (before.count(m) == 0) {
        return false;
      }
    }
    return true;
  }

  /// The captures have ended: their graphs' nodes mean nothing any more.
  void forget() noexcept { before_.clear(); }

 private:
  std::map<std::pair<unsigned long long, cudaStream_t>, std::unordered_set<cudaGraphNode_t>>
      before_;
};

}  // namespace cudamem::torch_bridge
