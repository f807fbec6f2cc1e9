"""Cluster launchers: Ray, Slurm and Kubernetes place and restart phalanx's node agents
(`phalanx train` on every node), so that everything the agent guarantees holds on a cluster too."""
