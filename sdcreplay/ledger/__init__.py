"""The device ledger: every verdict with evidence, per device, across jobs and hosts.

Device identity (`identity`), the store (SQLite here, PostgreSQL for a fleet: `store`,
`schema`), the records a command's result makes (`verdicts`), appending them without
ever failing the command (`notes`), and Megatron's tracker line (`tracker`). Below the
pipeline: it imports none of it, so every stage may append.
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Ledger": "store",
        "LedgerError": "store",
        "Record": "schema",
        "DeviceIdentity": "identity",
        "identify": "identity",
        "note": "notes",
        "note_result": "notes",
        "LedgerWarning": "notes",
    },
)
