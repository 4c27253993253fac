"""The trace bundle on disk: the manifest's types and rules, the writer (atomic), the reader
(validating, never unpickling), job bundles, checkpoint references and trust."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Bundle": "reader",
        "BundleInfo": "info",
        "BundleWriter": "writer",
        "JobBundle": "job_bundle",
        "Manifest": "manifest",
        "describe": "info",
        "is_job_bundle": "job_bundle",
        "manifest_digest": "manifest",
    },
)
