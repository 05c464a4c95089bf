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
