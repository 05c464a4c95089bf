"""Chapter 16's trace reader: it sorts a profiler trace's events into compute and communication and computes
their overlap correctly (synthetic traces with known intervals), and it finds both in real 2-rank traces."""

import json

import pytest

from scalebook.comm import launch
from scalebook.experiments import profiling


def _event(name, ts_ms, dur_ms, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3}


def _write(tmp_path, events, rank=0, world_size=2):
    path = tmp_path / f"rank{rank}.json"
    trace = {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world_size}, "traceEvents": events}
    path.write_text(json.dumps(trace))
    return path


def test_merged_intervals_and_their_intersection():
    assert profiling.merge_intervals([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    # [0, 2] and [3, 4] against [1, 3.5]: 1 + 0.5
    assert profiling.intersection_length([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)
    assert profiling.intersection_length([(0, 1)], [(1, 2)]) == 0.0


def test_overlap_of_a_synthetic_trace_with_known_intervals(tmp_path):
    events = [
        _event("DistributedDataParallel.forward", 0, 10, cat="user_annotation"),  # a label, not work
        _event("aten::mm", 0, 10),  # forward: 0-10 ms
        _event("autograd::engine::evaluate_function: MmBackward0", 20, 10),  # backward: 20-30 ms
        _event("aten::mm", 22, 5),  # nested inside the backward event: counted once
        _event("gloo:all_reduce", 5, 20, tid=2, cat="user_annotation"),  # worker thread: 5-25 ms
        _event("c10d::send", 40, 4),  # a blocking send on the compute thread: 40-44 ms
        _event("aten::copy_", 41, 1),  # packing the message: part of the send, not compute
        {"ph": "i", "name": "instant", "ts": 0, "pid": 7, "tid": 1},  # not a complete event
    ]
    trace = profiling.read_chrome_trace(_write(tmp_path, events, rank=1))
    assert (trace.rank, trace.world_size) == (1, 2)
    assert [e.kind for e in trace.events] == ["compute", "communication", "backward", "compute", "communication"]
    overlap = profiling.communication_overlap(trace)
    assert overlap.compute == pytest.approx(0.020)  # 0-10 and 20-30 ms
    assert overlap.communication == pytest.approx(0.024)  # 5-25 and 40-44 ms
    assert overlap.overlapped == pytest.approx(0.010)  # 5-10 and 20-25 ms
    assert overlap.exposed == pytest.approx(0.014)
    assert overlap.hidden_share == pytest.approx(10 / 24)
    assert overlap.span == pytest.approx(0.044)
    assert trace.threads("communication") == {1, 2} and trace.threads("compute", "backward") == {1}


def test_a_gpu_trace_counts_kernels_not_their_launches(tmp_path):
    events = [
        _event("aten::mm", 0, 1),  # the CPU launches ...
        _event("nccl:all_reduce", 1, 1),
        _event("sm90_xmma_gemm_bf16", 1, 10, tid=7, cat="kernel"),  # ... and the GPU computes: 1-11 ms
        _event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 6, 10, tid=8, cat="kernel"),  # 6-16 ms
    ]
    overlap = profiling.communication_overlap(profiling.read_chrome_trace(_write(tmp_path, events)))
    assert (overlap.compute, overlap.communication, overlap.overlapped) == pytest.approx((0.010, 0.010, 0.005))


def test_an_empty_trace_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no events"):
        profiling.communication_overlap(profiling.read_chrome_trace(_write(tmp_path, [])))


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """One launch on 2 ranks profiles a data-parallel and a pipeline step; their traces, read back."""
    trace_dir = tmp_path_factory.mktemp("traces")
    ranks = launch(profiling.profile_steps, 2, str(trace_dir), timeout=120)
    return {
        setup: [(info[setup], profiling.read_chrome_trace(info[setup]["path"])) for info in ranks]
        for setup in ("ddp", "pipeline")
    }


def test_a_data_parallel_trace_holds_one_all_reduce_per_bucket_beside_the_backward(traces):
    for rank, (expected, trace) in enumerate(traces["ddp"]):
        assert trace.rank == rank and trace.world_size == 2
        assert len(trace.named("gloo:all_reduce")) == expected["all_reduces"] > 1
        assert trace.named("autograd::engine::evaluate_function") and trace.named("aten::")
        # gloo runs the collectives on worker threads of its own, not on the thread that computes.
        compute_threads = trace.threads("compute", "backward")
        assert len(compute_threads) == 1
        assert {e.thread for e in trace.named("gloo:all_reduce")}.isdisjoint(compute_threads)
        overlap = profiling.communication_overlap(trace)
        assert 0 < overlap.overlapped <= min(overlap.communication, overlap.compute) <= overlap.span


def test_a_pipeline_trace_holds_the_planned_sends_and_receives_and_waits_for_them(traces):
    for expected, trace in traces["pipeline"]:
        assert len(trace.named("gloo:send")) == expected["sends"] == 4  # 1F1B on 2 stages, 4 micro-batches
        assert len(trace.named("gloo:recv")) == expected["receives"] == 4
        compute_threads = trace.threads("compute", "backward")
        assert {e.thread for e in trace.named("gloo:send") + trace.named("gloo:recv")} == compute_threads
        # The runtime waits for each batch of transfers before it computes again: nothing to hide behind.
        assert profiling.communication_overlap(trace).hidden_share < 0.05


def test_the_ranks_traces_share_one_clock(traces):
    # Both ranks met at a barrier just before the profiled step: their first events lie close together.
    starts = [min(e.start for e in trace.events) for _, trace in traces["ddp"]]
    assert abs(starts[0] - starts[1]) < 1.0
