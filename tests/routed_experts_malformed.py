"""Malformed routed-experts rows: one table for every decoder of them.

A response choice carries ``routed_experts`` (base64, standard alphabet, padded, of a
``.npy`` file version 1.0 or 2.0 holding a C-ordered uint8 or little-endian uint16
array of shape (rows, layers, top_k), nothing after its data) and
``routed_experts_start`` (a non-negative integer). Each case below breaks exactly one
of these, on an otherwise well-formed choice; every decoder must refuse every case
with its own error type, never return rows and never fail another way. The fork's
client decoder (``vllm.entrypoints.routed_experts``) runs over the table in
tests/entrypoints/test_routed_experts_malformed.py, the P/D proxy's
(``vllm_r3_pdproxy.merge.rows_from_choice``) in tests/pdproxy/test_malformed_rows.py.

Every payload is derived by hand: the ``.npy`` bytes are written here from the format's
definition (magic, version, header length, a padded Python-literal header, the data),
not by numpy's writer, so the table does not depend on the code it judges.

Not in the table: a choice without ``routed_experts``. The fork's decoder refuses it (a
client that asked for rows needs them); the proxy reads it as a side that returned no
rows, which its merge then judges (tests/pdproxy/test_merge.py).

Both decoders must refuse every case. The fork's decoder refused four of them only
after it stopped using ``numpy.load``, which is laxer than the contract: a
Fortran-ordered array, bytes after the data, .npy version 3.0, and a header claiming
16 TiB of rows (numpy.load allocates before it reads).
"""

from __future__ import annotations

import base64
import pickle
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

MAGIC = b"\x93NUMPY"


def npy(
    descr: Any,
    shape: tuple[int, ...],
    data: bytes,
    *,
    fortran: bool = False,
    version: tuple[int, int] = (1, 0),
) -> bytes:
    """A `.npy` file, by the format's definition: MAGIC, the version bytes, the
    header's length (uint16 little-endian for 1.0, uint32 from 2.0), the header (a
    dict literal padded with spaces and a newline so the data starts at a multiple of
    64), the data."""
    header = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape!r}, }}"
    length_format = "<H" if version == (1, 0) else "<I"
    prefix = len(MAGIC) + 2 + struct.calcsize(length_format)
    padding = -(prefix + len(header) + 1) % 64
    header += " " * padding + "\n"
    return (
        MAGIC
        + bytes(version)
        + struct.pack(length_format, len(header))
        + header.encode("latin1")
        + data
    )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# The well-formed rows: 3 positions x 2 layers x top-2, expert ids 0..11 in C order.
ROWS_BYTES = bytes(range(12))
ROWS = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
START = 5
GOOD_NPY = npy("|u1", (3, 2, 2), ROWS_BYTES)
# uint16 rows (ids above 255), little-endian: position 0 holds 256, 257, 258, 259.
ROWS_U16 = [[[256, 257], [258, 259]]]
GOOD_NPY_U16 = npy(
    "<u2", (1, 2, 2), b"".join(struct.pack("<H", v) for v in range(256, 260))
)
# Five ids whose base64 needs padding ("==") and the alphabet's "+" and "/".
ODD_NPY = npy("|u1", (1, 1, 5), bytes([3, 0xFB, 0xEF, 0xBE, 0xFF]))
assert len(ODD_NPY) % 3 == 1 and "+" in b64(ODD_NPY) and "/" in b64(ODD_NPY)


def choice(payload: Any = None, **fields: Any) -> dict[str, Any]:
    """A well-formed choice (GOOD_NPY from START), `payload` or `fields` replaced."""
    base: dict[str, Any] = {
        "index": 0,
        "routed_experts": b64(GOOD_NPY),
        "routed_experts_start": START,
    }
    if payload is not None:
        base["routed_experts"] = payload
    return base | fields


@dataclass(frozen=True)
class Case:
    name: str
    wrong: str  # what is wrong, in words
    choice: dict[str, Any]


WELL_FORMED = (
    Case("uint8", "nothing", choice()),
    Case("uint16", "nothing", choice(b64(GOOD_NPY_U16))),
    Case("padded-base64", "nothing", choice(b64(ODD_NPY))),
    Case(
        "npy-version-2.0",
        "nothing",
        choice(b64(npy("|u1", (3, 2, 2), ROWS_BYTES, version=(2, 0)))),
    ),
)
# The rows each WELL_FORMED case must decode to, in its order (all from START).
WELL_FORMED_ROWS = (ROWS, ROWS_U16, [[[3, 0xFB, 0xEF, 0xBE, 0xFF]]], ROWS)

