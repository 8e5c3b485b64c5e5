// topk.cu -- sampled-threshold top-k: candidate stream compaction, and scatter-add decode.
// Reference: compressors/topk.py (TopK._approx_indices, TopK.decompress_add_).
//
// Kernels:
//   topk_compact(const void* x, int dtype, i64 n, const void* thr, int* cand, u32 cap,
//                u32* count)
//       every i with |x[i]| >= *thr (thr: a device scalar of x's dtype, the sampled k-th
//       magnitude) gets a slot from a warp-aggregated atomic counter; slots < cap receive i.
//       *count ends as the total number of candidates (it may exceed cap: the caller then
//       retries with a larger buffer). Slot order is not deterministic; the caller sorts the
//       first min(count, cap) slots, which gives torch.nonzero's ascending order.
//   topk_scatter_add(const void* vals, int dtype, const int* idx, i64 k, float* acc, i64 n)
//       acc[idx[j]] = fl(acc[idx[j]] + vals[j]) for idx in [0, n), one IEEE add each (no FTZ:
//       subnormals kept, as index_add_ keeps them). The indices of one payload are distinct
//       except the zero-valued padding slots (index 0, value +0), and adding +0 commutes with
//       the other add bit for bit, so any order gives torch.index_add_'s bits.
//       Contract for corrupt payloads: an index outside [0, n) is skipped (index_add_ raises;
//       detecting it here would need a host synchronisation).

extern "C" __global__ void topk_compact(const void* x, int dtype, i64 n, const void* thr, int* cand,
                                        u32 cap, u32* count) {
    const float t = load_f32(thr, 0, dtype);
    const unsigned lane = threadIdx.x & 31U;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 base = (i64)blockIdx.x * blockDim.x + threadIdx.x - lane; base < n; base += stride) {
        i64 i = base + lane;
        bool keep = i < n && fabsf(load_f32(x, i, dtype)) >= t;
        u32 ballot = __ballot_sync(0xffffffffU, keep);
        if (ballot == 0U) continue;  // warp-uniform
        u32 slot0 = 0;
        if (lane == 0) slot0 = atomicAdd(count, (u32)__popc(ballot));
        slot0 = __shfl_sync(0xffffffffU, slot0, 0);
        if (keep) {
            u32 slot = slot0 + (u32)__popc(ballot & ((1U << lane) - 1U));
            if (slot < cap) cand[slot] = (int)i;
        }
    }
}

// acc += v as one IEEE round-to-nearest add, atomically. Not atomicAdd: a float atomicAdd to
// global memory flushes subnormal inputs and results to zero on the GPU (PTX atom.global.add.f32
// has no denormal mode), where torch's index_add_ keeps them. The CAS loop is uncontended here
// (distinct indices, except the zero pads at index 0).
__device__ __forceinline__ void atomic_add_rn(float* p, float v) {
    unsigned* w = (unsigned*)p;
    unsigned old = *w, seen;
    do {
        seen = old;
        old = atomicCAS(w, seen, __float_as_uint(__fadd_rn(__uint_as_float(seen), v)));
    } while (old != seen);
}

extern "C" __global__ void topk_scatter_add(const void* vals, int dtype, const int* idx, i64 k,
                                            float* acc, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < k; j += stride) {
        i64 i = idx[j];
        if (i >= 0 && i < n) atomic_add_rn(acc + i, load_f32(vals, j, dtype));
    }
}
