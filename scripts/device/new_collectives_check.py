"""GPU check of the collectives added for Horovod parity, through the pybind11
module (nvgroup_tf._engine), under mpirun with 2, 3 or 4 ranks (on one GPU: the
ranks share it as one NV-group, NVGROUP_ONE_GPU_GROUP=1 under MPS, as
scripts/device/run_all.sh sets up; stage `newcoll` there runs it).

  1. Communicator.reduce_scatter (the row reduce-scatter kernel in one
     NV-group; over several groups the hierarchical reduce-scatter: that
     kernel's group fold of every group's rows for this group rank, then a
     reduce-scatter-only cross step through pinned host memory, pipelined in
     chunks; its cross-group bytes must be exactly the reduce-scatter's, never
     the allreduce's, and its rows bitwise the allreduce's): every dtype
     (uint8, int8, uint16, int16, int32, int64, float16, bfloat16, float32,
     float64) x Sum/Average/Min/Max/Product x Horovod's uneven row split
     (zero rows included) x input outside / inside the registered buffer x a
     message larger than the registered buffer (several pieces); the output
     written between guard elements (misaligned too) that must stay untouched;
  2. Communicator.allreduce of the 8/16-bit integers (new kernels);
  3. Communicator.alltoallv: uneven and zero splits, odd row sizes, peer copies
     in one group and the host-staged path (several groups; a rank's data
     larger than the registered buffer); a CUDA graph capture on rank 0 only is
     the same error on every rank;
  4. the engine on device='cuda:N': reducescatter (Sum/Average, pre/postscale,
     integer scale semantics), grouped_reducescatter, alltoall (uneven, zero
     and no splits), grouped_allgather, allreduce of the 8/16-bit integers with
     and without scale factors; with 4 ranks also as 2 NV-groups of 2:
     reducescatter and grouped_reducescatter through the hierarchical
     reduce-scatter (cross-group bytes exactly the reduce-scatter's).
Every result: random data (never all zero), every element against a float64
(floats, within the summation's rounding) or exact-integer reference
(wrap-around arithmetic), bitwise equal on all ranks, and bitwise equal to the
same collective on the CPU path (CPU communicator / the engine on 'cpu'): the
CPU path is the reference implementation. Sections 1-3 run for the default
grouping (one NV-group), groups of one GPU, and (4 ranks) 2 groups of 2.

`--device cpu` runs everything on host memory (numpy) against the CPU path
only: a dry run of the script's own logic where there is no GPU.
Prints every failure with its rank, then one summary line per rank 0:
"# new_collectives_check np=N: PASSED|FAILED (checks, failures)"; exits non-zero
on any failure.
"""
import argparse
import ctypes
import hashlib
import os
import sys
import traceback

import numpy as np
from mpi4py import MPI

from nvgroup_tf import _engine as E

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
ap.add_argument("--quick", action="store_true", help="fewer shapes (dry runs)")
args = ap.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
ON_GPU = args.device == "cuda"
if ON_GPU:
    import cupy as cp
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).rank
    DEV_ORDINAL = local % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(DEV_ORDINAL).use()
    DEVICE = "cuda:%d" % DEV_ORDINAL
    STREAM = cp.cuda.Stream(non_blocking=True)
    STREAM_PTR = STREAM.ptr
else:
    DEVICE = "cpu"
    STREAM_PTR = 0

checks = 0
failures = []
section_counts = {}
section = "setup"


def check(ok, msg):
    global checks
    checks += 1
    section_counts.setdefault(section, [0, 0])
    section_counts[section][0] += 1
    if not ok:
        section_counts[section][1] += 1
        failures.append(msg)
        if len(failures) <= 60:
            print("[rank %d] FAIL %s: %s" % (rank, section, msg), flush=True)
    return ok


# ---------------------------------------------------------------- memory
class Buf:
    """Device (cupy) or host (numpy) bytes holding `n` elements of a dtype."""

    def __init__(self, host):
        host = np.ascontiguousarray(host)
        self.dtype = host.dtype
        raw = host.reshape(-1).view(np.uint8)
        self.mem = cp.asarray(raw) if ON_GPU else raw.copy()

    @property
    def ptr(self):
        return self.mem.data.ptr if ON_GPU else self.mem.ctypes.data

    def get(self):
        raw = cp.asnumpy(self.mem) if ON_GPU else self.mem.copy()
        return raw.view(self.dtype)


def sync():
    """Every copy cupy issued (on the legacy default stream, which the
    non-blocking STREAM and the communicators' streams do not wait for) is done."""
    if ON_GPU:
        cp.cuda.runtime.deviceSynchronize()


