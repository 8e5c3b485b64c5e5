"""Run under ``mpiexec -n N``: every compressor x algorithm through MPICommunicator.

Asserts (on every rank) replica identity, error bounds, lossless exactness, wire bytes,
unbiasedness of QSGD via two_phase/shared_scale, and that mismatched layouts raise on every
rank. Rank 0 prints ``MPI-ALGORITHMS OK <cases>`` at the end; any failure aborts the job.
"""

import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from comms.cluster.mpi import MPICommunicator  # noqa: E402
from dist import algo_ranks  # noqa: E402


def main():
    torch.set_num_threads(1)
    comm = MPICommunicator(MPI.COMM_WORLD)
    cases = algo_ranks.matrix()
    report = algo_ranks.check_matrix(comm, cases, n=4099, seeds=1)
    algo_ranks.check_matrix(comm, [("qsgd:bits=8", "two_phase"), ("fp16", "two_phase"),
                                   ("qsgd:bits=8", "shared_scale")], n=2051,
                            dtypes=(torch.float16, torch.bfloat16), seeds=1)
    for name in ("two_phase", "shared_scale"):
        algo_ranks.check_unbiased(comm, name, samples=32)
        assert algo_ranks.check_mismatch(comm, name, "qsgd:bits=8") == ["numel", "dtype"]
    comm.close()
    if comm.rank == 0:
        print(f"MPI-ALGORITHMS OK {len(report)} world={comm.world_size}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - never leave the other ranks waiting
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
