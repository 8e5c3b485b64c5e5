// topk.cu -- sampled-threshold top-k: candidate stream compaction, and scatter-add decode.
// Reference: compressors/topk.py (TopK._approx_indices, TopK.decompress_add_).
//
// Kernels:
//   topk_compact(const void* x, int dtype, i64 n, const void* thr, int* cand, u32 cap,
//                u32* count)
//       every i with |x[i]| >= *thr (thr: a device scalar of x's dtype, the sampled k-th
//       magnitude) is a candidate; slots < cap receive i, and *count ends as the total number
//       of candidates (it may exceed cap: the caller then retries with a larger buffer).
//       Block-level compaction: a tile of 8 * blockDim elements per block and step (grid-
//       stride), each thread a group of 8 (16-byte vector loads when x is 16-byte aligned);
//       a warp scan of the per-thread candidate counts (__shfl_up_sync), a block scan of the
//       warp totals in shared memory, then ONE atomicAdd per tile reserves the tile's slots;
//       candidates are written in ascending order within a tile. The tiles' order is not
//       deterministic: the caller sorts the first min(count, cap) slots, which gives
//       torch.nonzero's ascending order. Bytes/element: E + 4 * (candidates / n).
//   topk_scatter_add(const void* vals, int dtype, const int* idx, i64 k, float* acc, i64 n)
//       acc[idx[j]] = fl(acc[idx[j]] + vals[j]) for idx in [0, n), one IEEE add each (no FTZ:
//       subnormals kept, as index_add_ keeps them). The indices of one payload are distinct
//       except the zero-valued padding slots (index 0, value +0): every slot with an index
//       other than 0 is a plain load-add-store (no other slot touches it), the slots at index
//       0 go through a CAS loop (they may be many). Adding +0 commutes with the other add bit
//       for bit, so any order gives torch.index_add_'s bits. Bytes/slot: 4 + E + 8 (index,
//       value, accumulator read and write).
//       Contract for corrupt payloads: an index outside [0, n) is skipped (index_add_ raises;
//       detecting it here would need a host synchronisation); repeated nonzero indices race.

extern "C" __global__ void topk_compact(const void* x, int dtype, i64 n, const void* thr, int* cand,
                                        u32 cap, u32* count) {
    __shared__ u32 warp_base[32];
    __shared__ u32 tile_base;
    const float t = load_f32(thr, 0, dtype);
    const bool xvec = aligned_to(x, 16);
    const unsigned lane = threadIdx.x & 31U, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 ngroups = (n + 7) >> 3;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g0 = (i64)blockIdx.x * blockDim.x; g0 < ngroups; g0 += stride) {  // block-uniform
        const i64 g = g0 + threadIdx.x, i = g << 3;
        u32 keep = 0;
        if (g < ngroups) {
            float v[8];
            load_group(x, i, n, dtype, xvec, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) keep |= (u32)(i + k < n && fabsf(v[k]) >= t) << k;
        }
        const u32 mine = (u32)__popc(keep);
        u32 incl = mine;  // inclusive scan over the warp
        for (int off = 1; off < 32; off <<= 1) {
            u32 o = __shfl_up_sync(0xffffffffU, incl, off);
            if (lane >= (unsigned)off) incl += o;
        }
        if (lane == 31) warp_base[wid] = incl;
        __syncthreads();
        if (wid == 0) {
            u32 w = lane < nw ? warp_base[lane] : 0U, winc = w;
            for (int off = 1; off < 32; off <<= 1) {
                u32 o = __shfl_up_sync(0xffffffffU, winc, off);
                if (lane >= (unsigned)off) winc += o;
            }
            if (lane < nw) warp_base[lane] = winc - w;  // exclusive: the warp's offset in the tile
            if (lane == nw - 1) tile_base = atomicAdd(count, winc);
        }
        __syncthreads();
        u32 slot = tile_base + warp_base[wid] + incl - mine;
        for (int k = 0; k < 8; ++k) {
            if ((keep >> k) & 1U) {
                if (slot < cap) cand[slot] = (int)(i + k);
                slot++;
            }
        }
        __syncthreads();  // warp_base and tile_base are rewritten by the next tile
    }
}

// acc += v as one IEEE round-to-nearest add, atomically. Not atomicAdd: a float atomicAdd to
// global memory flushes subnormal inputs and results to zero on the GPU (PTX atom.global.add.f32
// has no denormal mode), where torch's index_add_ keeps them.
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
        const i64 i = idx[j];
        if (i <= 0 || i >= n) {
            if (i == 0 && n > 0) atomic_add_rn(acc, load_f32(vals, j, dtype));  // the pads share index 0
            continue;
        }
        acc[i] = __fadd_rn(acc[i], load_f32(vals, j, dtype));
    }
}
