"""The model presets' names, without importing torch: the command line's help lists them at start-up.
presets.py defines the shapes and checks that its names are these."""

PRESET_NAMES = (
    "tiny",
    "125m",
    "1b",
    "8b",
    "70b",
    "405b",
    "llama3.2-1b",
    "llama3.2-3b",
    "llama3.1-8b",
    "llama3.1-70b",
    "mistral-7b",
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
    "tiny-moe",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "deepseek-v3-tiny",
    "deepseek-v3-671b",
)
