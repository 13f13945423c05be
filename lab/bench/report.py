"""Shared output for benchmarks: a JSON file and a printed table."""

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any


def write_json(workdir: str, name: str, result: Mapping[str, Any]) -> str:
  """Writes ``workdir/<name>.json`` (creating ``workdir``) and returns its path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, f"{name}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2, sort_keys=False, default=_to_builtin)
  return path


def _to_builtin(x):
  if hasattr(x, "item"):  # NumPy scalars
    return x.item()
  if hasattr(x, "tolist"):
    return x.tolist()
  raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  """Formats rows as a fixed-width text table (floats to 4 significant digits)."""

  def cell(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return str(v)

  body = [[cell(r.get(c, "")) for c in columns] for r in rows]
  widths = [
    max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)
  ]
  lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
  lines.append("  ".join("-" * w for w in widths))
  lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)) for b in body]
  return "\n".join(lines)
