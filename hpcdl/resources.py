"""Where the files hpcdl ships beside its code live: `jobs/` and `slurm_templates/`.

They sit at the top of the source tree (where a site edits them), not inside the package, so a
wheel carries them as data files installed under `<prefix>/share/hpcdl/` (pyproject.toml's
`data-files`). A source checkout (an editable install) uses the tree's own copies, so edits take
effect at once; any other install finds them through its distribution's file list, which holds
for venvs, `--user` and `--prefix` installs alike.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent.parent


def shipped_dir(name: str) -> Path:
    """The directory of shipped files `name` ("jobs" or "slurm_templates")."""
    if (SOURCE_ROOT / "pyproject.toml").is_file() and (SOURCE_ROOT / name).is_dir():
        return SOURCE_ROOT / name
    try:
        dist = importlib.metadata.distribution("hpcdl")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for file in (dist.files or []) if dist else []:
        if file.parent.name == name and file.parent.parent.name == "hpcdl" and "share" in file.parts:
            return Path(dist.locate_file(file)).resolve().parent
    # Not found anywhere: name the source location, so the error that follows names a path.
    return SOURCE_ROOT / name
