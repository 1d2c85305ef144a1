"""docs/compatibility.md is what the tests' markers say; the markers themselves are well formed (fast: the tests are
read as syntax trees, nothing runs)."""

from types import SimpleNamespace

import pytest
from capabilities import PAIRS, load_limits, marker_problem
from compatibility import PAGE, cells, collect, render


@pytest.fixture(scope="module")
def marks():
    return collect()


def test_the_page_is_what_the_markers_say(marks):
    assert PAGE.read_text() == render(marks), "docs/compatibility.md is stale: run python tests/compatibility.py"


def test_each_refusal_message_is_one_the_test_asserts(marks):
    """The message a refuses marker shows on the page is (part of) a string in that test's code: the text it matches
    or asserts, so the page and the test cannot drift apart."""
    refusals = [m for m in marks if m.kind == "refuses"]
    assert refusals, "no refuses marker was collected"  # a floor, not a count: lifting a refusal removes one
    for m in refusals:
        assert any(m.kwargs["message"] in s for s in m.strings), (m.test, m.kwargs["message"])


def test_limits_name_pairs_no_test_proves_or_refuses(marks):
    """A documented limit or a 'not applicable' pair that a test now proves or refuses is stale data."""
    limits = load_limits()
    marked = {frozenset((a, b)) for m in marks for a in m.names for b in m.names if a < b}
    for kind, pairs in limits.items():
        assert not set(pairs) & marked, (kind, set(pairs) & marked)
    assert not set(limits["limit"]) & set(limits["not_applicable"])


def test_every_pair_has_one_cell_and_the_counts_add_up(marks):
    table = cells(marks)
    assert len(PAIRS) == len(table) == 136
    statuses = [status for status, _ in table.values()]
    assert set(statuses) <= {"tested", "refused", "limit", "not applicable", "unknown"}
    assert statuses.count("tested") >= 100 and statuses.count("refused") >= 5


def test_bad_markers_are_named_and_fail_collection():
    assert marker_problem("combines", ("fsdp", "llm_cp"), {}) is None
    assert "unknown capabilities ['zero3']" in marker_problem("combines", ("fsdp", "zero3"), {})
    assert "two or more" in marker_problem("combines", ("fsdp",), {})
    assert "message" in marker_problem("refuses", ("ft", "tp"), {})
    import conftest

    mark = SimpleNamespace(name="combines", args=("fsdp", "sequence_parallel"), kwargs={})
    item = SimpleNamespace(nodeid="tests/test_x.py::test_y", iter_markers=lambda name: [mark] * (name == "combines"))
    with pytest.raises(pytest.UsageError, match=r"test_y: @pytest.mark.combines.*unknown capabilities"):
        conftest._check_capability_markers([item])