def copy_to_address(address, host):
    raw = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    if raw.size == 0:
        return
    if ON_GPU:
        cp.cuda.runtime.memcpy(address, raw.ctypes.data, raw.size, cp.cuda.runtime.memcpyHostToDevice)
    else:
        np.ctypeslib.as_array((ctypes.c_uint8 * raw.size).from_address(address))[:] = raw


def fetch_engine_output(result, dtype):
    """The engine's allocated output: numpy on the CPU; (address, shape) on CUDA (freed here)."""
    if not ON_GPU or isinstance(result, np.ndarray):
        return np.ascontiguousarray(np.asarray(result)).reshape(-1).view(np.uint8).view(dtype), list(np.shape(result))
    address, shape = result
    n = int(np.prod(shape)) if len(shape) else 1
    out = np.empty(n, dtype=dtype)
    if out.nbytes:
        cp.cuda.runtime.memcpy(out.ctypes.data, address, out.nbytes, cp.cuda.runtime.memcpyDeviceToHost)
    E.free_cuda(address)
    return out, list(shape)


# ---------------------------------------------------------------- dtypes and data
# bfloat16 travels as its uint16 bits (numpy has no bfloat16).
NP = {"uint8": np.uint8, "int8": np.int8, "uint16": np.uint16, "int16": np.int16, "int32": np.int32,
      "int64": np.int64, "float16": np.float16, "bfloat16": np.uint16, "float32": np.float32,
      "float64": np.float64}
INTS = ("uint8", "int8", "uint16", "int16", "int32", "int64")
SMALL_INTS = INTS[:4]
FLOATS = ("float16", "bfloat16", "float32", "float64")
ALL = INTS + FLOATS
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}


def bf16_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f64_of(a, dtype):
    return bf16_to_f64(a) if dtype == "bfloat16" else a.astype(np.float64)


def data(seed, r, n, dtype, op="sum"):
    """Rank r's input: random, never all zero; small factors for products."""
    rng = np.random.default_rng([seed, r])
    if dtype in INTS:
        info = np.iinfo(NP[dtype])
        lo, hi = (int(info.min), int(info.max)) if op != "product" else ((-3, 3) if info.min < 0 else (0, 3))
        x = rng.integers(lo, hi, n, endpoint=True, dtype=np.int64)
        if n:
            x[0] = hi  # never all zero
        return x.astype(NP[dtype])
    v = rng.uniform(0.5, 2.0, n) if op == "product" else rng.uniform(-1.0, 1.0, n) + 1.0 / 64
    if dtype == "bfloat16":
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(NP[dtype])


def trunc_div(s, d):
    """int64 s / d rounded toward zero, exactly."""
    q = s // d
    return np.where((s % d != 0) & (s < 0), q + 1, q)


def int_reduce(xs, dtype, op, divisor=None):
    """Exact reference of the engine's integer arithmetic: wrap-around in the dtype."""
    t = NP[dtype]
    a = np.array([x.astype(np.int64) for x in xs])
    with np.errstate(over="ignore"):
        if op in ("sum", "average"):
            s = np.sum(a, axis=0, dtype=np.int64).astype(t)  # numpy int64 wraps like the device
            if op == "average":
                s = trunc_div(s.astype(np.int64), divisor or size).astype(t)
            return s
        if op == "product":
            return np.prod(a, axis=0, dtype=np.int64).astype(t)
    return (np.min(a, axis=0) if op == "min" else np.max(a, axis=0)).astype(t)


def int_engine_reference(xs, dtype, op, pre, post):
    """The engine's integer result: without scale factors the plain reduction;
    with them Horovod's trunc(x * pre) in, wrapped sum, trunc(sum * post [/ size])
    out (in double), wrapped (cc/engine/averaging.cc AverageByPostscale)."""
    if pre == 1.0 and post == 1.0:
        return int_reduce(xs, dtype, op)
    scaled = [np.trunc(x.astype(np.float64) * pre).astype(np.int64).astype(NP[dtype]) for x in xs]
    s = int_reduce(scaled, dtype, "sum").astype(np.int64)
    factor = post / size if op == "average" else post
    return np.trunc(s.astype(np.float64) * factor).astype(np.int64).astype(NP[dtype])


def float_check(got, xs, dtype, op, what, pre=1.0, post=1.0):
    g = f64_of(got, dtype)
    a = np.array([f64_of(x, dtype) * pre for x in xs])
    if op in ("min", "max"):
        want = np.min(a, axis=0) if op == "min" else np.max(a, axis=0)
        bad = int(np.sum(g != want))
    else:
        u = UNIT[dtype]
        if op == "product":
            want = np.prod(a, axis=0)
            tol = (2 * len(xs) + 2) * u * np.abs(want)
        else:
            want = np.sum(a, axis=0) * post / (size if op == "average" else 1)
            tol = (len(xs) + 3) * u * np.sum(np.abs(a), axis=0) * abs(post) / (size if op == "average" else 1)
        bad = int(np.sum(~(np.abs(g - want) <= tol)))
    return check(bad == 0, "%s: %d of %d elements off the float64 reference" % (what, bad, g.size))


