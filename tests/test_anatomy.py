"""profiling/course/anatomy.py: the step the "Anatomy of a step" page draws, on cases worked out
by hand (the page's JavaScript is checked against it in tests/test_docs_site.py)."""

from __future__ import annotations

import itertools
import re

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


def test_question_5s_answer_is_the_models_and_on_the_slider():
    """The page's question 5 (skip_sync from the page's settings: the 14-gradient MLP,
    1 Gbit/s, no latency, 25 MiB): the first k whose time per micro-batch is under 1.2x
    compute alone, its time and ratio, as the model computes them from the page's data,
    and a k the micro-batch slider reaches."""
    page, model, workload = _page_and_model("mlp_2048x7")
    buckets = model["layouts"]["25"]

    def reading(k: int) -> tuple[int, str]:  # ms per micro-batch, x compute alone
        s = anatomy.step(workload, buckets, "skip_sync", 1.0, 0.0, k)
        return round(s.step_s / k * 1e3), f"{s.step_s / s.compute_s:.2f}"

    question = page[page.index("**Question 5.**") : page.index("## How the page")]
    assert "under 1.2× its compute alone" in " ".join(question.split())
    first = next(k for k in range(1, 1000) if float(reading(k)[1]) < 1.2)
    found = re.search(
        r"k = (\d+), at (\d+) ms per micro-batch \((\d\.\d\d)×\); "
        r"k = (\d+) gives (\d+) ms \((\d\.\d\d)×\)", " ".join(question.split())
    )  # fmt: skip
    assert found, "question 5's answer no longer reads 'k = N, at T ms per micro-batch (R×)'"
    k, ms, ratio, other, other_ms, other_ratio = found.groups()
    assert int(k) == first and (int(ms), ratio) == reading(first)
    assert (int(other_ms), other_ratio) == reading(int(other))
    # The model's terms, as the bars' times give them.
    text = " ".join(question.split())
    terms = re.search(
        r"take (\d+) ms per micro-batch and the optimizer (\d+) ms per step.*?"
        r"about (\d+) ms more.*?t\(k\) ≈ (\d+) k \+ (\d+) ms", text
    )  # fmt: skip
    assert terms, "question 5's answer no longer gives the model's terms"
    one = anatomy.step(workload, buckets, "skip_sync", 1.0, 0.0, 1)
    micro, optimizer, sync = (
        workload.forward_s + workload.backward_s,
        workload.optimizer_s,
        (one.step_s - one.compute_s),
    )
    assert [int(x) for x in terms.groups()] == [
        round(micro * 1e3), round(optimizer * 1e3), round(sync * 1e3), round(micro * 1e3),
        round((sync + optimizer) * 1e3),
    ]  # fmt: skip
    slider = re.search(r'name="micro" min="1" max="(\d+)"', page)
    assert slider and first <= int(slider.group(1)), "the micro-batch slider stops short of k"


def test_every_cap_position_changes_the_layout():
    """The cap slider (one parameter per bucket, then the model's cap groups) never shows
    one layout twice; on the page it opens on the course's MLP at 25 MiB."""
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    data = anatomy.read_page_data(docs / "js/anatomy-workload.js")
    for name, model in data["models"].items():
        shown = ["per_parameter", *(g["layout"] for g in model["cap_groups"])]
        layouts = [model["layouts"][key] for key in shown]
        assert all(a != b for a, b in itertools.pairwise(layouts)), name
        caps = [cap for g in model["cap_groups"] for cap in g["caps_mb"]]
        assert caps == data["caps_mb"] == list(anatomy.CAPS_MB), name
    html = re.search(r'name="cap" min="0" max="(\d+)" value="(\d+)"', docs.joinpath(
        "anatomy.md").read_text())  # fmt: skip
    groups = data["models"]["mlp_2048x7"]["cap_groups"]
    assert html and int(html.group(1)) == len(groups)
    assert groups[int(html.group(2)) - 1]["layout"] == "25"


def _page_and_model(name: str):
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    model = anatomy.read_page_data(docs / "js/anatomy-workload.js")["models"][name]
    return (docs / "anatomy.md").read_text(), model, anatomy.from_json(model)


