"""SLURM: what to ask it for (`config`), the `slurm` launcher (`launcher`), `forge submit`
(`submit`) and the fixes monarch's SlurmJob needs (`compat`).

Import from the modules themselves: this file imports none of them, so that importing one
loads only what that one needs.
"""