CASES = (
    # The payload is not base64 of anything.
    Case("not-base64", "characters outside the base64 alphabet", choice("not base64!")),
    Case("empty", "an empty payload: no .npy file at all", choice("")),
    Case(
        "unpadded", "base64 without its '=' padding", choice(b64(ODD_NPY).rstrip("="))
    ),
    Case(
        "urlsafe-alphabet",
        "base64's URL-safe alphabet ('-', '_'), not the standard one",
        choice(base64.urlsafe_b64encode(ODD_NPY).decode("ascii")),
    ),
    Case(
        "embedded-space",
        "white space inside the base64 text",
        choice(b64(GOOD_NPY)[:8] + " " + b64(GOOD_NPY)[8:]),
    ),
    Case(
        "trailing-newline",
        "a newline after the base64 text",
        choice(b64(GOOD_NPY) + "\n"),
    ),
    # Base64, but not a .npy array.
    Case(
        "not-npy",
        "base64 of bytes that are not a .npy file",
        choice(b64(b"routed experts, but not as .npy")),
    ),
    Case(
        "bad-magic",
        "the magic string in lower case",
        choice(b64(b"\x93numpy" + GOOD_NPY[len(MAGIC) :])),
    ),
    Case(
        "unknown-version",
        ".npy format version 9.0",
        choice(b64(npy("|u1", (3, 2, 2), ROWS_BYTES, version=(9, 0)))),
    ),
    Case(
        "truncated-data",
        "the header says 12 bytes of data, 8 follow",
        choice(b64(GOOD_NPY[:-4])),
    ),
    Case(
        "pickled-object-array",
        "an object array: its data is a pickle",
        choice(b64(npy("|O", (1,), pickle.dumps([[1, 2]])))),
    ),
    Case(
        "structured-dtype",
        "a structured dtype with one uint8 field",
        choice(b64(npy([("ids", "|u1")], (3, 2, 2), ROWS_BYTES))),
    ),
    # A .npy array of the wrong shape or dtype.
    Case(
        "ndim-0",
        "a scalar, not (rows, layers, top_k)",
        choice(b64(npy("|u1", (), b"\x07"))),
    ),
    Case("ndim-1", "one dimension", choice(b64(npy("|u1", (12,), ROWS_BYTES)))),
    Case("ndim-2", "two dimensions", choice(b64(npy("|u1", (6, 2), ROWS_BYTES)))),
    Case(
        "ndim-4", "four dimensions", choice(b64(npy("|u1", (3, 2, 2, 1), ROWS_BYTES)))
    ),
    Case(
        "float32",
        "float32 values, not expert ids",
        choice(b64(npy("<f4", (1, 2, 2), struct.pack("<4f", 0.0, 1.0, 2.0, 3.0)))),
    ),
    Case(
        "int32",
        "int32, not uint8 or uint16",
        choice(b64(npy("<i4", (1, 2, 2), struct.pack("<4i", 0, 1, 2, 3)))),
    ),
    Case(
        "int64",
        "int64, not uint8 or uint16",
        choice(b64(npy("<i8", (1, 2, 2), struct.pack("<4q", 0, 1, 2, 3)))),
    ),
    Case("int8", "signed bytes", choice(b64(npy("|i1", (3, 2, 2), ROWS_BYTES)))),
    Case(
        "uint32",
        "uint32, wider than the contract",
        choice(b64(npy("<u4", (1, 2, 2), struct.pack("<4I", 0, 1, 2, 3)))),
    ),
    Case("bool", "booleans", choice(b64(npy("|b1", (1, 2, 2), b"\x00\x01\x00\x01")))),
    Case(
        "big-endian-uint16",
        "uint16 in big-endian byte order",
        choice(b64(npy(">u2", (1, 2, 2), struct.pack(">4H", 256, 257, 258, 259)))),
    ),
    # Well-formed in the format, not in the contract (numpy.load reads them).
    Case(
        "fortran-order",
        "a Fortran-ordered array",
        choice(b64(npy("|u1", (3, 2, 2), ROWS_BYTES, fortran=True))),
    ),
    Case(
        "trailing-bytes",
        "bytes after the data the header describes",
        choice(b64(GOOD_NPY + b"\x00\x00\x00\x00")),
    ),
    Case(
        "npy-version-3.0",
        ".npy format version 3.0 (vLLM writes 1.0)",
        choice(b64(npy("|u1", (3, 2, 2), ROWS_BYTES, version=(3, 0)))),
    ),
    Case(
        "huge-shape",
        "the header claims 2**40 rows (16 TiB) and no data follows",
        choice(b64(npy("|u1", (2**40, 2, 2), b""))),
    ),
    # The payload is not a string.
    Case("payload-int", "an integer instead of the base64 text", choice(12)),
    Case("payload-list", "the ids as a JSON list", choice(ROWS)),
    Case("payload-object", "a JSON object", choice({"rows": ROWS})),
    # routed_experts_start.
    Case(
        "start-missing",
        "no routed_experts_start",
        {k: v for k, v in choice().items() if k != "routed_experts_start"},
    ),
    Case(
        "start-null", "routed_experts_start is null", choice(routed_experts_start=None)
    ),
    Case(
        "start-negative", "routed_experts_start is -1", choice(routed_experts_start=-1)
    ),
    Case(
        "start-bool",
        "routed_experts_start is true (a bool, not an int)",
        choice(routed_experts_start=True),
    ),
    Case(
        "start-float", "routed_experts_start is 5.0", choice(routed_experts_start=5.0)
    ),
    Case(
        "start-string",
        'routed_experts_start is the string "5"',
        choice(routed_experts_start="5"),
    ),
    Case("start-list", "routed_experts_start is [5]", choice(routed_experts_start=[5])),
)

assert len({c.name for c in CASES}) == len(CASES)


Decoder = Callable[[dict[str, Any]], object]


def unrefused(
    decode: Decoder, refusal: type[Exception], cases: Iterable[Case]
) -> dict[str, str]:
    """The cases `decode` does not refuse by raising `refusal`, with what it did
    instead: returned a value, or raised something else."""
    failures: dict[str, str] = {}
    for case in cases:
        try:
            got = decode(dict(case.choice))
        except refusal:
            continue
        except Exception as exc:  # noqa: BLE001 - any other failure is reported
            failures[case.name] = f"raised {type(exc).__name__}: {str(exc)[:200]}"
        else:
            failures[case.name] = (
                f"accepted ({case.wrong}): returned {type(got).__name__}"
            )
    return failures


def assert_refused(
    decode: Decoder, refusal: type[Exception], cases: Iterable[Case]
) -> None:
    """Fail, naming each case and what happened, unless `decode` refuses every case
    by raising `refusal`."""
    failures = unrefused(decode, refusal, cases)
    assert not failures, (
        f"{len(failures)} malformed case(s) not refused with {refusal.__name__}: "
        + "; ".join(f"{name}: {what}" for name, what in failures.items())
    )
