"""Where a run's parts run: the topologies (`topology.choose`), Ray rollout actors and storage
units, a local Ray, the trainer's processes and the coordination service they share, and weights
out of a mesh that spans processes. The run loops (`knitjax.runtime`) take a topology and never
import this package."""
