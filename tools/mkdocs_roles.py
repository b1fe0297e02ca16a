"""mkdocs hook: the Sphinx roles our docstrings use (``:class:`~a.b.C```) read as code on the API page.

mkdocstrings renders Google-style docstrings as Markdown, where a role is no markup: without this hook
the page shows ``:class: ~lightning_distckpt.lightning.DistCheckpointStrategy``. Each role is dropped and
a ``~`` target is shortened to its last name, as Sphinx shows it.
"""

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _shown(m: "re.Match[str]") -> str:
    target = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
    return f"<code>{target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(_shown, html)
