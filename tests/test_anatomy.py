"""profiling/course/anatomy.py: the step the "Anatomy of a step" page draws, on cases worked out
by hand (the page's JavaScript is checked against it in tests/test_docs_site.py)."""

from __future__ import annotations

import pytest

from profiling.course import anatomy
from profiling.simulate.schedule import Grad, Workload

# Two gradients of 1 MB: the later layer's (index 1) ready 50 ms into backward, the
# first layer's at its end. At 1 Gbit/s on 2 ranks an all-reduce of 1 MB puts 1 MB
# through each link: 8 ms.
WORKLOAD = Workload(
    (Grad("first", 10**6, 0.100), Grad("last", 10**6, 0.050)),
    forward_s=0.100, backward_s=0.100, optimizer_s=0.010,
)  # fmt: skip
TWO_BUCKETS = [[1], [0]]  # reverse parameter order, as the stages cut


def step_ms(stage: str, latency_s: float = 0.0, micro: int = 1) -> float:
    return anatomy.step(WORKLOAD, TWO_BUCKETS, stage, 1.0, latency_s, micro).step_s * 1e3


def test_after_backward_the_buckets_go_one_after_the_other():
    assert step_ms("bucketed") == pytest.approx(100 + 100 + 8 + 8 + 10)


def test_overlapped_starts_each_bucket_once_its_gradients_are_ready():
    # bucket 0 at 150 ms (forward, then 50 ms of backward) to 158; bucket 1 when
    # backward ends at 200 ms, to 208; then the optimizer.
    assert step_ms("overlapped") == pytest.approx(208 + 10)


def test_each_message_pays_the_latency():
    # 2 ranks: 2 messages per all-reduce, 1 ms each.
    assert step_ms("overlapped", latency_s=1e-3) == pytest.approx(200 + 8 + 2 + 10)
    assert step_ms("bucketed", latency_s=1e-3) == pytest.approx(200 + 2 * (8 + 2) + 10)


def test_micro_batches_synchronise_each_unless_skip_sync():
    assert step_ms("overlapped", micro=2) == pytest.approx(2 * 208 + 10)
    assert step_ms("skip_sync", micro=2) == pytest.approx(200 + 208 + 10)


def test_bound_is_forward_then_the_longer_of_backward_and_the_all_reduces():
    cases = {  # (stage, latency s, micro-batches) -> ms
        ("overlapped", 0.0, 1): 100 + max(100, 16) + 10,
        ("overlapped", 0.05, 1): 100 + max(100, 16 + 4 * 50) + 10,
        ("bucketed", 0.0, 3): 3 * (100 + 100) + 10,
        ("skip_sync", 0.05, 3): 2 * 200 + 100 + 216 + 10,
    }
    for (stage, latency_s, micro), expected in cases.items():
        bound = anatomy.bound_s(WORKLOAD, TWO_BUCKETS, stage, 1.0, latency_s, micro)
        assert bound * 1e3 == pytest.approx(expected), (stage, latency_s, micro)
        assert step_ms(stage, latency_s, micro) >= bound * 1e3 - 1e-9


def test_the_figure_redraws_from_the_page_data_legibly(tmp_path, monkeypatch):
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    anatomy.main(["--from-page", "--out", str(tmp_path)])
    assert_legible(tmp_path / "bucket-curve.png", sizes)
