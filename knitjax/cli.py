"""Command-line error handling shared by ``knitjax.main`` and ``knitjax.bench``."""

import logging as std_logging
import sys

from absl import flags, logging


class _QuietLibraries(std_logging.Filter):
  """Keeps orbax's per-save INFO chatter out of the progress output."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def quiet_libraries() -> None:
  """Drops libraries' INFO records (orbax) from absl's handler; warnings still show."""
  logging.get_absl_handler().addFilter(_QuietLibraries())


def one_line(e: Exception) -> str:
  """The informative line of a flag-parsing error (config files raise through a traceback)."""
  text = str(e).replace("\\n", "\n").replace("\\'", "'")
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if isinstance(e, AttributeError | KeyError):
    return "unknown config field " + " ".join(lines).strip("'\"")
  if any("Traceback" in line or "Errno" in line for line in lines):
    return lines[-1]
  return " ".join(lines)


def parse_flags(argv: list[str]) -> list[str]:
  """Parses flags; a bad config file or override ends in one line, not a traceback."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as e:
    sys.exit(f"error: bad --config or flag: {one_line(e)}")
