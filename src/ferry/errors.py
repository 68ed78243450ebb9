"""The one error type for refusals. A `FerryError` is ferry saying no to an input it was given
(a config value, a file, a directory, a machine too small) with a message that names the problem
and the fix; the launcher prints it as one line and exits 2. Any other exception is a bug and is
shown with its traceback.

Subclasses keep the built-in type they always had as a second base (a `ConfigError` is still a
`ValueError`), so code that caught the built-in type goes on working.
"""

import json
from pathlib import Path
from typing import Any


class FerryError(Exception):
    """A refusal: the input cannot be used, and the message says why and what to do instead."""


class ConfigError(FerryError, ValueError):
    """A config that names a key the schema does not have, or has a value of the wrong kind."""


class DataError(FerryError, ValueError):
    """The data a run was pointed at cannot be read or is too small for the run."""


class JsonFileError(FerryError, ValueError):
    """A JSON file that does not parse: the message names the file, the line and the column."""


def read_json(path: Path, what: str = "") -> Any:
    """The JSON value in `path`; a file that does not parse is refused naming it, the line and
    the column (`json.JSONDecodeError` alone names neither the file nor what it was for)."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        label = f"{what} " if what else ""
        raise JsonFileError(
            f"{label}{path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}; "
            "fix or replace the file"
        ) from error
