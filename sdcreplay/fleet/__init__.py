"""In a fleet: screening devices with a corpus of real defects, the devices' states from the
ledger's evidence, and the lines that drain them (docs/fleet.md)."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "screen": "screen",
        "ScreenReport": "screen",
        "add_tickets": "corpus",
        "list_devices": "devices",
        "show_device": "devices",
        "clear_device": "devices",
        "export": "export",
    },
)
