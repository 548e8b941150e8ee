"""Sphinx extension: code listings of `ppo_lab` show no solution-region markers.

The package marks the parts of its functions that the course's students write with
`### BEGIN SOLUTION name` and `### END SOLUTION` comments (`ppo_lab/course/regions.py`). The
chapters show those functions with `literalinclude`, and a reader has no use for the markers, so
this `literalinclude` drops their lines and is otherwise Sphinx's own.
"""

import re

from docutils import nodes
from sphinx.directives.code import LiteralInclude

MARKER = re.compile(r"^\s*### (BEGIN|END) SOLUTION\b")


class LiteralIncludeWithoutMarkers(LiteralInclude):
    def run(self):
        result = super().run()
        for node in result:
            for block in node.findall(nodes.literal_block):
                text = block.astext()
                if "### " not in text:
                    continue
                kept = "\n".join(line for line in text.split("\n") if not MARKER.match(line))
                block.children = [nodes.Text(kept)]
                block.rawsource = kept  # equal to the text, so the block is still highlighted
        return result


def setup(app):
    app.add_directive("literalinclude", LiteralIncludeWithoutMarkers, override=True)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