def same_on_all_ranks(what, arr):
    digest = hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).tobytes()).hexdigest()
    return check(len(set(comm.allgather(digest))) == 1, "%s: results differ across ranks" % what)


def bitwise(a, b):
    a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    b = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    return a.shape == b.shape and np.array_equal(a, b)


def rows(dim0, r):
    return dim0 // size + (1 if r < dim0 % size else 0)


# ---------------------------------------------------------------- 1-3: communicator
OPS = ("sum", "average", "min", "max", "product")


def shapes():
    s = [(1, 1), (max(size - 1, 1), 3), (size, 1), (2 * size + 1, 17), (37, 5), (0, 3)]
    return s if args.quick else s + [(1000 * size + 3, 7)]


BIG = (4099, 257)  # > the 1 MiB registered buffer for every dtype: several pieces


def owner_table(c):
    """(group_index, group_rank) -> rank, and this rank's topology."""
    t = c.topology()
    places = comm.allgather((t["group_index"], t["group_rank"]))
    return {p: r for r, p in enumerate(places)}, t


def expected_cross_bytes(counts, esize, owners):
    """What the hierarchical reduce-scatter posts in cross-group exchanges: this
    rank's group partials of the rows of its group rank's peers in the other
    groups, once (none with one group). The old path (allreduce, then the rows)
    posted the allreduce's reduce-scatter + allgather bytes instead."""
    rank_of, t = owners
    if t["group_count"] == 1:
        return 0
    l, g = t["group_rank"], t["group_index"]
    return sum(counts[rank_of[(j, l)]] for j in range(t["group_count"]) if j != g) * esize


