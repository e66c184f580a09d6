"""The file writers both histories share: JSON with one event per line, and CSV rows (no torch).

``history.json`` and ``lr_history.json`` are read back by ``retune report`` and also read by people in
a diff or a pager, so both put each event on a line of its own instead of one line per field; both
CSV files are one row per event with the columns their module names. One implementation, here.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

PathLike = Union[str, Path]


def write_json_events(path: PathLike, data: Mapping[str, Any]) -> Path:
    """Write ``data`` (a JSON object) with its ``events`` list one event per line; return the path.

    >>> import json, tempfile
    >>> out = write_json_events(Path(tempfile.mkdtemp()) / "h.json", {"version": 1, "events": [{"a": 1}, {"a": 2}]})
    >>> print(out.read_text(), end="")
    {
      "version": 1,
      "events": [
        {"a": 1},
        {"a": 2}
      ]
    }
    >>> json.loads(out.read_text())["events"][1]
    {'a': 2}
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for key, value in data.items():
        if key == "events" and value:
            inner = ",\n".join(f"    {json.dumps(event)}" for event in value)
            lines.append(f'  "events": [\n{inner}\n  ]')
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    return path


def write_csv_rows(path: PathLike, fields: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write one CSV row per mapping under a header of ``fields``; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return path


__all__ = ["PathLike", "write_csv_rows", "write_json_events"]
