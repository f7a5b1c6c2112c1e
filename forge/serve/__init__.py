"""Doors from outside onto a run: attaching to a live run (`attach`)."""