def reduce_scatter_case(c, h, label, dtype, op, dim0, row, seed, in_registered, misaligned, owners):
    counts = [rows(dim0, r) * row for r in range(size)]
    total, mine = sum(counts), counts[rank]
    start = sum(counts[:rank])
    xs = [data(seed, r, total, dtype, op) for r in range(size)]
    what = "%s reduce_scatter %s %s dim0=%d row=%d%s%s" % (
        label, dtype, op, dim0, row, " in-registered" if in_registered else "", " misaligned" if misaligned else "")
    x = Buf(xs[rank])
    # The output between sentinel elements: 16 bytes before it (one element
    # more when misaligned, so it starts off a 16-byte boundary) and after it.
    esize = np.dtype(NP[dtype]).itemsize
    off = 16 // esize + (1 if misaligned else 0)
    sentinel = data(seed + 7, rank, mine + off + 16 // esize, dtype)
    out = Buf(sentinel)
    in_ptr = x.ptr
    if in_registered:
        copy_to_address(c.registered_buffer(), xs[rank])
        in_ptr = c.registered_buffer()
    sync()
    try:
        before = E.cross_bytes_sent()
        c.reduce_scatter(in_ptr, out.ptr + off * esize, counts, dtype, op, stream=STREAM_PTR)
        c.synchronize(STREAM_PTR)
        sent = E.cross_bytes_sent() - before
    except Exception as e:  # noqa: BLE001 -- a failure is a check failure, keep going
        check(False, "%s raised %s" % (what, e))
        return
    want_sent = expected_cross_bytes(counts, esize, owners)
    check(sent == want_sent, "%s: posted %d cross-group bytes, the reduce-scatter's are %d" % (
        what, sent, want_sent))
    got_all = out.get()
    got = got_all[off:off + mine]
    check(bitwise(got_all[:off], sentinel[:off]) and bitwise(got_all[off + mine:], sentinel[off + mine:]),
          "%s: wrote outside its %d elements" % (what, mine))
    # The CPU path on the same data (host memory, the CPU communicator).
    if h is not None:
        hx = xs[rank].copy()
        hout = np.empty(max(mine, 1), dtype=NP[dtype])
        h.reduce_scatter(hx.ctypes.data, hout.ctypes.data, counts, dtype, op)
        check(bitwise(got, hout[:mine]), "%s: not bitwise equal to the CPU path" % what)
    # The same data through this communicator's allreduce: our rows are its rows.
    full = Buf(np.empty(total, dtype=NP[dtype]))
    sync()
    if total:
        c.allreduce(x.ptr, full.ptr, total, dtype, op, stream=STREAM_PTR)
        c.synchronize(STREAM_PTR)
    f = full.get()
    check(bitwise(got, f[start:start + mine]), "%s: rows differ from the allreduce's" % what)
    same_on_all_ranks(what + " (allreduce)", f)
    every = comm.allgather(got.tobytes())
    check(b"".join(every) == f.tobytes(), "%s: the ranks' rows do not make up the allreduce" % what)
    parts = [xr[start:start + mine] for xr in xs]
    if dtype in INTS:
        want = int_reduce(parts, dtype, op)
        check(bitwise(got, want), "%s: wrong integer rows (first %s, want %s)" % (what, got[:4], want[:4]))
    else:
        float_check(got, parts, dtype, op, what)


def allreduce_small_ints(c, label, seed0):
    for i, dtype in enumerate(SMALL_INTS):
        for j, op in enumerate(OPS):
            for n in (1, 15, 16, 17, 4099, 65537 if args.quick else 1 << 21):
                seed = seed0 + 1000 * i + 100 * j + n % 97
                xs = [data(seed, r, n, dtype, op) for r in range(size)]
                x, y = Buf(xs[rank]), Buf(data(seed + 1, rank, n, dtype))
                sync()
                what = "%s allreduce %s %s n=%d" % (label, dtype, op, n)
                try:
                    c.allreduce(x.ptr, y.ptr, n, dtype, op, stream=STREAM_PTR)
                    c.synchronize(STREAM_PTR)
                except Exception as e:  # noqa: BLE001
                    check(False, "%s raised %s" % (what, e))
                    continue
                got = y.get()
                want = int_reduce(xs, dtype, op)
                check(bitwise(got, want), "%s: wrong (first %s, want %s)" % (what, got[:4], want[:4]))
                same_on_all_ranks(what, got)


GUARD = 5  # guard bytes either side of an alltoallv output


def alltoallv_cases(c, label, seed0, capacity):
    cases = [(12, 0), (1, 1), (4099, 2), (3, 3)]
    # one rank sends more than the registered buffer holds: the host-staged path
    cases.append((capacity // 3 + 1, 4))
    for row_bytes, k in cases:
        seed = seed0 + k

        def splits_of(r):
            s = np.random.default_rng([seed, r, 7]).integers(0, 4, size)
            s[(r + 1) % size] = 0  # a zero split on every rank
            if k == 4 and r == 0:
                s[:] = 1
                s[r] = 4
            return [int(v) for v in s]

        def payload(r):
            return np.random.default_rng([seed, r]).integers(1, 256, sum(splits_of(r)) * row_bytes,
                                                              dtype=np.int64).astype(np.uint8)

        mine = splits_of(rank)
        send = [v * row_bytes for v in mine]
        recv = [splits_of(s)[rank] * row_bytes for s in range(size)]
        x = Buf(payload(rank))
        out = Buf(np.full(sum(recv) + 2 * GUARD, 0xA5, dtype=np.uint8))  # with guard bytes
        sync()
        what = "%s alltoallv row_bytes=%d case %d" % (label, row_bytes, k)
        try:
            c.alltoallv(x.ptr, send, out.ptr + GUARD, recv, stream=STREAM_PTR)
            c.synchronize(STREAM_PTR)
        except Exception as e:  # noqa: BLE001
            check(False, "%s raised %s" % (what, e))
            continue
        got = out.get()
        parts = []
        for s in range(size):
            theirs = splits_of(s)
            a = sum(theirs[:rank]) * row_bytes
            parts.append(payload(s)[a:a + theirs[rank] * row_bytes])
        want = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        check(bitwise(got[GUARD:GUARD + sum(recv)], want), "%s: wrong bytes" % what)
        check(np.all(got[:GUARD] == 0xA5) and np.all(got[GUARD + sum(recv):] == 0xA5),
              "%s: wrote outside the output" % what)


def alltoallv_capture_on_one_rank(c, label):
    """Rank 0 calls alltoallv while its stream captures a CUDA graph, the others
    normally: the same InvalidArgument on every rank, in bounded time (the
    run's timeout), no rank left waiting in MPI."""
    what = "%s alltoallv with a capture on rank 0" % label
    stream = cp.cuda.Stream(non_blocking=True)
    x = Buf(np.arange(1, 4 * size + 1, dtype=np.uint8))
    out = Buf(np.zeros(4 * size, dtype=np.uint8))
    sync()  # nothing else runs on the device during the capture
    began = 0
    if rank == 0:
        try:
            mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
            stream.begin_capture(mode) if mode is not None else stream.begin_capture()
            began = 1
        except Exception as e:  # noqa: BLE001
            print("[rank 0] could not begin a capture: %s" % e, flush=True)
    if not comm.allreduce(began if rank == 0 else 1, op=MPI.MIN):
        check(False, "%s: rank 0 could not begin a capture" % what)
        return
    error = ""
    try:
        c.alltoallv(x.ptr, [4] * size, out.ptr, [4] * size, stream=stream.ptr)
    except Exception as e:  # noqa: BLE001
        error = str(e)
    finally:
        if rank == 0:
            try:
                stream.end_capture()
            except Exception as e:  # noqa: BLE001
                print("[rank 0] end_capture: %s" % e, flush=True)
    check("INVALID_ARGUMENT" in error and "capturing a CUDA graph" in error,
          "%s: expected the capture error on every rank, got %r" % (what, error))


def communicator_sections(label, group_size, seed0, pipeline_chunk=0):
    global section
    capacity = 1 << 20
    c = E.Communicator(comm.py2f(), device=DEVICE, group_size=group_size, registered_bytes=capacity,
                       pipeline_chunk=pipeline_chunk)
    h = None
    if ON_GPU:
        h = E.Communicator(comm.py2f(), device="cpu", group_size=group_size, registered_bytes=capacity,
                           pipeline_chunk=pipeline_chunk)
    owners = owner_table(c)
    t = c.topology()
    label = "%s[%dx%d]" % (label, t["group_count"], t["group_size"])
    if rank == 0:
        print("# %s: %s, %d group(s) of %d" % (label, c.device(), t["group_count"], t["group_size"]), flush=True)
    section = "reduce_scatter " + label
    k = 0
    for dtype in ALL:
        for op in OPS:
            for dim0, row in shapes():
                k += 1
                reduce_scatter_case(c, h, label, dtype, op, dim0, row, seed0 + k, in_registered=(k % 3 == 0),
                                    misaligned=(k % 2 == 1), owners=owners)
        for op in ("sum", "average"):
            if not args.quick or dtype in ("int8", "float32"):
                k += 1
                reduce_scatter_case(c, h, label, dtype, op, BIG[0], BIG[1], seed0 + k, False, k % 2 == 1, owners)
    section = "allreduce small ints " + label
    allreduce_small_ints(c, label, seed0 + 50000)
    section = "alltoallv " + label
    alltoallv_cases(c, label, seed0 + 90000, capacity)
    if ON_GPU:
        section = "alltoallv capture " + label
        alltoallv_capture_on_one_rank(c, label)
    del c, h


# ---------------------------------------------------------------- 4: engine
def gpu_result(got, what):
    """An engine check's result on DEVICE, compared bitwise with the CPU path's
    (`got` by device); None when either raised (already a failure)."""
    if DEVICE not in got or "cpu" not in got:
        return None
    if ON_GPU:
        check(bitwise(got[DEVICE], got["cpu"]), "%s: not bitwise equal to the CPU path" % what)
    return got[DEVICE]


def engine_two_groups_section():
    """4 ranks, the engine initialized as 2 NV-groups of 2 (NVGROUP_GROUP_SIZE=2):
    reducescatter and grouped_reducescatter through the hierarchical
    reduce-scatter on DEVICE and on the CPU, Sum/Average with scale factors;
    every row against the float64 / exact reference, bitwise equal to the CPU
    path's and to the engine allreduce's rows, and the cross-group bytes of
    each call exactly the reduce-scatter's."""
    global section
    probe = E.Communicator(comm.py2f(), device=DEVICE, group_size=2)
    owners = owner_table(probe)
    del probe
    os.environ["NVGROUP_GROUP_SIZE"] = "2"
    E.init(comm.py2f())
    section = "engine 2x2 reducescatter"
    devices = (DEVICE, "cpu") if ON_GPU else ("cpu",)
    cases = [(d, op, pre, post) for d in ("float32", "bfloat16", "float16", "float64", "int32", "int8") for op, pre, post
             in (("sum", 1.0, 1.0), ("average", 1.0, 1.0), ("sum", 0.5, 3.0), ("average", 3.0, 0.5))]
    for k, (dtype, op, pre, post) in enumerate(cases):
        shapes_g = [[2 * size + 1, 3], [1, 4], [size - 1, 2], [4099, 33]]
        small = dtype in INTS and (pre != 1.0 or post != 1.0)
        xs = []
        for i, sh in enumerate(shapes_g):
            n = int(np.prod(sh))
            if small:
                xs.append([np.random.default_rng([700000 + k, i, r]).integers(-20, 21, n).astype(NP[dtype])
                           for r in range(size)])
            else:
                xs.append([data(700000 + 10 * k + i, r, n, dtype) for r in range(size)])
        esize = np.dtype(NP[dtype]).itemsize
        want_sent = sum(expected_cross_bytes([rows(sh[0], r) * int(np.prod(sh[1:])) for r in range(size)], esize,
                                             owners) for sh in shapes_g)
        got = {}
        for device in devices:
            for grouped in (False, True):
                keep = [Buf(x[rank]) if device != "cpu" else x[rank].copy() for x in xs]
                sync()
                ptr = [(b.ptr if device != "cpu" else b.ctypes.data) for b in keep]
                what = "engine 2x2 %s reducescatter %s %s pre=%g post=%g on %s" % (
                    "grouped" if grouped else "plain", dtype, op, pre, post, device)
                try:
                    before = E.cross_bytes_sent()
                    if grouped:
                        hs = E.grouped_reducescatter_async(
                            [("g2x2/%s/%d/%d" % (device, k, i), ptr[i], sh, dtype, device)
                             for i, sh in enumerate(shapes_g)], op, pre, post)
                    else:
                        hs = [E.reducescatter_async("p2x2/%s/%d/%d" % (device, k, i), ptr[i], sh, dtype, op, pre,
                                                    post, device=device) for i, sh in enumerate(shapes_g)]
                    got[(device, grouped)] = [fetch_engine_output(E.wait(hh, 120), NP[dtype])[0] for hh in hs]
                    sent = E.cross_bytes_sent() - before
                    check(sent == want_sent, "%s: posted %d cross-group bytes, the reduce-scatters' are %d" % (
                        what, sent, want_sent))
                except Exception as e:  # noqa: BLE001
                    check(False, "%s raised %s" % (what, e))
        if any(key not in got for key in [(d, g) for d in devices for g in (False, True)]):
            continue
        for i, sh in enumerate(shapes_g):
            row = int(np.prod(sh[1:]))
            a = sum(rows(sh[0], r) for r in range(rank)) * row
            b = a + rows(sh[0], rank) * row
            what = "engine 2x2 reducescatter %s %s pre=%g post=%g %s" % (dtype, op, pre, post, sh)
            g = got[(DEVICE, False)][i]
            for key in got:
                check(bitwise(got[key][i], g), "%s: %s differs from plain on %s" % (what, key, DEVICE))
            x = Buf(xs[i][rank]) if ON_GPU else xs[i][rank].copy()
            y = Buf(np.zeros(int(np.prod(sh)), NP[dtype])) if ON_GPU else np.zeros(int(np.prod(sh)), NP[dtype])
            sync()
            p = (lambda m: m.ptr) if ON_GPU else (lambda m: m.ctypes.data)
            try:
                E.wait(E.allreduce_async("a2x2/%d/%d" % (k, i), p(x), p(y), sh, dtype, op, pre, post,
                                         device=DEVICE), 120)
                full = y.get() if ON_GPU else y
                check(bitwise(g, full[a:b]), "%s: rows differ from the engine allreduce's" % what)
            except Exception as e:  # noqa: BLE001
                check(False, "%s: allreduce raised %s" % (what, e))
            parts = [xr[a:b] for xr in xs[i]]
            if dtype in INTS:
                want = int_engine_reference(parts, dtype, op, pre, post)
                check(bitwise(g, want), "%s: wrong integer rows (first %s, want %s)" % (what, g[:4], want[:4]))
            else:
                float_check(g, parts, dtype, op, what, pre, post)
    E.shutdown()
    del os.environ["NVGROUP_GROUP_SIZE"]


def engine_section():
    global section
    E.init(comm.py2f())
    section = "engine reducescatter"
    cases = [(d, op, pre, post) for d in ALL for op, pre, post in
             (("sum", 1.0, 1.0), ("average", 1.0, 1.0), ("sum", 0.5, 3.0), ("average", 3.0, 0.5))]
    for k, (dtype, op, pre, post) in enumerate(cases):
        for dim0 in (1, size + 1, 4 * size + 3):
            shape = [dim0, 3, 2]
            n = int(np.prod(shape))
            seed = 200000 + 10 * k + dim0
            small = dtype in INTS and (pre != 1.0 or post != 1.0)
            xs = [data(seed, r, n, dtype) for r in range(size)]
            if small:  # scale factors on integers: values where trunc() matters but nothing saturates
                xs = [(np.random.default_rng([seed, r]).integers(-20 if dtype[0] == "i" else 0, 21, n))
                      .astype(NP[dtype]) for r in range(size)]
            a = sum(rows(dim0, r) for r in range(rank)) * 6
            b = a + rows(dim0, rank) * 6
            what = "engine reducescatter %s %s pre=%g post=%g dim0=%d" % (dtype, op, pre, post, dim0)
            got = {}
            for device in ((DEVICE, "cpu") if ON_GPU else ("cpu",)):
                x = Buf(xs[rank]) if device != "cpu" else None
                hx = xs[rank].copy()
                sync()
                try:
                    hnd = E.reducescatter_async("rs/%s/%d/%s" % (device, k, dim0), x.ptr if x else hx.ctypes.data,
                                                shape, dtype, op, pre, post, device=device)
                    got[device], oshape = fetch_engine_output(E.wait(hnd, 120), NP[dtype])
                    check(oshape == [rows(dim0, rank), 3, 2], "%s on %s: shape %s" % (what, device, oshape))
                except Exception as e:  # noqa: BLE001
                    check(False, "%s on %s raised %s" % (what, device, e))
            g = gpu_result(got, what)
            if g is None:
                continue
            parts = [x[a:b] for x in xs]
            if dtype in INTS:
                want = int_engine_reference(parts, dtype, op, pre, post)
                check(bitwise(g, want), "%s: wrong integer rows (first %s, want %s)" % (what, g[:4], want[:4]))
            else:
                float_check(g, parts, dtype, op, what, pre, post)

    section = "engine grouped_reducescatter"
    for dtype in ("float32", "int8", "bfloat16", "uint16"):
        shapes_g = [[size + k, 2 + k] for k in range(4)]
        xs = [[data(300000 + k, r, int(np.prod(s)), dtype) for r in range(size)] for k, s in enumerate(shapes_g)]
        got = {}
        for device in ((DEVICE, "cpu") if ON_GPU else ("cpu",)):
            keep = [Buf(x[rank]) if device != "cpu" else x[rank].copy() for x in xs]
            sync()
            items = [("grs/%s/%s[%d]" % (device, dtype, k), (b.ptr if device != "cpu" else b.ctypes.data),
                      shapes_g[k], dtype, device) for k, b in enumerate(keep)]
            try:
                hs = E.grouped_reducescatter_async(items, "average")
                got[device] = [fetch_engine_output(E.wait(hh, 120), NP[dtype])[0] for hh in hs]
            except Exception as e:  # noqa: BLE001
                check(False, "grouped reducescatter %s on %s raised %s" % (dtype, device, e))
        if DEVICE not in got or "cpu" not in got:
            continue
        for k, s in enumerate(shapes_g):
            row = s[1]
            a = sum(rows(s[0], r) for r in range(rank)) * row
            b = a + rows(s[0], rank) * row
            what = "grouped reducescatter %s member %d" % (dtype, k)
            g = got[DEVICE][k]
            if ON_GPU:
                check(bitwise(g, got["cpu"][k]), "%s: not bitwise equal to the CPU path" % what)
            parts = [x[a:b] for x in xs[k]]
            if dtype in INTS:
                check(bitwise(g, int_reduce(parts, dtype, "average")), "%s: wrong integer rows" % what)
            else:
                float_check(g, parts, dtype, "average", what)

    section = "engine alltoall"
    for i, dtype in enumerate(ALL):
        for k, even in enumerate((False, False, True)):
            seed = 400000 + 10 * i + k

            def splits_of(r):
                s = np.random.default_rng([seed, r, 7]).integers(0, 5, size)
                s[(r + 1) % size] = 0
                return [int(v) for v in s]

            mine = [2] * size if even else splits_of(rank)
            shape = [sum(mine), 3, 5]
            row = 15
            xs = {r: data(seed, r, (2 * size if even else sum(splits_of(r))) * row, dtype) for r in range(size)}
            what = "engine alltoall %s %s" % (dtype, "even (no splits)" if even else "splits")
            got = {}
            for device in ((DEVICE, "cpu") if ON_GPU else ("cpu",)):
                x = Buf(xs[rank]) if device != "cpu" else xs[rank].copy()
                sync()
                try:
                    hnd = E.alltoall_async("a2a/%s/%s/%d" % (device, dtype, k),
                                           x.ptr if device != "cpu" else x.ctypes.data, shape, dtype,
                                           [] if even else mine, device=device)
                    res, received = E.wait(hnd, 120)
                    got[device] = fetch_engine_output(res, NP[dtype])[0]
                    want_recv = [2] * size if even else [splits_of(s)[rank] for s in range(size)]
                    check(list(received) == want_recv, "%s on %s: received splits %s, want %s" % (
                        what, device, list(received), want_recv))
                except Exception as e:  # noqa: BLE001
                    check(False, "%s on %s raised %s" % (what, device, e))
            if DEVICE not in got:
                continue
            parts = []
            for s in range(size):
                theirs = [2] * size if even else splits_of(s)
                a = sum(theirs[:rank]) * row
                parts.append(xs[s][a:a + theirs[rank] * row])
            check(bitwise(got[DEVICE], np.concatenate(parts)), "%s: wrong rows" % what)

    section = "engine grouped_allgather"
    for dtype in ("int64", "uint8", "float16", "int16"):
        xs = [[data(500000 + k, r, (r + k + 1) * 2, dtype) for r in range(size)] for k in range(3)]
        for device in ((DEVICE,) if ON_GPU else ("cpu",)):
            keep = [Buf(x[rank]) if device != "cpu" else x[rank].copy() for x in xs]
            sync()
            items = [("gag/%s/%s[%d]" % (device, dtype, k), (b.ptr if device != "cpu" else b.ctypes.data),
                      [rank + k + 1, 2], dtype, device) for k, b in enumerate(keep)]
            try:
                hs = E.grouped_allgather_async(items)
                for k, hh in enumerate(hs):
                    g, oshape = fetch_engine_output(E.wait(hh, 120), NP[dtype])
                    want = np.concatenate(xs[k])
                    check(bitwise(g, want) and oshape == [sum(r + k + 1 for r in range(size)), 2],
                          "grouped allgather %s member %d: wrong rows" % (dtype, k))
            except Exception as e:  # noqa: BLE001
                check(False, "grouped allgather %s raised %s" % (dtype, e))

    section = "engine allreduce small ints"
    for i, dtype in enumerate(SMALL_INTS):
        for op, pre, post in (("sum", 1.0, 1.0), ("product", 1.0, 1.0), ("min", 1.0, 1.0), ("max", 1.0, 1.0),
                              ("average", 1.0, 1.0), ("sum", 3.0, 0.5), ("average", 0.5, 3.0)):
            n = 4099
            seed = 600000 + 100 * i + int(pre * 4) + int(post * 4) + OPS.index(op)
            if pre != 1.0 or post != 1.0:
                xs = [(np.random.default_rng([seed, r]).integers(-20 if dtype[0] == "i" else 0, 21, n))
                      .astype(NP[dtype]) for r in range(size)]
            else:
                xs = [data(seed, r, n, dtype, op) for r in range(size)]
            what = "engine allreduce %s %s pre=%g post=%g" % (dtype, op, pre, post)
            got = {}
            for device in ((DEVICE, "cpu") if ON_GPU else ("cpu",)):
                x = Buf(xs[rank]) if device != "cpu" else xs[rank].copy()
                fill = data(seed + 5, rank, n, dtype)  # a sentinel, overwritten by the result
                y = Buf(fill) if device != "cpu" else fill.copy()
                sync()
                p = (lambda b: b.ptr) if device != "cpu" else (lambda b: b.ctypes.data)
                try:
                    E.wait(E.allreduce_async("ar/%s/%s/%s/%g/%g" % (device, dtype, op, pre, post), p(x), p(y), [n],
                                             dtype, op, pre, post, device=device), 120)
                    got[device] = y.get() if device != "cpu" else y
                except Exception as e:  # noqa: BLE001
                    check(False, "%s on %s raised %s" % (what, device, e))
            g = gpu_result(got, what)
            if g is None:
                continue
            want = int_engine_reference(xs, dtype, op, pre, post)
            check(bitwise(g, want), "%s: wrong (first %s, want %s)" % (what, g[:4], want[:4]))
            same_on_all_ranks(what, g)
    E.shutdown()


# ---------------------------------------------------------------- main
try:
    communicator_sections("default", 0, 10000)
    # several groups: a 256 KiB pipeline chunk, so the hierarchical reduce-scatter
    # cuts each 1 MiB piece into several pipelined chunks
    communicator_sections("groups-of-1", 1, 20000, pipeline_chunk=1 << 18)
    if size == 4:
        communicator_sections("2x2", 2, 30000, pipeline_chunk=1 << 18)
        engine_two_groups_section()
    engine_section()
except Exception:  # noqa: BLE001 -- an unexpected error: report it and end the job (no hang)
    print("[rank %d] FAIL crash: %s" % (rank, traceback.format_exc()), flush=True)
    print("# new_collectives_check np=%d device=%s: FAILED (rank %d crashed after %d checks)" % (
        size, args.device, rank, checks), flush=True)
    comm.Abort(1)

totals = comm.gather((checks, len(failures), section_counts), root=0)
if rank == 0:
    n_checks = sum(t[0] for t in totals)
    n_fail = sum(t[1] for t in totals)
    per = {}
    for _, _, sc in totals:
        for k, (c_, f_) in sc.items():
            per.setdefault(k, [0, 0])
            per[k][0] += c_
            per[k][1] += f_
    for k, (c_, f_) in per.items():
        print("#   %-44s %6d checks %5d failures" % (k, c_, f_), flush=True)
    print("# new_collectives_check np=%d device=%s: %s (%d checks, %d failures)" % (
        size, args.device, "PASSED" if n_fail == 0 else "FAILED", n_checks, n_fail), flush=True)
comm.Barrier()
sys.exit(0 if comm.allreduce(len(failures)) == 0 else 1)
