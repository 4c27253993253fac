"""Callbacks that attach a ring buffer and a detector to the trainers people use.

`hf.SdcReplayCallback` (Hugging Face ``transformers.Trainer``, extra ``sdcreplay[hf]``) and
`lightning.SdcReplayCallback` (``lightning.Trainer``, extra ``sdcreplay[lightning]``) share
`watch.StepWatch`, which imports neither framework. Only this package imports them.
"""
