"""Placement, one concept in one package: which devices each process owns (`devices`), moving
a process onto cores (`cores`), the roles a run places (`roles`), the plan (`plan`), the cost
model (`cost_model`), its calibration (`calibration`), colocated turn-taking (`turns`), and
the run-time placer the loop calls (`placer`).

It sits beside forge.controller at the bottom of the layers and knows nothing of RL, Monarch
or a run's config: forge.controller, forge.loop and forge.actors import it, never the
reverse. Nothing is imported here, so a process that needs one module (vLLM's engine:
`cores`) loads only that one.
"""
