"""Files on disk, below the pipeline: reading what a stranger may have prepared (`safeio`)
and tensors in HDF5 without pickle (`tensorio`)."""
