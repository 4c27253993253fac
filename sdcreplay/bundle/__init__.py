"""The trace bundle on disk: the manifest's types and rules, the writer (atomic), the reader
(validating, never unpickling), job bundles, checkpoint references and trust."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        name: "manifest"
        for name in (
            "Bundle",
            "BundleInfo",
            "BundleWriter",
            "JobBundle",
            "Manifest",
            "describe",
            "is_job_bundle",
            "manifest_digest",
        )
    },
)
