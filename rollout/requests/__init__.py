"""Requests: a prompt checked at intake (intake.py) becomes a `Request` (request.py) of n
`Sequence`s (sequence.py); a step schedules some of them as a `Batch` (batch.py); a finished
request is handed out as a `RolloutOutput` (outputs.py)."""
