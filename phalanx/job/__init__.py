"""A training job from one node's point of view: everything `phalanx train` does around the launch, as
one function that the command line and cluster launchers call alike."""
