// A CUDA graph composed of separately captured pieces, the middle ones each under a conditional IF node
// (CUDA 12.4+): piece 0, then for i = 1 .. n - 2 a one-thread kernel that sets the node's condition from the
// device flag flags[i - 1], and an IF node whose body holds piece i as a child graph, then piece n - 1. So a
// round's draft steps after the first run only where the GPU reads that some row still drafts, with nothing read
// back to the host (torch before 2.13 has no CUDAGraph.begin_capture_to_if_node; this builds the same node from
// graphs torch captured with keep_graph=True). Torch-free: raw graph handles and device pointers in, an
// instantiated cudaGraphExec_t out.
#include <cuda_runtime.h>

#include "cuda/launchers.h"

namespace specdec {
namespace cuda {
namespace {

__global__ void set_if_kernel(cudaGraphConditionalHandle handle, const bool* flag) {
  cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}

// Adds `node_params` to `graph` after `dep` (nullptr: no dependency).
cudaError_t add_node(cudaGraphNode_t* node, cudaGraph_t graph, const cudaGraphNode_t* dep,
                     cudaGraphNodeParams* node_params) {
  const size_t deps = dep != nullptr ? 1 : 0;
#if CUDART_VERSION >= 13000
  return cudaGraphAddNode(node, graph, dep, nullptr, deps, node_params);
#else
  return cudaGraphAddNode(node, graph, dep, deps, node_params);
#endif
}

}  // namespace

cudaError_t compose_if_chain(const cudaGraph_t* pieces, int num_pieces, const bool* const* flags,
                             cudaGraphExec_t* exec) {
  *exec = nullptr;
  if (pieces == nullptr || num_pieces < 2) return cudaErrorInvalidValue;
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaGraphCreate(&graph, 0);
  if (e != cudaSuccess) return e;
  cudaGraphNode_t prev = nullptr;
  e = cudaGraphAddChildGraphNode(&prev, graph, nullptr, 0, pieces[0]);
  for (int i = 1; e == cudaSuccess && i < num_pieces - 1; ++i) {
    cudaGraphConditionalHandle handle;
    e = cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault);
    if (e != cudaSuccess) break;
    const bool* flag = flags[i - 1];
    void* args[] = {&handle, &flag};
    cudaKernelNodeParams kernel = {};
    kernel.func = reinterpret_cast<void*>(set_if_kernel);
    kernel.gridDim = dim3(1);
    kernel.blockDim = dim3(1);
    kernel.kernelParams = args;
    cudaGraphNode_t set = nullptr;
    e = cudaGraphAddKernelNode(&set, graph, &prev, 1, &kernel);
    if (e != cudaSuccess) break;
    cudaGraphNodeParams cond = {};
    cond.type = cudaGraphNodeTypeConditional;
    cond.conditional.handle = handle;
    cond.conditional.type = cudaGraphCondTypeIf;
    cond.conditional.size = 1;
    cudaGraphNode_t node = nullptr;
    e = add_node(&node, graph, &set, &cond);
    if (e != cudaSuccess) break;
    cudaGraphNode_t body = nullptr;  // the body graph is owned by the conditional node
    e = cudaGraphAddChildGraphNode(&body, cond.conditional.phGraph_out[0], nullptr, 0, pieces[i]);
    prev = node;
  }
  cudaGraphNode_t last = nullptr;
  if (e == cudaSuccess) e = cudaGraphAddChildGraphNode(&last, graph, &prev, 1, pieces[num_pieces - 1]);
  if (e == cudaSuccess) e = cudaGraphInstantiate(exec, graph, 0);
  const cudaError_t destroyed = cudaGraphDestroy(graph);  // the instantiated graph keeps what it needs
  return e != cudaSuccess ? e : destroyed;
}

cudaError_t launch_graph(cudaGraphExec_t exec, cudaStream_t stream) { return cudaGraphLaunch(exec, stream); }

cudaError_t destroy_graph(cudaGraphExec_t exec) { return cudaGraphExecDestroy(exec); }

}  // namespace cuda
}  // namespace specdec