def _answer(page: str, question: int) -> str:
    start = page.index(f"**Question {question}.**")
    return " ".join(page[start : page.index(f"**Question {question + 1}.**")].split())


def test_question_2s_answer_is_the_models_at_two_slider_positions():
    """Question 2 (overlapped, the 14-gradient MLP, no latency, 25 MiB): the two
    bandwidths the answer names are neighbouring positions of the slider (10^(-1 + p/10)
    Gbit/s, shown to 2 digits), the step and ratio at each are the model's, and the
    first is above 1.15x compute alone, the second under."""
    page, model, workload = _page_and_model("mlp_2048x7")
    answer = _answer(page, 2)
    found = re.findall(r"(\d+) ms at (\d+(?:\.\d)?) Gbit/s \((\d\.\d\d)×", answer)
    assert len(found) == 2, f"question 2's answer no longer reads 'T ms at G Gbit/s (R×': {answer}"
    positions = []
    for ms, shown, ratio in found:
        position = next(
            p for p in range(31) if f"{10 ** (-1 + p / 10):.2g}" == f"{float(shown):.2g}"
        )
        s = anatomy.step(workload, model["layouts"]["25"], "overlapped",
                         10 ** (-1 + position / 10), 0.0, 1)  # fmt: skip
        assert (int(ms), ratio) == (round(s.step_s * 1e3), f"{s.step_s / s.compute_s:.2f}")
        positions.append((position, s.step_s / s.compute_s))
    (p1, r1), (p2, r2) = positions
    assert p2 == p1 + 1 and r1 >= 1.15 > r2


def test_question_4s_answer_is_the_models_u():
    """Question 4 (overlapped, the 48-gradient MLP, 10 Gbit/s, 2 ms per message): every
    step the answer gives, per parameter, at a cap and in one bucket, is the model's, and
    so is backward."""
    page, model, workload = _page_and_model("mlp_1024x24")
    answer = _answer(page, 4)

    def ms(layout: str) -> int:
        s = anatomy.step(workload, model["layouts"][layout], "overlapped", 10.0, 2e-3, 1)
        return round(s.step_s * 1e3)

    per_parameter = re.search(r"(\d+) ms with one parameter per bucket", answer)
    one_bucket = re.search(r"(\d+) ms in one bucket", answer)
    caps = re.findall(r"(\d+) ms at (\d+) MiB", answer)
    backward = re.search(r"backward's (\d+)", answer)
    assert per_parameter and one_bucket and caps and backward, answer
    assert int(per_parameter.group(1)) == ms("per_parameter")
    assert int(one_bucket.group(1)) == ms("100") == ms(model["cap_groups"][-1]["layout"])
    for step, cap in caps:
        assert int(step) == ms(cap), f"{cap} MiB"
    assert int(backward.group(1)) == round(workload.backward_s * 1e3)


def test_the_bucketed_pages_table_is_the_models():
    """The bucketed page's table (the 48-gradient MLP at 10 Gbit/s and 2 ms per message:
    one parameter per bucket, 10 MiB, 25 MiB, one bucket) is the step model's, row by row."""
    from pathlib import Path

    _, model, workload = _page_and_model("mlp_1024x24")
    page = (Path(__file__).resolve().parent.parent / "docs/stages/bucketed.md").read_text()
    layouts = ["per_parameter", "10", "25", "100"]
    header = (
        "| 10 Gbit/s, 2 ms per message | one parameter per bucket | 10 MiB | 25 MiB | one bucket |"
    )
    assert header in page
    for stage in ("bucketed", "overlapped"):
        row = re.search(rf"^\| {stage}, ms \| (.*) \|$", page, re.M)
        assert row, f"the table has no {stage} row"
        shown = [int(cell) for cell in row.group(1).split(" | ")]
        model_ms = [
            round(anatomy.step(workload, model["layouts"][key], stage, 10.0, 2e-3, 1).step_s * 1e3)
            for key in layouts
        ]
        assert shown == model_ms, stage
