"""What a step computed, as it runs: digests, the signature log, layer and operator capture,
the collective message log, fault injection, determinism and in-memory snapshots."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "SignatureCapture": "layers",
        "OperatorMode": "operators",
        "OperatorLog": "operators",
        "CallSite": "operators",
        "SignatureLog": "signature",
        "read_signature_log": "signature",
        "TrainingSnapshot": "snapshot",
        "tensor_digest": "digest",
        "FaultSpec": "faults",
        "Injector": "faults",
        "parse_specs": "faults",
    },
)
