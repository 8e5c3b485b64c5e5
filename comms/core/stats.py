"""Per-bucket accounting: what each bucket sent on its last call (``state.report()``)."""

from __future__ import annotations

from ..algorithms.dense import dense_wire_bytes

__all__ = ["BucketStats", "record_call", "dense_wire_bytes", "stats_rows"]


class BucketStats:
    """Per-bucket accounting of the last call: bytes one rank sends per step, dense and on the wire."""

    __slots__ = ("bucket", "numel", "dtype", "algorithm", "dense_bytes", "wire_bytes", "calls",
                 "_compressor")

    def __init__(self, bucket, numel, dtype, algorithm, dense_bytes, wire_bytes, compressor=None):
        self.bucket, self.numel, self.dtype = bucket, numel, dtype
        self.algorithm, self.dense_bytes, self.wire_bytes = algorithm, dense_bytes, wire_bytes
        self.calls = 0
        self._compressor = compressor  # the variant the bytes were counted for (warm-up ramps)

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else float("inf")

    def as_dict(self) -> dict:
        public = {k: getattr(self, k) for k in self.__slots__ if not k.startswith("_")}
        return public | {"ratio": self.ratio}


def record_call(stats: dict, index: int, numel: int, dtype, element_size: int, world: int,
                algorithm: str, wire_bytes, compressor=None, dense_bytes=None) -> BucketStats:
    """Count one call of bucket ``index``; (re)create its entry when its size, algorithm or
    ``compressor`` (a warm-up variant, then the compressor itself) changed. ``wire_bytes()`` and
    ``dense_bytes()`` are called only then (``None``: a ring allreduce's bytes; a dense route
    sends the dense bytes)."""
    st = stats.get(index)
    if (st is None or st.numel != numel or st.algorithm != algorithm
            or st._compressor is not compressor):
        dense = dense_wire_bytes(numel, element_size, world) if dense_bytes is None else dense_bytes()
        st = stats[index] = BucketStats(index, numel, dtype, algorithm, dense,
                                        dense if wire_bytes is None else wire_bytes(), compressor)
    st.calls += 1
    return st


def stats_rows(stats: dict, label: str, name_of) -> list[str]:
    """The per-entry rows of a ``report()`` table (header first): ``name_of(key)`` names each
    entry (a bucket index, a module's fqn) under the column ``label``."""
    rows = [f"{label:>24} {'numel':>11} {'dtype':>9} {'algorithm':>18} {'dense B':>12} "
            f"{'wire B':>12} {'ratio':>7}"]
    for k in sorted(stats):
        s = stats[k]
        rows.append(f"{name_of(k):>24} {s.numel:>11} {str(s.dtype).replace('torch.', ''):>9} "
                    f"{s.algorithm:>18} {s.dense_bytes:>12} {s.wire_bytes:>12} {s.ratio:>7.1f}")
    return rows
