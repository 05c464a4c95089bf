"""Sphinx extension for the API page: render the package's plain-text docstrings faithfully.

The package's docstrings are written for readers of the source, not in reStructuredText: an indented
block after a paragraph is a formula or a table, to be shown as it is. reST would read it as a block
quote (and warn about its ragged indentation). This hook turns every such block into a literal block by
ending the paragraph before it with ``::``, which reST renders as a single ``:`` (or nothing).
"""


def _mark_literal_blocks(app, what, name, obj, options, lines):
    for i in range(2, len(lines)):
        opens_block = lines[i].startswith(" ") and not lines[i - 1].strip()
        previous = lines[i - 2].rstrip()
        if opens_block and previous and not previous.startswith(" ") and not previous.endswith("::"):
            lines[i - 2] = previous + (":" if previous.endswith(":") else " ::")


def setup(app):
    app.connect("autodoc-process-docstring", _mark_literal_blocks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
