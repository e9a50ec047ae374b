// A team: the threads of one parallel region running a decode step's layers together (decoder_layer, decoder_layers:
// csrc/cpu/layer_cpu.cpp), each taking its share of every product and attention, a barrier (sync) wherever a step
// reads what the others wrote.
//
// Why: a layer is ~10 steps of a few microseconds each (4 products, attention, norms, RoPE); opening a parallel region
// for each (at::parallel_for) cost ~2.3 us a region on a 2-core Xeon with AMX (the second thread started ~1.5 us
// after the first, and the join ~0.8 us), 5 regions a layer; a barrier among threads already running costs ~0.3 us
// (libgomp, spinning). llama.cpp's CPU backend runs a graph the same way: its threads stay in one region and meet at
// a barrier after each node.
#pragma once
#include <ATen/Parallel.h>

#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace specdec {
namespace cpu {

struct Team {
  int id = 0, size = 1;  // this thread's number, and the team's

  // Waits until every thread of the team has reached this point (writes before it seen after it).
  void sync() const {
#ifdef _OPENMP
    if (size > 1) {
#pragma omp barrier
    }
#endif
  }

  // This thread's share of n items: [begin, end), near-equal contiguous runs in thread order.
  int64_t begin(int64_t n) const { return n * id / size; }
  int64_t end(int64_t n) const { return n * (id + 1) / size; }
};

// Runs f(team) on every thread of one parallel region (at::get_num_threads() threads), or on the calling thread alone
// (a team of one) inside a parallel region already, with one thread, or where torch does not parallelise with OpenMP.
// f must not throw, and every thread must reach each of its syncs.
template <class F>
void run_team(const F& f) {
#ifdef _OPENMP
  at::internal::lazy_init_num_threads();
  if (at::get_num_threads() > 1 && !at::in_parallel_region()) {
#pragma omp parallel
    {
      const Team team{omp_get_thread_num(), omp_get_num_threads()};
      at::internal::ThreadIdGuard guard(team.id);
      f(team);
    }
    return;
  }
#endif
  f(Team{});
}

}  // namespace cpu
}  // namespace specdec
