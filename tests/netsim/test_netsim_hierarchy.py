"""2 netsim hosts x 2 ranks (1 Gb/s between hosts, loopback inside): groups, hierarchical
replica identity, and the cost model's dense-allreduce prediction against measurement.

Skips without root, ``ip netns`` or the netsim script. One rank launch runs every job; the
fixture holds /tmp/netsim.lock for the whole run.
"""

import fcntl
import importlib.util
import os

import pytest

pytestmark = [pytest.mark.netsim, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_hierarchy", os.path.join(ROOT, "bench", "hierarchy.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results():
    bench = _bench()
    why = bench.netsim_unavailable()
    if why:
        pytest.skip(why)
    with open(bench.NETSIM_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return bench.run_netsim(["groups", "hier", "cost"], rate="1gbit", hosts=2, per_host=2,
                                    timeout=200, lock=False, extra=["--pg-timeout", "120"])
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def test_groups_are_the_hosts(results):
    for r, res in enumerate(results):
        g = res["groups"]
        assert g["nodes"] == [[0, 1], [2, 3]]
        assert g["local_rank"] == r % 2 and g["local_size"] == 2  # launch order: host-major
        assert g["intra_sum"] == float(sum([[0, 1], [2, 3]][r // 2]))
        assert g["inter_sum"] == float((r % 2) + (r % 2) + 2)


def test_hierarchical_replica_identical(results):
    for key in results[0]["hier"]:
        digests = {res["hier"][key]["digest"] for res in results}
        assert len(digests) == 1, f"{key}: ranks differ"
        xs = sum(res["hier"][key]["x_sum"] for res in results)
        owns = sum(res["hier"][key]["own_sum"] for res in results)
        total = results[0]["hier"][key]["total_sum"]
        assert abs(owns - total) <= 1e-3 * max(1.0, abs(total)), key  # EF: owns add up to the result
        # compressed, but close to the true sum: fp16 rounding; qsgd 4-bit zero-mean noise of
        # std < 0.1 per element (|x| < ~1.2, 7 levels), summed over 1e5 elements
        bound = 0.5 if key.startswith("fp16") else 0.5 * 100_003 ** 0.5
        assert abs(total - xs) < bound, key


def test_cost_model_predicts_dense_allreduce(results):
    c = results[0]["cost"]
    assert all(res["cost"]["model"] == c["model"] for res in results)  # same numbers everywhere
    # within 30%, plus 2 ms of slack: at 256 KiB an op is 4-9 ms and four ranks sharing two
    # cores shift single ops by a few ms either way (CI saw 4.5 predicted vs 6.9 measured once)
    for size, p, m in zip(c["sizes"], c["predicted"], c["measured"]):
        assert abs(p - m) <= 0.3 * m + 2e-3, f"{size} B: predicted {p * 1e3:.2f} ms, measured {m * 1e3:.2f} ms ({c['model']})"
