"""Files sdcreplay writes out verbatim (the ticket's repro.py)."""
