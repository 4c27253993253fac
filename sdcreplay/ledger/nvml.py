"""NVML's view of a GPU, found by its UUID: who the board is and how it is doing now.

Tickets show a vendor the board's identity and health; the ledger names a device by the
same UUID, serial and PCI bus id. Torch-free; ``pynvml`` (the ``gpu`` extra,
``nvidia-ml-py``) is imported when asked, and its absence is said, never raised.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

NVML_IDENTITY = ("name", "uuid", "serial", "board_part_number", "vbios", "inforom", "pci_bus_id")
"""What a vendor's return process identifies a board by, in the order ticket.md shows it."""


def nvml_identity(uuid: str, *, health: bool = True) -> dict:
    """NVML's view of the GPU with this UUID (by UUID: CUDA_VISIBLE_DEVICES cannot mislead it).

    ``identity`` names the board; ``health`` is its state now: ECC counts
    (volatile since the driver loaded, aggregate over its life), retired pages,
    remapped rows, clocks, temperature and power. A field the board or driver
    does not support holds ``unavailable (NVML's reason)``. ``health=False``: the identity
    alone (what the ledger needs).
    """
    try:
        import pynvml
    except ImportError:
        return {
            "available": False,
            "note": "install nvidia-ml-py (pip install 'sdcreplay[gpu]') "
            "for serial, VBIOS and ECC counters",
        }
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"available": False, "note": f"NVML: {exc}"}
    try:
        name = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        handle = pynvml.nvmlDeviceGetHandleByUUID(name)

        def ask(query: Callable[[], Any]) -> Any:
            try:
                return _text(query())
            except pynvml.NVMLError as exc:  # not supported on this board, or no permission
                return f"unavailable ({exc})"

        identity = {
            key: ask(partial(query, handle)) for key, query in _identity_queries(pynvml).items()
        }
        found = {
            "available": True,
            "driver": ask(pynvml.nvmlSystemGetDriverVersion),
            "identity": identity,
        }
        return {**found, "health": _health(pynvml, handle, ask)} if health else found
    except pynvml.NVMLError as exc:
        return {"available": False, "note": f"NVML: {exc}"}
    finally:
        pynvml.nvmlShutdown()


def _identity_queries(nvml) -> dict[str, Callable]:
    return {
        "name": nvml.nvmlDeviceGetName,
        "uuid": nvml.nvmlDeviceGetUUID,
        "serial": nvml.nvmlDeviceGetSerial,
        "board_part_number": nvml.nvmlDeviceGetBoardPartNumber,
        "vbios": nvml.nvmlDeviceGetVbiosVersion,
        "inforom": nvml.nvmlDeviceGetInforomImageVersion,
        "pci_bus_id": lambda h: nvml.nvmlDeviceGetPciInfo(h).busId,
    }


def _health(nvml, handle, ask: Callable[[Callable[[], Any]], Any]) -> dict:
    """ECC, retired pages, remapped rows, clocks, temperature and power of one GPU, now."""
    counters = (("volatile", nvml.NVML_VOLATILE_ECC), ("aggregate", nvml.NVML_AGGREGATE_ECC))
    errors = (
        ("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
        ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
    )
    ecc = {
        f"{when}_{kind}": ask(partial(nvml.nvmlDeviceGetTotalEccErrors, handle, error, counter))
        for when, counter in counters
        for kind, error in errors
    }
    causes = (
        ("single_bit_ecc", nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
        ("double_bit_ecc", nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
    )

    def retired_pages(cause_code: int) -> int:
        return len(nvml.nvmlDeviceGetRetiredPages(handle, cause_code))

    retired = {cause: ask(partial(retired_pages, code)) for cause, code in causes}
    retired["pending"] = ask(lambda: bool(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)))
    rows = ask(
        lambda: dict(
            zip(
                ("correctable", "uncorrectable", "pending", "failure"),
                nvml.nvmlDeviceGetRemappedRows(handle),
                strict=True,
            )
        )
    )
    clock_codes = (
        ("graphics", nvml.NVML_CLOCK_GRAPHICS),
        ("sm", nvml.NVML_CLOCK_SM),
        ("memory", nvml.NVML_CLOCK_MEM),
    )
    clocks = {
        clock: ask(partial(nvml.nvmlDeviceGetClockInfo, handle, code))
        for clock, code in clock_codes
    }
    return {
        "ecc": ecc,
        "retired_pages": retired,
        "remapped_rows": rows,
        "clocks_mhz": clocks,
        "temperature_c": ask(
            partial(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        ),
        "power_w": ask(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),
        "power_limit_w": ask(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000),
    }


def _text(value):
    return value.decode() if isinstance(value, bytes) else value
