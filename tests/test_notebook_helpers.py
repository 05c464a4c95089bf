"""The chapters' helpers: showing package source, tables, units, executing a notebook."""

import nbformat
import pytest

from scalebook import notebook
from scalebook.model import Block


def test_show_source_renders_the_package_code_itself():
    shown = notebook.show_source(Block).data
    assert "class Block(nn.Module):" in shown and "scalebook.model" in shown
    assert shown.count("```") == 2


def test_markdown_table_escapes_pipes():
    table = notebook.markdown_table([("a|b", 1)], ["x", "y"]).data
    assert table.splitlines() == ["| x | y |", "|---|---|", "| a\\|b | 1 |"]


def test_rounded_keeps_four_significant_digits_everywhere_in_a_value():
    import numpy as np
    import torch

    # The two values the same cell produced on two CPUs (AVX-512 and another kernel set): equal once rounded.
    assert notebook.rounded(3.7534787059275545) == notebook.rounded(3.7534787059275536) == 3.753
    assert notebook.rounded(3.754) != notebook.rounded(3.753)  # a changed result still shows
    assert notebook.rounded({"a": [1.234567e-7, np.float32(2 / 3)], "b": (torch.tensor(1 / 3), 7, "x")}) == {
        "a": [1.235e-7, 0.6667], "b": (0.3333, 7, "x")}  # fmt: skip
    assert repr(notebook.rounded(-0.0)) == "0.0" and notebook.rounded(True) is True
    assert notebook.rounded(2.0 / 3, digits=2) == 0.67


def test_markdown_table_shows_floats_rounded():
    table = notebook.markdown_table([(1 / 3, 1e-7 / 3, "0.123456789")], ["a", "b", "c"]).data
    assert table.splitlines()[2] == "| 0.3333 | 3.333e-08 | 0.123456789 |"  # strings are shown as written


@pytest.mark.parametrize(
    "error, tolerance, text",
    [(0.0, 1e-5, "0"), (9.5e-7, 1e-5, "< 1e-05"), (1.9e-6, 1e-5, "< 1e-05"), (-3e-6, 1e-5, "< 1e-05"),
     (0.34, 1e-4, "3.4e-01")],
)  # fmt: skip
def test_error_text_shows_a_rounding_error_by_its_tolerance_and_a_large_one_as_it_is(error, tolerance, text):
    assert notebook.error_text(error, tolerance) == text


def test_glue_gives_the_prose_the_value_its_output_shows(monkeypatch):
    shown = {}
    monkeypatch.setattr("myst_nb.glue", lambda name, value, display=True: shown.update({name: value}))
    notebook.glue("x", 3.7534787059275545)
    notebook.glue("flops", 3.1500000000000004, digits=None)  # Python arithmetic on constants: the same everywhere
    notebook.glue("err", 9.5e-7, below=1e-5)
    notebook.glue("big", 0.34, below=1e-4)
    assert shown == {"x": 3.753, "flops": 3.1500000000000004, "err": 1e-5, "big": 0.34}
    assert all(getattr(notebook.glued, name) == value for name, value in shown.items())


@pytest.mark.parametrize(
    "n, unit, text",
    [(700e9, "GB", "700 GB"), (2.8e12, "GB", "2,800 GB"), (3.37e6, "auto", "3.37 MB"), (12, "auto", "12 B")],
)
def test_human_bytes_uses_decimal_units(n, unit, text):
    assert notebook.human_bytes(n, unit) == text


def test_human_count():
    assert notebook.human_count(175e9) == "175B" and notebook.human_count(124_439_808) == "124M"


def test_execute_notebook_runs_saves_outputs_and_stores_each_eval_result_where_its_cell_stands(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from scalebook.notebook import glue, glued\nprint(6 * 7)\nglue('tb', 2.84, display=False)"
        ),
        nbformat.v4.new_markdown_cell('Holds {eval}`f"{glued.tb:.1f}"` TB, {eval}``glued["tb"]`` exactly.'),
        nbformat.v4.new_code_cell("glue('tb', 9.0, display=False)"),
        nbformat.v4.new_markdown_cell('Then {eval}`f"{glued.tb:.1f}"` TB.'),
    ]
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    seconds = notebook.execute_notebook(path)
    assert seconds > 0
    cells = nbformat.read(path, as_version=4).cells
    assert cells[0].outputs[0]["text"] == "42\n"
    # jupyterlab-myst's format: the expression and the kernel's user_expressions reply for it.
    assert cells[1].metadata.user_expressions == [
        {
            "expression": 'f"{glued.tb:.1f}"',
            "result": {"status": "ok", "data": {"text/plain": "'2.8'"}, "metadata": {}},
        },
        {"expression": 'glued["tb"]', "result": {"status": "ok", "data": {"text/plain": "2.84"}, "metadata": {}}},
    ]
    assert notebook.shown_text(cells[3].metadata.user_expressions[0]["result"]) == "9.0"
    assert cells[2].execution_count == 2  # evaluating the expressions runs no cell of its own

    # Prose may announce a value glued further down: its cell is evaluated again after the last cell.
    nb.cells.insert(0, nbformat.v4.new_markdown_cell("Ahead: {eval}`glued.later`."))
    nb.cells.append(nbformat.v4.new_code_cell("glue('later', 7, display=False)"))
    nbformat.write(nb, path)
    notebook.execute_notebook(path)
    cells = nbformat.read(path, as_version=4).cells
    assert notebook.shown_text(cells[0].metadata.user_expressions[0]["result"]) == "7"

    nb.cells[2].source = "Holds {eval}`glued.nothing` TB."
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match=r"markdown cell 2: \{eval\} failed: glued.nothing -> AttributeError"):
        notebook.execute_notebook(path)


def test_eval_expressions_finds_each_role_once_and_shown_text_strips_string_quotes():
    text = 'a {eval}`f"{glued.x:.1f}"` b {eval}``glued["y"]`` c {eval}`f"{glued.x:.1f}"` `{eval}` d'
    assert notebook.eval_expressions(text) == ['f"{glued.x:.1f}"', 'glued["y"]']
    assert notebook.shown_text({"status": "ok", "data": {"text/plain": '"it\'s"'}}) == "it's"
    assert notebook.shown_text({"status": "ok", "data": {"text/plain": "1e-07"}}) == "1e-07"
    with pytest.raises(ValueError, match="no text/plain"):
        notebook.shown_text({"status": "error", "ename": "NameError"})


def test_setup_applies_the_one_style_file():
    import matplotlib
    import torch

    from scalebook import plots

    matplotlib.rcdefaults()
    threads = torch.get_num_threads()
    notebook.setup()
    torch.set_num_threads(threads)
    style = matplotlib.rc_params_from_file(plots.STYLE, use_default_template=False)
    assert len(style) > 20
    assert {key: matplotlib.rcParams[key] for key in style} == dict(style)
    # Opaque white, so that figures read on dark pages (a transparent figure would not).
    assert matplotlib.colors.to_rgba(matplotlib.rcParams["savefig.facecolor"]) == (1.0, 1.0, 1.0, 1.0)
    matplotlib.rcdefaults()
