"""``dracap simulate`` and ``dracap plan``: the simulator's accounting, each mode's rules,
traces, the capacity math and the commands' output and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import cli
from services.planning.capacity import plan_capacity
from services.planning.fleets import Fleet, Mode, parse_mode
from services.planning.simulating import Options, devices_needed, simulate
from services.planning.traces import (
    SyntheticSpec,
    TraceClaim,
    TraceError,
    load_trace,
    parse_sizes,
    parse_trace,
    rate_for_load,
    synthetic,
    write_trace,
)
from services.reservation.allocating import Allocator
from services.reservation.outcomes import Allocated, Unschedulable

GI = 1024**3
SIZES = parse_sizes("4Gi:30,8Gi:25,10Gi:15,16Gi:15,20Gi:10,40Gi:5")
MODES = ["consumable", "whole-device", "fixed-slices:10Gi", "fixed-slices:20Gi"]
POLICIES = ["first-fit", "binpack", "spread", "fragmentation-aware"]


def _churn(claims: int = 1500, devices: int = 10, seed: int = 3) -> list[TraceClaim]:
    rate = rate_for_load(1.3, devices * 40 * GI, SIZES, 600.0)
    return synthetic(SyntheticSpec(claims, SIZES, rate, 600.0, seed))


def _fleets(devices: int = 10) -> list[Fleet]:
    fleets = []
    for mode in MODES:
        for policy in POLICIES if mode == "consumable" else ["first-fit"]:
            fleets.append(Fleet(devices, 40 * GI, parse_mode(mode), policy))
    return fleets


# --- accounting -------------------------------------------------------------------------


@pytest.mark.parametrize("fleet", _fleets(), ids=lambda f: f.label)
@pytest.mark.parametrize("max_wait", [None, 0.0, 120.0])
def test_accounting_on_a_synthetic_trace(fleet: Fleet, max_wait: float | None) -> None:
    trace = _churn()
    result = simulate(trace, fleet, Options(max_wait=max_wait, samples=50))
    # every claim is served, rejected or waiting at the end
    assert result.served + result.rejected + result.waiting == result.claims == len(trace)
    assert result.waiting == 0  # claims leave, so the queue drains or times out
    if max_wait == 0:
        assert result.waited == 0
        assert result.rejected == result.refused_on_arrival + result.too_large
    # the allocated ratio is never above 1, nor above what was taken
    assert result.series
    for sample in result.series:
        assert 0 <= sample.allocated <= sample.consumed <= 1
    assert 0 <= result.peak_allocated <= result.peak_consumed <= 1
    assert 0 <= result.allocated_mean <= 1
    for value in (result.allocated_at_first_refusal, result.allocated_saturated):
        assert value is None or 0 <= value <= 1
    assert 0 <= result.stranded_mean <= 1
    if result.queue_p50_s is not None:
        assert result.queue_p99_s is not None
        assert 0 < result.queue_p50_s <= result.queue_p99_s
        assert max_wait is None or result.queue_p99_s <= max_wait


def test_claims_that_never_leave_stay_waiting_at_the_end() -> None:
    trace = [TraceClaim(float(i), 30 * GI, None, f"c{i}") for i in range(5)]
    result = simulate(trace, Fleet(2, 40 * GI, Mode("consumable")))
    assert (result.served, result.rejected, result.waiting) == (2, 0, 3)
    assert result.allocated_at_first_refusal == pytest.approx(60 / 80)
    assert result.stranded_at_first_refusal == pytest.approx(20 / 80)  # 10Gi + 10Gi < 30Gi


def test_a_claim_larger_than_a_device_is_rejected_not_refused() -> None:
    trace = [TraceClaim(0.0, 41 * GI, 10.0, "big"), TraceClaim(1.0, 1 * GI, 10.0, "small")]
    for mode in ("consumable", "whole-device", "fixed-slices:10Gi"):
        result = simulate(trace, Fleet(1, 40 * GI, parse_mode(mode)))
        assert (result.rejected, result.too_large, result.refused_on_arrival) == (1, 1, 0)
        assert result.served == 1


def test_a_waiting_claim_is_served_when_capacity_comes_back() -> None:
    trace = [TraceClaim(0.0, 30 * GI, 100.0, "a"), TraceClaim(10.0, 20 * GI, 50.0, "b")]
    result = simulate(trace, Fleet(1, 40 * GI, Mode("consumable")))
    assert result.served == 2
    assert result.queue_p50_s == pytest.approx(90.0)  # b waited from 10 to 100


# --- what each mode may do ----------------------------------------------------------------


def _decide_until_full(fleet: Fleet, size: int) -> list[Allocated]:
    alloc = Allocator(fleet.inventory())
    claim = fleet.claim(size)
    held = []
    while True:
        out = alloc.allocate(claim)
        if isinstance(out, Unschedulable):
            return held
        assert isinstance(out, Allocated), out
        alloc.commit(out)
        held.append(out)


def test_whole_device_never_shares() -> None:
    fleet = Fleet(4, 40 * GI, Mode("whole-device"))
    held = _decide_until_full(fleet, 1 * GI)
    devices = [g.device for out in held for g in out.grants]
    assert len(devices) == len(set(devices)) == 4
    # and through the simulation: tiny claims that never leave, one per device
    trace = [TraceClaim(float(i), GI, None, f"c{i}") for i in range(10)]
    result = simulate(trace, fleet)
    assert (result.served, result.waiting) == (4, 6)
    assert result.consumed_at_first_refusal == 1.0
    assert result.allocated_at_first_refusal == pytest.approx(4 / 160)


@pytest.mark.parametrize(("slice_gi", "slices"), [(10, 4), (15, 2), (40, 1)])
def test_fixed_slices_never_allocate_a_partial_slice(slice_gi: int, slices: int) -> None:
    fleet = Fleet(3, 40 * GI, Mode("fixed-slices", slice_gi * GI))
    held = _decide_until_full(fleet, 1 * GI)
    grants = [g for out in held for g in out.grants]
    assert len(held) == 3 * slices  # every slice once, whole: never two claims on one
    assert all(len(out.grants) == 1 for out in held)
    assert all(g.share_id is None and not g.consumed for g in grants)  # dedicated
    assert len({g.device for g in grants}) == len(grants)
    capacities = {
        fleet.inventory().devices[i].capacities["memory"].total.value() for i in range(3 * slices)
    }
    assert capacities == {slice_gi * GI}
    # a claim one byte larger than a slice fits nothing
    assert fleet.need(slice_gi * GI + 1) == 0
    trace = [TraceClaim(float(i), 3 * GI, None, f"c{i}") for i in range(20)]
    result = simulate(trace, fleet)
    assert result.served == 3 * slices
    assert result.peak_consumed == pytest.approx(3 * slices * slice_gi / 120)


def test_consumable_packs_what_whole_devices_cannot() -> None:
    trace = [TraceClaim(float(i), 10 * GI, None, f"c{i}") for i in range(20)]
    shared = simulate(trace, Fleet(4, 40 * GI, Mode("consumable")))
    whole = simulate(trace, Fleet(4, 40 * GI, Mode("whole-device")))
    assert shared.served == 16 and shared.allocated_at_first_refusal == 1.0
    assert whole.served == 4


def test_devices_needed_is_the_fewest_without_a_refusal() -> None:
    trace = _churn(claims=400, devices=6)
    fleet = Fleet(6, 40 * GI, Mode("consumable"), "binpack")
    needed = devices_needed(trace, fleet)
    assert needed is not None
    at = simulate(trace, Fleet(needed, 40 * GI, Mode("consumable"), "binpack"))
    below = simulate(trace, Fleet(needed - 1, 40 * GI, Mode("consumable"), "binpack"))
    assert at.refused_on_arrival == 0
    assert below.refused_on_arrival > 0
    whole = devices_needed(trace, Fleet(6, 40 * GI, Mode("whole-device")))
    assert whole is not None and whole > needed
    assert devices_needed(trace, Fleet(6, 40 * GI, Mode("fixed-slices", 10 * GI))) is None


def test_the_same_trace_gives_the_same_decisions() -> None:
    trace = _churn(claims=600)
    fleet = Fleet(10, 40 * GI, Mode("consumable"), "fragmentation-aware")
    first, second = simulate(trace, fleet), simulate(trace, fleet)
    assert first.series == second.series
    assert (first.served, first.rejected, first.stranded_mean) == (
        second.served,
        second.rejected,
        second.stranded_mean,
    )


# --- traces ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["trace.csv", "trace.ndjson"])
def test_a_written_trace_reads_back(tmp_path: Path, name: str) -> None:
    trace = [TraceClaim(0.5, 10 * GI, 300.0, "a"), TraceClaim(0.25, 4 * GI, None, "b")]
    write_trace(trace, tmp_path / name)
    assert load_trace(tmp_path / name) == sorted(trace, key=lambda c: c.arrival)


def test_trace_sizes_may_be_bytes_and_durations_empty() -> None:
    text = "size,arrival,duration\n1073741824,0,\n2Gi,1.5,inf\n"
    assert parse_trace(text, "t.csv") == [
        TraceClaim(0.0, GI, None, "2"),
        TraceClaim(1.5, 2 * GI, None, "3"),
    ]
    ndjson = '{"arrival": 1, "size": 5368709120, "duration": 60}\n'
    assert parse_trace(ndjson, "t.txt") == [TraceClaim(1.0, 5 * GI, 60.0, "1")]


@pytest.mark.parametrize(
    ("text", "name", "message"),
    [
        ("arrival,size\n0,10Qi\n", "t.csv", "t.csv:2: size: must be a quantity"),
        ("arrival,size\n-1,10Gi\n", "t.csv", "t.csv:2: arrival: must be a finite number >= 0"),
        ("arrival,size,duration\n0,1Gi,0\n", "t.csv", "t.csv:2: duration: must be a number"),
        ("arrival,bytes\n0,1Gi\n", "t.csv", "t.csv:1: bytes: unknown column"),
        ("size\n1Gi\n", "t.csv", "t.csv:1: header: needs a column 'arrival'"),
        ('{"arrival": 0, "size": "1Gi", "gpu": 1}\n', "t.ndjson", "t.ndjson:1: gpu: unknown"),
        ('{"arrival": 0, "size": 0}\n', "t.ndjson", "t.ndjson:1: size: must be a quantity"),
        ("{not json\n", "t.ndjson", "t.ndjson:1: line: must be one JSON object"),
        ("arrival,size\n", "t.csv", "t.csv: file: holds no claim"),
    ],
)
def test_a_bad_trace_line_names_file_line_field_and_rule(
    text: str, name: str, message: str
) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace(text, name)
    assert str(caught.value).startswith(message)


def test_the_synthetic_generator_follows_its_spec() -> None:
    spec = SyntheticSpec(4000, SIZES, 2.0, 100.0, 7)
    trace = synthetic(spec)
    assert trace == synthetic(spec)  # the seed decides everything
    assert len(trace) == 4000
    assert {c.size for c in trace} == {c.size for c in SIZES}
    assert sorted(c.arrival for c in trace) == [c.arrival for c in trace]
    assert trace[-1].arrival / 4000 == pytest.approx(0.5, rel=0.1)  # 2 per second
    durations = [c.duration for c in trace if c.duration is not None]
    assert sum(durations) / len(durations) == pytest.approx(100.0, rel=0.1)
    assert spec.median_size() == 8 * GI


# --- the capacity math ------------------------------------------------------------------------


def test_plan_with_the_design_numbers() -> None:
    devices = [(f"node-{i // 8}", 40 * GI) for i in range(100)]
    plan = plan_capacity(devices, target=0.7, overhead=GI, headroom_nodes=2, fragmentation=0.05)
    remaining = [s.remaining // GI for s in plan.steps]
    # raw 4,000; at 70 %: 2,800; overhead 100 x 1: 2,700; 16 devices x 27: 2,268; 5 %
    assert remaining == [4000, 2800, 2700, 2268, 2154]
    assert plan.schedulable == plan.steps[-1].remaining
    assert [s.deduction for s in plan.steps[1:]] == [
        a.remaining - b.remaining for a, b in zip(plan.steps, plan.steps[1:], strict=False)
    ]


# --- the commands -------------------------------------------------------------------------------


def test_plan_command_prints_each_step(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--devices", "100", "--capacity", "40Gi", "--target-utilization", "0.7"]
    argv += ["--overhead", "1Gi", "--headroom-nodes", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2800Gi" in out and "2700Gi" in out and "2268Gi" in out
    assert "schedulable: 2268Gi (100 devices on 13 nodes)" in out


def test_plan_measures_fragmentation_on_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_trace(_churn(claims=300), tmp_path / "t.csv")
    argv = ["plan", "--devices", "10", "--capacity", "40Gi", "--target-utilization", "0.7"]
    assert cli.main([*argv, "--trace", str(tmp_path / "t.csv"), "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["steps"][-1]["step"].startswith("fragmentation loss")
    assert plan["schedulable"] <= plan["steps"][-2]["remaining"]


def test_simulate_command_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "cmp.png"
    argv = ["simulate", "--claims", "400", "--devices", "8", "--duration", "300"]
    argv += ["--modes", "consumable,whole-device", "--policies", "first-fit,binpack"]
    assert cli.main([*argv, "-o", "json", "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    labels = [r["label"] for r in data["results"]]
    assert labels == ["consumable/first-fit", "consumable/binpack", "whole-device"]
    assert all(r["devices_needed"] for r in data["results"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--modes", "mig"], "--modes: 'mig': must be consumable"),
        (["simulate", "--modes", "fixed-slices:50Gi"], "a slice must not be larger"),
        (["simulate", "--policies", "best"], "--policies: 'best'"),
        (["simulate", "--capacity", "forty"], "--capacity: must be a quantity"),
        (["simulate", "--max-wait", "-1"], "--max-wait: must be a number of seconds >= 0"),
        (["simulate", "--sizes", "4Gi:0"], "--sizes: entry 0: must be SIZE[:WEIGHT]"),
        (["simulate", "--trace", "/nonexistent.csv"], "/nonexistent.csv: file: cannot be read"),
        # checked before the run, not after it
        (["simulate", "--plot", "/nonexistent/dir/cmp.png"], "directory /nonexistent/dir does"),
        (["simulate", "--plot", "cmp.svg"], "--plot cmp.svg: must end in .png"),
        (["plan", "--devices", "1", "--capacity", "1Gi", "--target-utilization", "2"], "(0, 1]"),
        (["plan", "--target-utilization", "0.7"], "--devices and --capacity are required"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
