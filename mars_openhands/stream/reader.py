"""Reader: a recorded stream (JSONL or Parquet) back into typed events or a pandas DataFrame.

The frame has one row per event and one column per field of *any* event kind (the union over
:data:`~mars_openhands.stream.events.EVENT_TYPES`, in a fixed order), so frames of different runs
concatenate and their Parquet schemas match; a field that an event's kind lacks is null. Column
types: ``kind``/strings ``object``; ``t_mono_ns`` ``int64``; ``t_wall`` ``datetime64[ns, UTC]``;
other integers nullable ``Int64``; floats ``float64`` (NaN when absent); booleans nullable
``boolean``.

Every JSONL line is validated with :func:`~mars_openhands.stream.events.parse_event`, so an
old-shape file gains the defaults of fields added since. pandas and pyarrow are imported lazily:
this module imports with the standard library and pydantic only.
"""

from __future__ import annotations

import logging
import os
import types
import typing
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mars_openhands.stream.events import EVENT_TYPES, Event, EventError, parse_event

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "StreamReadError",
    "column_dtypes",
    "events_to_frame",
    "iter_events",
    "jsonl_to_parquet",
    "read_stream",
]

logger = logging.getLogger(__name__)


class StreamReadError(ValueError):
    """A stream file could not be read; the message names the file and line."""


def _base_type(annotation: Any) -> Any:
    """``int | None`` → ``int``; ``Annotated[int, ...]`` → ``int``; ``Literal["a"]`` → ``str``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _base_type(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return type(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(inner)
    return annotation


def column_dtypes() -> dict[str, str]:
    """Return ``{column: pandas dtype}`` for every field of every event kind, in column order.

    Order: ``kind``, the common fields, then each kind's own fields in ``EVENT_TYPES`` order.
    Pure.
    """
    dtype_by_type = {int: "Int64", float: "float64", bool: "boolean", str: "object",
                     datetime: "datetime64[ns, UTC]"}
    dtypes: dict[str, str] = {"kind": "object"}
    for cls in EVENT_TYPES.values():
        for name, field in cls.model_fields.items():
            if name not in dtypes:
                dtypes[name] = dtype_by_type[_base_type(field.annotation)]
    dtypes["t_mono_ns"] = "int64"  # required on every event, never null
    return dtypes


def _iter_jsonl(path: Path, skip_truncated_tail: bool) -> Iterator[Event]:
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    # A complete file ends with "\n", so the split leaves an empty last piece; anything else in
    # the last piece is a line the writer did not finish (a crash mid-write).
    *complete, tail = lines
    for line_number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            yield parse_event(line)
        except EventError as e:
            raise StreamReadError(f"{path}:{line_number}: {e}") from None
    if tail.strip():
        try:
            yield parse_event(tail)
        except EventError as e:
            if skip_truncated_tail:
                logger.warning("skipping truncated final line %d of %s (%d bytes)",
                               len(lines), path, len(tail))
                return
            raise StreamReadError(
                f"{path}:{len(lines)}: truncated or invalid final line (no newline; a crash can "
                f"leave one): {e}; pass skip_truncated_tail=True to ignore it"
            ) from None


def _iter_parquet(path: Path) -> Iterator[Event]:
    import pyarrow.parquet as pq

    for row_number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        cls = EVENT_TYPES.get(row.get("kind"), None)
        if cls is not None:  # drop the union's columns this kind does not have
            row = {k: v for k, v in row.items() if k in cls.model_fields}
        try:
            yield parse_event(row)
        except EventError as e:
            raise StreamReadError(f"{path}: row {row_number}: {e}") from None


def iter_events(
    path: str | os.PathLike[str], *, skip_truncated_tail: bool = False
) -> Iterator[Event]:
    """Yield the typed events of a ``.jsonl`` or ``.parquet`` stream file, in file order.

    Args:
        path: a stream file; the suffix selects the format.
        skip_truncated_tail: ignore an unparseable final JSONL line without a newline (what a crash
            mid-write leaves) instead of raising. Corrupt lines elsewhere always raise.

    Raises:
        StreamReadError: a line or row is not a valid event (message: ``file:line: reason``).
        ValueError: unsupported suffix.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        return _iter_jsonl(path, skip_truncated_tail)
    if path.suffix == ".parquet":
        return _iter_parquet(path)
    raise ValueError(f"unsupported stream file {path}: expected a .jsonl or .parquet suffix")


def events_to_frame(events: typing.Iterable[Event]) -> pd.DataFrame:
    """Build the stream frame (one row per event, all :func:`column_dtypes` columns).

    Raises:
        ImportError: pandas is missing (install the ``eval`` extra).
    """
    import pandas as pd

    rows = [event.model_dump() for event in events]
    return _apply_dtypes(pd.DataFrame.from_records(rows, columns=list(column_dtypes())))


def _apply_dtypes(frame: pd.DataFrame) -> pd.DataFrame:
    """Select and cast the :func:`column_dtypes` columns (missing strings are ``None``)."""
    import pandas as pd

    out = {}
    for column, dtype in column_dtypes().items():
        values = frame[column]
        if dtype.startswith("datetime64"):
            out[column] = pd.to_datetime(values, utc=True).astype(dtype)
        elif dtype == "object":  # object, not pandas 3's "str", so both pandas majors agree
            values = values.astype(object)
            out[column] = values.where(values.notna(), None)
        else:
            out[column] = values.astype(dtype)
    return pd.DataFrame(out, index=pd.RangeIndex(len(frame)))


def read_stream(path: str | os.PathLike[str], *, skip_truncated_tail: bool = False) -> pd.DataFrame:
    """Read a ``.jsonl`` or ``.parquet`` stream file into a DataFrame (see the module docstring).

    Args:
        path: a stream file written by :class:`~mars_openhands.stream.recorder.StreamRecorder`.
        skip_truncated_tail: see :func:`iter_events`.

    Returns:
        One row per event in file order, columns and dtypes as in :func:`column_dtypes`.

    Raises:
        StreamReadError: a corrupt line/row (message names the file and line number).
        ImportError: pandas/pyarrow missing (install the ``eval`` extra).
    """
    path = Path(path)
    if path.suffix == ".parquet":
        import pandas as pd

        frame = pd.read_parquet(path)
        if not set(column_dtypes()) <= set(frame.columns):  # an older, narrower schema
            return events_to_frame(_iter_parquet(path))
        return _apply_dtypes(frame)
    return events_to_frame(iter_events(path, skip_truncated_tail=skip_truncated_tail))


def jsonl_to_parquet(
    jsonl_path: str | os.PathLike[str], parquet_path: str | os.PathLike[str]
) -> int:
    """Convert a complete JSONL stream to Parquet, atomically (temporary file, then rename).

    Returns:
        Number of events written.

    Raises:
        StreamReadError: a corrupt line in the JSONL file (the Parquet file is not written).
        ImportError: pandas/pyarrow missing; install the ``eval`` extra or pass
            ``write_parquet=False`` to the recorder (the JSONL file stays complete).
    """
    try:
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"writing {parquet_path} needs pandas and pyarrow "
            f"(pip install 'mars-openhands[eval]'); the JSONL stream {jsonl_path} is complete; "
            "pass write_parquet=False to skip Parquet"
        ) from e
    frame = read_stream(jsonl_path)
    parquet_path = Path(parquet_path)
    tmp_path = parquet_path.with_name(parquet_path.name + ".tmp")
    frame.to_parquet(tmp_path, index=False)
    os.replace(tmp_path, parquet_path)
    return len(frame)
