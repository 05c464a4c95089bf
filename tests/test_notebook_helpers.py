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


def test_execute_notebook_runs_and_saves_outputs(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(6 * 7)")]
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    seconds = notebook.execute_notebook(path)
    assert seconds > 0
    assert nbformat.read(path, as_version=4).cells[0].outputs[0]["text"] == "42\n"


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
