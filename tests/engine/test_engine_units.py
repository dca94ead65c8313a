"""Unit tests of the engine's pure parts through nvgroup_tf._engine.testing:
the negotiation wire format, the fusion planner and the response builder
(mismatch messages). No MPI."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from nvgroup_tf import _engine

T = _engine.testing

# Enum values from cc/include/nvgroup/types.h (fixed by contract).
ALLREDUCE, ALLGATHER, BROADCAST = 0, 1, 2
UINT8, INT8, BOOL, F16, BF16, F32, F64, I32, I64 = range(9)
SUM, AVG, MIN, MAX, PROD = range(5)
CPU, CUDA = 0, 1
OK, FAILED_PRECONDITION = 0, 2
ELEMENT_SIZE = {UINT8: 1, INT8: 1, BOOL: 1, F16: 2, BF16: 2, F32: 4, F64: 8, I32: 4, I64: 8}


def request(name="t", type=ALLREDUCE, dtype=F32, device_kind=CPU, op=SUM, prescale=1.0,
            postscale=1.0, root=0, shape=(2, 3), group_id=0, group_size=0, splits=(), refused_duplicate=""):
    return dict(name=name, type=type, dtype=dtype, device_kind=device_kind, op=op,
                prescale=prescale, postscale=postscale, root=root, shape=list(shape),
                group_id=group_id, group_size=group_size, splits=list(splits),
                refused_duplicate=refused_duplicate)


def response(name="t", error_code=OK, error_message="", first_dims=(), **kw):
    d = request(name=name, **kw)
    d.pop("splits")  # requests only
    d.pop("refused_duplicate")
    d.update(error_code=error_code, error_message=error_message, first_dims=list(first_dims))
    return d


def random_request(rng):
    return request(
        name="".join(rng.choice("abcxyz/_:0123456789\u00e9") for _ in range(rng.randint(0, 40))),
        type=rng.randint(0, 5), dtype=rng.randint(0, 10), device_kind=rng.randint(0, 1),
        op=rng.randint(0, 4), prescale=rng.uniform(-4, 4), postscale=rng.choice([1.0, 0.25, -1e300]),
        root=rng.randint(-2**31, 2**31 - 1),
        shape=[rng.randint(-2**63, 2**63 - 1) for _ in range(rng.randint(0, 5))],
        group_id=rng.randint(0, 2**64 - 1), group_size=rng.randint(0, 2**32 - 1),
        splits=[rng.randint(-2**63, 2**63 - 1) for _ in range(rng.randint(0, 4))],
        refused_duplicate=rng.choice(["", "x", "grad/w\u00e9"]))


def random_response(rng):
    d = random_request(rng)
    d.pop("splits")  # requests only
    d.pop("refused_duplicate")
    d.update(error_code=rng.randint(0, 7), error_message="x" * rng.randint(0, 100),
             first_dims=[rng.randint(0, 1000) for _ in range(rng.randint(0, 6))])
    return d


# --- wire format -------------------------------------------------------------

def test_request_list_round_trip():
    rng = random.Random(1)
    for n in (0, 1, 7, 200):
        reqs = [random_request(rng) for _ in range(n)]
        assert T.decode_request_list(T.encode_request_list(reqs)) == reqs


def test_response_list_round_trip():
    rng = random.Random(2)
    for n in (0, 1, 9, 100):
        resps = [random_response(rng) for _ in range(n)]
        code, message, decoded = T.decode_response_list(T.encode_response_list(resps, 6, "fatal!"))
        assert (code, message, decoded) == (6, "fatal!", resps)


def assert_malformed(decode, data):
    with pytest.raises(_engine.EngineError, match="INTERNAL: malformed negotiation message"):
        decode(data)


def test_every_truncation_is_an_error():
    rng = random.Random(3)
    for encode, decode, make in (
            (T.encode_request_list, T.decode_request_list, random_request),
            (T.encode_response_list, T.decode_response_list, random_response)):
        data = encode([make(rng) for _ in range(3)])
        for cut in range(len(data)):
            assert_malformed(decode, data[:cut])
        assert_malformed(decode, data + b"\0")  # trailing bytes


def test_bad_header_enum_and_huge_counts():
    good = T.encode_request_list([request()])
    assert_malformed(T.decode_request_list, b"XXXX" + good[4:])              # magic
    assert_malformed(T.decode_request_list, good[:4] + b"\x09" + good[5:])   # version
    assert_malformed(T.decode_response_list, good)                           # kind
    # count field claiming 2^32-1 requests in a short message: rejected before allocating
    assert_malformed(T.decode_request_list, good[:6] + b"\xff\xff\xff\xff" + good[10:])
    # dtype byte out of range (offset: header 6 + count 4 + name length 4 + "t" 1 + type 1)
    bad = bytearray(good)
    bad[6 + 4 + 4 + 1 + 1] = 77
    with pytest.raises(_engine.EngineError, match="dtype value 77 out of range"):
        T.decode_request_list(bytes(bad))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2**31), st.integers(0, 255))
def test_garbled_bytes_never_crash(noise, position, value):
    rng = random.Random(position)
    for encode, decode, make in (
            (T.encode_request_list, T.decode_request_list, random_request),
            (T.encode_response_list, T.decode_response_list, random_response)):
        for data in (noise, bytearray(encode([make(rng) for _ in range(2)]))):
            data = bytearray(data)
            if data:
                data[position % len(data)] = value
            try:
                decode(bytes(data))
            except _engine.EngineError as e:
                assert "malformed negotiation message" in str(e)


# --- fusion planner ----------------------------------------------------------

def nbytes(r):
    n = 1
    for d in r["shape"]:
        n *= d
    return n * ELEMENT_SIZE[r["dtype"]]


def check_plan(responses, threshold, plan):
    placed = sorted(i for b in plan for i in b["responses"])
    assert placed == list(range(len(responses)))          # every response exactly once
    firsts = [b["responses"][0] for b in plan]
    assert firsts == sorted(firsts)                       # buckets in order of first response
    for b in plan:
        rs = [responses[i] for i in b["responses"]]
        if len(rs) > 1:
            keys = {(r["dtype"], r["op"], r["prescale"], r["postscale"], r["device_kind"]) for r in rs}
            assert len(keys) == 1 and all(r["type"] == ALLREDUCE and r["error_code"] == OK for r in rs)
            assert b["bytes"] <= threshold
        assert b["responses"] == sorted(b["responses"])
        end = 0
        for i, off in zip(b["responses"], b["offsets"]):
            assert off % 16 == 0 and off >= end           # 16-byte aligned, no overlap
            end = off + nbytes(responses[i])
        assert b["bytes"] == end


def test_plan_fusion_packs_compatible_tensors_in_order():
    rs = [response("a", shape=[10]), response("b", dtype=F64, shape=[3]), response("c", shape=[5]),
          response("d", op=MAX, shape=[1]), response("e", shape=[1])]
    plan = T.plan_fusion(rs, 1 << 20)
    assert [b["responses"] for b in plan] == [[0, 2, 4], [1], [3]]
    assert plan[0]["offsets"] == [0, 48, 80]     # 40 B -> pad to 48; 20 B -> pad to 80
    assert plan[0]["bytes"] == 84
    check_plan(rs, 1 << 20, plan)


def test_plan_fusion_threshold_zero_and_large_tensors():
    rs = [response(str(i), shape=[100]) for i in range(4)]
    assert [b["responses"] for b in T.plan_fusion(rs, 0)] == [[0], [1], [2], [3]]
    assert [b["responses"] for b in T.plan_fusion(rs, 800)] == [[0, 1], [2, 3]]
    big = [response("big", shape=[1000]), response("s", shape=[1])]
    assert [b["responses"] for b in T.plan_fusion(big, 100)] == [[0], [1]]


def test_plan_fusion_keeps_errors_allgather_broadcast_alone():
    rs = [response("a", shape=[4]), response("x", error_code=FAILED_PRECONDITION, error_message="m"),
          response("g", type=ALLGATHER, shape=[2], first_dims=[2, 2]),
          response("b", type=BROADCAST, shape=[4]), response("c", shape=[4])]
    plan = T.plan_fusion(rs, 1 << 20)
    assert [b["responses"] for b in plan] == [[0, 4], [1], [2], [3]]
    assert [b["fusable"] for b in plan] == [True, False, False, False]


def test_plan_fusion_random_is_valid_and_deterministic():
    rng = random.Random(5)
    for _ in range(50):
        rs = [response(str(i), dtype=rng.choice([F16, F32, F64, I32]), op=rng.choice([SUM, AVG]),
                       type=rng.choice([ALLREDUCE] * 5 + [BROADCAST]),
                       shape=[rng.randint(0, 300)]) for i in range(rng.randint(1, 60))]
        threshold = rng.choice([0, 64, 1000, 4096, 1 << 20])
        plan = T.plan_fusion(rs, threshold)
        check_plan(rs, threshold, plan)
        assert plan == T.plan_fusion(rs, threshold)


# --- response builder (rank 0's validation) ------------------------------------

def test_build_response_agrees_and_collects_first_dims():
    r = T.build_response([request(type=ALLGATHER, shape=[r + 1, 3]) for r in range(3)])
    assert r["error_code"] == OK and r["first_dims"] == [1, 2, 3]


@pytest.mark.parametrize("field,values,text", [
    ("shape", [[2, 3], [3, 3]], "Mismatched allreduce tensor shapes for 't': rank 0 has [2, 3], rank 1 has [3, 3]"),
    ("dtype", [F32, F64], "Mismatched allreduce dtypes for 't': rank 0 has float32, rank 1 has float64"),
    ("op", [SUM, MAX], "Mismatched allreduce ops for 't': rank 0 has Sum, rank 1 has Max"),
    ("type", [ALLREDUCE, BROADCAST], "Mismatched collective types for 't': rank 0 has allreduce, rank 1 has broadcast"),
    ("prescale", [1.0, 0.5], "Mismatched allreduce prescale factors for 't': rank 0 has 1, rank 1 has 0.5"),
])
def test_build_response_mismatch_messages(field, values, text):
    r = T.build_response([request(**{field: v}) for v in values])
    assert r["error_code"] == FAILED_PRECONDITION and r["error_message"] == text


def test_build_response_groups_ranks_by_value():
    r = T.build_response([request(type=BROADCAST, root=v) for v in (0, 1, 0, 1, 1)])
    assert r["error_message"] == ("Mismatched broadcast root ranks for 't': ranks [0, 2] have 0, "
                                  "ranks [1, 3, 4] have 1")
    r = T.build_response([request(type=ALLGATHER, shape=s) for s in ([1, 2], [5, 2], [1, 3])])
    assert "rank 2 has [?, 3]" in r["error_message"]


# --- coordinator (rank 0's table, groups, stalls) -------------------------------

def coordinate(size, script, warning=0.0, shutdown=0.0):
    return [[(r["name"], r["error_code"]) for r in batch]
            for batch in T.run_coordinator(size, warning, shutdown, script)]


def test_coordinator_releases_in_completion_order_once_all_ranks_report():
    out = coordinate(3, [
        ("add", 0, request("a"), 0.0), ("add", 0, request("b"), 0.0), ("add", 1, request("b"), 0.0),
        ("take",),
        ("add", 2, request("b"), 0.0), ("add", 1, request("a"), 0.0), ("add", 2, request("a"), 0.0),
        ("take",), ("take",)])
    assert out == [[], [("b", OK), ("a", OK)], []]


def test_coordinator_holds_group_members_until_the_whole_group_completes():
    g = dict(group_id=42, group_size=3)
    out = coordinate(2, [
        ("add", 0, request("g1", **g), 0.0), ("add", 1, request("g1", **g), 0.0),
        ("add", 0, request("solo"), 0.0), ("add", 1, request("solo"), 0.0),
        ("add", 0, request("g2", **g), 0.0), ("add", 1, request("g2", **g), 0.0),
        ("take",),
        ("add", 0, request("g3", **g), 0.0), ("add", 1, request("g3", shape=[9], **g), 0.0),
        ("take",)])
    # g3 mismatches: its error goes out and completes the group, releasing g1, g2 together.
    assert out == [[("solo", OK)], [("g3", FAILED_PRECONDITION), ("g1", OK), ("g2", OK)]]



@pytest.mark.parametrize("rank0_first", [True, False])
def test_coordinator_fails_every_member_of_groups_that_differ_across_ranks(rank0_first):
    """Rank 0 groups g[0], g[1]; rank 1 groups g[0], g[1], g[2]: every member
    fails at once (g[2], which rank 0 never submits, too), and the table is
    clean afterwards (a later grouped collective of those names runs)."""
    g0, g1 = dict(group_id=11, group_size=2), dict(group_id=12, group_size=3)
    rank0 = [("add", 0, request("g[%d]" % i, **g0), 0.0) for i in range(2)]
    rank1 = [("add", 1, request("g[%d]" % i, **g1), 0.0) for i in range(3)]
    g = dict(group_id=13, group_size=3)
    again = [("add", rank, request("g[%d]" % i, **g), 1.0) for rank in (0, 1) for i in range(3)]
    result = T.run_coordinator(2, 0.0, 0.0, (rank0 + rank1 if rank0_first else rank1 + rank0) + [("take",)]
                               + again + [("take",)])
    failed = {}
    for r in result[0]:
        failed.setdefault(r["name"], []).append(r)
    assert set(failed) == {"g[0]", "g[1]", "g[2]"}, result
    assert all(r["error_code"] == FAILED_PRECONDITION for rs in failed.values() for r in rs), result
    assert "Mismatched allreduce groups for 'g[" in failed["g[2]"][0]["error_message"], failed["g[2]"]
    # Nothing is held any more: the same names grouped alike on both ranks run.
    assert [(r["name"], r["error_code"]) for r in result[1]] == [("g[0]", OK), ("g[1]", OK), ("g[2]", OK)]

def test_coordinator_forget_drops_a_partial_report():
    out = coordinate(2, [
        ("add", 0, request("x"), 0.0), ("forget", "x"),
        ("add", 1, request("x"), 0.0), ("take",),
        ("add", 0, request("x"), 0.0), ("take",)])
    assert out == [[], [("x", OK)]]


def test_coordinator_stall_shutdown_fails_the_stalled_name_and_its_group():
    DEADLINE_EXCEEDED = 5
    g = dict(group_id=7, group_size=2)
    result = T.run_coordinator(3, 1.0, 2.0, [
        ("add", 0, request("late"), 10.0), ("add", 2, request("late"), 10.5),
        ("add", 0, request("m1", **g), 10.0), ("add", 1, request("m1", **g), 10.0), ("add", 2, request("m1", **g), 10.0),
        ("add", 0, request("m2", **g), 10.0),
        ("stalls", 11.9), ("stalls", 12.1), ("take",)])
    assert result[0] == [] and result[2] == []
    failed = {r["name"]: r for r in result[1]}
    assert set(failed) == {"late", "m1", "m2"}
    assert all(r["error_code"] == DEADLINE_EXCEEDED for r in failed.values())
    assert failed["late"]["error_message"].startswith(
        "Stalled ranks: tensor 'late' is ready on ranks [0, 2] but missing on [1] for 2 s")
    assert "member of a group with stalled tensor" in failed["m1"]["error_message"]


def refusal(name, in_flight=None):
    """A rank's refusal of its collective `name` (Note [Refused duplicates])."""
    return request(name, refused_duplicate=name if in_flight is None else in_flight)


