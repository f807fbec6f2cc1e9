"""The run directory as one contract: its file names, its lock, its JSON-lines files, its checkpoints as
readers see them, preparing one before training, and loading the model it holds.

Everything above (train, safe, launch, observe, serve, export) reaches a run's files through here.
"""
