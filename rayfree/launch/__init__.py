"""Where a node learns its place in the cluster when a scheduler started it: Slurm, LeaderWorkerSet, torchrun,
SkyPilot (launchers.py reads each one's environment; placement.py merges it with the flags and RAYFREE_*,
refusing what disagrees; hostlist.py expands Slurm's compressed node lists)."""
