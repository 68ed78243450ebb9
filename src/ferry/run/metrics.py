"""One JSON object per logged step, appended to the run's metrics.jsonl."""

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        self._file.close()


def _plain(value: Any) -> Any:
    """JSON-able Python numbers from numpy / JAX scalars."""
    return value.item() if hasattr(value, "item") else value
