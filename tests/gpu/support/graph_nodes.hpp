// How many nodes of one type a CUDA graph has: the GPU tests of stream capture count the
// allocation and free nodes that the interop headers' temporaries become.
#pragma once

#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

namespace cudamem_test {

inline std::size_t count_nodes(cudaGraph_t graph, cudaGraphNodeType type) {
  std::size_t count = 0;
  cudamem::check(cudaGraphGetNodes(graph, nullptr, &count), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(count);
  cudamem::check(cudaGraphGetNodes(graph, nodes.data(), &count), "cudaGraphGetNodes");
  std::size_t matching = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType node_type{};
    cudamem::check(cudaGraphNodeGetType(node, &node_type), "cudaGraphNodeGetType");
    matching += node_type == type ? 1 : 0;
  }
  return matching;
}

}  // namespace cudamem_test
