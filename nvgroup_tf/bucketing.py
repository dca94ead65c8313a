"""Fusion buckets for gradient allreduce: one pure function decides them.

How it works
------------
The optimizer lists its dense gradients in backprop order (the reverse of the
variable order: the last layer's gradient is computed first) and asks
`assign_buckets` which of them travel together. Each bucket becomes one
grouped_allreduce, so the first buckets can be reduced while backprop is still
producing the later gradients, and there are few enough collectives that their
per-call latency does not dominate.

Rules (after PyTorch DDP's compute_bucket_assignment_by_size in
torch/csrc/distributed/c10d/reducer.cpp):
  * Gradients of different dtypes never share a bucket (a fused buffer has one
    dtype); each dtype fills its own open bucket.
  * A gradient that would push its open bucket over the cap closes that bucket
    first, so a bucket never exceeds its cap unless it holds a single gradient
    larger than the cap (which then travels alone).
  * The first bucket of each dtype has its own, smaller cap, so the first
    collective starts as early as possible (DDP: 1 MiB first, then 25 MiB).
  * cap_bytes <= 0 disables fusion: one bucket per gradient.
  * Buckets come out ordered by their first gradient's position, i.e. in the
    order they become ready during backprop; inside a bucket the input order
    is kept. Every rank computes the same assignment from the same inputs, so
    bucket names (`bucket_name`) match across ranks without negotiation.
"""
import hashlib
from typing import List, Sequence


def assign_buckets(sizes_bytes: Sequence[int], dtypes: Sequence[str], cap_bytes: int,
                   first_bucket_cap_bytes: int) -> List[List[int]]:
    """Groups gradient indices into fusion buckets.

    Args:
      sizes_bytes: size of each gradient in bytes, in backprop order.
      dtypes: dtype name of each gradient (any hashable label; same length).
      cap_bytes: largest bucket in bytes; <= 0 puts every gradient alone.
      first_bucket_cap_bytes: cap of the first bucket of each dtype (<= cap_bytes
        to have an effect; larger values are clipped to cap_bytes).
    Returns:
      A list of buckets, each a list of indices into the inputs; every index
      appears exactly once.
    """
    if len(sizes_bytes) != len(dtypes):
        raise ValueError("assign_buckets: %d sizes but %d dtypes" % (len(sizes_bytes), len(dtypes)))
    for i, s in enumerate(sizes_bytes):
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError("assign_buckets: sizes_bytes[%d] = %r is not a non-negative integer" % (i, s))
    if cap_bytes <= 0:
        return [[i] for i in range(len(sizes_bytes))]
    first_cap = max(1, min(first_bucket_cap_bytes, cap_bytes))

    done: List[List[int]] = []
    open_bucket = {}   # dtype -> (indices, bytes)
    started = set()    # dtypes whose first bucket has been closed
    for i, (size, dtype) in enumerate(zip(sizes_bytes, dtypes)):
        cap = cap_bytes if dtype in started else first_cap
        indices, total = open_bucket.get(dtype, ([], 0))
        if indices and total + size > cap:
            done.append(indices)
            started.add(dtype)
            indices, total = [], 0
        open_bucket[dtype] = (indices + [i], total + size)
    done.extend(indices for indices, _ in open_bucket.values())
    return sorted(done, key=lambda b: b[0])


def bucket_name(index: int, paths: Sequence[str]) -> str:
    """Deterministic collective name of bucket `index` holding the gradients of
    the variables `paths` (identical on all ranks; the hash makes a mismatch in
    the variable set show up as a name mismatch instead of a silent mix-up)."""
    digest = hashlib.sha1("\n".join(paths).encode("utf-8")).hexdigest()[:12]
    return "nvg_grad_bucket_%d_%s" % (index, digest)
