#include "engine/device/cuda_graphs.h"

#include <string>
#include <utility>

#include "tqkv/error.h"

namespace tqkv::engine {

int graph_bucket(int n) {
  static constexpr int kBuckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, kMaxGraphBatch};
  if (n <= 0) return 0;
  for (int b : kBuckets)
    if (n <= b) return b;
  return 0;
}

StepGraph::StepGraph(int b, std::shared_ptr<StepActivations> a) : bucket(b), acts(std::move(a)) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, static_cast<size_t>(b) * (sizeof(int64_t) + sizeof(int32_t)));
  if (e != cudaSuccess)
    throw Error(ErrorCode::Capacity, std::string("cuda graphs: allocating a step's inputs: ") + cudaGetErrorString(e));
  positions = static_cast<int64_t*>(p);
  tokens = reinterpret_cast<int32_t*>(positions + b);
}

StepGraph::~StepGraph() {
  if (exec) cudaGraphExecDestroy(exec);
  cudaFree(positions);
}

}  // namespace tqkv::engine