INVALID_ARGUMENT = 1


def test_coordinator_matches_a_refusal_like_a_request_and_fails_the_name():
    """Rank 0 refused 'n' (and its group mate 'm'); the other ranks' 'n' and 'm'
    fail with the refusing rank's text once every rank reported or refused, and
    the name runs again afterwards."""
    result = T.run_coordinator(3, 0.0, 0.0, [
        ("add", 0, refusal("n"), 0.0), ("add", 0, refusal("m", "n"), 0.0),
        ("add", 1, request("n", type=ALLGATHER), 0.0), ("take",),
        ("add", 2, refusal("n"), 0.0), ("add", 1, request("m"), 0.0), ("add", 2, request("m"), 0.0),
        ("take",),
        ("add", 0, request("n"), 1.0), ("add", 1, request("n"), 1.0), ("add", 2, request("n"), 1.0),
        ("take",)])
    assert result[0] == []  # rank 2 has not reported 'n' yet
    assert [(r["name"], r["error_code"]) for r in result[1]] == [("n", INVALID_ARGUMENT), ("m", INVALID_ARGUMENT)]
    assert result[1][0]["error_message"] == (
        "duplicate name: a collective named 'n' was submitted on ranks [0, 2] while another collective named "
        "'n' was in flight there; it fails on every rank. Names must be unique until the previous request "
        "completes")
    assert result[1][1]["error_message"].startswith(
        "duplicate name: 'm', in a group with a collective named 'n', was submitted on rank 0 ")
    assert [(r["name"], r["error_code"]) for r in result[2]] == [("n", OK)]


