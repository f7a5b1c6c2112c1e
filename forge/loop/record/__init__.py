"""The batch record every run keeps (batches.py) and `forge replay`, which trains from it again
(replay.py)."""
