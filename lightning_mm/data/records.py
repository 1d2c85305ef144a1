"""Reading a data file's records (JSON list, JSON lines, parquet) with ``datasets``, and naming the place where a
malformed file goes wrong.

``datasets`` reports a JSON file it cannot parse as ``DatasetGenerationError: An error occurred while generating
the dataset``, naming neither the file nor the record. When it fails, the file is parsed again here with the
standard ``json`` module, record by record, to raise a :class:`DataFileError` naming the file, the record and
its line and column (a JSON list), or the line (JSON lines).
"""

from __future__ import annotations

import json
from pathlib import Path

CUT_SHORT = "a file cut short (an interrupted write or copy) ends inside its last record: write or copy it again"
MALFORMED = "correct or remove that record"
ENDS_INSIDE = "(the file ends inside it)"
NOT_UTF8 = "save the file as UTF-8 (JSON's encoding)"


class DataFileError(ValueError):
    """A data file that cannot be read: ``path`` and ``reason`` (the record and line where it goes wrong)."""

    def __init__(self, path, reason: str, fix: str = MALFORMED):
        self.path, self.reason = Path(path).absolute(), reason
        path = self.path
        super().__init__(f"data file {path}: {reason}; {fix}")


class MissingDataFileError(DataFileError, FileNotFoundError):
    """A data file path that names no file."""

    def __init__(self, path):
        super().__init__(path, "no such file", "give the path of a JSON, JSONL or parquet file (data_path, "
                                               "val_data_path or predict_data_path)")


def load_records(data_path, cache_dir=None):
    """The records of a JSON / JSONL / parquet file as a memory-mapped ``datasets.Dataset``; a file that does not
    exist or does not parse raises :class:`DataFileError` naming the file and the record."""
    import datasets

    path = Path(data_path)
    if not path.is_file():
        raise MissingDataFileError(path)
    builder = "parquet" if path.suffix == ".parquet" else "json"
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as err:  # datasets raises DatasetGenerationError, or a ValueError while it infers the schema
        where = json_error(path) if builder == "json" else None
        if where is not None:
            fix = CUT_SHORT if where.endswith(ENDS_INSIDE) else NOT_UTF8 if where.startswith("byte") else MALFORMED
            raise DataFileError(path, where, fix) from err
        if not isinstance(err, datasets.exceptions.DatasetGenerationError):
            raise
        cause = err.__cause__ or err.__context__
        reason = f"datasets cannot read it ({type(cause).__name__}: {cause})" if cause else str(err)
        raise DataFileError(path, reason, "check that it is one JSON list of records, one JSON record per line or "
                                          "a parquet file") from err


def json_error(path) -> str | None:
    """Where ``path`` stops being JSON: the record, line and column of a JSON list, the line (and record) of JSON
    lines, the byte that is not UTF-8; None when the file parses."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return f"byte {err.start} is not UTF-8 ({err.reason})"
    start = len(text) - len(text.lstrip())
    if text[start:start + 1] == "[":
        return _list_error(text, start + 1)
    return _lines_error(text)


def _position(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"line {line}, column {pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


def _list_error(text: str, pos: int) -> str | None:
    """The first problem of a JSON list whose ``[`` ends just before ``pos``."""
    decoder, index = json.JSONDecoder(), 0
    while True:
        pos = _skip_space(text, pos)
        if pos == len(text):
            last = f"after record {index - 1} " if index else ""
            return f"the list ends {last}without its closing ']' {ENDS_INSIDE}"
        if text[pos] == "]":
            rest = _skip_space(text, pos + 1)
            return None if rest == len(text) else f"text after the list's closing ']' ({_position(text, rest)})"
        if index:
            if text[pos] != ",":
                return f"record {index - 1} is not followed by ',' or ']' ({_position(text, pos)})"
            pos = _skip_space(text, pos + 1)
        try:
            _, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            # a string runs to the end of the text only when the file ends inside it (a newline would end it)
            ends = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
            cut = " " + ENDS_INSIDE if ends else ""
            return (f"record {index} (from {_position(text, pos)}) is not valid JSON: {_what(err)} at "
                    f"{_position(text, err.pos)}{cut}")
        index, pos = index + 1, end


def _what(err: json.JSONDecodeError) -> str:
    return err.msg.removesuffix(" at")  # "Unterminated string starting at" (the position follows)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _lines_error(text: str) -> str | None:
    """The first line of a JSON-lines text that is not one JSON value (blank lines are skipped)."""
    index = 0
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            if index == 0 and _parses(text):  # one JSON value over several lines, not JSON lines
                return None
            cut = " " + ENDS_INSIDE if number == len(lines) or not any(s.strip() for s in lines[number:]) \
                else ""
            return f"line {number} (record {index}) is not valid JSON: {_what(err)} at column {err.colno}{cut}"
        index += 1
    return None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
