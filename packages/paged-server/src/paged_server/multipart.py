"""A strict, bounded multipart/form-data parser (RFC 7578) for upload routes such as
/v1/audio/transcriptions; standard library only.

    Content-Type: multipart/form-data; boundary=B
    body:  --B CRLF headers CRLF CRLF content  CRLF --B CRLF ...  CRLF --B-- [epilogue]

Each part needs `Content-Disposition: form-data; name="..."` (`filename` marks a file);
its other headers (Content-Type) are kept, none is interpreted but the disposition. A
preamble before the first delimiter and an epilogue after the last are ignored (RFC 2046).

Bounds: at most `max_parts` parts, a part's header block at most 8 KiB, a text field at most
`max_field_bytes`, a file at most `max_file_bytes` (the whole body is already capped by the
HTTP server). Anything malformed is a 400 whose `param` names the field it concerns (the
part's name once its headers are read; `Content-Type` for a missing or bad boundary; `file`
-like names for a truncated part), never a 500.
"""

from __future__ import annotations

import email.parser
import email.policy
import re
from dataclasses import dataclass

from paged_server.errors import bad_request

MAX_HEADER_BYTES = 8 << 10  # one part's header block
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")  # RFC 2046
_HEADERS = email.parser.BytesHeaderParser(policy=email.policy.HTTP)


@dataclass(slots=True)
class Part:
    """One form field: `data` its raw bytes; `filename` None for a plain (text) field."""

    name: str
    data: bytes
    filename: str | None = None
    content_type: str | None = None

    def text(self) -> str:
        """A text field's value (UTF-8); a 400 naming the field for other bytes."""
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad_request(f"'{self.name}' is not UTF-8 text: {e}", self.name) from None


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a `multipart/form-data` Content-Type header; a 400 naming the header
    for another media type or a missing / malformed boundary."""
    msg = _HEADERS.parsebytes(b"Content-Type: " + (content_type or "").encode("latin-1") + b"\r\n")
    if msg.get_content_type() != "multipart/form-data":
        raise bad_request(
            f"the body must be multipart/form-data, got Content-Type {content_type!r}",
            "Content-Type",
        )
    boundary = msg.get_param("boundary")
    if not isinstance(boundary, str) or not _BOUNDARY.fullmatch(boundary):
        raise bad_request(
            "the multipart/form-data Content-Type needs a boundary parameter of 1-70 "
            f"characters (RFC 2046), got {boundary!r}",
            "Content-Type",
        )
    return boundary.encode("ascii")


def parse_form(
    content_type: str | None,
    body: bytes,
    *,
    max_parts: int = 64,
    max_field_bytes: int = 64 << 10,
    max_file_bytes: int = 25 << 20,
) -> dict[str, list[Part]]:
    """The parts of a multipart/form-data `body`, by field name in body order."""
    boundary = boundary_of(content_type)
    delimiter = b"\r\n--" + boundary
    # the first delimiter may open the body (no CRLF before it) or follow a preamble
    if body.startswith(delimiter[2:]):
        pos = len(delimiter) - 2
    else:
        at = body.find(delimiter)
        if at < 0:
            raise bad_request("the multipart body holds no part (no boundary line)", "Content-Type")
        pos = at + len(delimiter)
    form: dict[str, list[Part]] = {}
    count = 0
    while True:
        pos = _after_delimiter(body, pos, form)
        if pos < 0:  # the close delimiter: the rest is the epilogue
            return form
        count += 1
        if count > max_parts:
            raise bad_request(f"the form has more than {max_parts} parts", None)
        end_headers = body.find(b"\r\n\r\n", pos, pos + MAX_HEADER_BYTES + 4)
        if body.startswith(b"\r\n", pos):  # a part without headers
            end_headers = pos - 2
        if end_headers < 0:
            name = _name_in(body[pos : pos + MAX_HEADER_BYTES])
            raise bad_request(
                f"part {count} of the form ({name or 'unnamed'}): its headers are cut short or "
                f"over {MAX_HEADER_BYTES} bytes",
                name,
            )
        part = _part_headers(body[pos : end_headers + 2], count)
        start = end_headers + 4
        end = body.find(delimiter, start)
        if end < 0:
            raise bad_request(
                f"'{part.name}': the form ends inside this part (no closing boundary line)",
                part.name,
            )
        cap = max_file_bytes if part.filename is not None else max_field_bytes
        if end - start > cap:
            what = "file" if part.filename is not None else "field"
            raise bad_request(
                f"'{part.name}': a {what} of {end - start} bytes is over the limit of {cap}",
                part.name,
            )
        part.data = body[start:end]
        form.setdefault(part.name, []).append(part)
        pos = end + len(delimiter)


def _after_delimiter(body: bytes, pos: int, form: dict[str, list[Part]]) -> int:
    """Where the next part's headers start after a delimiter ending at `pos`; -1 after the
    close delimiter. Transport padding (spaces, tabs) may follow a delimiter."""
    if body.startswith(b"--", pos):
        return -1
    while pos < len(body) and body[pos] in b" \t":
        pos += 1
    if not body.startswith(b"\r\n", pos):
        last = next(reversed(form), None)
        raise bad_request(
            "the multipart body is cut short or malformed after a boundary line (expected "
            "CRLF or the closing '--')",
            last,
        )
    return pos + 2


def _name_in(block: bytes) -> str | None:
    """The field name in the header lines of a part cut short, if they got that far."""
    try:
        name = _HEADERS.parsebytes(block).get_param("name", header="content-disposition")
    except Exception:  # lines too broken to read: no name to give
        return None
    return name if isinstance(name, str) and name else None


def _part_headers(block: bytes, index: int) -> Part:
    """A part's header lines -> its Part (no data yet); a 400 for a part that is not a named
    form-data field."""
    try:
        headers = _HEADERS.parsebytes(block)
    except Exception as e:  # the parser's own errors: bytes that are no header block
        raise bad_request(f"part {index} of the form: unreadable headers: {e}", None) from None
    disposition = headers.get("Content-Disposition")
    if disposition is None or headers.get_content_disposition() != "form-data":
        raise bad_request(
            f"part {index} of the form needs a 'Content-Disposition: form-data; name=...' header",
            None,
        )
    name = headers.get_param("name", header="content-disposition")
    if not isinstance(name, str) or not name:
        raise bad_request(f"part {index} of the form has no field name", None)
    filename = headers.get_filename()
    return Part(name, b"", filename, headers.get("Content-Type"))
