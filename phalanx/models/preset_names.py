"""The model presets' names, without importing torch: the command line's help lists them at start-up.
presets.py defines the shapes and checks that its names are these."""

PRESET_NAMES = ("tiny", "125m", "1b", "8b", "70b", "405b")