def test_coordinator_stall_inspector_names_an_unmatched_refusal():
    DEADLINE_EXCEEDED = 5
    result = T.run_coordinator(2, 1.0, 2.0, [("add", 1, refusal("lone"), 10.0), ("stalls", 12.1), ("take",)])
    assert [(r["name"], r["error_code"]) for r in result[0]] == [("lone", DEADLINE_EXCEEDED)]
    assert result[1] == []


# --- join (Coordinator) ---------------------------------------------------------

REDUCESCATTER, ALLTOALL, JOIN = 3, 4, 5


def test_coordinator_join_counts_joined_ranks_in():
    """Rank 2 joins: names the others submit complete without it (allreduce,
    reducescatter), other collectives and CUDA tensors become errors naming the
    joined ranks; a name pending before the join completes at the join; the join
    answers once everyone joined with the last rank to join, then the state resets."""
    join = request(name="nvgroup.join", type=JOIN, shape=())
    out = T.run_coordinator(3, 0.0, 0.0, [
        ("add", 0, request(name="early"), 0.0),
        ("add", 1, request(name="early"), 0.0),
        ("take",),                                   # early waits for rank 2
        ("add", 2, join, 0.1),
        ("take",),                                   # early completes at the join
        ("add", 0, request(name="x"), 0.2),
        ("add", 1, request(name="x"), 0.2),
        ("add", 0, request(name="rs", type=REDUCESCATTER), 0.2),
        ("add", 1, request(name="rs", type=REDUCESCATTER), 0.2),
        ("add", 0, request(name="g", type=ALLGATHER), 0.2),
        ("add", 1, request(name="g", type=ALLGATHER), 0.2),
        ("add", 0, request(name="cuda", device_kind=CUDA), 0.2),
        ("add", 1, request(name="cuda", device_kind=CUDA), 0.2),
        ("take",),
        ("add", 1, join, 0.3),
        ("add", 0, join, 0.4),
        ("take",),                                   # everyone joined: rank 0 was last
        ("add", 0, request(name="y"), 0.5),
        ("take",),                                   # no longer joined: y waits
    ])
    assert out[0] == []
    assert [(r["name"], r["error_code"]) for r in out[1]] == [("early", OK)]
    by_name = {r["name"]: r for r in out[2]}
    assert by_name["x"]["error_code"] == OK and by_name["rs"]["error_code"] == OK
    for name in ("g", "cuda"):
        assert by_name[name]["error_code"] == FAILED_PRECONDITION
        assert "ranks [2] have joined" in by_name[name]["error_message"], by_name[name]
    assert [(r["name"], r["type"], r["root"]) for r in out[3]] == [("nvgroup.join", JOIN, 0)]
    assert out[4] == []


def test_build_response_alltoall_splits_matrix():
    by_rank = [request(type=ALLTOALL, shape=(3, 2), splits=(1, 2)), request(type=ALLTOALL, shape=(4, 2), splits=(4, 0))]
    r = T.build_response(by_rank)
    assert r["error_code"] == OK and r["first_dims"] == [1, 2, 4, 0]
    bad = T.build_response([request(type=ALLTOALL, shape=(3, 2), splits=(1, 2)),
                            request(type=ALLTOALL, shape=(3, 5), splits=(1, 2))])
    assert bad["error_code"] == FAILED_PRECONDITION and "all but the first dimension" in bad["error_message"]


def test_init_fault_hook_refuses_an_unknown_phase_or_kind():
    """The hook fires at a named phase of init(); a phase init() never enters
    (or a misspelled one) would make a fault test pass without any fault."""
    with pytest.raises(Exception, match="unknown phase 'knob'"):
        _engine.testing.fault_in_init("knob", "stop")
    with pytest.raises(Exception, match="kind must be stop or kill"):
        _engine.testing.fault_in_init("knobs", "freeze")
