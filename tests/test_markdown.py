import pytest

from pipeline.markdown import table


def test_table_renders_header_rule_and_rows():
    md = table(["method", "users/s"], [["beam", 1.5], ["a|b", "2 (1-3)"]], align=["left", "right"])
    assert md.splitlines() == [
        "| method | users/s |",
        "|---|---:|",
        "| beam | 1.5 |",
        "| a\\|b | 2 (1-3) |",
    ]


def test_table_refuses_rows_that_do_not_fit_the_header():
    with pytest.raises(ValueError, match="a row of 1 cells under 2 columns"):
        table(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="3 alignments for 2 columns"):
        table(["a", "b"], [], align=["left", "left", "left"])
