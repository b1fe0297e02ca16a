"""What an export's rank has put on disk, to take back when the export does not complete.

The safetensors export (:mod:`.safetensors_out`) writes every file under a temporary name and renames
it into place only once every rank has written all of its own: a failure or an interrupt (Ctrl-C, the
command line's SIGTERM) before then replaces nothing, and :meth:`Placing.take_back` removes what was
written (and the output directory, if the export made it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..storage.commit import fsync_dir
from ..storage.output_files import remove_made_dirs, remove_temp, write_temp
from .hf_owned import INDEX_FILE


@dataclass
class Placing:
    """What this rank of an export has put on disk, to take back when the export does not complete
    (a failure, Ctrl-C, the command line's SIGTERM): every file is written under a temporary name
    first and renamed into place only once all ranks wrote theirs, so an interrupted export replaces
    nothing and leaves no directory it made (``fresh``: rank 0 made the output directory; then the
    files renamed into it go too)."""

    out: str
    made: List[str] = field(default_factory=list)  # rank 0: the directories made, deepest first
    fresh: bool = False
    temps: Dict[str, str] = field(default_factory=dict)  # output path -> its temporary file, not yet renamed
    placed: List[str] = field(default_factory=list)  # renamed into a fresh directory
    renaming: bool = False  # a file of this rank was renamed into place: the old files are no longer whole
    aside: Optional[str] = None  # rank 0: the earlier index, moved aside before the renames
    done: bool = False

    def write(self, name: str, write: Any) -> None:
        path = os.path.join(self.out, name)
        self.temps[path] = write_temp(path, write)

    def place(self, names: Sequence[str]) -> None:
        for name in names:
            path = os.path.join(self.out, name)
            self.renaming = True  # noted first: an interrupt right after the rename still finds it
            if self.fresh:
                self.placed.append(path)
            os.replace(self.temps[path], path)
            del self.temps[path]

    def take_back(self) -> None:
        if self.done:
            return
        for tmp in self.temps.values():
            remove_temp(tmp)
        for path in self.placed:
            remove_temp(path)
        remove_made_dirs(self.made)
        if self.aside is not None:  # the earlier export is whole again while none of its files was replaced
            index = os.path.join(self.out, INDEX_FILE)
            if self.renaming or os.path.lexists(index):
                remove_temp(self.aside)
            else:
                os.rename(self.aside, index)
                fsync_dir(self.out)
