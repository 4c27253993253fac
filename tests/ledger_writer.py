"""One of the concurrent ledger writers of tests/ledger/test_store.py: opens the ledger named
on its command line (creating and migrating it, as every first writer does) and appends N
records, one transaction each, named by its writer number."""

from __future__ import annotations

import sys

from sdcreplay.ledger.schema import Record
from sdcreplay.ledger.store import Ledger


def main(location: str, writer: int, count: int) -> None:
    with Ledger.open(location) as ledger:
        for index in range(count):
            ledger.append(
                [
                    Record(
                        f"cpu:{writer}@test-host",
                        f"cpu:{writer}",
                        "test-host",
                        "screen",
                        "passed",
                        f"writer {writer} record {index}",
                        iteration=index,
                    )
                ]
            )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
