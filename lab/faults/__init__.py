"""The fault suite: ``python -m lab.faults --workdir DIR`` (see docs/reliability.md).

Parts: kill-resume at named fault points (`kill_resume`), Ray actor loss (`actor_loss`), generated
bad inputs (`bad_inputs`), and backpressure under over-production (`backpressure`).
"""
