"""MkDocs hook: the repository's README.md becomes the site's guide page (``guide.md``).

The README stays the one source; the files it links to (a plot under ``results/``) are
copied in beside it, so ``mkdocs build --strict`` checks its links like any page's.
"""

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s#]+)")


def on_files(files, config):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "guide.md", content=text))
    for target in sorted(set(LINK.findall(text))):
        path = ROOT / target
        if "://" not in target and path.is_file():
            files.append(File.generated(config, target, content=path.read_bytes()))
    return files
