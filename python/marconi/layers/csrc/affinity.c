/* Pin each OpenMP thread of the calling thread's team to one CPU (thread t to cpus[t]), as
 * vLLM's CPU worker does with VLLM_CPU_OMP_THREADS_BIND. GNU OpenMP reuses a master's team
 * threads for every later parallel region of the same size, so torch's intra-op regions (same
 * libgomp, see ckernel.py) and our kernels then run on the pinned threads. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

void pin_omp_threads(const long *cpus, long n) {
#pragma omp parallel num_threads((int)n)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET((int)cpus[omp_get_thread_num()], &set);
        sched_setaffinity(0, sizeof set, &set);
    }
}

#ifdef MARCONI_PYEXT
#include "pyext.h"
PYEXT_FUNCTION(pin_omp_threads, "pl", pin_omp_threads((const long *)v[0].p, v[1].l))
PYEXT_MODULE(affinity, PYEXT_METHOD(pin_omp_threads))
#endif
