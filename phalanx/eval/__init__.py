"""`phalanx eval`: lm-evaluation-harness tasks through phalanx's own serving engine, and bits per byte on
held-out text through the model itself."""
